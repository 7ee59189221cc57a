"""CheckpointManager in one process on 8 CPU devices: round trips, resharding, errors, preemption."""

import os
import pickle
import pickletools
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.checkpoint.tree import is_key
from spmd._src.clusters.launch import PREEMPTED_EXIT_CODE

TX = optax.adam(1e-2)


def create_state(key):
    k1, k2 = jax.random.split(key)
    params = {
        "dense": {"kernel": jax.random.normal(k1, (16, 8)), "bias": jnp.arange(8.0)},
        "embed": jax.random.normal(k2, (8, 4)),
    }
    return {"params": params, "opt": TX.init(params), "key": k2, "step": jnp.int32(7)}


STRATEGIES = {
    "mirrored": lambda: spmd.MirroredStrategy(),
    "one_device": lambda: spmd.OneDeviceStrategy(jax.devices()[3]),
    "central_storage": lambda: spmd.CentralStorageStrategy(),
    "parameter_server_4": lambda: spmd.ParameterServerStrategy(
        spmd.partitioners.FixedShardsPartitioner(2), devices=jax.devices()[:4]
    ),
    "two_d": lambda: spmd.Strategy(
        mesh=spmd.make_mesh({"data": 4, "model": 2}),
        rules=[(r".*/kernel", P("data", "model")), (r".*embed", P(None, "model"))],
        batch_axes=("data",),
    ),
}


def _host(tree):
    """Numpy values of every leaf, PRNG keys as their key data."""
    return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if is_key(x) else x), tree)


def _assert_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(_host(got)), jax.tree.leaves(_host(want)), strict=True):
        assert g.dtype == w.dtype and np.array_equal(g, w)


def _assert_placed_as(got, target):
    for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(target), strict=True):
        assert g.sharding == t.sharding, (g.sharding, t.sharding)
        assert g.dtype == t.dtype


@pytest.fixture
def ckpt(tmp_path):
    manager = spmd.CheckpointManager(tmp_path / "ckpt")
    yield manager
    manager.close()


@pytest.fixture(scope="module")
def state():
    """A state on the default device, computed once (strategy.put places it: no compile)."""
    return jax.jit(create_state)(jax.random.key(1))


@pytest.fixture(scope="module")
def saved_by_strategy(tmp_path_factory, state):
    """One checkpoint per strategy: (directory, the state as it was saved)."""
    saved = {}
    for name, make in STRATEGIES.items():
        directory = tmp_path_factory.mktemp(name)
        placed = make().put(state)
        with spmd.CheckpointManager(directory) as ckpt:
            assert ckpt.save(10, placed)
        saved[name] = (directory, placed)
    return saved


@pytest.mark.cpu_mesh
@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(STRATEGIES))
def test_restore_into_every_other_strategy(source, saved_by_strategy):
    directory, state = saved_by_strategy[source]
    with spmd.CheckpointManager(directory) as ckpt:
        for target_name, make in STRATEGIES.items():
            target = make().abstract_state(create_state, jax.random.key(0))
            restored = ckpt.restore(target=target)
            _assert_equal(restored, state)
            _assert_placed_as(restored, target)
            if target_name == "central_storage":
                assert restored["params"]["embed"].sharding.memory_kind == "pinned_host"


@pytest.mark.cpu_mesh
def test_restore_into_a_placed_state_takes_its_layout(saved_by_strategy):
    directory, state = saved_by_strategy["mirrored"]
    placed = STRATEGIES["two_d"]().put(jax.jit(create_state)(jax.random.key(5)))
    with spmd.CheckpointManager(directory) as ckpt:
        restored = ckpt.restore(10, target=placed)
    _assert_equal(restored, state)
    _assert_placed_as(restored, placed)


@pytest.mark.cpu_mesh
def test_leaves_without_sharding_take_the_current_strategy(saved_by_strategy):
    directory, state = saved_by_strategy["mirrored"]
    strategy = STRATEGIES["parameter_server_4"]()
    shapes = jax.eval_shape(create_state, jax.random.key(0))
    with spmd.CheckpointManager(directory) as ckpt, strategy.scope():
        restored = ckpt.restore(target=shapes)
    _assert_equal(restored, state)
    want = strategy.state_sharding(shapes)
    for got, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(want), strict=True):
        assert got.sharding == sharding


def _is_pickle(data: bytes) -> bool:
    """Whether `data` parses as one complete pickle (read only, nothing executed)."""
    try:
        ops = list(pickletools.genops(data))
    except Exception:
        return False
    return bool(ops) and ops[-1][0].name == "STOP" and ops[-1][2] == len(data) - 1


@pytest.mark.cpu_mesh
def test_no_checkpoint_file_is_a_pickle(saved_by_strategy):
    assert _is_pickle(pickle.dumps({"w": np.ones(2)}))  # the detector does detect pickles
    files = [p for directory, _ in saved_by_strategy.values() for p in directory.rglob("*")]
    files = [p for p in files if p.is_file()]
    assert len(files) > 5 * 5  # the state, data and metadata items of five checkpoints
    assert not [p for p in files if _is_pickle(p.read_bytes())]
    assert not [p for p in files if p.suffix in (".pkl", ".pickle", ".npy")]


