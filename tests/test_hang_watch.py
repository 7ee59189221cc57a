"""The hang watch's rule (who is behind), its settings, and the roll call's verdicts."""

import math

import pytest

import spmd
from spmd.clusters.hang_watch import Record, behind, check_hang_timeout, interval_for
from spmd.clusters.roll_call import Verdict


def rec(step, stalled, *, waiting=False, limit=10.0, done=False):
    return Record(1, step, stalled, limit, step >= 2, waiting, done)


def test_nobody_is_behind_while_every_process_advances():
    assert behind({0: rec(50, 1.0), 1: rec(49, 2.0)}) is None


def test_the_lowest_step_is_behind_not_the_processes_waiting_for_it():
    # process 1 stopped at step 4; process 0 ran ahead and now waits in a collective
    records = {0: rec(6, 11.0, waiting=True), 1: rec(4, 12.0)}
    assert behind(records) == 1


def test_among_equal_steps_the_one_not_waiting_in_jax_is_behind():
    records = {0: rec(7, 12.0, waiting=True), 1: rec(7, 11.0), 2: rec(7, 12.5, waiting=True)}
    assert behind(records) == 1


def test_a_finished_process_is_never_behind():
    records = {0: rec(3, 40.0, done=True), 1: rec(9, 11.0)}
    assert behind(records) == 1


def test_a_process_not_yet_armed_can_be_named_once_an_armed_one_is_past_its_limit():
    # process 1 hangs before its second step (compiled, then its loader deadlocked)
    records = {0: rec(2, 11.0, waiting=True), 1: Record(3, 1, 11.5, 10.0, False, False)}
    assert behind(records) == 1


def test_a_process_behind_by_little_time_is_not_named_yet():
    records = {0: rec(9, 10.5, waiting=True), 1: rec(3, 2.0, limit=10.0)}
    assert behind(records) is None  # stalled for under half its limit


def test_no_record_past_its_limit_means_no_verdict_even_with_an_infinite_one():
    records = {0: rec(5, 3.0), 1: Record(0, 0, 100.0, math.inf, False, False)}
    assert behind(records) is None


@pytest.mark.parametrize("bad", [0, -1, "soon", True, float("nan"), [5]])
def test_a_hang_timeout_that_is_not_a_positive_number_is_a_configuration_error(bad):
    with pytest.raises(spmd.ConfigurationError, match=r"(?s)hang_timeout.*Received.*To fix"):
        check_hang_timeout(bad)


def test_a_hang_timeout_is_seconds():
    assert check_hang_timeout(None) is None
    assert check_hang_timeout("7.5") == 7.5 and check_hang_timeout(600) == 600.0


def test_the_publication_interval_follows_the_shorter_bound():
    assert interval_for(None, 100) == 5.0
    assert interval_for(3, 100) == pytest.approx(0.6)
    assert interval_for(None, 10) == 1.0
    assert interval_for(0.1, 100) == 0.25


@pytest.mark.parametrize(
    "verdict",
    [
        Verdict(),
        Verdict(missing=(1, 3)),
        Verdict(twice=2, where=("10.0.0.2 (pid 4 on a)", "10.0.0.3 (pid 9 on b)")),
    ],
)
def test_a_verdict_survives_its_line(verdict):
    assert Verdict.parse(verdict.line(), 5) == verdict


def test_an_answer_that_is_no_verdict_means_the_id_was_taken():
    verdict = Verdict.parse("\x00\x00\x12\x04 grpc settings", 1)
    assert verdict.twice == 1 and not verdict.ok
