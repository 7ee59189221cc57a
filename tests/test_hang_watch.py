"""The hang watch's rule (who is behind), its settings, and the roll call's verdicts."""

import dataclasses
import math
import threading

import jax
import jax.numpy as jnp
import pytest

import spmd
import spmd._src.strategy.per_replica
import spmd._src.strategy.step
from spmd._src.clusters import hang_watch
from spmd._src.clusters.hang_watch import Record, behind, check_hang_timeout, interval_for
from spmd._src.clusters.roll_call import Verdict


def rec(step, stalled, *, waiting=False, limit=10.0, done=False, waited=0.0, in_spmd=True):
    return Record(1, step, stalled, limit, step >= 2, waiting, done, waited, in_spmd, step)


def named(records):
    """The processes `behind` names, or None."""
    verdict = behind(records)
    return None if verdict is None else verdict.named


def test_a_record_tells_a_step_call_returned_only_once_the_process_is_past_it():
    """A peer's record says it returned from step call 5 (without agreeing there) only
    when it made a later call, finished, or made 5 calls and is out of spmd's calls."""
    assert hang_watch.returned_from(rec(6, 0.0), 5)
    assert hang_watch.returned_from(rec(5, 0.0, in_spmd=False, waiting=True), 5)
    assert hang_watch.returned_from(rec(5, 0.0, done=True), 5)
    assert not hang_watch.returned_from(rec(5, 9.0, waiting=True), 5)  # inside call 5
    assert not hang_watch.returned_from(rec(4, 0.0, in_spmd=False), 5)  # not there yet
    assert Record(1, 5, 0.0, 10.0, True, False).in_spmd  # a record without it: inside


def test_nobody_is_behind_while_every_process_advances():
    assert named({0: rec(50, 1.0), 1: rec(49, 2.0)}) is None


def test_the_lowest_step_is_behind_not_the_processes_waiting_for_it():
    # process 1 stopped at step 4; process 0 ran ahead and now waits in a collective
    records = {0: rec(6, 11.0, waiting=True), 1: rec(4, 12.0)}
    assert named(records) == (1,)


def test_among_equal_steps_the_one_not_waiting_in_jax_is_behind():
    records = {0: rec(7, 12.0, waiting=True), 1: rec(7, 11.0), 2: rec(7, 12.5, waiting=True)}
    assert named(records) == (1,)


def test_a_finished_process_is_never_behind():
    records = {0: rec(3, 40.0, done=True), 1: rec(2, 11.0)}
    assert named(records) == (1,)  # process 0's last steps wait for it


def test_a_process_running_its_own_code_after_a_peer_ended_is_left_to_finish():
    # process 1 reached its end; the chief exports (its own code): nobody waits for it
    assert named({0: rec(9, 40.0), 1: rec(9, 40.0, done=True)}) is None


def test_a_process_waiting_past_a_peer_that_ended_is_not_named():
    # process 1 ended after 9 steps; process 0 waits in step 10: the end-of-program wait
    # names process 1 (spmd._src.clusters.exit_wait), not the hang watch process 0
    assert named({0: rec(10, 40.0, waiting=True), 1: rec(9, 40.0, done=True)}) is None


def test_a_stall_in_one_process_s_callback_names_that_process():
    # both main threads wait in JAX at step 5; process 1's callback runs its own code
    stuck = dataclasses.replace(rec(5, 12.0), callback=True)
    verdict = behind({0: rec(5, 12.0, waiting=True), 1: stuck})
    assert verdict.named == (1,) and verdict.why == hang_watch.WAITED


def test_processes_nothing_tells_apart_are_all_named_and_said_so():
    verdict = behind({0: rec(5, 12.0, waiting=True), 1: rec(5, 11.0, waiting=True)})
    assert verdict.named == (0, 1) and hang_watch.TIE in verdict.why
    verdict = behind({0: rec(5, 12.0), 1: rec(5, 11.0)})  # both in their own code
    assert verdict.named == (0, 1) and verdict.why == (
        "while every process ran its own code, none waiting for another"
    )


