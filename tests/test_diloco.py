"""spmd.DiLoCo: islands that train apart and average every H steps, against the paper in plain JAX."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from diloco_reference import INNER, batches, create, initial, logits, make_step, reference
from jax.sharding import PartitionSpec as P

import spmd
from spmd.testing import assert_trees_allclose

pytestmark = pytest.mark.cpu_mesh
# float32 rounding (a few ulps of parameters ~1): the reference's start is create() run
# eagerly, init's runs under jit (an ulp apart); islands of several devices all-reduce
# their gradients, and the sync its deltas, in another order than the reference's sums;
# and XLA fuses the outer update otherwise. Where none of these differ, the islands'
# steps equal the reference's bit for bit (test_islands_run_the_step_unchanged_bit_for_bit).
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _train(strategy, inner, steps, **step_options):
    state = strategy.init(create, jax.random.key(0), inner=inner)
    step = strategy.step(make_step(inner), **step_options)
    losses = []
    for x, y in batches(steps):
        state, metrics = step(state, x, y)
        losses.append(np.asarray(metrics["loss"]))
    return state, losses


def _check(state, want_global, want_islands, losses=None, want_losses=None, tol=TOL):
    assert_trees_allclose(spmd_params(state), want_global, **tol)
    for i, island in enumerate(want_islands):
        got = jax.tree.map(lambda x, i=i: np.asarray(x)[i], state.islands)
        assert_trees_allclose(got, island, **tol)
    if losses is not None:
        np.testing.assert_allclose(np.asarray(losses), np.asarray(want_losses), **tol)


def spmd_params(state):
    return jax.tree.map(np.asarray, state.params)


# Two islands of SGD in the fast tier (4 s of CPU in a fresh process, AdamW's 6.5 s); the
# other counts and AdamW in the slow one.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "islands, inner",
    [
        pytest.param(2, "sgd"),
        *(
            pytest.param(i, n, marks=_SLOW)
            for i in (1, 2, 4)
            for n in ("sgd", "adamw")
            if (i, n) != (2, "sgd")
        ),
    ],
)
def test_equals_the_paper_on_one_device(islands, inner):
    strategy = spmd.DiLoCo(islands=islands, sync_every=3)
    state, losses = _train(strategy, inner, 7)
    want = reference(initial(jax.random.key(0), inner), make_step(inner), batches(7), islands, 3)
    _check(state, want[0], want[1], losses, want[2])
    assert int(state.step) == 7


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_0d_batch_argument_is_replicated_to_every_island_as_a_step_replicates_it():
    """A 0-d data argument (a rate passed positionally) is one value every island sees,
    as Strategy.step takes it; the oracle is the same step with the value closed over."""
    strategy = spmd.DiLoCo(islands=2, sync_every=2)
    sgd = make_step("sgd")

    def scaled(state, x, y, scale):
        return sgd(state, x * scale, y)

    taking = strategy.step(scaled)
    closing = strategy.step(lambda state, x, y: sgd(state, x * 0.5, y))
    got = strategy.init(create, jax.random.key(0), inner="sgd")
    want = strategy.init(create, jax.random.key(0), inner="sgd")
    for x, y in batches(3):
        got, got_metrics = taking(got, x, y, np.float32(0.5))
        want, want_metrics = closing(want, x, y)
        np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], **TOL)
    assert_trees_allclose(spmd_params(got), spmd_params(want), **TOL)


@pytest.mark.slow  # 9 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_islands_run_the_step_unchanged_bit_for_bit(inner):
    """One device per island, before the first sync, from the state init makes (under
    jit): every island's steps are the reference's jitted step on its rows, bit for bit."""
    strategy = spmd.DiLoCo(islands=8, sync_every=100)
    state, losses = _train(strategy, inner, 5)
    start = jax.jit(functools.partial(create, inner=inner))(jax.random.key(0))
    want = reference(start, make_step(inner), batches(5), 8, 100)
    _check(state, want[0], want[1], losses, want[2], tol={"rtol": 0, "atol": 0})


@pytest.mark.slow  # compiles several programs: seconds on 2 shared cores
def test_streaming_fragments_sync_on_a_staggered_schedule():
    strategy = spmd.DiLoCo(islands=2, sync_every=4, fragments=2)
    state, losses = _train(strategy, "adamw", 9)
    want = reference(initial(jax.random.key(0)), make_step(), batches(9), 2, 4, fragments=2)
    _check(state, want[0], want[1], losses, want[2])


def _by_path(params):
    """Nesterov SGD for the kernels, nothing for the biases: labels read from the paths."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "kernel" if "kernel" in jax.tree_util.keystr(path) else "bias", params
    )


