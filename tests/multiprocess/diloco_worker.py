"""One process of a DiLoCo job: islands across processes (and one island over both), against the paper."""

import json
import sys
from pathlib import Path

import spmd

spmd.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diloco_reference import batches, create, initial, make_step, reference  # noqa: E402

TOL = {"rtol": 1e-6, "atol": 1e-6}  # float32 rounding, as tests/test_diloco.py


def close(a, b):
    return all(
        np.allclose(np.asarray(x), np.asarray(y), **TOL)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def run(strategy, islands, steps=7, sync_every=3):
    state = strategy.init(create, jax.random.key(0))
    step = strategy.step(make_step())
    losses = []
    for x, y in batches(steps):
        state, metrics = step(state, x, y)
        losses.append(multihost_utils.process_allgather(metrics["loss"], tiled=True))
    want = reference(initial(jax.random.key(0)), make_step(), batches(steps), islands, sync_every)
    island_ok = all(
        close(strategy.global_state(state, island=i)["opt"], want[1][i]["opt"])
        for i in range(islands)
    )
    return {
        "mesh": dict(strategy.mesh.shape),
        "global": close(state.params, want[0]),
        "islands": island_ok,
        "losses": bool(np.allclose(np.asarray(losses), want[2], **TOL)),
        "step": int(np.asarray(state.step.addressable_shards[0].data)),
    }


def coordinated(strategy, steps=7):
    """The parameter server tutorial's loop: every process schedules, joins and fetches."""
    coordinator = spmd.ClusterCoordinator(strategy)
    step = strategy.step(make_step())
    state = strategy.init(create, jax.random.key(0))
    iterator = iter(coordinator.create_per_worker_dataset(lambda: batches(steps - 1)))

    def step_fn(iterator):
        nonlocal state
        state, metrics = step(state, *next(iterator))
        return metrics["loss"]

    for _ in range(steps - 2):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    loss = coordinator.fetch(coordinator.schedule(step_fn, args=(iterator,)))
    want = reference(initial(jax.random.key(0)), make_step(), batches(steps - 1), 2, 3)
    return {
        "global": close(state.params, want[0]),
        "loss": bool(np.allclose(loss, want[2][-1], **TOL)),
        "done": coordinator.done(),
    }


one_per_process = spmd.DiLoCo(spmd.MultiWorkerMirroredStrategy(), islands=2, sync_every=3)
two_per_process = spmd.DiLoCo(islands=4, sync_every=3)
across_processes = spmd.DiLoCo(spmd.MultiWorkerMirroredStrategy(), islands=1, sync_every=3)
island_of = {d.process_index for d in one_per_process.mesh.devices[jax.process_index()].flat}
print(
    "RESULT "
    + json.dumps(
        {
            "process": jax.process_index(),
            "island_processes": sorted(island_of),
            "one": run(one_per_process, 2),
            "two": run(two_per_process, 4),
            "across": run(across_processes, 1),
            "coordinated": coordinated(one_per_process),
        }
    ),
    flush=True,
)
