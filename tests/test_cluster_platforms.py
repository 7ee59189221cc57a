"""Cluster resolution on Kubernetes and Cloud TPU, without either: their environments, stood in.

Kubernetes: docs/multihost.md's manifests are parsed, and each pod gets the
environment Kubernetes would give it (the downward API, JOB_COMPLETION_INDEX,
HOSTNAME). JAX's own Kubernetes detection runs against a stand-in `kubernetes`
client built from the same manifests. Cloud TPU: JAX's detection runs against
a stand-in for its metadata lookups (`get_metadata`). Nothing calls
jax.distributed.initialize: what spmd resolves is compared with what JAX's
`auto_detect_unset_distributed_params` (what jax.distributed.initialize() does
with no arguments) would pass on.
"""

import re
import socket
import sys
import types
from pathlib import Path

import pytest
import yaml
from jax._src import clusters
from jax._src.clusters import cloud_tpu_cluster
from jax._src.clusters import cluster as jax_cluster
from jax._src.clusters.k8s_cluster import K8sCluster

from spmd._src.clusters.initialize import resolve
from spmd._src.errors import ClusterError

DOC = Path(__file__).resolve().parents[1] / "docs" / "multihost.md"
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
PLATFORM_VARS = (
    "TF_CONFIG",
    "SPMD_COORDINATOR_ADDRESS",
    "SPMD_NUM_PROCESSES",
    "SPMD_PROCESS_ID",
    "SPMD_DEVICES_PER_PROCESS",
    "SLURM_JOB_ID",
    "OMPI_MCA_orte_hnp_uri",
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
    "HOSTNAME",
    "TPU_SKIP_MDS_QUERY",
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "JAX_COORDINATOR_PORT",
)


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    for name in PLATFORM_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # no jax[k8s] unless a test adds it


def ns(**fields):
    return types.SimpleNamespace(**fields)


def jax_would_pass(timeout: int = 5) -> tuple:
    """What jax.distributed.initialize() with no arguments would start with."""
    detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    return detect(None, None, None, None, None, timeout)[:3]


def host(address: str) -> str:
    return address.rpartition(":")[0]


# ------------------------------------------------------------------ the docs' manifests


def kubernetes_manifests() -> list[dict]:
    """Every YAML document in docs/multihost.md's Kubernetes section."""
    text = DOC.read_text()
    section = text.split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def indexed_jobs() -> list[tuple[str, dict, str, dict]]:
    """(job name, Job spec, pod subdomain, manifest) as Kubernetes would create each Job."""
    jobs = []
    for doc in kubernetes_manifests():
        if doc["kind"] == "Job":
            spec = doc["spec"]
            jobs.append((doc["metadata"]["name"], spec, spec["template"]["spec"]["subdomain"], doc))
        elif doc["kind"] == "JobSet":
            jobset = doc["metadata"]["name"]
            [replicated] = doc["spec"]["replicatedJobs"]
            assert replicated["replicas"] == 1, "the completion index is the process index"
            name = f"{jobset}-{replicated['name']}-0"  # JobSet's Job naming
            jobs.append((name, replicated["template"]["spec"], jobset, doc))
    return jobs


JOBS = indexed_jobs()
JOB_IDS = [doc["kind"] for *_, doc in JOBS]


def test_docs_have_an_indexed_job_and_a_jobset():
    assert sorted(JOB_IDS) == ["Job", "JobSet"]


def pod_env(spec: dict, index: int, hostname: str) -> dict[str, str]:
    """The environment Kubernetes gives pod `index` of an Indexed Job with `spec`."""
    [container] = spec["template"]["spec"]["containers"]
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": hostname}
    env["JOB_COMPLETION_INDEX"] = str(index)
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_ANNOTATION, var
            env[var["name"]] = str(index)
    return env


@pytest.mark.parametrize("name, spec, subdomain, doc", JOBS, ids=JOB_IDS)
def test_manifest_jobs_are_indexed_and_run_train_py(name, spec, subdomain, doc):
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]  # every pod at once: one job
    assert spec["backoffLimit"] == 0  # a replacement pod cannot rejoin a running job
    [container] = spec["template"]["spec"]["containers"]
    assert container["command"][:2] == ["python", "train.py"]


