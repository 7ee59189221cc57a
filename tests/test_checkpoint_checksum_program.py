"""A save's checksums: programs per kind of leaf (not per leaf), each device folding its own
blocks, compiled ahead of the first write, started beside Orbax's write, never skipped."""

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.checkpoint import integrity, store
from spmd._src.checkpoint.integrity import checksums, compile_count, dispatch


def many_leaves(count: int, seed: int = 0) -> dict:
    """`count` small leaves of four kinds (shapes and dtypes), as a deep model's state has."""
    kinds = [((8, 4), jnp.float32), ((4,), jnp.float32), ((3, 5), jnp.bfloat16), ((), jnp.int32)]
    out = {}
    for i in range(count):
        shape, dtype = kinds[i % len(kinds)]
        out[f"leaf{i:05d}"] = (jnp.arange(np.prod(shape, dtype=int)) + seed + i).reshape(shape)
        out[f"leaf{i:05d}"] = out[f"leaf{i:05d}"].astype(dtype)
    return out


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_the_checksum_programs_compile_once_per_leaf_kind_whatever_the_leaf_count(monkeypatch):
    monkeypatch.setattr(integrity, "_programs", {})  # none compiled by earlier tests
    state = many_leaves(2000)  # four kinds of leaf (shape, dtype)
    before = compile_count()
    first = checksums(state)
    assert compile_count() == before + 4  # not one per leaf
    again = checksums(many_leaves(2000, seed=1))  # same structure, other values
    assert compile_count() == before + 4
    assert again != first and len(first) == 2000
    checksums(many_leaves(3000))  # more leaves of the same kinds: no new program
    assert compile_count() == before + 4
    checksums(many_leaves(8))  # a small state of the same kinds: one program per kind
    assert compile_count() == before + 8
    # Each leaf's checksum is the one it has alone (batching does not mix leaves).
    for path in ("leaf00000", "leaf00001", "leaf01998", "leaf01999"):
        assert first[path] == checksums({path: state[path]})[path]
        assert first[path] == checksums({path: np.asarray(state[path])})[path]


def test_an_async_save_fetches_the_checksums_in_its_background_commit(tmp_path, monkeypatch):
    threads = []
    fetch = integrity.Pending.result

    def recorded(self):
        threads.append(threading.current_thread())
        return fetch(self)

    monkeypatch.setattr(integrity.Pending, "result", recorded)
    state = many_leaves(40)
    with spmd.CheckpointManager(tmp_path, async_save=True) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        saving = list(threads)  # restore's own checksums come after, on this thread
        restored = ckpt.restore(1, target=state)
    assert saving and threading.main_thread() not in saving
    assert all(np.array_equal(restored[p], state[p]) for p in state)
    saved = ckpt_record(tmp_path, 1)
    assert saved["checksums"] == checksums(state)


def ckpt_record(folder, step):
    return json.loads((folder / str(step) / "metadata" / "metadata").read_text())


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("fails", ["start", "fetch"])
def test_a_step_whose_checksums_fail_is_never_committed(tmp_path, monkeypatch, async_save, fails):
    def broken(*args):
        raise RuntimeError("device lost while checksumming")

    state = many_leaves(12)
    ckpt = spmd.CheckpointManager(tmp_path, async_save=async_save)
    try:
        ckpt.save(1, state)
        ckpt.wait()
        if fails == "start":
            monkeypatch.setattr(integrity, "dispatch", broken)
        else:
            monkeypatch.setattr(integrity.Pending, "result", broken)
        with pytest.raises(spmd.CheckpointError, match=r"(?s)steps=\[2\].*device lost"):
            ckpt.save(2, state)
            ckpt.wait()
        assert ckpt.all_steps() == [1]
    finally:
        monkeypatch.undo()
        ckpt.close()


def test_dispatch_returns_before_the_sums_are_fetched_and_holds_its_inputs():
    x = jnp.arange(1000.0)
    pending = dispatch({"x": x})
    x.delete()  # as a donating train step would: the dispatched program holds its input
    assert pending.result() == checksums({"x": jnp.arange(1000.0)})


MESHES = {
    "auto": lambda: jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2),
    "explicit": lambda: jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2),
}
SPECS = [P("a", "b"), P("b", "a"), P(("a", "b")), P(("b", "a")), P("a"), P(None, "b"), P()]
VALUES = {
    "float32": lambda: jax.random.normal(jax.random.key(0), (16, 8)),
    "bfloat16": lambda: jnp.linspace(-3, 3, 16 * 8, dtype=jnp.bfloat16).reshape(16, 8),
    "complex64": lambda: (jnp.arange(128.0) - 1j * jnp.arange(128.0)).reshape(16, 8),
    "int8": lambda: (jnp.arange(128) % 251 - 120).astype(jnp.int8).reshape(16, 8),
    "bool": lambda: (jnp.arange(128) % 3 == 0).reshape(16, 8),
}


