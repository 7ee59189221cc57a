"""The end-of-program wait's rule: a process at its end fails only where a peer waits for it."""

from spmd._src.clusters.exit_wait import ExitWait
from spmd._src.clusters.hang_watch import Record


def rec(seq, shared, *, waiting=False, done=False):
    return Record(seq, shared, 0.0, 10.0, True, waiting, done, 0.0, True, shared)


def ended(shared=5, timeout=30.0):
    """Process 0 of 2, at its end after `shared` steps spanning the processes."""
    return ExitWait(0, 2, shared, timeout)


def test_a_peer_running_its_own_code_is_left_to_finish():
    wait = ended()
    for t in range(0, 10_000, 100):
        assert wait.look(float(t), {0: rec(1, 5, done=True), 1: rec(t, 5)}) is None


def test_a_peer_waiting_in_a_step_this_process_never_makes_is_a_deadlock_at_its_next_record():
    wait = ended()
    assert wait.look(0.0, {1: rec(7, 6, waiting=True)}) is None  # one record: not yet
    why = wait.look(0.5, {1: rec(8, 6, waiting=True)})
    assert why.startswith(
        "process 0 reached the end of its program after 5 step call(s) spanning the processes, "
        "but process 1 waits for it in a collective of its step call 6"
    )


def test_a_peer_that_stops_waiting_starts_again():
    wait = ended()
    wait.look(0.0, {1: rec(7, 6, waiting=True)})
    wait.look(0.5, {1: rec(8, 6)})  # it runs its own code between dispatches
    assert wait.look(1.0, {1: rec(9, 6, waiting=True)}) is None


def test_a_peer_waiting_in_jax_with_no_step_call_fails_the_wait_after_exit_timeout():
    wait = ended(timeout=30.0)
    assert wait.look(0.0, {1: rec(1, 5, waiting=True)}) is None
    assert wait.look(29.0, {1: rec(30, 5, waiting=True)}) is None
    why = wait.look(30.0, {1: rec(31, 5, waiting=True)})
    assert "process 1 has waited in JAX since, 30 s (exit_timeout=30 s), with no step" in why


def test_a_peer_behind_this_one_is_not_waiting_for_it():
    # its last steps' collectives have this process's side dispatched: they finish
    wait = ended(timeout=1.0)
    assert wait.look(0.0, {1: rec(1, 4, waiting=True)}) is None
    assert wait.look(100.0, {1: rec(2, 4, waiting=True)}) is None


def test_every_process_at_its_end_ends_the_wait():
    wait = ended()
    assert not wait.done({0: rec(1, 5, done=True)})
    assert not wait.done({0: rec(1, 5, done=True), 1: rec(1, 5)})
    assert wait.done({0: rec(1, 5, done=True), 1: rec(1, 5, done=True)})
