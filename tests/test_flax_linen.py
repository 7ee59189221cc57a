"""Flax linen states (MaxText's TrainState, boxed or unboxed) laid out by their annotations
and rules, and activations constrained by the same rules inside a compiled step."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import oracle_compiled

import spmd
from spmd._src.logical import REST

pytestmark = pytest.mark.cpu_mesh

DOC = pathlib.Path(__file__).parent.parent / "docs" / "flax.md"
HEADING = "## Flax linen: a MaxText-style state"


def _doc_snippets() -> list[str]:
    """The section's python blocks: the decoder, then its state unboxed as MaxText does."""
    section = DOC.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _doc_snippet() -> str:
    return _doc_snippets()[0]


@pytest.fixture(scope="module")
def doc():
    """The docs' MaxText-style decoder section, run as it is written."""
    namespace: dict = {}
    exec(compile(_doc_snippet(), str(DOC), "exec"), namespace)
    return namespace


TOKENS = np.random.default_rng(0).integers(0, 32, (8, 9))


@pytest.fixture(scope="module")
def oracle(doc):
    """The one-device losses of four steps of the docs' decoder on TOKENS, computed once
    for every test that compares a strategy's losses with them (rtol 2e-5)."""
    key = jax.random.key(0)
    state = oracle_compiled(doc["create"], key)(key)
    step = oracle_compiled(doc["train_step"], state, TOKENS)
    losses = []
    for _ in range(4):
        state, loss = step(state, TOKENS)
        losses.append(float(loss))
    return losses


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


@pytest.mark.slow  # 22 s of CPU: over the fast tier's share (tests/tiers.py)
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


@pytest.mark.slow  # 11 s of CPU alone (the docs' decoder for 8 devices and one), 3 in the file
@pytest.mark.parametrize("mesh", ["data4_model2", "fsdp8"])
def test_boxed_trainstate_losses_equal_one_device(doc, oracle, mesh):
    strategy = _strategies(doc)[mesh]
    state = strategy.init(doc["create"], jax.random.key(0))
    expected = _flax_shardings(strategy, strategy.logical_axis_rules, doc["create"])
    # The docs' strategy is this data4_model2 one (same mesh, rules and train_step): its
    # step, compiled when the docs ran, is reused rather than compiled again.
    step = doc["step"] if mesh == "data4_model2" else strategy.step(doc["train_step"])
    losses = []
    for _ in range(4):
        state, loss = step(state, TOKENS)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, oracle, rtol=2e-5)
    assert oracle[-1] < oracle[0]
    _check_leaf_by_leaf(state, expected)  # the layout survives the steps


def _unboxed(tree):
    """MaxText's max_utils.unbox_logicallypartioned: every nn.LogicallyPartitioned unboxed."""
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    return jax.tree.map(lambda x: x.unbox() if is_box(x) else x, tree, is_leaf=is_box)


def _maxtext_state(create, mesh, rules):
    """What MaxText's setup_initial_state returns: the state made under jax.jit with
    out_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
    rules) (get_abstract_state), then unboxed: plain arrays, each sharded on `mesh`."""
    flax_rules = [rule for rule in rules if rule[0] != REST]
    with nn.logical_axis_rules(flax_rules):
        abstract = jax.eval_shape(create, jax.random.key(0))
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, flax_rules)
        state = jax.jit(create, out_shardings=shardings)(jax.random.key(0))
    return _unboxed(state)


@pytest.mark.slow  # 9 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("mesh", ["data4_model2", "fsdp8"])
def test_maxtext_unboxed_state_keeps_its_layout_through_put_and_steps(doc, oracle, mesh):
    """The unboxed, pre-sharded state of MaxText's setup_initial_state: its leaves' own
    shardings are the only annotation left, and put and the step keep them."""
    strategy = _strategies(doc)[mesh]
    expected = _flax_shardings(strategy, strategy.logical_axis_rules, doc["create"])
    state = _maxtext_state(doc["create"], strategy.mesh, strategy.logical_axis_rules)
    want = P(None, None, "model") if mesh == "data4_model2" else P(None, "fsdp")
    assert state.params["layers"]["wi"].sharding.is_equivalent_to(
        NamedSharding(strategy.mesh, want), 3
    )
    state = strategy.put(state)
    _check_leaf_by_leaf(state, expected)
    sources = jax.tree.leaves(strategy.state_spec(state, sources=True))
    assert {layout.source for layout in sources} == {"placed sharding", "default"}
    step = strategy.step(doc["train_step"])
    losses = []
    for _ in range(4):
        state, loss = step(state, TOKENS)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, oracle, rtol=2e-5)
    _check_leaf_by_leaf(state, expected)  # every leaf, the optimizer's moments too
    assert step.cache_size() == 1


