"""spmd._src.roofline: collectives read from HLO text by link, per loop iteration, and the step-time model."""

import pytest

from spmd._src.calibration import MATMUL_EFFICIENCY
from spmd._src.roofline import estimate, traffic
from spmd._src.topologies import CHIPS

HLO = """HloModule step, num_partitions=4

%body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %p = (s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}) parameter(0)
  %ag = f32[8,128]{1,0:T(8,128)S(1)} all-gather(%x), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (s32[], f32[8,128]) tuple(%i, %ag)
}

%cond (p: (s32[], f32[8,128])) -> pred[] {
  %c = s32[]{:T(128)} constant(6)
  %g = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%g, %c), direction=LT
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0:T(256)} parameter(0)
  %w = (s32[], f32[8,128]) while(%init), condition=%cond, body=%body
  %ar = f32[256]{0:T(256)} all-reduce(%a), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
  %send = (f32[64]{0:T(256)}, u32[], token[]) send(%ar, %tok), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="all-reduce_0",_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv = (f32[64]{0:T(256)}, u32[], token[]) recv(%tok), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="all-reduce_0",_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %out = f32[256]{0:T(256)} copy(%ar)
}
"""


def test_collectives_by_link_with_loops_counted_per_iteration():
    flows = {(t.kind, t.link): t for t in traffic(HLO, num_partitions=4, slices=2)}
    gather = flows[("all-gather", "ICI")]
    assert gather.count == 6 and gather.bytes == 6 * 8 * 128 * 4  # the loop runs 6 times
    assert gather.wire_bytes == pytest.approx(6 * 3 / 4 * 8 * 128 * 4)  # (g-1)/g N, g = 4
    reduce = flows[("all-reduce", "ICI")]
    assert reduce.count == 1 and reduce.wire_bytes == pytest.approx(2 * 3 / 4 * 1024)
    dcn = flows[("all-reduce", "DCN")]  # the send counts, its recv does not
    assert dcn.count == 1 and dcn.bytes == 256 and dcn.wire_bytes == pytest.approx(256.0)


def test_the_step_time_is_the_stated_roofline():
    flows = traffic(HLO, num_partitions=4, slices=2)
    chip = CHIPS["v5p"]
    r = estimate(chip, flops=459e12, hbm_bytes=2765e9 / 2, flows=flows, efficiency=1.0)
    assert r.compute_s == pytest.approx(1.0) and r.memory_s == pytest.approx(0.5)
    ici = sum(t.wire_bytes for t in flows if t.link == "ICI")
    assert r.ici_s == pytest.approx(ici / (4800e9 / 8))
    assert r.dcn_s == pytest.approx(256 / (50e9 / 8))
    assert r.step_s == pytest.approx(1.0 + r.ici_s + r.dcn_s) and r.bound == "compute"
    v4 = estimate(CHIPS["v4"], 1.0, 1.0, flows, devices_per_chip=2)
    assert v4.dcn_s == 0 and not v4.dcn_known  # no published DCN figure: left out, and said
    # A TPU's published peak at the efficiency calibrated on MaxText's runs.
    assert v4.efficiency == MATMUL_EFFICIENCY
    assert v4.compute_s == pytest.approx(1.0 / (275e12 * MATMUL_EFFICIENCY / 2))


SHARED_CHANNELS = """HloModule step, num_partitions=4

%fused_start (p0: f32[64,128]) -> f32[256,128] {
  %p0 = f32[64,128]{1,0:T(8,128)} parameter(0)
  ROOT %ag.0 = f32[256,128]{1,0:T(8,128)} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
}

%fused_body (p1: f32[64,128]) -> f32[256,128] {
  %p1 = f32[64,128]{1,0:T(8,128)} parameter(0)
  ROOT %ag.1 = f32[256,128]{1,0:T(8,128)S(1)} all-gather(%p1), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (a: f32[256,128]) -> f32[64,128] {
  %a = f32[256,128]{1,0:T(8,128)} parameter(0)
  %rs = f32[64,128]{1,0:T(8,128)} reduce-scatter(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %f0 = f32[256,128]{1,0:T(8,128)} fusion(%rs), kind=kOutput, calls=%fused_start
  %f1 = f32[256,128]{1,0:T(8,128)} fusion(%rs), kind=kOutput, calls=%fused_body
  ROOT %out = f32[64,128]{1,0:T(8,128)} copy(%rs)
}
"""


def test_collectives_of_different_kinds_on_one_channel_are_each_counted():
    # XLA numbers channels per kind: this reduce-scatter and all-gather share channel 1,
    # and the all-gather's async pieces (start and body) share it too: one of each.
    flows = {(t.kind, t.link): t for t in traffic(SHARED_CHANNELS, num_partitions=4)}
    assert set(flows) == {("all-gather", "ICI"), ("reduce-scatter", "ICI")}
    gather, scatter = flows[("all-gather", "ICI")], flows[("reduce-scatter", "ICI")]
    assert gather.count == 1 and gather.wire_bytes == pytest.approx(3 / 4 * 256 * 128 * 4)
    assert scatter.count == 1 and scatter.wire_bytes == pytest.approx(3 * 64 * 128 * 4)


# XLA:CPU and XLA:GPU write a loop's condition as a fusion that calls the comparison, and
# say the trip count they proved in the while's backend_config.
FUSED_CONDITION = """HloModule step, num_partitions=4

%body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %p = (s32[], f32[8,128]{1,0}) parameter(0)
  %ar = f32[8,128]{1,0} all-reduce(%x), channel_id=7, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[8,128]) tuple(%i, %ar)
}

%wrapped_compare_computation (a: s32[], b: s32[]) -> pred[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%cond (p: (s32[], f32[8,128])) -> pred[] {
  %p = (s32[], f32[8,128]{1,0}) parameter(0)
  %c = s32[] constant(6)
  %g = s32[] get-tuple-element(%p), index=0
  ROOT %wrapped_compare = pred[] fusion(%g, %c), kind=kLoop, calls=%wrapped_compare_computation
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %w = (s32[], f32[8,128]) while(%init), condition=%cond, body=%body{config}
  ROOT %out = f32[256]{0} copy(%a)
}
"""


@pytest.mark.parametrize(
    "config",
    [
        "",
        ', backend_config={"known_induction_variable":{"tuple_index":"0"},'
        '"known_trip_count":{"n":"6"}}',
    ],
    ids=["condition_fusion", "known_trip_count"],
)
def test_a_loop_whose_condition_calls_its_comparison_counts_its_collective_per_iteration(config):
    """A scanned layer's gradient all-reduce on CPU or GPU runs once per layer, not once."""
    (reduce,) = traffic(FUSED_CONDITION.replace("{config}", config), num_partitions=4)
    assert reduce.count == 6 and reduce.bytes == 6 * 8 * 128 * 4


def test_the_known_trip_count_wins_over_a_condition_it_cannot_read():
    hlo = FUSED_CONDITION.replace("{config}", ', backend_config={"known_trip_count":{"n":"3"}}')
    hlo = hlo.replace("%c = s32[] constant(6)", "%c = s32[] get-tuple-element(%p), index=1")
    (reduce,) = traffic(hlo, num_partitions=4)
    assert reduce.count == 3