OUTER_BY_PATH = {
    "multi_transform": optax.multi_transform(
        {"kernel": optax.sgd(0.7, momentum=0.9, nesterov=True), "bias": optax.set_to_zero()},
        _by_path,
    ),
    "masked": optax.masked(
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        {"dense": {"kernel": True, "bias": False}, "out": {"kernel": True, "bias": False}},
    ),
}


@pytest.mark.slow  # 16 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("fragments", [1, 2])
@pytest.mark.parametrize("outer", sorted(OUTER_BY_PATH))
def test_an_outer_optimizer_choosing_leaves_by_path_sees_the_parameters_tree(outer, fragments):
    strategy = spmd.DiLoCo(
        islands=2, sync_every=2, fragments=fragments, outer_optimizer=OUTER_BY_PATH[outer]
    )
    state, losses = _train(strategy, "adamw", 5)
    start = create(jax.random.key(0))
    want = reference(start, make_step(), batches(5), 2, 2, fragments, OUTER_BY_PATH[outer])
    _check(state, want[0], want[1], losses, want[2])
    if outer == "multi_transform":  # the biases' outer update is zero: they never move
        bias = spmd_params(state)["out"]["bias"]
        np.testing.assert_array_equal(bias, start["params"]["out"]["bias"])
    assert not np.allclose(spmd_params(state)["out"]["kernel"], start["params"]["out"]["kernel"])


def test_an_outer_optimizer_needing_more_arguments_is_refused_at_init():
    outer = optax.chain(optax.sgd(0.7), optax.contrib.reduce_on_plateau())
    strategy = spmd.DiLoCo(islands=2, sync_every=3, outer_optimizer=outer)
    with pytest.raises(spmd.ConfigurationError, match="needs no extra arguments") as caught:
        strategy.init(create, jax.random.key(0))
    assert "value" in str(caught.value)


@pytest.mark.slow  # compiles several programs: seconds on 2 shared cores
def test_inner_tensor_parallel_and_inner_strategy_layouts():
    rules = [(r".*dense/kernel", P(None, "model")), (r".*out/kernel", P("model", None))]
    tp = spmd.DiLoCo(
        {"data": -1, "model": 2}, islands=2, sync_every=3, rules=rules, batch_axes=("data",)
    )
    state, losses = _train(tp, "adamw", 4)
    assert state.islands["params"]["dense"]["kernel"].sharding.spec == P("island", None, "model")
    assert state.params["dense"]["kernel"].sharding.spec == P(None, "model")
    want = reference(initial(jax.random.key(0)), make_step(), batches(4), 2, 3)
    _check(state, want[0], want[1], losses, want[2])
    fsdp = spmd.DiLoCo(
        spmd.ParameterServerStrategy(spmd.partitioners.FixedShardsPartitioner(2)),
        islands=2,
        sync_every=3,
    )
    assert fsdp.mesh.shape == {"island": 2, "ps0": 1, "ps1": 2, "ps2": 2}
    state, losses = _train(fsdp, "adamw", 4)
    assert state.islands["params"]["dense"]["kernel"].sharding.spec[0] == "island"
    _check(state, want[0], want[1], losses, want[2])


@pytest.mark.slow  # compiles several programs: seconds on 2 shared cores
def test_inner_steps_move_nothing_across_islands_and_the_sync_one_all_reduce():
    strategy = spmd.DiLoCo(islands=2, sync_every=10)
    state = strategy.init(create, jax.random.key(0))
    x, y = batches(1)[0]
    report = strategy.explain(make_step(), state, x, y)
    assert report.inner_crossing == {}  # no collective whose devices span islands
    assert report.inner.collectives  # (the all-reduce inside each island is there)
    params_bytes = sum(v.nbytes for v in jax.tree.leaves(state.params))
    assert set(report.sync_crossing) == {"all-reduce"}
    # each of an island's 4 devices carries a quarter of every parameter across
    assert report.sync_crossing["all-reduce"].bytes == params_bytes // 4
    assert report.synchronous_bytes_across_islands_per_step >= params_bytes // 4
    assert report.ratio == pytest.approx(1 / 10, rel=0.01)
    assert "per step" in str(report)
    gathered = strategy.explain(strategy.step(make_step(), gather_metrics=True), state, x, y)
    assert sum(c.bytes for c in gathered.inner_crossing.values()) <= 2 * 4 * 2


