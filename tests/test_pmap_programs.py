"""pmap programs port to `strategy.run(..., axis_name=...)` with no edit, and a step names them.

The oracle is the same program under `jax.pmap` on the same eight devices: a
linen model with `nn.BatchNorm(axis_name="batch")` whose gradients are
`lax.pmean`-ed over "batch", as flax's pmap-era examples train.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd

# pmap's parity oracles run over the eight CPU devices (N replicas).
pytestmark = pytest.mark.cpu_mesh

N = 8  # replicas
LOCAL = 4  # examples per replica


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name="batch", momentum=0.9)(x)
        return nn.Dense(3)(nn.relu(x))


MODEL = Net()
TX = optax.sgd(0.1, momentum=0.9)


def _train_step(params, stats, opt_state, x, y):
    """The pmap-era step, unchanged: per-replica loss, pmean'd grads and loss."""

    def loss_fn(p):
        logits, updates = MODEL.apply(
            {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates["batch_stats"]

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grads = jax.lax.pmean(grads, "batch")
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state, jax.lax.pmean(loss, "batch")


def _data(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, N * LOCAL, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=(steps, N * LOCAL)).astype(np.int32)
    return x, y


def _init():
    variables = MODEL.init(jax.random.key(0), jnp.ones((LOCAL, 5)), train=False)
    params, stats = variables["params"], variables["batch_stats"]
    return params, stats, TX.init(params)


def _pmap_oracle(steps):
    params, stats, opt_state = _init()
    rep = jax.tree.map(lambda a: jnp.stack([a] * N), (params, stats, opt_state))
    step = jax.pmap(_train_step, axis_name="batch")
    xs, ys = _data(steps)
    losses = []
    for x, y in zip(xs, ys, strict=True):
        *rep, loss = step(*rep, x.reshape(N, LOCAL, 5), y.reshape(N, LOCAL))
        losses.append(np.asarray(loss[0]))
    return jax.tree.map(lambda a: np.asarray(a[0]), tuple(rep)), losses


# One batch axis, and two (hosts x replicas) that the axis name stands for together.
EVERY_BATCH_LAYOUT = pytest.mark.parametrize(
    "make",
    [
        spmd.MirroredStrategy,
        lambda: spmd.Strategy(
            mesh=spmd.make_mesh({"host": 2, "replica": 4}), batch_axes=("host", "replica")
        ),
    ],
    ids=["mirrored", "two_batch_axes"],
)


@pytest.mark.slow
@EVERY_BATCH_LAYOUT
def test_a_pmap_training_loop_runs_unchanged_under_run_with_its_axis_name(make):
    strategy = make()
    steps = 3
    (want_params, want_stats, _), want_losses = _pmap_oracle(steps)
    params, stats, opt_state = _init()
    # Each replica's copy as a PerReplica, the way pmap's replicated arguments are.
    rep = jax.tree.map(lambda a: spmd.PerReplica(jnp.stack([a] * N)), (params, stats, opt_state))
    xs, ys = _data(steps)
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        *rep, loss = strategy.run(_train_step, args=(*rep, x, y), axis_name="batch")
        np.testing.assert_allclose(strategy.local_results(loss)[0], want_losses[i], rtol=1e-5)
    got_params, got_stats = jax.tree.map(
        lambda r: np.asarray(strategy.local_results(r)[0]),
        tuple(rep[:2]),
        is_leaf=lambda r: isinstance(r, spmd.PerReplica),
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got_params, want_params
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got_stats, want_stats
    )


def test_axis_index_and_all_gather_over_the_own_name_match_pmap():
    strategy = spmd.MirroredStrategy()
    x = np.arange(N * 2, dtype=np.float32)

    def fn(v):
        return jax.lax.axis_index("i"), jax.lax.all_gather(v, "i"), jax.lax.psum(v, "i")

    want = jax.pmap(fn, axis_name="i")(x.reshape(N, 2))
    got = strategy.run(fn, args=(x,), axis_name="i")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g.values), np.asarray(w))


def test_the_replica_context_collectives_still_work_beside_an_own_axis_name():
    strategy = spmd.MirroredStrategy()
    x = np.arange(N, dtype=np.float32)

    def fn(v):
        ctx = spmd.get_replica_context()
        return ctx.all_reduce("SUM", v), ctx.replica_id_in_sync_group

    total, ids = strategy.run(fn, args=(x,), axis_name="batch")
    assert strategy.reduce("MEAN", total, axis=None) == pytest.approx(x.sum())
    assert [int(i) for i in strategy.local_results(ids)] == list(range(N))


@pytest.mark.parametrize("bad", [3, "model"])
def test_an_axis_name_that_is_not_a_string_or_names_another_mesh_axis_is_an_error(bad):
    strategy = spmd.Strategy(mesh=spmd.make_mesh({"data": 4, "model": 2}), batch_axes=("data",))
    with pytest.raises(spmd.ConfigurationError, match="axis_name"):
        strategy.run(lambda v: v, args=(np.ones(4, np.float32),), axis_name=bad)


