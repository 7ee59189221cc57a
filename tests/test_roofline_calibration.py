"""The roofline's efficiency against MaxText's published TPU runs: each estimate within 20%."""

import pytest

from spmd._src import calibration
from spmd._src.calibration import MATMUL_EFFICIENCY, MAXTEXT_RUNS
from spmd._src.roofline import estimate
from spmd._src.topologies import CHIPS


@pytest.mark.parametrize("run", MAXTEXT_RUNS, ids=lambda r: f"{r.name}-{r.target}")
def test_each_published_run_is_estimated_within_20_percent(run):
    # The roofline itself, fed the FLOPs the run's step executes (no compile).
    r = estimate(CHIPS[run.chip], calibration.executed_flops(run), 0.0, ())
    assert r.efficiency == MATMUL_EFFICIENCY and r.bound == "compute"
    ratio = r.step_s / calibration.published_step(run)
    assert 0.8 <= ratio <= 1.2, (run.name, run.target, ratio)


def test_the_flops_are_maxtexts_own_count():
    # MaxText's MFU is its FLOPs over peak: the published TFLOP/s and MFU agree with them.
    for run in MAXTEXT_RUNS:
        peak = CHIPS[run.chip].peak_flops
        mfu = calibration.maxtext_flops(run) / calibration.published_step(run) / peak
        assert mfu == pytest.approx(run.mfu, rel=0.01), run


def test_recomputation_is_counted_as_the_step_runs_it():
    full = next(r for r in MAXTEXT_RUNS if r.remat == "full")
    assert calibration.executed_flops(full) > 1.3 * calibration.maxtext_flops(full)
    none = full._replace(remat="none")
    assert calibration.executed_flops(none) == calibration.maxtext_flops(none)


def test_the_runs_span_three_generations_and_the_note_says_what_is_assumed():
    assert {r.chip for r in MAXTEXT_RUNS} == {"v4", "v5e", "v5p"}
    assert 0.5 < MATMUL_EFFICIENCY < 0.9
    note = calibration.calibration_note()
    assert f"{MATMUL_EFFICIENCY:.0%} of peak" in note and f"{len(MAXTEXT_RUNS)} published" in note


def test_measured_figures_are_taken_at_face_value():
    measured = CHIPS["v5p"].__class__(**{**CHIPS["v5p"].__dict__, "name": "cpu"})
    assert estimate(measured, 1.0, 0.0, ()).efficiency == 1.0