@pytest.mark.parametrize("sync_every", [4, 10, 1000])
def test_explain_prints_every_programs_bytes_in_one_column(sync_every):
    from spmd._src.strategy.islands import IslandsExplanation

    reduce = {"all-reduce": spmd.Collective("all-reduce", 1, 4840)}
    report = IslandsExplanation(None, (), None, sync_every, {}, reduce, reduce)
    rows = str(report).splitlines()[1:4]
    assert [r.split(":")[0].strip() for r in rows] == [
        "inner step",
        f"sync (every {sync_every})",
        "synchronous step",
    ]
    columns = {len(r) - len(r.split(":", 1)[1].lstrip()) for r in rows}
    assert len(columns) == 1, rows


@pytest.mark.slow  # compiles several programs: seconds on 2 shared cores
def test_state_checkpoints_and_resumes_exactly(tmp_path):
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    data = batches(7)
    step = strategy.step(make_step())
    state = strategy.init(create, jax.random.key(0))
    ckpt = spmd.CheckpointManager(tmp_path, max_to_keep=None, async_save=False)
    for t, (x, y) in enumerate(data, 1):
        state, _ = step(state, x, y)
        ckpt.save(t, state)
    again = spmd.DiLoCo(islands=2, sync_every=3)
    restored = ckpt.restore(4, target=again.abstract_state(create, jax.random.key(0)))
    assert int(restored.step) == 4
    step2 = again.step(make_step())
    for x, y in data[4:]:
        restored, _ = step2(restored, x, y)
    assert_trees_allclose(restored, state, rtol=0, atol=0)
    ckpt.close()


