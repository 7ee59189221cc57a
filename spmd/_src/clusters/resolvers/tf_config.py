"""The cluster the TF_CONFIG environment variable describes (parsed in spmd/_src/clusters/spec.py)."""

from __future__ import annotations

import os

from spmd._src.clusters.spec import (
    ENV_LAUNCH_TF_CONFIG,
    TF_CONFIG,
    ClusterInfo,
    parse_tf_config,
)

__all__ = ["TfConfigResolver"]


class TfConfigResolver:
    """The TF_CONFIG environment variable (see `parse_tf_config`)."""

    source = TF_CONFIG

    def is_present(self) -> bool:
        """Whether TF_CONFIG is set to something other than blank or '{}', or than the
        one `spmd launch` wrote for the program (its SPMD_* variables then answer)."""
        text = os.environ.get(TF_CONFIG, "")
        return text.strip() not in ("", "{}") and text != os.environ.get(ENV_LAUNCH_TF_CONFIG)

    def resolve(self) -> ClusterInfo:
        """Parses TF_CONFIG."""
        return parse_tf_config(os.environ[TF_CONFIG])
