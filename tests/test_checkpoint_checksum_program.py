"""A save's checksums: one program per state structure, run beside Orbax's write, never skipped."""

import threading

import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.checkpoint import integrity
from spmd.checkpoint.integrity import checksums, compile_count, dispatch


def many_leaves(count: int, seed: int = 0) -> dict:
    """`count` small leaves of four kinds (shapes and dtypes), as a deep model's state has."""
    kinds = [((8, 4), jnp.float32), ((4,), jnp.float32), ((3, 5), jnp.bfloat16), ((), jnp.int32)]
    out = {}
    for i in range(count):
        shape, dtype = kinds[i % len(kinds)]
        out[f"leaf{i:05d}"] = (jnp.arange(np.prod(shape, dtype=int)) + seed + i).reshape(shape)
        out[f"leaf{i:05d}"] = out[f"leaf{i:05d}"].astype(dtype)
    return out


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
    import json

    return json.loads((folder / str(step) / "metadata" / "metadata").read_text())


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_step_whose_checksums_fail_is_never_committed(tmp_path, monkeypatch, async_save):
    def broken(self):
        raise RuntimeError("device lost while checksumming")

    state = many_leaves(12)
    ckpt = spmd.CheckpointManager(tmp_path, async_save=async_save)
    try:
        ckpt.save(1, state)
        ckpt.wait()
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
