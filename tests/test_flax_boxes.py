"""Every flax box in a linen state is laid out as flax reads it, or is an error naming it.

Flax's `nn.get_partition_spec` reads any `meta.AxisMetadata` box through its
`get_partition_spec()`: `nn.Partitioned`, `nn.LogicallyPartitioned`, the `NNXMeta`
of an NNX layer bridged into linen (`nnx.bridge.to_linen`), or a box of the user's
own. A box that cannot say how its leaf is sharded, or names that are not a tuple of
names, is a ConfigurationError naming where it is, never a silent replication.
"""

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import meta
from flax.nnx import bridge
from jax.sharding import PartitionSpec as P

import spmd

pytestmark = pytest.mark.cpu_mesh

RULES = [("mlp", "model"), ("embed", None), ("out", None)]
X = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
Y = np.random.default_rng(1).normal(size=(16, 2)).astype(np.float32)


def _strategy(rules=RULES):
    return spmd.Strategy(
        spmd.make_mesh({"data": 4, "model": 2}), batch_axes=("data",), logical_axis_rules=rules
    )


def _partitioned(names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Bridged(nn.Module):
    """A linen model whose layers are NNX layers bridged in: their kernels are NNXMeta boxes."""

    @nn.compact
    def __call__(self, x):
        up = bridge.to_linen(
            nnx.Linear, 4, 8, kernel_init=_partitioned(("embed", "mlp")), name="up"
        )
        down = bridge.to_linen(
            nnx.Linear, 8, 2, kernel_init=_partitioned(("mlp", "out")), name="down"
        )
        return down(jnp.tanh(up(x)))


TX = optax.adam(1e-2)


def create_bridged(key):
    params = Bridged().init(key, jnp.ones((1, 4)))["params"]
    return {"params": params, "opt": TX.init(params)}


def train_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((Bridged().apply({"params": params}, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def _flax_shardings(strategy, create):
    """What flax reads: nn.get_partition_spec of the abstract state, mapped by
    nn.logical_to_mesh_sharding with the strategy's rules."""
    with nnx.use_eager_sharding(False):
        abstract = jax.eval_shape(create, jax.random.key(0))
    specs = nn.get_partition_spec(abstract)
    rules = strategy.logical_axis_rules
    return jax.tree.leaves(nn.logical_to_mesh_sharding(specs, strategy.mesh, rules))


def _check_leaf_by_leaf(state, expected):
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    assert len(leaves) == len(expected)
    for (path, leaf), sharding in zip(leaves, expected, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
            jax.tree_util.keystr(path),
            leaf.sharding.spec,
            sharding.spec,
        )


def _spec(leaf):
    """The leaf's PartitionSpec, one entry per dimension."""
    spec = tuple(leaf.sharding.spec)
    return spec + (None,) * (leaf.ndim - len(spec))


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_bridged_nnx_layer_is_laid_out_as_flax_reads_its_annotation():
    strategy = _strategy()
    state = strategy.init(create_bridged, jax.random.key(0))
    expected = _flax_shardings(strategy, create_bridged)
    _check_leaf_by_leaf(state, expected)
    kernel = state["params"]["up"]["kernel"]
    assert type(kernel).__name__ == "NNXMeta"  # the box is kept
    assert _spec(kernel.value) == (None, "model")
    assert _spec(state["params"]["down"]["kernel"].value) == ("model", None)
    assert _spec(state["opt"][0].mu["up"]["kernel"].value) == (None, "model")
    # put and abstract_state read the same boxes.
    with nnx.use_eager_sharding(False):
        made = jax.jit(create_bridged)(jax.random.key(0))
    _check_leaf_by_leaf(strategy.put(made), expected)
    abstract = strategy.abstract_state(create_bridged, jax.random.key(0))
    for leaf, sharding in zip(jax.tree.leaves(abstract), expected, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, len(leaf.shape))


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_bridged_nnx_layer_trains_as_on_one_device():
    strategy = _strategy()
    state = strategy.init(create_bridged, jax.random.key(0))
    expected = _flax_shardings(strategy, create_bridged)
    step = strategy.step(train_step)
    oracle_step = jax.jit(train_step)
    losses, oracle = [], []
    with nnx.use_eager_sharding(False):  # one device: the bridged layers' names unread
        oracle_state = jax.jit(create_bridged)(jax.random.key(0))
        for _ in range(4):
            state, loss = step(state, X, Y)
            oracle_state, oracle_loss = oracle_step(oracle_state, X, Y)
            losses.append(float(loss))
            oracle.append(float(oracle_loss))
    np.testing.assert_allclose(losses, oracle, rtol=2e-5)
    assert oracle[-1] < oracle[0]
    _check_leaf_by_leaf(state, expected)  # the layout survives the steps


class Sharded(flax.struct.PyTreeNode, meta.AxisMetadata):
    """A box of the user's own that says its sharding as nn.Partitioned does."""

    value: jax.Array
    names: tuple = flax.struct.field(pytree_node=False)

    def unbox(self):
        return self.value

    def replace_boxed(self, val):
        return self.replace(value=val)

    def add_axis(self, index, params):
        return self

    def remove_axis(self, index, params):
        return self

    def get_partition_spec(self):
        return P(*self.names)


class Tagged(flax.struct.PyTreeNode, meta.AxisMetadata):
    """A box of the user's own that says nothing about sharding."""

    value: jax.Array
    tag: str = flax.struct.field(pytree_node=False)

    def unbox(self):
        return self.value

    def replace_boxed(self, val):
        return self.replace(value=val)

    def add_axis(self, index, params):
        return self

    def remove_axis(self, index, params):
        return self


class Broken(Tagged):
    """A box whose get_partition_spec fails."""

    def get_partition_spec(self):
        raise NotImplementedError("no spec for tagged boxes")


def _box_state(box):
    def create(key):
        return {"dense": {"kernel": box(jax.random.normal(key, (4, 8))), "bias": jnp.zeros(8)}}

    return create


def test_a_box_of_the_users_own_is_laid_out_by_its_get_partition_spec():
    strategy = _strategy()
    create = _box_state(lambda x: Sharded(x, ("embed", "mlp")))
    state = strategy.init(create, jax.random.key(0))
    _check_leaf_by_leaf(state, _flax_shardings(strategy, create))
    assert _spec(state["dense"]["kernel"].value) == (None, "model")


@pytest.mark.parametrize(
    "box, says",
    [
        (lambda x: Tagged(x, "ema"), "has none"),
        (lambda x: Broken(x, "ema"), "NotImplementedError: no spec for tagged boxes"),
    ],
    ids=["no_get_partition_spec", "get_partition_spec_raises"],
)
def test_a_box_that_cannot_say_its_sharding_is_an_error_naming_its_path_and_type(box, says):
    strategy = _strategy()
    for make in (
        lambda: strategy.init(_box_state(box), jax.random.key(0)),
        lambda: strategy.put(_box_state(box)(jax.random.key(0))),
    ):
        with pytest.raises(spmd.ConfigurationError) as error:
            make()
        text = str(error.value)
        assert "'dense/kernel'" in text, text
        assert f"{__name__}.{type(box(jnp.ones(1))).__name__}" in text, text
        assert says in text, text


@pytest.mark.parametrize(
    "names",
    [
        pytest.param("mlp", id="bare_string"),
        pytest.param(("embed", 1), id="int_inside"),
        pytest.param(("embed", ("model", 2)), id="int_in_a_tuple"),
    ],
)
@pytest.mark.parametrize("kind", ["linen_logical", "linen_partitioned", "nnx"])
def test_names_that_are_not_a_tuple_of_names_are_an_error_naming_path_and_names(kind, names):
    init = nn.initializers.lecun_normal()
    if kind == "nnx":

        def create(key):
            return nnx.Linear(4, 8, kernel_init=_partitioned(names), rngs=nnx.Rngs(key))

    else:
        boxed = (
            nn.with_logical_partitioning(init, names)
            if kind == "linen_logical"
            else nn.with_partitioning(init, names)
        )

        def create(key):
            return {"dense": {"kernel": boxed(key, (4, 8))}}

    with pytest.raises(spmd.ConfigurationError) as error:
        _strategy().init(create, jax.random.key(0))
    text = str(error.value)
    assert "a tuple with one entry per dimension" in text, text
    assert "kernel'" in text, text
    assert f"names={names!r}" in text, text
    if isinstance(names, str):
        assert "a bare string is read letter by letter" in text
