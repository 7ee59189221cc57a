"""Flax linen states (MaxText's boxed TrainState) laid out by their annotations and rules."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from spmd.logical import REST

pytestmark = pytest.mark.cpu_mesh

DOC = pathlib.Path(__file__).parent.parent / "docs" / "flax.md"
HEADING = "## Flax linen: a MaxText-style state"


def _doc_snippet() -> str:
    section = DOC.read_text().split(HEADING, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def doc():
    """The docs' MaxText-style decoder section, run as it is written."""
    namespace: dict = {}
    exec(compile(_doc_snippet(), str(DOC), "exec"), namespace)
    return namespace


TOKENS = np.random.default_rng(0).integers(0, 32, (8, 9))
FSDP_RULES = [("activation_batch", "fsdp"), ("embed", "fsdp"), (REST, None)]


def _strategies(doc):
    return {
        "data4_model2": spmd.Strategy(
            spmd.make_mesh({"data": 4, "model": 2}),
            batch_axes=("data",),
            logical_axis_rules=doc["RULES"],
        ),
        "fsdp8": spmd.Strategy(
            spmd.make_mesh({"fsdp": 8}), batch_axes=("fsdp",), logical_axis_rules=FSDP_RULES
        ),
    }


def _flax_shardings(strategy, rules, create):
    """What MaxText computes: nn.get_partition_spec of the boxed abstract state, mapped by
    nn.logical_to_mesh_sharding with the same rules (flax replicates unmapped names)."""
    flax_rules = [rule for rule in rules if rule[0] != REST]
    with nn.logical_axis_rules(flax_rules):
        abstract = jax.eval_shape(create, jax.random.key(0))
    specs = nn.get_partition_spec(abstract)
    return jax.tree.leaves(nn.logical_to_mesh_sharding(specs, strategy.mesh, flax_rules))


def _check_leaf_by_leaf(state, expected):
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    assert len(leaves) == len(expected)
    for (path, leaf), sharding in zip(leaves, expected, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
            jax.tree_util.keystr(path),
            leaf.sharding.spec,
            sharding.spec,
        )


@pytest.mark.parametrize("mesh", ["data4_model2", "fsdp8"])
def test_boxed_trainstate_is_laid_out_as_flax_maps_its_boxes(doc, mesh):
    strategy = _strategies(doc)[mesh]
    state = strategy.init(doc["create"], jax.random.key(0))
    expected = _flax_shardings(strategy, strategy.logical_axis_rules, doc["create"])
    _check_leaf_by_leaf(state, expected)
    assert isinstance(state.params["layers"]["wi"], nn.LogicallyPartitioned)  # boxes kept
    want = P(None, None, "model") if mesh == "data4_model2" else P(None, "fsdp")
    assert state.params["layers"]["wi"].value.sharding.spec == want
    assert state.opt_state[0].mu["layers"]["wi"].value.sharding.spec == want
    # put, state_sharding and abstract_state read the same boxes.
    _check_leaf_by_leaf(strategy.put(jax.jit(doc["create"])(jax.random.key(0))), expected)
    abstract = strategy.abstract_state(doc["create"], jax.random.key(0))
    for leaf, sharding in zip(jax.tree.leaves(abstract), expected, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, len(leaf.shape))


@pytest.mark.parametrize("mesh", ["data4_model2", "fsdp8"])
def test_boxed_trainstate_losses_equal_one_device(doc, mesh):
    strategy = _strategies(doc)[mesh]
    state = strategy.init(doc["create"], jax.random.key(0))
    expected = _flax_shardings(strategy, strategy.logical_axis_rules, doc["create"])
    step = strategy.step(doc["train_step"])
    oracle_state = jax.jit(doc["create"])(jax.random.key(0))
    oracle_step = jax.jit(doc["train_step"])
    losses, oracle = [], []
    for _ in range(4):
        state, loss = step(state, TOKENS)
        oracle_state, oracle_loss = oracle_step(oracle_state, TOKENS)
        losses.append(float(loss))
        oracle.append(float(oracle_loss))
    np.testing.assert_allclose(losses, oracle, rtol=2e-5)
    assert oracle[-1] < oracle[0]
    _check_leaf_by_leaf(state, expected)  # the layout survives the steps


def test_partitioned_boxes_name_mesh_axes(doc):
    def create(key):
        init = nn.with_partitioning(nn.initializers.ones, (None, "model"))
        return {"kernel": init(key, (4, 8))}

    strategy = _strategies(doc)["data4_model2"]
    state = strategy.init(create, jax.random.key(0))
    assert state["kernel"].value.sharding.spec == P(None, "model")


def test_create_fn_that_unboxes_itself_is_an_error(doc):
    strategy = _strategies(doc)["data4_model2"]
    with pytest.raises(
        spmd.ConfigurationError, match=r"sharding constraint(.|\n)*leaf=.params/embedding"
    ):
        strategy.init(lambda key: nn.meta.unbox(doc["create"](key)), jax.random.key(0))
    with pytest.raises(spmd.ConfigurationError, match="nn.meta.unbox"):
        strategy.abstract_state(lambda key: nn.meta.unbox(doc["create"](key)), jax.random.key(0))


def test_a_rule_over_the_path_lays_out_an_unboxed_leaf(doc):
    strategy = spmd.Strategy(
        spmd.make_mesh({"data": 4, "model": 2}),
        rules=[(r".*", None)],
        logical_axis_rules=doc["RULES"],
    )
    state = strategy.init(lambda key: nn.meta.unbox(doc["create"](key)), jax.random.key(0))
    assert state.params["layers"]["wi"].sharding.spec == P()