@pytest.mark.slow  # 19 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.cpu_mesh
@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", sorted(VALUES))
def test_checksums_folded_block_by_block_are_those_of_the_whole_array(mesh, spec, dtype):
    # Each device folds the blocks it holds at their place in the array; replicas add nothing.
    x = VALUES[dtype]()
    want = checksums({"x": np.asarray(x)})
    placed = jax.device_put(x, NamedSharding(MESHES[mesh](), spec))
    assert checksums({"x": placed}) == want


@pytest.mark.cpu_mesh
def test_checksums_of_arrays_in_host_memory_and_on_another_device_are_those_of_numpy():
    x = jnp.arange(24.0).reshape(6, 4)
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    in_host = jax.device_put(x, NamedSharding(mesh, P("a"), memory_kind="pinned_host"))
    elsewhere = jax.device_put(x, jax.devices()[5])
    scalar = jax.device_put(jnp.float32(2.5), NamedSharding(mesh, P()))
    want = checksums({"x": np.asarray(x), "s": np.float32(2.5)})
    assert checksums({"x": in_host, "s": scalar}) == want
    assert checksums({"x": elsewhere})["x"] == want["x"]


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.cpu_mesh
def test_a_replicated_array_is_folded_on_one_device_and_a_sharded_one_on_each(monkeypatch):
    monkeypatch.setattr(integrity, "_programs", {})
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    replicated = jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P()))
    sharded = jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P("d")))
    before = compile_count()
    checksums({"r": replicated})
    assert compile_count() == before + 1  # one copy of each block is folded
    checksums({"s": sharded})
    assert compile_count() == before + 1 + 8  # one program for each device's block
    for program in integrity._programs.values():
        text = program.result().as_text()
        assert "all-reduce" not in text and "all-gather" not in text  # no communication


def test_one_call_stacks_at_most_the_batch_bytes_of_a_device(monkeypatch):
    # A call folds a batch of same-kind leaves stacked: big leaves go a few at a time.
    monkeypatch.setattr(integrity, "_programs", {})
    monkeypatch.setattr(integrity, "_BATCH_BYTES", 2**20)
    state = {f"w{i}": jnp.full((512, 512), i, jnp.float32) for i in range(8)}  # 1 MiB each
    assert checksums(state) == checksums({p: np.asarray(x) for p, x in state.items()})
    (program,) = [f.result() for f in integrity._programs.values()]
    # Its temporaries: twice its stacked blocks at most (8 MiB a leaf at a time; 16 all at once).
    assert program.memory_analysis().temp_size_in_bytes < 3 * 2**20


def test_the_first_save_call_compiles_the_programs_of_the_first_write(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_programs", {})
    state = many_leaves(40)
    with spmd.CheckpointManager(tmp_path, save_interval_steps=2) as ckpt:
        before = compile_count()
        assert not ckpt.save(1, state)  # writes nothing, starts the compiles
        started = compile_count()
        assert started == before + 4
        for compiling in list(integrity._programs.values()):
            compiling.result()
        assert ckpt.save(2, state)
        assert compile_count() == started  # the write found them compiled
        ckpt.wait()
        assert ckpt.restore(2, target=state)["leaf00007"].tolist() == state["leaf00007"].tolist()


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_an_async_save_starts_the_checksums_once_orbax_has_copied_the_arrays(
    tmp_path, monkeypatch, async_save
):
    # Started earlier, the device programs would hold the workers Orbax's copies need.
    events = []
    save, start = store.SharedStore.save, integrity.dispatch

    def orbax_save(self, *args):
        result = save(self, *args)
        events.append("orbax save returned")
        return result

    def dispatched(arrays, version=integrity.FORMAT):
        events.append("checksums started")
        return start(arrays, version)

    monkeypatch.setattr(store.SharedStore, "save", orbax_save)
    monkeypatch.setattr(integrity, "dispatch", dispatched)
    with spmd.CheckpointManager(tmp_path, async_save=async_save) as ckpt:
        ckpt.save(1, many_leaves(8))
    if async_save:
        assert events == ["orbax save returned", "checksums started"]
    else:  # a synchronous save commits, record included, before it returns
        assert events == ["checksums started", "orbax save returned"]
    assert ckpt_record(tmp_path, 1)["checksums"] == checksums(many_leaves(8))