@pytest.mark.cpu_mesh
def test_restore_to_numpy_for_inspection(saved_by_strategy):
    directory, state = saved_by_strategy["parameter_server_4"]
    with spmd.CheckpointManager(directory) as ckpt:
        tree = ckpt.restore()
    assert isinstance(tree["params"]["dense"]["kernel"], np.ndarray)
    np.testing.assert_array_equal(
        tree["params"]["dense"]["kernel"], state["params"]["dense"]["kernel"]
    )
    np.testing.assert_array_equal(tree["key"], jax.random.key_data(state["key"]))
    assert tree["opt"]["0"]["mu"]["embed"].shape == (8, 4)  # optax's tuple, by index


@pytest.mark.cpu_mesh
def test_saved_arrays_lists_paths_shapes_and_dtypes_without_reading_them(saved_by_strategy):
    directory, state = saved_by_strategy["parameter_server_4"]
    with spmd.CheckpointManager(directory, read_only=True) as ckpt:
        saved = ckpt.saved_arrays()
        assert saved == ckpt.saved_arrays(ckpt.latest_step())
    assert saved["params/dense/kernel"] == (state["params"]["dense"]["kernel"].shape, "float32")
    assert saved["opt/0/mu/embed"] == ((8, 4), "float32")
    assert sorted({p.split("/")[0] for p in saved}) == ["key", "opt", "params", "step"]


@pytest.mark.cpu_mesh
def test_mismatched_tree_names_the_paths(saved_by_strategy):
    directory, _ = saved_by_strategy["mirrored"]
    target = STRATEGIES["mirrored"]().abstract_state(create_state, jax.random.key(0))
    del target["params"]["embed"]
    target["extra"] = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=target["step"].sharding)
    target["params"]["dense"]["bias"] = jax.ShapeDtypeStruct(
        (9,), jnp.float32, sharding=target["step"].sharding
    )
    with spmd.CheckpointManager(directory) as ckpt, pytest.raises(spmd.CheckpointError) as e:
        ckpt.restore(target=target)
    text = str(e.value)
    assert "in_target_not_in_checkpoint=['extra']" in text
    assert "params/embed" in text and "in_checkpoint_not_in_target" in text
    assert "params/dense/bias: saved float32[8], target float32[9]" in text
    assert "To fix:" in text


class Position:
    """An iterator position as the input pipeline keeps it: get_state / set_state."""

    def __init__(self, position=0):
        self.position = position

    def get_state(self):
        return {"position": self.position, "epoch": 2}

    def set_state(self, state):
        self.position = state["position"]


def test_data_position_and_metadata_round_trip(ckpt, state):
    assert ckpt.save(3, state, data=Position(3), metadata={"lr": 0.1, "note": "warmup"})
    assert ckpt.save(4, state, data={"position": 4})
    ckpt.wait()
    iterator, plain = Position(), {"stale": True}
    ckpt.restore(3, target=state, data=iterator)
    ckpt.restore(4, target=state, data=plain)
    assert iterator.position == 3 and plain == {"position": 4}
    assert ckpt.restore_data(3) == {"position": 3, "epoch": 2}
    assert ckpt.metadata(3) == {"lr": 0.1, "note": "warmup"} and ckpt.metadata() is None


def test_non_json_data_is_an_error_that_teaches(ckpt):
    state = {"w": jnp.ones(3)}
    with pytest.raises(spmd.CheckpointError, match="saved as JSON"):
        ckpt.save(1, state, metadata={"lr": np.float32(0.1)})
    with pytest.raises(spmd.CheckpointError, match="get_state"):
        ckpt.save(1, state, data=object())
    assert ckpt.all_steps() == []


def test_interval_force_max_to_keep_and_no_overwrite(tmp_path):
    state = {"w": jnp.ones(3)}
    with spmd.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=5) as ckpt:
        assert [ckpt.save(s, state) for s in range(1, 11)] == [s % 5 == 0 for s in range(1, 11)]
        assert ckpt.save(12, state, force=True)
        assert not ckpt.save(12, state, force=True)  # a saved step is never overwritten
        ckpt.wait()
        assert ckpt.all_steps() == [10, 12] and ckpt.latest_step() == 12


def test_async_save_survives_the_state_being_donated(ckpt, state):
    state = spmd.MirroredStrategy().put(jax.tree.map(jnp.copy, state))
    want = _host(state)
    ckpt.save(1, state)
    jax.tree.map(lambda x: x.delete(), state)  # what a donating step does to its input
    ckpt.wait()
    _assert_equal(ckpt.restore(1, target=jax.eval_shape(create_state, jax.random.key(0))), want)