def test_the_jobs_headless_service_is_its_subdomain():
    [(name, spec, subdomain, _)] = [j for j in JOBS if j[3]["kind"] == "Job"]
    [service] = [d for d in kubernetes_manifests() if d["kind"] == "Service"]
    assert service["spec"]["clusterIP"] is None or service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["name"] == subdomain
    assert service["spec"]["selector"] == {"job-name": name}


@pytest.mark.parametrize("name, spec, subdomain, doc", JOBS, ids=JOB_IDS)
def test_every_pod_of_the_manifest_resolves_to_its_place(name, spec, subdomain, doc, monkeypatch):
    count = spec["parallelism"]
    for index in range(count):
        for var, value in pod_env(spec, index, f"{name}-{index}").items():
            monkeypatch.setenv(var, value)
        info = resolve()
        assert (info.process_index, info.process_count) == (index, count)
        assert info.source == "spmd launch"  # the SPMD_* variables
        assert info.is_chief == (index == 0)
        assert host(info.coordinator_address) == f"{name}-0.{subdomain}"  # pod 0, by DNS


# ------------------------------------------------------------------ JAX's Kubernetes detection


def fake_kubernetes(job_name: str, spec: dict, subdomain: str, jobset: str | None):
    """A stand-in `kubernetes` client answering as the API server would for these pods."""
    count = spec["parallelism"]
    ips = {f"{job_name}-{i}": f"10.8.0.{10 + i}" for i in range(count)}
    labels = {"job-name": job_name, **({JOBSET_NAME_LABEL: jobset} if jobset else {})}
    pods = {
        ip: ns(
            metadata=ns(
                name=pod,
                labels=labels,
                owner_references=[ns(kind="Job", controller=True, name=job_name)],
            ),
            spec=ns(subdomain=subdomain),
        )
        for pod, ip in ips.items()
    }
    job = ns(
        metadata=ns(name=job_name, labels=dict(labels)),
        spec=ns(parallelism=spec["parallelism"], completions=spec["completions"]),
    )

    def list_namespaced_pod(namespace, field_selector):
        return ns(items=[pods[field_selector.removeprefix("status.podIP=")]])

    def read_namespaced_job(name, namespace):
        assert name == job_name, name
        return job

    core = ns(list_namespaced_pod=list_namespaced_pod, list_namespaced_service=None)
    batch = ns(read_namespaced_job=read_namespaced_job)
    client = ns(
        CoreV1Api=lambda: core,
        BatchV1Api=lambda: batch,
        exceptions=ns(ApiException=type("ApiException", (Exception,), {})),
    )
    module = types.ModuleType("kubernetes")
    module.config = ns(load_incluster_config=lambda: None)
    module.client = client
    return module, ips


def clear_k8s_caches():
    for attr in ("_pod", "_job", "_headless_svc", "_controller"):
        K8sCluster.__dict__[attr].__func__.cache_clear()


@pytest.mark.parametrize("name, spec, subdomain, doc", JOBS, ids=JOB_IDS)
def test_jax_kubernetes_detection_agrees_with_the_manifest(name, spec, subdomain, doc, monkeypatch):
    jobset = doc["metadata"]["name"] if doc["kind"] == "JobSet" else None
    module, ips = fake_kubernetes(name, spec, subdomain, jobset)
    monkeypatch.setitem(sys.modules, "kubernetes", module)
    for attr in ("_core_api", "_batch_api", "_ApiException"):
        monkeypatch.setattr(K8sCluster, attr, None, raising=False)  # restored after
    monkeypatch.setattr(K8sCluster, "_namespace", classmethod(lambda cls: "default"))
    coordinator_host = host(pod_env(spec, 0, "")["SPMD_COORDINATOR_ADDRESS"])
    dns = {**ips, coordinator_host: ips[f"{name}-0"]}
    monkeypatch.setattr(socket, "gethostbyname", lambda h: dns[h])
    count = spec["parallelism"]
    for index in range(count):
        clear_k8s_caches()
        env = pod_env(spec, index, f"{name}-{index}")
        for var in ("KUBERNETES_SERVICE_HOST", "HOSTNAME", "JOB_COMPLETION_INDEX"):
            monkeypatch.setenv(var, env[var])  # no SPMD_*: JAX's detection answers
        info = resolve()
        assert (info.process_index, info.process_count, info.source) == (
            index,
            count,
            "K8sCluster",
        )
        coordinator, jax_count, jax_index = jax_would_pass()
        assert (jax_index, jax_count) == (index, count)
        assert host(coordinator) == coordinator_host  # the docs' name is JAX's name
    clear_k8s_caches()


