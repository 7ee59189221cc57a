"""The reference workload: a fixed sample of the suite's work, timed on the machine at hand, so
that runs on different machines compare.

The machines a run is lent differ by 2.5x in CPU time for the same tests (2026-12-02 and
2026-12-03), so a run's seconds alone say little about the tests. A test's work is
mostly two things, and the workload does each once in a fresh process, as a process a
test starts does: it starts (imports JAX, flax.nnx, optax and orbax) and compiles and
runs a small program (a flax.nnx MLP's AdamW train step, 20 steps), with the run's XLA
flags and without its compilation cache. `cpu_seconds()` is its CPU time, the least of
three tries (it took 4.8 to 6.5 s on one machine of 2026-12-03 within an hour: figures
in workloads compare to about 20%); a recorded run keeps it (tests/conftest.py) and
`python tests/tiers.py` states the run's CPU time in workloads, a figure of the tests
rather than of the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

SCRIPT = """
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in [(16, 64), (64, 64), (64, 1)]])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


model = MLP(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


@nnx.jit
def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


x = jnp.linspace(-1.0, 1.0, 32 * 16).reshape(32, 16)
y = jnp.sum(x, axis=1, keepdims=True)
for _ in range(20):
    loss = step(model, optimizer, x, y)
assert float(loss) == float(loss), "the workload's loss is not a number"
"""


def _env() -> dict[str, str]:
    """The run's environment (its XLA flags, one CPU platform) without its compilation cache:
    the workload compiles, as a process of a test running a new program does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _once() -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [sys.executable, "-c", SCRIPT], env=_env(), check=True, capture_output=True, timeout=300
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cpu_seconds(tries: int = 3) -> float:
    """The workload's CPU seconds on this machine: the least of `tries` fresh processes."""
    return round(min(_once() for _ in range(tries)), 3)


if __name__ == "__main__":
    print(f"the reference workload: {cpu_seconds():.2f} s of CPU")