def test_an_unboxed_state_on_a_host_placed_strategy_keeps_its_layout_in_host_memory(doc):
    strategy = spmd.Strategy(
        spmd.make_mesh({"data": 4, "model": 2}),
        batch_axes=("data",),
        logical_axis_rules=doc["RULES"],
        placement="host",
    )
    state = strategy.put(_maxtext_state(doc["create"], strategy.mesh, doc["RULES"]))
    wi = state.params["layers"]["wi"]
    assert wi.sharding.spec == P(None, None, "model")
    assert wi.sharding.memory_kind == "pinned_host"


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_an_unboxed_state_placed_on_another_device_order_keeps_its_layout(doc):
    """A mesh of the same axes over the devices in another order (MaxText builds its
    own): the layout is read by axis names and laid out on the strategy's mesh."""
    strategy = _strategies(doc)["data4_model2"]
    mesh = Mesh(np.asarray(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
    state = strategy.put(_maxtext_state(doc["create"], mesh, doc["RULES"]))
    expected = _flax_shardings(strategy, strategy.logical_axis_rules, doc["create"])
    _check_leaf_by_leaf(state, expected)
    assert state.params["layers"]["wi"].sharding.mesh == strategy.mesh


def test_an_unboxed_leaf_sharded_over_axes_the_mesh_lacks_is_an_error(doc):
    """MaxText's mesh calls the model axis "tensor": a strategy on {data, model} cannot
    keep that layout, and says so rather than replicate the leaf."""
    strategy = _strategies(doc)["data4_model2"]
    tensor_mesh = spmd.make_mesh({"data": 4, "tensor": 2})
    rules = [(name, "tensor" if target == "model" else target) for name, target in doc["RULES"]]
    state = _maxtext_state(doc["create"], tensor_mesh, rules)
    with pytest.raises(spmd.ConfigurationError) as error:
        strategy.put(state)
    text = str(error.value)
    assert "leaf='params/embedding'" in text  # the first such leaf, by path
    assert "['tensor']" in text and "its_mesh={'data': 4, 'tensor': 2}" in text
    assert "add a rule for the path" in text
    # A rule for the paths lays them out; nothing is guessed.
    ruled = spmd.Strategy(
        strategy.mesh,
        rules=[(r".*", None)],
        batch_axes=("data",),
        logical_axis_rules=doc["RULES"],
    )
    assert ruled.put(state).params["layers"]["wi"].sharding.spec == P()


def test_a_rule_or_a_named_strategy_wins_over_an_unboxed_leafs_sharding(doc):
    strategy = _strategies(doc)["data4_model2"]
    state = _maxtext_state(doc["create"], strategy.mesh, doc["RULES"])
    ruled = spmd.Strategy(
        strategy.mesh, rules=[(r".*wi", P("model"))], logical_axis_rules=doc["RULES"]
    )
    placed = ruled.put(state)
    assert placed.params["layers"]["wi"].sharding.spec == P("model")
    assert placed.params["layers"]["wo"].sharding.spec == P(None, "model")  # kept
    # MirroredStrategy replicates every leaf it has no annotation for, as tf.distribute.
    mirrored = spmd.MirroredStrategy().put(state)
    assert all(leaf.sharding.spec == P() for leaf in jax.tree.leaves(mirrored))


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_the_docs_unboxed_state_runs_as_written(doc, capsys):
    namespace = dict(doc)
    exec(compile(_doc_snippets()[1], str(DOC), "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2:] == ["P(None, None, 'model')", "placed sharding"]
    wi = namespace["unboxed"].params["layers"]["wi"]
    assert not isinstance(wi, nn.LogicallyPartitioned)
    assert wi.sharding.spec == P(None, None, "model")  # after a step too


def test_partitioned_boxes_name_mesh_axes(doc):
    def create(key):
        init = nn.with_partitioning(nn.initializers.ones, (None, "model"))
        return {"kernel": init(key, (4, 8))}

    strategy = _strategies(doc)["data4_model2"]
    state = strategy.init(create, jax.random.key(0))
    assert state["kernel"].value.sharding.spec == P(None, "model")


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_create_fn_that_unboxes_itself_keeps_its_boxes_layout(doc):
    """nn.meta.unbox inside create_fn constrains each leaf to its box's layout: kept."""
    strategy = _strategies(doc)["data4_model2"]
    expected = _flax_shardings(strategy, strategy.logical_axis_rules, doc["create"])
    unboxing = lambda key: nn.meta.unbox(doc["create"](key))  # noqa: E731
    _check_leaf_by_leaf(strategy.init(unboxing, jax.random.key(0)), expected)
    abstract = strategy.abstract_state(unboxing, jax.random.key(0))
    for leaf, sharding in zip(jax.tree.leaves(abstract), expected, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, len(leaf.shape))


def test_create_fn_that_unboxes_itself_is_an_error_on_a_named_strategy(doc):
    """A named strategy lays leaves out by its own policy: an unboxed leaf it would
    replicate, whose box asked for a sharded layout, is an error naming the leaf."""
    strategy = spmd.MirroredStrategy(logical_axis_rules=[("mlp", "replica")])
    with pytest.raises(spmd.ConfigurationError, match=r"nn.meta.unbox(.|\n)*leaf='params/layers"):
        strategy.init(lambda key: nn.meta.unbox(doc["create"](key)), jax.random.key(0))


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
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


@pytest.mark.slow  # 10 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "mesh, hidden",
    [("data4_model2", '[{"data"}, {}, {"model"}]'), ("fsdp8", '[{"fsdp"}, {}, {}]')],
)
def test_the_decoders_logical_constraints_reach_its_compiled_step(doc, mesh, hidden):
    """The decoder's nn.with_logical_constraint calls (in its scanned layers) are in the
    program the step compiles, mapped by the strategy's rules."""
    strategy = _strategies(doc)[mesh]
    state = strategy.init(doc["create"], jax.random.key(0))
    lowered, _ = strategy.step(doc["train_step"]).lower(state, TOKENS)
    text = lowered.as_text()
    # the MLP activation: (batch, length, mlp) = (8, 8, 32)
    assert re.search(
        rf"sdy.sharding_constraint %\S+ <@mesh, {re.escape(hidden)}> : tensor<8x8x32xf32>", text
    ), mesh


class _Probe(nn.Module):
    """One linen layer whose activation is constrained by logical names, then inspected."""

    report: object  # called with the activation's sharding, as the compiler lays it out

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.normal(0.5), ("embed", "mlp"))
        hidden = x @ self.param("wi", init, (16, 32))
        hidden = nn.with_logical_constraint(hidden, ("activation_batch", "activation_mlp"))
        jax.debug.inspect_array_sharding(hidden, callback=self.report)
        return jnp.tanh(hidden).sum(axis=-1)


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "mesh, want", [("data4_model2", P("data", "model")), ("fsdp8", P("fsdp", None))]
)
def test_a_logical_constraint_lays_out_the_activation_in_the_compiled_step(doc, mesh, want):
    """jax.debug.inspect_array_sharding reports the layout the compiled step gives the
    constrained activation: the strategy's rules' mapping; the numbers are one device's."""
    strategy = _strategies(doc)[mesh]
    seen: list = []
    model = _Probe(seen.append)
    x = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
    y = np.random.default_rng(2).normal(size=(8,)).astype(np.float32)

    def train_step(params, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), loss

    create = lambda key: model.init(key, jnp.ones((1, 16)))["params"]  # noqa: E731
    params = strategy.init(create, jax.random.key(0))
    oracle_params = jax.jit(create)(jax.random.key(0))
    step, oracle_step = strategy.step(train_step), jax.jit(train_step)
    for _ in range(3):
        params, loss = step(params, x, y)
        oracle_params, oracle_loss = oracle_step(oracle_params, x, y)
        np.testing.assert_allclose(float(loss), float(oracle_loss), rtol=1e-5)
    compiled = [s for s in seen if len(s.device_set) == len(strategy.devices)]
    assert compiled, seen
    assert compiled[0].is_equivalent_to(NamedSharding(strategy.mesh, want), 2), compiled[0]


@pytest.mark.slow  # 17 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_boxed_state_round_trips_through_a_checkpoint(doc, tmp_path):
    """Saved after a step and restored into abstract_state: the boxes, every leaf's
    layout and value come back, and training goes on as if never stopped."""
    strategy = _strategies(doc)["data4_model2"]
    step = strategy.step(doc["train_step"], donate=False)
    state, _ = step(strategy.init(doc["create"], jax.random.key(0)), TOKENS)
    with spmd.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        restored = ckpt.restore(target=strategy.abstract_state(doc["create"], jax.random.key(0)))
    assert isinstance(restored.params["layers"]["wi"], nn.LogicallyPartitioned)
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert after.sharding.is_equivalent_to(before.sharding, before.ndim)
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    _, loss = step(state, TOKENS)
    _, restored_loss = step(restored, TOKENS)
    assert float(restored_loss) == float(loss)


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


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
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


class _ConstrainedInRun(nn.Module):
    """A linen layer whose activation is constrained over the batch and the mlp axes."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        hidden = jax.nn.relu(nn.Dense(8, kernel_init=init)(x))
        hidden = nn.with_logical_constraint(hidden, ("batch", "mlp"))
        return hidden.sum(-1)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_logical_constraint_in_a_model_run_per_replica_inside_a_step_keeps_its_other_axes():
    """Inside strategy.run the batch axes are manual: the constraint's batch name drops out
    and its mlp name still lays the activation over the model axis, inside the step and
    eagerly under the same rules; the numbers are one device's."""
    rules = [("batch", "data"), ("mlp", "model"), ("embed", None), (REST, None)]
    mesh = spmd.make_mesh({"data": 2, "model": 4})
    strategy = spmd.Strategy(mesh, batch_axes=("data",), logical_axis_rules=rules)
    model = _ConstrainedInRun()
    params = strategy.init(lambda k: model.init(k, jnp.ones((1, 4))), jax.random.key(0))
    x = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)  # 6 rows a replica
    want = np.asarray(model.apply(jax.device_get(params), x))

    def per_replica(v, p):
        return model.apply(p, v)

    @strategy.step(donate=False)
    def step(p, v):
        return strategy.gather(strategy.run(per_replica, args=(v,), kwargs={"p": p}))

    np.testing.assert_allclose(np.asarray(step(params, x)), want, rtol=1e-5, atol=1e-6)
    text = step.lower(params, x)[0].as_text()
    activation = r'sdy.sharding_constraint %\S+ <@mesh, \[\{\}, \{"model"\}\]> : tensor<6x8xf32>'
    assert re.search(activation, text), text
    with nn.logical_axis_rules([("batch", "data"), ("mlp", "model")]):
        eager = strategy.gather(strategy.run(per_replica, args=(x,), kwargs={"p": params}))
    np.testing.assert_allclose(np.asarray(eager), want, rtol=1e-5, atol=1e-6)


