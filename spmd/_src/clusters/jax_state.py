"""The one reader of JAX's private distributed state.

JAX keeps the coordination service's client, its preemption sync manager and
the process's id and count in `jax._src.distributed.global_state`, and has no
public accessor for the client. Every module of spmd that needs them asks here,
so a JAX release that moves them breaks one guarded import, not five.
"""

from __future__ import annotations

from typing import Any

__all__ = ["backends_started", "coordination_client", "global_state", "preemption_sync_manager"]


def global_state() -> Any:
    """JAX's `global_state` of `jax.distributed` (None when JAX moved it)."""
    try:
        from jax._src import distributed  # private: guarded, JAX may move it
    except ImportError:
        return None
    return getattr(distributed, "global_state", None)


def coordination_client() -> Any:
    """The coordination service's client, or None when jax.distributed is not initialized."""
    return getattr(global_state(), "client", None)


def preemption_sync_manager() -> Any:
    """JAX's preemption sync manager, or None where it does not run."""
    return getattr(global_state(), "preemption_sync_manager", None)


def backends_started() -> bool:
    """Whether JAX has created its backends (after which its setup is fixed)."""
    try:
        from jax._src import xla_bridge  # private: guarded, JAX may move it
    except ImportError:
        return False
    started = getattr(xla_bridge, "backends_are_initialized", lambda: False)
    return bool(started())
