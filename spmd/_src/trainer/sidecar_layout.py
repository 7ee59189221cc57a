"""Where a SidecarEvaluator finds the model in a saved state: the Trainer's layout or a loop's.

`Trainer.fit` saves `{"params", "opt_state", "rest", "step", ...}`; a custom
loop saves what it likes, e.g. examples/06's `{"params", "opt", "key"}`. The
evaluator reads the parameters at `params_key` and the model's other state
(BatchNorm statistics, RNG counts) at `rest_key`, each a '/'-joined path into
the saved state, and never the optimizer state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from spmd._src.errors import CheckpointError, ConfigurationError, message, received

__all__ = ["Layout"]

_EXAMPLE = (
    'examples/06_checkpoint_resume.py saves {"params", "opt", "key"}: params_key="params", '
    "rest_key=None"
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The paths of the model's parameters and other state in a saved state."""

    params_key: str  # where the parameters are, e.g. "params" or "model/params"
    rest_key: str | None  # where the model's other state is; None: nowhere (not read)

    @classmethod
    def checked(cls, params_key: Any, rest_key: Any) -> Layout:
        """The layout, once both keys are paths and neither holds the other."""
        _check_key(params_key, "params_key")
        if rest_key is not None:
            _check_key(rest_key, "rest_key")
            if _within(rest_key, params_key) or _within(params_key, rest_key):
                raise ConfigurationError(
                    message(
                        "params_key and rest_key name two separate parts of the saved state.",
                        received(params_key=params_key, rest_key=rest_key),
                        "pass the key of each (the Trainer's: 'params' and 'rest'), or "
                        "rest_key=None if the loop saves no other model state.",
                    )
                )
        return cls(params_key, rest_key)

    def parts(self, state: dict) -> dict[str, str]:
        """part of the train state ("params", "rest") -> its key: the rest only where the model
        has other state (a model without any reads nothing more)."""
        parts = {"params": self.params_key}
        if self.rest_key is not None and jax.tree.leaves(state["rest"]):
            parts["rest"] = self.rest_key
        return parts

    def target(self, state: dict) -> dict:
        """The restore target: each part of `state` at its key."""
        target: dict = {}
        for part, key in self.parts(state).items():
            *folders, leaf = key.split("/")
            node = target
            for folder in folders:
                node = node.setdefault(folder, {})
            node[leaf] = state[part]
        return target

    def read(self, restored: dict, state: dict) -> dict:
        """The parts of the train state in `restored` (a restored `target`)."""
        found = {}
        for part, key in self.parts(state).items():
            node = restored
            for name in key.split("/"):
                node = node[name]
            found[part] = node
        return found

    def check(self, saved: list[str], state: dict, step: int) -> None:
        """Raises if a part's key holds nothing in the checkpoint (`saved`: its array paths)."""
        for part, key in self.parts(state).items():
            if any(_within(path, key) for path in saved):
                continue
            name = "params_key" if part == "params" else "rest_key"
            what = "parameters" if part == "params" else "other state (BatchNorm statistics...)"
            raise CheckpointError(
                message(
                    f"SidecarEvaluator reads the model's {what} from the checkpoint at {name}; "
                    "the checkpoint has nothing there.",
                    received(
                        **{name: key},
                        step=step,
                        checkpoint_keys=sorted({p.split("/")[0] for p in saved}),
                    ),
                    f"pass {name}= the key the training loop saves them under ({_EXAMPLE}; "
                    "Trainer.fit's checkpoints: the defaults).",
                )
            )


def _within(path: str, key: str) -> bool:
    return path == key or path.startswith(key + "/")


def _check_key(key: Any, name: str) -> None:
    parts = key.split("/") if isinstance(key, str) else []
    if parts and all(parts):
        return
    raise ConfigurationError(
        message(
            f"{name} is a '/'-joined path into the saved state, e.g. 'params' or 'model/params'.",
            received(**{name: key}),
            f"pass the key the training loop saves under ({_EXAMPLE}).",
        )
    )