def test_an_indexed_job_pod_nothing_describes_is_an_error(monkeypatch):
    """Before: each pod resolved to process 0 of 1, a chief training alone."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    with (
        pytest.warns(UserWarning, match=r"jax\[k8s\]"),  # JAX's own: no kubernetes package
        pytest.raises(ClusterError) as e,
    ):
        resolve()
    text = str(e.value)
    assert "JOB_COMPLETION_INDEX" in text and "'2'" in text
    assert "SPMD_NUM_PROCESSES=1" in text and "SPMD_PROCESS_ID" in text


def test_an_indexed_job_pod_meant_to_train_alone_says_so(monkeypatch):
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "1")
    info = resolve()
    assert (info.process_index, info.process_count, info.coordinator_address) == (0, 1, None)


# ------------------------------------------------------------------ Cloud TPU


def tpu_vm(monkeypatch, metadata: dict[str, str]) -> None:
    """A Cloud TPU VM whose metadata server answers `metadata` (404 for anything else)."""
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(jax_cluster, "running_in_cloud_tpu_vm", True)

    def get_metadata(key):
        return (metadata[key], 200) if key in metadata else ("", 404)

    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", get_metadata)
    monkeypatch.setattr(socket, "gethostbyname", lambda h: "10.130.0.2")


ENDPOINTS_OLD = ",".join(f"w{i}:1:10.130.0.{2 + i}" for i in range(4))  # name:id:ip
ENDPOINTS_NEW = ",".join(f"t1v-n-{i}" for i in range(4))  # hostnames


@pytest.mark.parametrize(
    "endpoints, worker0", [(ENDPOINTS_OLD, "10.130.0.2"), (ENDPOINTS_NEW, "t1v-n-0")]
)
@pytest.mark.parametrize("worker", [0, 3])
def test_gce_tpu_slice(endpoints, worker0, worker, monkeypatch):
    meta = {"agent-worker-number": str(worker), "worker-network-endpoints": endpoints}
    tpu_vm(monkeypatch, {**meta, "tpu-env": "ACCELERATOR_TYPE: 'v4-32'\n"})
    info = resolve()
    assert (info.process_index, info.process_count, info.source) == (worker, 4, "gcetpu")
    assert info.is_chief == (worker == 0)
    assert jax_would_pass() == (f"{worker0}:8482", 4, worker)


@pytest.mark.parametrize("slice_id, worker, expected", [(0, 0, 0), (1, 0, 4), (1, 3, 7)])
def test_gce_tpu_multislice(slice_id, worker, expected, monkeypatch):
    tpu_env = (
        "MEGASCALE_COORDINATOR_ADDRESS: '10.130.0.2:8080'\n"
        f"MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '{slice_id}'\n"
    )
    meta = {"agent-worker-number": str(worker), "worker-network-endpoints": ENDPOINTS_OLD}
    tpu_vm(monkeypatch, {**meta, "tpu-env": tpu_env})
    info = resolve()
    assert (info.process_index, info.process_count, info.source) == (expected, 8, "gcetpu")
    assert jax_would_pass() == ("10.130.0.2:8482", 8, expected)


def test_gke_tpu_pod(monkeypatch):
    tpu_vm(monkeypatch, {})  # GKE: the values come from the environment
    monkeypatch.setenv("TPU_WORKER_ID", "2")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "train-0-0.train,train-0-1.train,h2,h3")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    info = resolve()
    assert (info.process_index, info.process_count, info.source) == (6, 8, "gketpu")
    assert jax_would_pass() == ("train-0-0.train:8482", 8, 6)


def test_spmd_variables_win_over_tpu_detection(monkeypatch):
    tpu_vm(monkeypatch, {"agent-worker-number": "1", "worker-network-endpoints": ENDPOINTS_OLD})
    monkeypatch.setenv("SPMD_COORDINATOR_ADDRESS", "10.130.0.2:1234")
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "4")
    monkeypatch.setenv("SPMD_PROCESS_ID", "1")
    info = resolve()
    assert (info.process_index, info.source) == (1, "spmd launch")


def test_tpu_detection_that_cannot_read_its_values_is_a_cluster_error(monkeypatch):
    tpu_vm(monkeypatch, {"agent-worker-number": "one", "worker-network-endpoints": "a:b"})
    with pytest.raises(ClusterError, match="gcetpu") as e:
        resolve()
    assert "num_processes" in str(e.value)
