"""strategy.run, reduce, gather and a step's keyword arguments, fed per process.

    python run_signature_worker.py

Each scenario makes the two processes pass the same or different arguments and
records what happened ("ok" with the result, or "BatchError" with its message).
Every process prints one line, "RESULT <json>", mapping each scenario to its
outcome, and how many signature agreements (`_BatchSignatures.agree`) and
coordination-service calls the steady loops made.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import spmd
from spmd._src.strategy import step_checks

spmd.initialize()
strategy = spmd.MultiWorkerMirroredStrategy()
me = jax.process_index()
outcomes: dict = {}


class _Counting:
    """The coordination client, counting the calls the checks make through it."""

    def __init__(self, client):
        self.client, self.calls = client, 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.client, name)


client = _Counting(step_checks.coordination_client())
step_checks.coordination_client = lambda: client
agreements: list[str] = []
_agree = step_checks._BatchSignatures.agree


def _counted(self, index, record, stop=None):
    agreements.append(record["batch"])
    return _agree(self, index, record, stop)


step_checks._BatchSignatures.agree = _counted


def attempt(name, fn):
    try:
        outcomes[name] = ["ok", fn()]
    except spmd.BatchError as error:
        outcomes[name] = ["BatchError", str(error)]


def total(v):
    return spmd.get_replica_context().all_reduce("SUM", v.sum())


def rows():
    x = np.arange(8 if me == 0 else 16, dtype=np.float32).reshape(-1, 1)
    return float(strategy.reduce("MEAN", strategy.run(lambda v: total(v), args=(x,))))


def dtypes():
    x = np.arange(8, dtype=np.float32 if me == 0 else np.int32).reshape(-1, 1)
    out = strategy.run(lambda v: total(v.astype(jnp.float32)), args=(x,))
    return float(strategy.reduce("MEAN", out))


def static_keyword():
    x = np.ones((8, 1), np.float32)
    out = strategy.run(
        lambda v, training: v * 2.0 if training else v, args=(x,), kwargs={"training": me == 0}
    )
    return np.asarray(strategy.gather(out)).tolist()


def steady():
    """Runs of a new lambda each, alike on both processes: 8 rows once, 4 more times,
    then 16 rows; what the agreements and coordination-service calls were after each."""
    phases = {}
    for phase, rows, calls in (("first", 8, 1), ("same", 8, 4), ("new_shape", 16, 1)):
        for _ in range(calls):
            x = np.arange(rows, dtype=np.float32).reshape(-1, 1)
            out = strategy.run(lambda v: total(v), args=(x,))
            phases.setdefault("sums", []).append(float(strategy.reduce("MEAN", out)))
        phases[phase] = {"agreements": len(agreements), "client_calls": client.calls}
    return phases


def gathered():
    x = np.arange(8, dtype=np.float32).reshape(-1, 1)
    out = strategy.run(lambda v: (v.sum(), v * 2.0), args=(x,))
    return [np.asarray(strategy.gather(value)).tolist() for value in out]


def reduce_shapes():
    value = np.ones(3 if me == 0 else 4, np.float32)
    return np.asarray(strategy.reduce("SUM", value)).tolist()


def reduce_same():
    return np.asarray(strategy.reduce("SUM", np.full(3, me + 1.0, np.float32))).tolist()


def train(step, kwargs_of):
    state = strategy.put({"w": np.zeros(3, np.float32)})
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32)
    for _ in range(3):
        state, _ = step(state, x, y, **kwargs_of(me))
    return np.asarray(jax.device_get(state["w"])).tolist()


def linear_step(state, x, y, scale=1.0, offset=None):
    def loss(w):
        shift = 0.0 if offset is None else offset.sum()
        return jnp.mean((x @ w - y + shift) ** 2)

    value, grad = jax.value_and_grad(loss)(state["w"])
    return {"w": state["w"] - 0.1 * scale * grad}, {"loss": value}


def run_keyword_value():
    x = np.ones((8, 1), np.float32)
    out = strategy.run(lambda v, scale: v * scale, args=(x,), kwargs={"scale": 1.0 + me})
    return np.asarray(strategy.gather(out)).tolist()


def rate_step(state, x, y, lr):
    value, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
    return {"w": state["w"] - lr * grad}, {"loss": value}


def schedule_cost(calls=40):
    """Seconds per call of a step whose `lr=` keyword is one value throughout, and of
    one whose `lr=` changes every call (a schedule), each agreement counted."""
    step = strategy.step(rate_step)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32)
    timing = {}
    for name, rate in (("constant", lambda i: 0.1), ("schedule", lambda i: 0.1 / (1 + i))):
        state = strategy.put({"w": np.zeros(3, np.float32)})
        state, _ = step(state, x, y, lr=rate(0))  # compiled, and agreed
        jax.block_until_ready(state)
        before, start = len(agreements), time.perf_counter()
        for i in range(1, calls + 1):
            state, _ = step(state, x, y, lr=rate(i))
        jax.block_until_ready(state)
        seconds = (time.perf_counter() - start) / calls
        timing[name] = {"per_call_s": seconds, "agreements": len(agreements) - before}
    return timing


def local_strategy():
    """A strategy over this process's devices alone: each process runs apart, on batches
    of its own (8 rows on one, 16 on the other); nothing is agreed on."""
    local = spmd.MirroredStrategy()
    x = np.arange(8 if me == 0 else 16, dtype=np.float32).reshape(-1, 1)
    before = len(agreements)
    total_rows = float(
        local.reduce("SUM", local.run(lambda v: v.shape[0] + 0.0 * v.sum(), args=(x,)))
    )
    state, _ = local.step(linear_step)(
        local.put({"w": np.zeros(3, np.float32)}), np.ones((len(x), 3), np.float32), x[:, 0]
    )
    jax.block_until_ready(state)
    return {"rows": total_rows, "agreements": len(agreements) - before}


scaled = strategy.step(linear_step, static_argnames=("scale",))
attempt("run_rows", rows)
attempt("run_dtype", dtypes)
attempt("run_static_keyword", static_keyword)
attempt("run_steady", steady)
attempt("gather", gathered)
attempt("reduce_shapes", reduce_shapes)
attempt("reduce_same", reduce_same)
attempt("step_static_keyword", lambda: train(scaled, lambda p: {"scale": 1.0 + p}))
attempt(
    "step_keyword_shape", lambda: train(scaled, lambda p: {"offset": np.zeros(3 + p, np.float32)})
)
attempt("step_same_keywords", lambda: train(scaled, lambda p: {"scale": 2.0}))
attempt("step_keyword_value", lambda: train(scaled, lambda p: {"offset": np.float32(p)}))
attempt("run_keyword_value", run_keyword_value)
attempt("schedule_cost", schedule_cost)
attempt("local_strategy", local_strategy)
print("RESULT " + json.dumps(outcomes), flush=True)