@pytest.mark.slow  # compiles several programs: seconds on 2 shared cores
@pytest.mark.parametrize("saved, restored", [(2, 4), (4, 2)])
def test_restores_into_another_island_count(tmp_path, saved, restored):
    """The global params, outer state and step carry over; every island restarts from the
    global params with saved island i % saved's inner state (4 -> 2: islands 2, 3 dropped)."""
    before = spmd.DiLoCo(islands=saved, sync_every=3)
    state = before.init(create, jax.random.key(0))
    step = before.step(make_step())
    for x, y in batches(7):  # one inner step past the sync at 6
        state, _ = step(state, x, y)
    kernel = np.asarray(state.islands["params"]["out"]["kernel"])
    assert not np.allclose(kernel[0], np.asarray(state.params["out"]["kernel"]))
    ckpt = spmd.CheckpointManager(tmp_path, async_save=False)
    ckpt.save(7, state)
    after = spmd.DiLoCo(islands=restored, sync_every=3)
    got = after.restore(ckpt, create, jax.random.key(0), islands=saved)
    assert int(got.step) == 7
    assert got.islands["opt"][0].mu["out"]["bias"].shape[0] == restored
    assert_trees_allclose(got.params, state.params, rtol=0, atol=0)
    assert_trees_allclose(got.outer, state.outer, rtol=0, atol=0)
    for i in range(restored):  # the inner step since the sync is dropped
        island = jax.tree.map(lambda x, i=i: np.asarray(x)[i], got.islands)
        assert_trees_allclose(island["params"], state.params, rtol=0, atol=0)
        inner = jax.tree.map(lambda x, i=i: np.asarray(x)[i % saved], state.islands["opt"])
        assert_trees_allclose(island["opt"], inner, rtol=0, atol=0)
    got, metrics = after.step(make_step())(got, *batches(1)[0])
    assert np.asarray(metrics["loss"]).shape == (restored,)
    ckpt.close()


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("islands", [None, 4, 1])
def test_a_restore_told_another_island_count_than_saved_says_which_to_pass(tmp_path, islands):
    """A 2-island checkpoint restored by a 4-island DiLoCo without islands= (or with a
    wrong one): a CheckpointError that reads the saved count and says to pass islands=2."""
    before = spmd.DiLoCo(islands=2, sync_every=3)
    ckpt = spmd.CheckpointManager(tmp_path, async_save=False)
    ckpt.save(1, before.init(create, jax.random.key(0)))
    after = spmd.DiLoCo(islands=4, sync_every=3)
    with pytest.raises(spmd.CheckpointError, match="this one holds 2 islands") as info:
        after.restore(ckpt, create, jax.random.key(0), islands=islands)
    text = str(info.value)
    assert "pass islands=2" in text and "saved_islands=2" in text
    assert ("as islands= was not passed" in text) == (islands is None)
    ckpt.close()


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_manager_restore_into_another_island_count_says_to_use_strategy_restore(tmp_path):
    """ckpt.restore(target=) of a 2-island checkpoint into a 4-island abstract state: the
    same create function, so the fix names strategy.restore(..., islands=2), not the model."""
    before = spmd.DiLoCo(islands=2, sync_every=3)
    ckpt = spmd.CheckpointManager(tmp_path, async_save=False)
    ckpt.save(1, before.init(create, jax.random.key(0)))
    after = spmd.DiLoCo(islands=4, sync_every=3)
    with pytest.raises(spmd.CheckpointError, match="shape_or_dtype_differs") as info:
        ckpt.restore(target=after.abstract_state(create, jax.random.key(0)))
    fix = str(info.value).split("To fix: ")[1]
    assert "holds 2 islands" in fix and "the target 4" in fix
    assert "strategy.restore(manager, create_fn, key, islands=2)" in fix

    def wider(key):  # another model too: the island count is not all that differs
        state = create(key)
        state["params"]["out"]["bias"] = jnp.zeros(7)
        return state

    with pytest.raises(spmd.CheckpointError) as info:
        ckpt.restore(target=after.abstract_state(wider, jax.random.key(0)))
    fix = str(info.value).split("To fix: ")[1]
    assert "same create function" in fix and "islands=" not in fix
    ckpt.close()


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_islands_a_restore_adds_draw_their_own_random_numbers(tmp_path):
    """2 -> 4 islands: islands 0, 1 keep their saved keys; 2, 3 fold theirs with their index."""
    two = spmd.DiLoCo(islands=2, sync_every=2)
    state = two.init(create_with_key, jax.random.key(0))
    ckpt = spmd.CheckpointManager(tmp_path, async_save=False)
    ckpt.save(0, state)
    four = spmd.DiLoCo(islands=4, sync_every=2)
    grown = four.restore(ckpt, create_with_key, jax.random.key(0), islands=2)
    keys = np.asarray(jax.random.key_data(grown.islands["rng"]))
    saved = np.asarray(jax.random.key_data(state.islands["rng"]))
    np.testing.assert_array_equal(keys[:2], saved)
    for i in (2, 3):
        folded = jax.random.fold_in(jax.random.wrap_key_data(saved[i % 2]), i)
        np.testing.assert_array_equal(keys[i], jax.random.key_data(folded))
    assert len({k.tobytes() for k in keys}) == 4
    _, metrics = four.step(noisy_step)(grown, np.ones((16, 4), np.float32))
    assert len(set(np.asarray(metrics["kept"]).tolist())) > 1
    ckpt.close()


