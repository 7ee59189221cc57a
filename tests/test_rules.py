"""Rules over pytree paths, and the partitioners."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.rules import path_str, resolve_specs
from spmd.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner

pytestmark = pytest.mark.cpu_mesh  # every test here uses the eight CPU devices

MESH = spmd.make_mesh({"data": 4, "model": 2})
TREE = {
    "encoder": {"kernel": jnp.zeros((8, 4)), "bias": jnp.zeros(4)},
    "head": {"kernel": jnp.zeros((4, 2)), "bias": jnp.zeros(2)},
}


def _paths(tree):
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_paths_join_with_slash_and_drop_nnx_value():
    assert _paths(TREE) == ["encoder/bias", "encoder/kernel", "head/bias", "head/kernel"]
    state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    assert _paths(state) == ["bias", "kernel"]
    opt = optax.adam(1e-3).init(TREE)
    assert "0/mu/encoder/kernel" in _paths(opt)


def test_first_match_wins_and_unmatched_replicate():
    rules = [(r"encoder/kernel", P("data", "model")), (r".*kernel", P(None, "model"))]
    specs = resolve_specs(TREE, rules, MESH)
    assert specs["encoder"]["kernel"] == P("data", "model")
    assert specs["head"]["kernel"] == P(None, "model")
    assert specs["head"]["bias"] == P()


def test_trailing_none_is_trimmed():
    specs = resolve_specs(TREE, [(r"encoder/kernel", P("data", None))], MESH)
    assert specs["encoder"]["kernel"] == P("data")


def test_strict_names_the_unmatched_path():
    with pytest.raises(spmd.ConfigurationError, match="'encoder/bias' matched none"):
        resolve_specs(TREE, [(r".*kernel", None)], MESH, strict=True)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (P("data", "model", None), "longer than the leaf's rank"),
        (P("nope"), "names mesh axes the mesh does not have"),
        (P(None, ("data", "model")), "does not divide it"),
    ],
)
def test_bad_rules_teach(spec, fragment):
    with pytest.raises(spmd.ConfigurationError) as info:
        resolve_specs(TREE, [(r"encoder/kernel", spec)], MESH)
    assert fragment in str(info.value) and "encoder/kernel" in str(info.value)


def test_fixed_shards_partitioner():
    assert FixedShardsPartitioner(4)((16, 3), np.float32) == [4, 1]
    assert FixedShardsPartitioner(4)((2, 3), np.float32) == [2, 1]
    assert FixedShardsPartitioner(4)((), np.float32) == []


def test_min_size_partitioner_keeps_shards_large_enough():
    part = MinSizePartitioner(min_shard_bytes=1024)
    assert part((1024,), np.float32) == [4]  # 4 KiB -> four 1 KiB shards
    assert part((100,), np.float32) == [1]  # too small to split
    assert MinSizePartitioner(min_shard_bytes=1024, max_shards=2)((1024,), np.float32) == [2]


def test_max_size_partitioner_caps_shard_size():
    part = MaxSizePartitioner(max_shard_bytes=1024)
    assert part((1024,), np.float32) == [4]
    assert part((1025,), np.float32) == [5]
    assert MaxSizePartitioner(max_shard_bytes=1024, max_shards=2)((1024,), np.float32) == [2]


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_partitioner_arguments_are_checked(bad):
    with pytest.raises(spmd.ConfigurationError, match="positive integer"):
        FixedShardsPartitioner(bad)


def test_partitioner_rounds_to_what_the_mesh_can_make():
    mesh = spmd.make_mesh({"a": 2, "b": 2, "c": 2})
    axes = (("c", 2), ("b", 2), ("a", 2))  # innermost first
    tree = {"w": jnp.zeros((24, 2))}
    down = resolve_specs(tree, [(".*", FixedShardsPartitioner(3))], mesh, shard_axes=axes)
    assert down["w"] == P("c")  # 3 is not a product of the axes: round down to 2
    up = resolve_specs(tree, [(".*", MaxSizePartitioner(24 * 2 * 4 // 3))], mesh, shard_axes=axes)
    assert up["w"] == P(("b", "c"))  # 3 shards asked as a size cap: round up to 4
    odd = resolve_specs(
        {"w": jnp.zeros((6, 2))}, [(".*", FixedShardsPartitioner(8))], mesh, shard_axes=axes
    )
    assert odd["w"] == P("c")  # 6 rows split at most 2 ways on this mesh


def test_rules_for_the_model_paths_apply_wherever_the_model_sits():
    params = {"layers": {"dot1": {"kernel": jnp.zeros((8, 4))}}}
    state = (params, optax.adam(1e-3).init(params))
    specs = resolve_specs(state, [(r"layers/dot1/kernel", P("data"))], MESH)
    assert specs[0]["layers"]["dot1"]["kernel"] == P("data")
    assert specs[1][0].mu["layers"]["dot1"]["kernel"] == P("data")
    assert specs[1][0].nu["layers"]["dot1"]["kernel"] == P("data")
    # a suffix starts at a '/': 'dot1/kernel' does not match 'xdot1/kernel'
    other = {"xdot1": {"kernel": jnp.zeros((8, 4))}}
    assert resolve_specs(other, [(r"dot1/kernel", P("data"))], MESH)["xdot1"]["kernel"] == P()