class _Factored(nn.Module):
    """One annotated linen kernel, large enough for adafactor to factor its moment."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.normal(0.1), ("embed", "mlp"))
        return jnp.tanh(x @ self.param("w", init, (16, 32))).sum(-1)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_adafactor_on_a_boxed_linen_train_state_trains_as_on_one_device():
    """optax maps over the boxed params, so its factored moments (v_row, v_col: rank 1)
    carry their kernel's two names, as nnx.Optimizer's inherit them: they take the
    default layout, as on the NNX path, and training matches one device."""
    from flax.training import train_state

    rules = [("mlp", "model"), ("embed", None), (REST, None)]
    strategy = spmd.Strategy(
        spmd.make_mesh({"data": 2, "model": 4}), batch_axes=("data",), logical_axis_rules=rules
    )
    model = _Factored()
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)

    def create(key):
        params = model.init(key, jnp.ones((1, 16)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, x):
        loss, grads = jax.value_and_grad(lambda p: (model.apply({"params": p}, x) ** 2).mean())(
            state.params
        )
        return state.apply_gradients(grads=grads), loss

    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    state = strategy.init(create, jax.random.key(0))
    factored = state.opt_state[0]
    assert factored.v_row["w"].value.sharding.spec == P()
    assert factored.v_col["w"].value.sharding.spec == P()
    assert state.params["w"].value.sharding.spec == P(None, "model")
    step, oracle = strategy.step(train_step), jax.jit(train_step)
    want_state = jax.jit(create)(jax.random.key(0))
    for _ in range(3):
        state, loss = step(state, x)
        want_state, want = oracle(want_state, x)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("kind", ["strategy", "diloco"])
def test_init_passes_a_module_and_an_optimizer_among_its_arguments_as_they_are(kind):
    """flax's guide writes init_fn(key, x, model, optimizer) under jax.jit with
    static_argnums: init (and abstract_state) pass the arguments that are not arrays as
    they are and trace the arrays; the state equals init_fn's on one device."""
    rules = [("mlp", "model"), ("embed", None), (REST, None)]
    mesh = spmd.make_mesh({"data": 2, "model": 4})
    strategy = spmd.Strategy(mesh, batch_axes=("data",), logical_axis_rules=rules)
    if kind == "diloco":
        strategy = spmd.DiLoCo(strategy, islands=2, sync_every=2)

    def init_fn(key, x, model, optimizer):
        params = nn.meta.unbox(model.init(key, x)["params"])
        return {"params": params, "opt": optimizer.init(params)}

    model, tx, x = _Factored(), optax.adam(1e-2), jnp.ones((1, 16))
    state = strategy.init(init_fn, jax.random.key(0), x, model, tx)
    abstract = strategy.abstract_state(init_fn, jax.random.key(0), x, model, tx)
    want = jax.jit(init_fn, static_argnums=(2, 3))(jax.random.key(0), x, model, tx)
    got = state if kind == "strategy" else state.params
    wanted = want if kind == "strategy" else want["params"]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), jax.device_get(wanted))
    assert jax.tree.structure(abstract) == jax.tree.structure(state)