def test_a_step_with_a_pmap_collective_says_to_remove_the_name_or_use_run():
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def train_step(state, x):
        return state, {"mean": jax.lax.pmean(x.mean(), "batch")}

    state = strategy.put({"w": jnp.zeros(2)})
    with pytest.raises(spmd.ConfigurationError) as caught:
        train_step(state, np.ones((8, 2), np.float32))
    text = str(caught.value)
    assert "axis_name='batch'" in text and "strategy.run" in text and "remove the axis name" in text
    assert isinstance(caught.value.__cause__, NameError)


def test_a_step_with_a_pmap_batch_norm_is_named_too():
    strategy = spmd.MirroredStrategy()
    params, stats, opt_state = _init()

    @strategy.step
    def train_step(state, x, y):
        *new, loss = _train_step(*state, x, y)
        return tuple(new), {"loss": loss}

    state = strategy.put((params, stats, opt_state))
    x, y = _data(1)
    with pytest.raises(spmd.ConfigurationError, match="global view"):
        train_step(state, x[0], y[0])


@pytest.mark.slow
@EVERY_BATCH_LAYOUT
def test_run_with_an_axis_name_inside_a_step_matches_pmap(make):
    # The step's error points here: keep the per-replica code and run it with
    # run(..., axis_name=...); inside a step as well as eagerly.
    strategy = make()
    (want_params, want_stats, _), want_losses = _pmap_oracle(1)
    params, stats, opt_state = _init()

    @strategy.step
    def train_step(state, x, y):
        rep = jax.tree.map(lambda a: spmd.PerReplica(jnp.stack([a] * N)), state)
        *new, loss = strategy.run(_train_step, args=(*rep, x, y), axis_name="batch")
        first = jax.tree.map(
            lambda r: r.values[0], tuple(new), is_leaf=lambda r: isinstance(r, spmd.PerReplica)
        )
        return first, {"loss": strategy.reduce("MEAN", loss, axis=None)}

    x, y = _data(1)
    (got_params, got_stats, _), metrics = train_step(
        strategy.put((params, stats, opt_state)), x[0], y[0]
    )
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[0], rtol=1e-5)
    for got, want in ((got_params, want_params), (got_stats, want_stats)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


@pytest.mark.parametrize("axis_name", [None, "i"])
def test_run_of_a_pmap_collective_on_another_name_says_which_axis_name_to_pass(axis_name):
    strategy = spmd.MirroredStrategy()

    def fn(v):
        return jax.lax.pmean(v, "batch")

    with pytest.raises(spmd.ConfigurationError) as caught:
        strategy.run(fn, args=(np.ones(N, np.float32),), axis_name=axis_name)
    text = str(caught.value)
    assert "unbound_axis='batch'" in text and f"axis_name={axis_name!r}" in text
    assert "pass axis_name='batch' to strategy.run" in text
    assert isinstance(caught.value.__cause__, NameError)


@pytest.mark.parametrize("context", ["scope", "set_mesh"])
def test_run_with_an_axis_name_under_the_strategys_mesh_context_matches_pmap(context):
    # A mesh with a model axis beside the batch: the replicas are 4, as pmap over 4 devices.
    strategy = spmd.Strategy(mesh=spmd.make_mesh({"data": 4, "model": 2}), batch_axes=("data",))
    x = np.arange(16, dtype=np.float32)

    def fn(v):
        return jax.lax.psum(v.sum(), "batch") + jax.lax.axis_index("batch")

    want = jax.pmap(fn, axis_name="batch", devices=jax.devices()[:4])(x.reshape(4, 4))
    enter = strategy.scope() if context == "scope" else jax.set_mesh(strategy.mesh)
    with enter:
        got = strategy.run(fn, args=(x,), axis_name="batch")
    np.testing.assert_array_equal(np.asarray(got.values), np.asarray(want))


def test_a_replicated_pmap_state_passed_as_a_batch_names_run_arguments_and_per_replica():
    from flax import jax_utils

    strategy = spmd.MirroredStrategy()
    state = jax_utils.replicate({"w": jnp.ones((3, 2))})  # leading axis: one copy per device

    def step(params, images):
        return jax.lax.pmean((images @ params["w"]).sum(), "batch")

    with pytest.raises(spmd.BatchError) as caught:
        strategy.run(step, args=(state, np.ones((2 * N, 3), np.float32)), axis_name="batch")
    text = str(caught.value)
    assert "params=8, images=16" in text and "spmd.PerReplica" in text
    # As the error says: the copies as a PerReplica run as pmap ran them.
    want = jax.pmap(step, axis_name="batch")(state, np.ones((N, 2, 3), np.float32))
    got = strategy.run(
        step, args=(spmd.PerReplica(state), np.ones((2 * N, 3), np.float32)), axis_name="batch"
    )
    np.testing.assert_allclose(np.asarray(got.values), np.asarray(want))