def test_logical_constraints_in_a_step_follow_the_strategy_rules(doc):
    strategy = _strategies(doc)["data4_model2"]

    def constrain(x):
        return nn.with_logical_constraint(x, ("activation_batch", "activation_mlp", "layers"))

    with strategy.context(traced=True):
        jaxpr = jax.make_jaxpr(constrain)(jnp.ones((8, 4, 2)))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    assert eqn.params["sharding"].spec == P("data", "model", None)


def test_every_unmapped_name_is_listed_in_one_error(doc):
    strategy = spmd.Strategy(
        spmd.make_mesh({"data": 4, "model": 2}), logical_axis_rules=[("mlp", "model")]
    )
    with pytest.raises(spmd.ConfigurationError) as error:
        strategy.init(doc["create"], jax.random.key(0))
    text = str(error.value)
    for name in ("vocab", "embed", "heads", "kv", "layers"):
        assert f"'{name}' (at '" in text, name
    assert "'mlp' (at" not in text
    assert "params/embedding'" in text  # one path for each name
    assert "REST" in text


def test_rest_rule_replicates_the_names_no_other_rule_maps(doc):
    strategy = spmd.Strategy(
        spmd.make_mesh({"data": 4, "model": 2}),
        logical_axis_rules=[("mlp", "model"), (REST, None)],
    )
    state = strategy.init(doc["create"], jax.random.key(0))
    assert state.params["layers"]["wi"].value.sharding.spec == P(None, None, "model")
    assert state.params["layers"]["query"].value.sharding.spec == P()
    assert state.params["embedding"].value.sharding.spec == P()


def test_rest_rule_only_replicates(doc):
    with pytest.raises(spmd.ConfigurationError, match="REST cannot map to mesh axes"):
        spmd.Strategy(spmd.make_mesh({"data": 4, "model": 2}), logical_axis_rules=[(REST, "model")])


def test_a_box_own_rules_map_its_names_first(doc):
    def create(key):
        init = nn.with_logical_partitioning(
            nn.initializers.ones, ("batchless", "hidden"), rules=(("hidden", "model"),)
        )
        return {"kernel": init(key, (4, 8))}

    strategy = spmd.Strategy(
        spmd.make_mesh({"data": 4, "model": 2}), logical_axis_rules=[("batchless", None)]
    )
    state = strategy.init(create, jax.random.key(0))
    assert state["kernel"].value.sharding.spec == P(None, "model")


# MaxText's base.yml logical_axis_rules, as MaxText writes them (lists), on its six-axis mesh.
MAXTEXT_RULES = [
    ["activation_batch", ["data", "fsdp", "fsdp_transpose"]],
    ["activation_heads", ["tensor", "sequence"]],
    ["activation_length", "sequence"],
    ["activation_embed", "tensor"],
    ["activation_mlp", "tensor"],
    ["activation_kv", "tensor"],
    ["activation_vocab", ["tensor", "sequence"]],
    ["activation_vocab", "tensor"],
    ["activation_vocab", "sequence"],
    ["mlp", ["fsdp_transpose", "tensor", "autoregressive"]],
    ["vocab", ["tensor", "autoregressive"]],
    ["embed", ["fsdp", "fsdp_transpose", "sequence"]],
    ["embed", ["fsdp", "sequence"]],
    ["norm", "tensor"],
    ["heads", ["tensor", "autoregressive"]],
    ["kv", []],
    ["cache_batch", []],
    ["cache_heads", ["autoregressive", "tensor"]],
    ["cache_kv", []],
    ["cache_sequence", []],
]
MAXTEXT_NAMES = {
    "wi": ("embed", "mlp"),  # mlp's rule comes first: it takes fsdp_transpose from embed
    "wo": ("mlp", "embed"),
    "embedding": ("vocab", "embed"),
    "query": ("embed", "heads", "kv"),
    "out": ("heads", "kv", "embed"),
    "scale": ("norm",),
    "gate": ("heads", "mlp"),
}


def test_maxtext_rules_lay_out_every_leaf_as_flax_maps_them():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.ones
            return sum(
                self.param(n, nn.with_logical_partitioning(init, names), (8,) * len(names)).sum()
                for n, names in MAXTEXT_NAMES.items()
            )

    rules = [(name, tuple(t) if isinstance(t, list) else t) for name, t in MAXTEXT_RULES]
    axes = {"data": 1, "fsdp": 2, "fsdp_transpose": 2, "sequence": 1, "tensor": 2}
    mesh = spmd.make_mesh({**axes, "autoregressive": 1})
    strategy = spmd.Strategy(
        mesh, batch_axes=("data", "fsdp", "fsdp_transpose"), logical_axis_rules=rules
    )

    def create(key):
        return Layer().init(key, jnp.ones(1))

    state = strategy.init(create, jax.random.key(0))
    want = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(jax.eval_shape(create, jax.random.key(0))), mesh, rules
    )
    for name, names in MAXTEXT_NAMES.items():
        got = state["params"][name].value.sharding
        assert got.is_equivalent_to(want["params"][name], len(names)), (name, got.spec)


def test_maxtext_rules_on_a_mesh_without_their_axes_name_every_missing_axis_at_once():
    rules = [(name, tuple(t) if isinstance(t, list) else t) for name, t in MAXTEXT_RULES]
    with pytest.raises(spmd.ConfigurationError) as caught:
        spmd.Strategy(
            spmd.make_mesh({"data": 2, "fsdp": 4}), batch_axes=("data",), logical_axis_rules=rules
        )
    text = str(caught.value)
    assert "['autoregressive', 'fsdp_transpose', 'sequence', 'tensor']" in text
    assert "('cache_heads', ('autoregressive', 'tensor'))" in text  # the last such rule too
    assert "'fsdp_transpose': 1" in text  # the mesh those rules expect, with size-1 axes