@pytest.mark.slow  # compiles several programs: seconds on 2 shared cores
def test_global_state_evaluates_with_the_synchronous_strategy():
    strategy = spmd.DiLoCo(islands=2, sync_every=2)
    state, _ = _train(strategy, "sgd", 2)
    user = strategy.global_state(state)
    assert_trees_allclose(user["params"], strategy.global_params(state), rtol=0, atol=0)
    x, y = batches(1, seed=3)[0]
    evaluate = strategy.synchronous.step(lambda s, x, y: make_step("sgd")(s, x, y)[1], donate=False)
    got = float(evaluate(user, x, y)["loss"])
    assert np.isfinite(got)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"islands": 3}, "split evenly into 3 islands"),
        ({"islands": 0}, "islands"),
        ({"sync_every": 2, "fragments": 3}, "fragments must not exceed sync_every"),
        ({"outer_optimizer": "sgd"}, "optax GradientTransformation"),
        ({"inner": {"island": 2}}, "without 'island'"),
        ({"inner": spmd.MirroredStrategy, "islands": 2}, "inner is None, a spmd.Strategy"),
        ({"params": 3}, "params is a '/'-separated path"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, fragment):
    with pytest.raises(spmd.ConfigurationError, match=fragment.replace("(", r"\(")):
        spmd.DiLoCo(**kwargs)


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_bad_states_and_calls_say_what_to_do():
    strategy = spmd.DiLoCo(islands=2, sync_every=2, params="weights")
    with pytest.raises(spmd.ConfigurationError, match="params names the part"):
        strategy.init(create, jax.random.key(0))
    strategy = spmd.DiLoCo(islands=2, sync_every=2)
    step = strategy.step(make_step())
    with pytest.raises(spmd.ConfigurationError, match="DiLoCoState"):
        step(create(jax.random.key(0)), *batches(1)[0])
    state = strategy.init(create, jax.random.key(0))
    x, y = batches(1, batch=6)[0]
    with pytest.raises(spmd.BatchError, match="split evenly"):
        step(state, x, y)
    with pytest.raises(spmd.ConfigurationError, match="positionally"):
        step(state, x, y=y)
    with pytest.raises(spmd.ConfigurationError, match="over 3 islands|carve|outermost batch"):
        spmd.DiLoCo(spmd.MirroredStrategy(), islands=3)


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_outer_optimizer_lr_one_plain_sgd_is_averaging():
    """With outer SGD at lr 1 the global parameters are the islands' average (local SGD)."""
    strategy = spmd.DiLoCo(islands=2, sync_every=2, outer_optimizer=optax.sgd(1.0))
    state = strategy.init(create, jax.random.key(0), inner="sgd")
    step = strategy.step(make_step("sgd"))
    data = batches(2)
    for x, y in data[:1]:
        state, _ = step(state, x, y)
    before = jax.tree.map(np.asarray, state.islands["params"])
    x, y = data[1]
    state, _ = step(state, x, y)
    want = reference(initial(jax.random.key(0), "sgd"), make_step("sgd"), data, 2, 10)[1]
    average = jax.tree.map(lambda a, b: (a + b) / 2, want[0]["params"], want[1]["params"])
    assert_trees_allclose(spmd_params(state), average, **TOL)
    assert not np.allclose(before["out"]["kernel"][0], before["out"]["kernel"][1])


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
def test_unusable_states_say_what_to_do():
    strategy = spmd.DiLoCo(islands=2, sync_every=2)
    step = strategy.step(make_step())
    state = strategy.init(create, jax.random.key(0))
    x, y = batches(1)[0]
    new, _ = step(state, x, y)
    with pytest.raises(spmd.ConfigurationError, match="used up this one"):
        step(state, x, y)  # donated by the call before
    other = spmd.DiLoCo(islands=4, sync_every=2).init(create, jax.random.key(0))
    with pytest.raises(spmd.ConfigurationError, match="holds 2 islands"):
        step(other, x, y)
    derived = spmd.DiLoCo(islands=2, params=lambda s: {"w": s["params"]["out"]["kernel"] * 2})
    with pytest.raises(spmd.ConfigurationError, match="params"):
        derived.init(create, jax.random.key(0))
    counted = spmd.DiLoCo(islands=2, params="opt")  # adamw's state holds an int32 count
    with pytest.raises(spmd.ConfigurationError, match="floating point"):
        counted.init(create, jax.random.key(0))
    state, _ = step(new, x, y)  # the live state still works
    assert int(state.step) == 2


@pytest.mark.slow  # compiles several programs: seconds on 2 shared cores
def test_restore_or_init_and_scope_take_a_diloco_strategy(tmp_path):
    strategy = spmd.DiLoCo(islands=2, sync_every=2)
    ckpt = spmd.CheckpointManager(tmp_path, async_save=False)
    with strategy.scope():
        assert spmd.get_strategy() is strategy
        state, start = ckpt.restore_or_init(create, jax.random.key(0), strategy=strategy)
    assert start == 0
    step = strategy.step(make_step())
    for t, (x, y) in enumerate(batches(3), 1):
        state, _ = step(state, x, y)
        ckpt.save(t, state)
    again, start = ckpt.restore_or_init(create, jax.random.key(0), strategy=strategy)
    assert start == 3 and int(again.step) == 3
    assert_trees_allclose(again, state, rtol=0, atol=0)
    ckpt.close()