def test_a_verdict_names_a_process_only_at_the_step_it_was_named_at():
    verdict = behind({0: rec(6, 11.0, waiting=True), 1: rec(4, 12.0)})
    assert verdict.names(1, 4) and not verdict.names(1, 5) and not verdict.names(0, 6)


def test_a_process_not_yet_armed_can_be_named_once_an_armed_one_is_past_its_limit():
    # process 1 hangs before its second step (compiled, then its loader deadlocked)
    records = {0: rec(2, 11.0, waiting=True), 1: Record(3, 1, 11.5, 10.0, False, False)}
    assert named(records) == (1,)


def test_before_its_first_step_a_process_is_named_once_a_peer_has_waited_in_spmd_for_it():
    # process 0 waits in its first step (or a restore's barrier); process 1 never came
    records = {0: rec(1, 40.0, waiting=True, waited=10.5), 1: rec(0, 40.0)}
    assert named(records) == (1,)


def test_processes_that_all_work_before_their_first_step_are_never_named():
    # every process loads data or restores for longer than the limit: nobody waits
    assert named({0: rec(0, 900.0), 1: rec(0, 900.0), 2: rec(0, 880.0)}) is None


def test_a_short_wait_after_long_work_names_nobody():
    # all worked 900 s before the first step; process 0 has waited 4 s for process 1
    assert named({0: rec(1, 900.0, waiting=True, waited=4.0), 1: rec(0, 900.0)}) is None


def test_before_the_first_steps_a_process_that_waits_itself_is_not_named():
    # both in JAX (a collective every one of them entered): nobody to blame
    records = {0: rec(0, 50.0, waiting=True, waited=20.0), 1: rec(0, 50.0, waiting=True)}
    assert named(records) is None


def test_a_process_still_compiling_its_first_step_is_not_named():
    # process 0 compiled and waits in the step; process 1 compiles (its stall starts again)
    records = {0: rec(1, 30.0, waiting=True, waited=12.0), 1: rec(1, 0.3)}
    assert named(records) is None


def test_a_process_behind_by_little_time_is_not_named_yet():
    records = {0: rec(9, 10.5, waiting=True), 1: rec(3, 2.0, limit=10.0)}
    assert named(records) is None  # stalled for under half its limit


def test_no_record_past_its_limit_means_no_verdict_even_with_an_infinite_one():
    records = {0: rec(5, 3.0), 1: Record(0, 0, 100.0, math.inf, False, False)}
    assert named(records) is None


def watch(hang_timeout: float | None = 10.0) -> hang_watch._Watch:
    return hang_watch._Watch(0, 2, hang_timeout, 5.0, 1.0, None, lambda *_: None, moved_at=0.0)


def looks(monkeypatch, **activity) -> None:
    """Every look at the main thread finds `activity` (waiting, compiling, in_spmd)."""
    found = hang_watch._Activity(
        **{"waiting": False, "compiling": False, "in_spmd": False, **activity}
    )
    monkeypatch.setattr(hang_watch, "_activity", lambda: found)


def test_time_waiting_in_spmd_adds_up_and_starts_again_at_a_step(monkeypatch):
    w = watch()
    looks(monkeypatch, waiting=True, in_spmd=True)
    assert w.sample(10.0, False).waited == 0.0
    assert w.sample(14.0, False).waited == 4.0
    monkeypatch.setattr(hang_watch, "STEPS", [1])
    record = w.sample(15.0, False)
    assert record.waited == 0.0 and record.step == 1 and record.stalled == 0.0


def test_waiting_in_jax_outside_spmd_or_working_is_no_wait(monkeypatch):
    w = watch()
    looks(monkeypatch, waiting=True)  # a program's own jax.jit, no spmd call around it
    w.sample(1.0, False)
    assert w.sample(30.0, False).waited == 0.0
    looks(monkeypatch, in_spmd=True)  # a restore reading its files
    assert w.sample(60.0, False).waited == 0.0