def _logical_kernel(names, shape=(8, 16)):
    def create(key):
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), names)
        return {"w": init(key, shape)}

    return create


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_logical_name_that_is_also_a_mesh_axis_is_mapped_by_the_rules_alone_as_in_flax():
    """('embed', 'model') with no rule for 'model': flax's nn.logical_to_mesh_sharding
    replicates it (the oracle); so does spmd under (REST, None); without it the name is
    unmapped, and the error says to add ('model', 'model')."""
    mesh = spmd.make_mesh({"data": 2, "model": 4})
    rules = [("embed", None), ("hidden", "model")]
    create = _logical_kernel(("embed", "model"))
    abstract = jax.eval_shape(create, jax.random.key(0))
    want = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)["w"].spec
    strategy = spmd.Strategy(mesh, batch_axes=("data",), logical_axis_rules=[*rules, (REST, None)])
    got = strategy.init(create, jax.random.key(0))["w"].value.sharding.spec
    assert tuple(want) == (None, None) and tuple(got) == ()  # replicated, both
    strict = spmd.Strategy(mesh, batch_axes=("data",), logical_axis_rules=rules)
    with pytest.raises(spmd.ConfigurationError, match="'model' \\(at 'w'\\)"):
        strict.init(create, jax.random.key(0))
    mapped = spmd.Strategy(mesh, logical_axis_rules=[*rules, ("model", "model")])
    assert mapped.init(create, jax.random.key(0))["w"].value.sharding.spec == P(None, "model")


def test_a_logical_name_for_two_dimensions_is_an_error_as_in_flax():
    mesh = spmd.make_mesh({"data": 2, "model": 4})
    create = _logical_kernel(("hidden", "hidden"), shape=(8, 8))
    abstract = jax.eval_shape(create, jax.random.key(0))
    with pytest.raises(ValueError, match="more than once"):  # flax's own answer
        nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, [("hidden", "model")])
    strategy = spmd.Strategy(mesh, logical_axis_rules=[("hidden", "model"), (REST, None)])
    with pytest.raises(spmd.ConfigurationError, match="names 'hidden' for two dimensions") as info:
        strategy.init(create, jax.random.key(0))
    assert "path='w'" in str(info.value) and "('hidden', None)" in str(info.value)