@pytest.mark.slow  # compiles three programs of a transformer: seconds on 2 shared cores
def test_a_scanned_models_bytes_across_islands_are_one_hth_of_synchronous_training():
    """examples/07's LM scans its layers: the synchronous step all-reduces each layer's
    gradients inside the loop, once per layer, and explain counts it so (the trip count
    of an XLA:CPU loop is in its backend config and behind a fused comparison)."""
    from bench import bench_gpu

    lm = bench_gpu.example()
    cfg = lm.LMConfig(vocab=32, dim=32, heads=2, mlp=64, layers=3, seq=16, batch=8)
    create, step = bench_gpu.lm_pure(dataclasses.replace(cfg, attention="xla"))
    strategy = spmd.DiLoCo(islands=2, sync_every=10)
    state = strategy.abstract_state(create)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), np.int32)
    report = strategy.explain(step, state, tokens)
    params_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    # 2 islands of 4 devices: each device carries a quarter of the parameters across
    assert report.sync_crossing["all-reduce"].bytes == params_bytes // 4
    synchronous = report.synchronous_crossing["all-reduce"]
    assert synchronous.count >= cfg.layers  # each layer's all-reduce, and the rest's
    assert synchronous.bytes == pytest.approx(params_bytes / 4, rel=1e-3)
    assert report.ratio == pytest.approx(1 / 10, rel=1e-3)


def _wide(key):
    """A state whose leaves fill TPU tiles, so that no padding blurs the bytes."""
    params = {"w": jax.random.normal(key, (256, 512)), "b": jax.numpy.zeros(512)}
    return {"params": params, "opt": optax.sgd(0.1).init(params)}


def _wide_step(state, x):
    def loss(p):
        return ((x @ p["w"] + p["b"]) ** 2).mean()

    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt = optax.sgd(0.1).update(grads, state["opt"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}


@pytest.mark.slow  # compiles three programs for two TPU slices: seconds on 2 shared cores
def test_on_tpu_slices_the_sync_sends_one_hth_of_synchronous_trainings_dcn_bytes():
    pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")
    two = spmd.topology("v5e-4", slices=2)  # an island per slice, joined over DCN
    strategy = spmd.DiLoCo(spmd.TPUStrategy(topology=two), islands=2, sync_every=10)
    state = strategy.abstract_state(_wide, jax.random.key(0))
    x = jax.ShapeDtypeStruct((64, 256), np.float32)
    report = strategy.explain(_wide_step, state, x)
    assert report.inner.chip == report.sync[0].chip == "v5e"  # the TPU compiler's reports
    assert report.inner_crossing == {}
    assert not [t for t in report.inner.traffic if t.link == "DCN"]
    dcn = [t for t in report.sync[0].traffic if t.link == "DCN"]
    assert dcn and report.sync_crossing["all-reduce"].bytes == sum(t.wire_bytes for t in dcn)
    # each of a slice's 4 chips sends its quarter of the parameters (in 4 KiB TPU tiles)
    quarter = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)) / 4
    assert quarter <= report.sync_crossing["all-reduce"].bytes <= quarter + 4096
    assert report.ratio == pytest.approx(1 / 10, rel=0.01)


def _module(*lines):
    return "HloModule m\n\nENTRY %main () -> f32[] {\n  " + "\n  ".join(lines) + "\n}\n"


def test_crossing_reads_every_replica_group_format():
    from spmd._src.strategy.islands import crossing

    lines = {
        "inside": "%a = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={{0,1},{2,3}}",
        "iota_inside": "%b = f32[4]{0} all-gather(f32[2]{0} %x), replica_groups=[2,2]<=[4]",
        "iota_across": "%c = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups=[2,2]<=[2,2]T(1,0)",
        "explicit_across": "%d = f32[2]{0} all-reduce(f32[2]{0} %x), replica_groups={{0,2},{1,3}}",
        "permute": "%e = f32[1]{0} collective-permute(f32[1]{0} %x), source_target_pairs={{0,2}}",
        "all": "%f = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups={}",
        "mesh_inside": "%g = f32[8]{0} all-reduce(f32[8]{0} %x), channel_id=9, "
        "replica_groups=mesh['a'=2,'b'=2], device_ids=([4]) {'b'}, to_apply=%add",
        "mesh_across": "%h = f32[6]{0} all-reduce(f32[6]{0} %x), channel_id=10, "
        "replica_groups=mesh['a'=2,'b'=2], device_ids=([4]) {'a'}, to_apply=%add",
    }
    devices = jax.devices()[:4]
    inside = [lines[k] for k in ("inside", "iota_inside", "mesh_inside")]
    assert crossing(_module(*inside), 2, devices) == {}
    found = crossing(_module(*lines.values()), 2, devices)
    assert found["all-reduce"].count == 4
    # groups of one device per island carry their bytes; the group of all 4
    # devices (2 in each island) carries half of them across: a ring of 2 islands
    assert found["all-reduce"].bytes == (4 + 2 + 6) * 4 + 4 * 4 // 2
    assert found["collective-permute"].bytes == 4


