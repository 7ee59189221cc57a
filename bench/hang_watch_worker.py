"""One process of the hang-watch benchmark: a step with and without the watch beside it.

Usage: python bench/hang_watch_worker.py STEPS REPEATS OUT.json

One process with 8 CPU devices joins jax.distributed alone (its collectives
in-process, as without it), and the coordination service holds the records of
PROCESSES processes, as process 0 of a 100-process job reads them. The watch's
work of every interval (`_Watch.tick`: look at the main thread, publish, read
every record, judge) runs in a thread every INTERVAL seconds, the shortest
interval the watch uses, during the turns of one runner and not the other's;
both take turns with the hand-written jax.jit floor.
"""

import dataclasses
import json
import os
import sys
import threading
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.bench_step import GLOBAL_BATCH, _floor_runner, _spmd_runner  # noqa: E402

PROCESSES = 100  # records process 0 reads each interval
INTERVAL = 0.25  # seconds: the shortest publication interval (hang_watch.interval_for)
NEVER = 3600.0  # a hang timeout and silence bound the benchmark never reaches


def join_alone() -> object:
    """jax.distributed with this one process and the other processes' records; its client."""
    import jax
    from jax._src import distributed

    from spmd._src.clusters import hang_watch
    from spmd._src.clusters.launch import free_port

    jax.config.update("jax_cpu_collectives_implementation", None)
    jax.distributed.initialize(f"127.0.0.1:{free_port()}", 1, 0)
    client = distributed.global_state.client
    record = json.dumps(dataclasses.asdict(hang_watch.Record(1, 0, 0.0, NEVER, False, False)))
    for index in range(1, PROCESSES):
        client.key_value_set(f"{hang_watch._KEY}{index}", record)
    return client


def watch_beside(client: object) -> tuple[object, threading.Event]:
    """Process 0's watch and a daemon thread doing its work every INTERVAL while the event is set."""
    from spmd._src.clusters import hang_watch

    watch = hang_watch._Watch(0, PROCESSES, NEVER, NEVER, INTERVAL, client, lambda *_: os._exit(1))
    on = threading.Event()

    def loop() -> None:
        while on.wait():
            watch.tick(time.monotonic(), False)
            time.sleep(INTERVAL)

    threading.Thread(target=loop, name="spmd-hang-watch", daemon=True).start()
    return watch, on


def main() -> None:
    steps, repeats, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    common.set_cpu_devices(8)
    client = join_alone()
    import spmd

    watch, on = watch_beside(client)
    x, y = common.batch("tiny", GLOBAL_BATCH)
    off = _spmd_runner(spmd.MirroredStrategy(), "tiny", x, y)
    watched = _spmd_runner(spmd.MirroredStrategy(), "tiny", x, y)

    def run_watched(n: int) -> None:
        on.set()
        try:
            watched(n)
        finally:
            on.clear()

    runners = {"floor": _floor_runner("tiny", x, y), "off": off, "on": run_watched}
    times = common.timeit(runners, steps=steps, repeats=repeats)
    start, ticks = time.perf_counter(), 20
    for _ in range(ticks):
        watch.tick(time.monotonic(), False)
    tick_s = (time.perf_counter() - start) / ticks
    count_s = timeit.timeit("steps[0] += 1", setup="steps = [0]", number=10**6) / 10**6
    Path(out).write_text(json.dumps({"times": times, "tick_s": tick_s, "count_s": count_s}))


if __name__ == "__main__":
    main()
