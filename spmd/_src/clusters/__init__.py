"""The cluster family: one resolver per environment (TF_CONFIG, Slurm/Open MPI through JAX,
Kubernetes Indexed Jobs, explicit arguments, `spmd launch`, a single process), the cluster
spec, `initialize` and the distributed runtime, and the local launcher.

Its modules are internal; the public names are exported by `spmd` itself (`spmd.cluster`,
`spmd.initialize`, `spmd.ClusterInfo`). The package is `clusters`, not `cluster`, because
`spmd.cluster` is the public function.
"""