def test_crossing_reads_the_slices_of_dcn_transfers():
    """A megascale send joins slices: its target names them, or every slice."""
    from types import SimpleNamespace

    from spmd._src.strategy.islands import crossing

    attrs = '_xla_host_transfer_rendezvous="{}",_xla_megascale_transfer_type="ALL_REDUCE"'
    pairs = "{{100000,200000},{300000,400000}}"
    send = (
        "%s{i} = (f32[64]{{0}}, u32[], token[]) send(f32[64]{{0}} %x, token[] %t), "
        "is_host_transfer=true, frontend_attributes={{{attrs},_xla_megascale_target={target}}}"
    )
    devices = [SimpleNamespace(slice_index=s) for s in range(4) for _ in range(2)]
    across_all = send.format(i=1, attrs=attrs.format("r1"), target='"{1,2,3,4}x{0:1}"')
    inside = send.format(i=2, attrs=attrs.format("r2"), target=pairs)
    assert crossing(_module(inside), 2, devices) == {}  # slices 0+1 and 2+3: one island each
    assert crossing(_module(inside), 4, devices)["all-reduce"].bytes == 256
    found = crossing(_module(across_all, inside), 2, devices)
    assert found["all-reduce"].count == 1 and found["all-reduce"].bytes == 256 // 2


# -- each island is a data-parallel job of its own: its batch, its replicas --------

ISLAND_BATCH = 16  # batches() gives 32 rows: 16 to each of 2 islands


def averaging_step(global_batch_size, tokens=1):
    """The paper's step with spmd.compute_average_loss in place of the mean (`tokens` > 1:
    a per-token loss of shape (batch, tokens), every token the example's loss)."""
    tx = INNER["adamw"]

    def train_step(state, x, y):
        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y)
            if tokens > 1:
                per_example = jnp.repeat(per_example[:, None], tokens, axis=1) / tokens
            return spmd.compute_average_loss(per_example, global_batch_size=global_batch_size)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    return train_step


def per_replica_step(strategy, seen):
    """The parameter server tutorial's step_fn: strategy.run(replica_fn) and strategy.reduce
    inside the step, the replica function averaging with compute_average_loss."""
    tx = INNER["adamw"]

    def replica_fn(x, y, params):
        context = spmd.get_replica_context()
        seen.append((context.num_replicas_in_sync, spmd.get_strategy() is strategy))

        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y)
            return spmd.compute_average_loss(per_example)

        return jax.value_and_grad(loss_fn)(params)

    def train_step(state, x, y):
        losses, grads = strategy.run(replica_fn, args=(x, y), kwargs={"params": state["params"]})
        loss, grads = strategy.reduce("SUM", losses), strategy.reduce("SUM", grads)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    return train_step


def _paper(steps, islands=2):
    return reference(initial(jax.random.key(0)), make_step(), batches(steps), islands, 3)


@pytest.mark.slow  # 8 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("global_batch_size", [None, ISLAND_BATCH], ids=["default", "island"])
def test_compute_average_loss_over_the_islands_batch_equals_the_paper(global_batch_size):
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    state = strategy.init(create, jax.random.key(0))
    step = strategy.step(averaging_step(global_batch_size))
    losses = []
    for x, y in batches(4):
        state, metrics = step(state, x, y)
        losses.append(np.asarray(metrics["loss"]))
    want = _paper(4)
    _check(state, want[0], want[1], losses, want[2])