def create_small(key):
    return {"kernel": jax.random.normal(key, (8, 2)), "key": key}


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.cpu_mesh
def test_restore_or_init_starts_fresh_then_resumes(ckpt):
    strategy = spmd.MirroredStrategy()
    with strategy.scope():
        state, step = ckpt.restore_or_init(create_small, jax.random.key(0))
        assert step == 0
        _assert_equal(state, create_small(jax.random.key(0)))
        ckpt.save(4, state, data=Position(4))
        ckpt.wait()
    position = Position()
    resumed, step = ckpt.restore_or_init(
        create_small, jax.random.key(9), data=position, strategy=STRATEGIES["two_d"]()
    )
    assert step == 4 and position.position == 4
    _assert_equal(resumed, state)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)


def create_nnx():
    model = Model(nnx.Rngs(0))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


@pytest.mark.slow
def test_nnx_objects_restore_in_place_into_another_strategy(ckpt):
    model, optimizer = spmd.MirroredStrategy().put(create_nnx())
    model.dense.kernel[...] = model.dense.kernel[...] + 1.0
    ckpt.save(2, (model, optimizer))
    ckpt.wait()
    strategy = STRATEGIES["parameter_server_4"]()
    target = strategy.put(create_nnx())
    layout = target[0].dense.kernel[...].sharding
    restored = ckpt.restore(target=target)
    assert restored is target
    np.testing.assert_array_equal(target[0].dense.kernel[...], model.dense.kernel[...])
    assert target[0].dense.kernel[...].sharding == layout
    with strategy.scope():
        (again, _), step = ckpt.restore_or_init(create_nnx)
    assert step == 2
    np.testing.assert_array_equal(again.dense.kernel[...], model.dense.kernel[...])
    _assert_equal(nnx.to_pure_dict(nnx.state(again)), nnx.to_pure_dict(nnx.state(model)))


def test_restore_without_checkpoint_or_after_close_says_what_to_do(tmp_path):
    ckpt = spmd.CheckpointManager(tmp_path)
    with pytest.raises(spmd.CheckpointError, match="restore_or_init"):
        ckpt.restore()
    with pytest.raises(spmd.CheckpointError, match="complete_steps=\\[\\]"):
        ckpt.restore(5)
    ckpt.close()
    ckpt.close()  # idempotent
    with pytest.raises(spmd.CheckpointError, match="close\\(\\) is final"):
        ckpt.save(1, {"w": jnp.ones(2)})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_to_keep": 0}, "max_to_keep"),
        ({"save_interval_steps": 1.5}, "save_interval_steps"),
        ({"preemption": "sometimes"}, "preemption"),
        ({"preemption": "jax"}, "preemption"),
        ({"preemption_check_steps": 0}, "preemption_check_steps"),
    ],
)
def test_arguments_are_checked(tmp_path, kwargs, name):
    with pytest.raises(spmd.ConfigurationError, match=name):
        spmd.CheckpointManager(tmp_path, **kwargs)


def test_leftover_temporary_folder_is_ignored(tmp_path):
    state = {"w": jnp.ones(3)}
    with spmd.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state, data={"position": 1})
    shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp")  # a save cut short
    with spmd.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.latest_step() == 1
        assert ckpt.restore_data() == {"position": 1}


def test_sigterm_saves_at_the_next_step_then_exits_42(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    state = {"w": jnp.ones(3)}
    ckpt = spmd.CheckpointManager(tmp_path, save_interval_steps=100, preemption="signal")
    assert ckpt.save(1, state) is False
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(spmd.Preempted) as e:
        ckpt.save(2, state, data={"position": 2})
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.step == 2
    assert isinstance(e.value, SystemExit) and not isinstance(e.value, Exception)
    assert signal.getsignal(signal.SIGTERM) == before  # closed, handler put back
    with spmd.CheckpointManager(tmp_path) as view:
        assert view.all_steps() == [2] and view.restore_data() == {"position": 2}


def test_sigterm_says_that_it_saves_only_at_a_save_every_process_reaches_in_time(tmp_path, capfd):
    """A process stopped by a launcher after a peer failed, or blocked in a collective, has a
    manager open but makes no save: the line says what happens then, not that it saves."""
    with spmd.CheckpointManager(tmp_path, preemption="signal") as ckpt:
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt._watcher.noticed()
    said = capfd.readouterr().err
    assert "at the next CheckpointManager.save() that every process reaches" in said, said
    assert "if no such save comes within 120 s (grace_period), it ends with code 143" in said


def test_sigterm_without_exit_marks_the_step(tmp_path):
    with spmd.CheckpointManager(
        tmp_path, save_interval_steps=100, preemption="signal", exit_on_preemption=False
    ) as ckpt:
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt.reached_preemption(3)
        assert ckpt.save(3, {"w": jnp.ones(3)}) is True
        assert ckpt.preempted_step == 3 and not ckpt.save(4, {"w": jnp.ones(3)})
