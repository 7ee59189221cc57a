"""spmd's implementation: every module here is internal; the public API is `spmd`
and its documented submodules (`spmd.callbacks`, `spmd.losses`, `spmd.logical`,
`spmd.partitioners`, `spmd.testing`)."""