@pytest.mark.slow  # 7 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("tokens", [1, 4], ids=["per_example", "per_token"])
def test_compute_average_loss_over_the_batch_across_islands_says_to_pass_the_islands(tokens):
    """32 rows over 2 islands: dividing each island's sum by 32 would halve its loss (and,
    for SGD, its learning rate) silently."""
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    state = strategy.init(create, jax.random.key(0))
    x, y = batches(1)[0]
    step = strategy.step(averaging_step(len(x) * tokens, tokens))
    with pytest.raises(spmd.ConfigurationError) as caught:
        step(state, x, y)
    text = str(caught.value)
    assert "each island is a data-parallel job of its own" in text
    assert f"global_batch_size={len(x) * tokens}, islands=2, island_batch_size=16" in text
    assert f"pass global_batch_size={ISLAND_BATCH * tokens}" in text
    one = spmd.DiLoCo(islands=1, sync_every=3)  # one island: its batch is the global batch
    one.step(averaging_step(len(x) * tokens, tokens))(one.init(create, jax.random.key(0)), x, y)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("through", ["closure", "get_strategy"])
def test_num_replicas_in_sync_inside_a_step_says_to_read_replicas_per_island(through):
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    assert (strategy.num_replicas_in_sync, strategy.replicas_per_island) == (8, 4)

    def scaled_step(state, x, y):
        read = strategy if through == "closure" else spmd.get_strategy()
        new, metrics = make_step()(state, x, y)
        return new, {"loss": metrics["loss"] * read.num_replicas_in_sync}

    state = strategy.init(create, jax.random.key(0))
    with strategy.scope(), pytest.raises(spmd.ContextError) as caught:
        strategy.step(scaled_step)(state, *batches(1)[0])
    assert "num_replicas_in_sync=8, islands=2, replicas_per_island=4" in str(caught.value)
    assert "read strategy.replicas_per_island inside the step" in str(caught.value)


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_run_and_reduce_inside_a_step_are_the_islands_per_replica_view_and_equal_the_paper():
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    state = strategy.init(create, jax.random.key(0))
    seen = []
    step = strategy.step(per_replica_step(strategy, seen))
    losses = []
    for x, y in batches(4):
        state, metrics = step(state, x, y)
        losses.append(np.asarray(metrics["loss"]))
    assert set(seen) == {(4, True)}  # an island's 4 replicas; get_strategy() is the DiLoCo
    want = _paper(4)
    _check(state, want[0], want[1], losses, want[2])


def test_run_and_reduce_outside_a_step_say_to_move_them_into_the_step():
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    x, y = batches(1)[0]
    with pytest.raises(spmd.ContextError, match="inside a step") as caught:
        strategy.run(lambda x, y: x.sum(), args=(x, y))
    assert "strategy.run(replica_fn, args=(x, y)" in str(caught.value)
    with pytest.raises(spmd.ContextError, match="DiLoCo's reduce"):
        strategy.reduce("SUM", spmd.PerReplica(np.ones(8)))


KEYED_TX = optax.sgd(0.1)


def create_with_key(key):
    params = {"w": jax.numpy.ones((4, 2))}
    return {"params": params, "opt": KEYED_TX.init(params), "rng": jax.random.key(1)}


def noisy_step(state, x):
    rng, sub = jax.random.split(state["rng"])
    mask = jax.random.bernoulli(sub, 0.5, x.shape)
    grads = jax.grad(lambda p: ((x * mask) @ p["w"]).sum())(state["params"])
    updates, opt = KEYED_TX.update(grads, state["opt"])
    new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "rng": rng}
    return new, {"kept": mask.mean()}


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_each_island_draws_its_own_random_numbers():
    """A typed PRNG key in the state is folded with the island's index at init."""
    strategy = spmd.DiLoCo(islands=2, sync_every=2)
    state = strategy.init(create_with_key, jax.random.key(0))
    keys = jax.random.key_data(state.islands["rng"])
    assert not np.array_equal(keys[0], keys[1])
    np.testing.assert_array_equal(
        keys[1], jax.random.key_data(jax.random.fold_in(jax.random.key(1), 1))
    )
    step = strategy.step(noisy_step)
    kept = [np.asarray(step(state, np.ones((16, 4), np.float32))[1]["kept"])]
    assert kept[0][0] != kept[0][1]


def test_explain_with_a_batch_the_islands_replicas_do_not_divide_is_a_batch_error():
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    state = strategy.init(create, jax.random.key(0))
    x, y = batches(1, batch=30)[0]
    with pytest.raises(spmd.BatchError, match="split evenly over the 8 replicas") as caught:
        strategy.explain(make_step(), state, x, y)
    assert "global_batch_size=30" in str(caught.value)
