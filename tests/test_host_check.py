"""The per-batch host agreement of the input pipeline (spmd/_src/data/prefetch.py HostCheck),
over simulated processes sharing an in-memory key-value store: the requests it costs
grow with the processes, not their square, and a disagreement is an error on each."""

import collections
import threading
import time

import pytest

from spmd._src.data.prefetch import HostCheck
from spmd._src.errors import BatchError


class Store:
    """The coordination service's key-value store, as JAX's client reaches it, counting requests."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()
        self.requests = collections.Counter()

    def key_value_set(self, key, value):
        with self.changed:
            self.requests["set"] += 1
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.changed:
            self.requests["get"] += 1
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise TimeoutError(key)
            return self.values[key]

    def key_value_dir_get(self, key):
        with self.changed:
            self.requests["dir_get"] += 1
            prefix = key.rstrip("/") + "/"
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

    def key_value_delete(self, key):
        with self.changed:
            self.requests["delete"] += 1
            for k in [k for k in self.values if k == key or k.startswith(key + "/")]:
                del self.values[k]


def _run(count, records_of, steps, timeout=5.0):
    """Each simulated process agrees on `steps` batches; returns (outcome per process, store)."""
    store, outcomes = Store(), [None] * count

    def process(p):
        check = HostCheck(store, timeout, process=p, count=count, serial=0)
        try:
            for step in range(steps):
                check.agree(step, records_of(p, step), threading.Event())
        except BatchError as error:
            outcomes[p] = error
        else:
            outcomes[p] = "ok"

    threads = [threading.Thread(target=process, args=(p,)) for p in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes, store


@pytest.mark.parametrize("count", [2, 8, 32])
def test_agreement_costs_order_n_requests_per_batch(count):
    steps = 5
    outcomes, store = _run(count, lambda p, step: {"shape": "[16, 4]"}, steps)
    assert outcomes == ["ok"] * count
    per_batch = sum(store.requests.values()) / steps
    # each process posts its record and reads the verdict; process 0 reads the
    # records (a directory read, a blocking read per late one) and posts the verdict
    assert per_batch <= 4 * count + 4, store.requests
    assert len(store.values) <= 2 * count + 2, "the records of finished batches are deleted"


def test_a_different_shape_is_an_error_on_every_process_naming_the_batch():
    def records(p, step):
        return {"shape": "[32]" if (p == 3 and step == 2) else "[16]"}

    outcomes, _ = _run(4, records, 4)
    assert all(isinstance(o, BatchError) for o in outcomes), outcomes
    for outcome in outcomes:
        assert "batch_index=2" in str(outcome) and "[32]" in str(outcome)


def test_a_failure_of_process_0_reaches_the_others():
    def records(p, step):
        return {"error": "OSError: process 0 lost its disk"} if p == 0 else {"shape": "[16]"}

    outcomes, _ = _run(3, records, 1)
    assert all(isinstance(o, BatchError) for o in outcomes), outcomes
    assert all("process 0 lost its disk" in str(o) for o in outcomes)


def test_a_missing_process_is_named_by_every_other_within_the_timeout():
    count, store, outcomes = 3, Store(), {}

    def process(p):
        check = HostCheck(store, 0.5, process=p, count=count, serial=0)
        start = time.monotonic()
        try:
            check.agree(0, {"shape": "[16]"}, threading.Event())
        except BatchError as error:
            outcomes[p] = (str(error), time.monotonic() - start)

    threads = [threading.Thread(target=process, args=(p,)) for p in (0, 1)]  # 2 never comes
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == [0, 1]
    for text, seconds in outcomes.values():
        assert "missing_process=2" in text and "batch_index=0" in text
        assert seconds < 5