def test_tracing_and_compiling_are_progress(monkeypatch):
    w = watch()
    looks(monkeypatch, compiling=True, in_spmd=True)
    assert w.sample(500.0, False).stalled == 0.0
    looks(monkeypatch)
    assert w.sample(503.0, False).stalled == 3.0


def test_before_any_step_the_limit_is_the_hang_timeout_or_its_floor(monkeypatch):
    looks(monkeypatch)
    assert watch(None).sample(1.0, False).limit == hang_watch.MIN_HANG_TIMEOUT
    assert watch(42.0).sample(1.0, False).limit == 42.0


def test_the_default_limit_is_ten_times_the_slowest_recent_step(monkeypatch):
    looks(monkeypatch)
    w, steps = watch(None), [0]
    monkeypatch.setattr(hang_watch, "STEPS", steps)

    def step_at(now: float, count: int = 1) -> float:
        steps[0] += count
        return w.sample(now, False).limit

    assert step_at(0.0, 2) == hang_watch.MIN_HANG_TIMEOUT  # armed; no step timed yet
    assert step_at(45.0) == 450.0  # a step of 45 s: 10 x 45, over the floor
    assert step_at(85.0) == 450.0  # one of 40 s: the slowest rules
    assert step_at(105.0, 2) == 450.0  # two in 20 s: 10 s each
    now = 105.0
    for _ in range(29):  # the 32 most recent steps timed still hold the 45 s one
        now += 1.0
        assert step_at(now) == 450.0
    assert step_at(now + 1.0) == 400.0  # it is no longer recent: the 40 s one rules
    assert step_at(now + 2.0) == hang_watch.MIN_HANG_TIMEOUT  # nor that one: 10 x 10 s < floor


def test_strategy_run_is_progress_unless_traced_in_a_step(monkeypatch):
    steps = [0]
    monkeypatch.setattr(hang_watch, "STEPS", steps)
    monkeypatch.setattr(spmd._src.strategy.step, "_STEPS", steps)
    monkeypatch.setattr(spmd._src.strategy.per_replica, "_STEPS", steps)
    strategy = spmd.MirroredStrategy()
    batch = jnp.ones((strategy.num_replicas_in_sync, 2))
    strategy.run(jnp.sum, args=(batch,))
    assert steps == [1]  # a pmap port's step

    @strategy.step
    def step(state, x):
        return state + strategy.reduce("SUM", strategy.run(jnp.sum, args=(x,)), axis=None), 0.0

    step(jnp.zeros(()), batch)
    assert steps == [2]  # the step counts; the run traced inside it does not


def test_a_look_at_the_main_thread_sees_jax_compile():
    seen, done = [], threading.Event()

    def look():  # a look every millisecond: the compile takes hundreds of them
        while not done.wait(0.001):
            seen.append(hang_watch._activity())

    thread = threading.Thread(target=look, name="spmd-hang-watch")
    thread.start()
    try:
        unrolled = lambda x: [x := jnp.sin(x) @ x for _ in range(60)][-1]  # noqa: E731
        jax.jit(unrolled)(jnp.ones((8, 8))).block_until_ready()
    finally:
        done.set()
        thread.join()
    compiling = [a for a in seen if a.compiling]
    assert compiling and not any(a.waiting for a in compiling)


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
        Verdict(counts=((0, 2, "10.0.0.1:1234"), (1, 3, "[::1]:1234"))),
    ],
)
def test_a_verdict_survives_its_line(verdict):
    assert Verdict.parse(verdict.line(), 5) == verdict


def test_an_answer_that_is_no_verdict_means_the_id_was_taken():
    verdict = Verdict.parse("\x00\x00\x12\x04 grpc settings", 1)
    assert verdict.twice == 1 and not verdict.ok
