"""Under `spmd launch`: a process ended by an uncaught ConfigurationError exits with code 78."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import Any

from spmd._src.clusters.launch_results import CONFIGURATION_EXIT_CODE
from spmd._src.errors import BatchError, ConfigurationError

__all__ = ["exit_78_on_configuration_errors", "printing_hook"]

_RAISED: list[type] = []  # the kind of the uncaught error, once one ended the program


def exit_78_on_configuration_errors() -> None:
    """Makes an uncaught ConfigurationError or BatchError end this process with code 78.

    The traceback prints as before; then, after every exit handler registered
    later (checkpoint managers, loaders) has run, the process exits with
    CONFIGURATION_EXIT_CODE, which `spmd launch` does not restart for (the same
    program raises it again). Before this, an error such as a malformed
    SPMD_HANG_TIMEOUT, raised before the process joined its peers, exited 1 and
    was restarted. Installed once; joining several processes replaces it with
    the hook that also tells the peers (`distributed.join`).
    """
    if getattr(sys.excepthook, "printing", None) is not None:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        if issubclass(kind, ConfigurationError | BatchError):
            _RAISED.append(kind)

    hook.printing = previous  # type: ignore[attr-defined]
    sys.excepthook = hook
    atexit.register(_exit_if_raised)


def printing_hook(hook: Any) -> Any:
    """The hook that prints a traceback: `hook`'s own, where `hook` is this module's."""
    return getattr(hook, "printing", hook)


def _exit_if_raised() -> None:
    if _RAISED:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(CONFIGURATION_EXIT_CODE)
