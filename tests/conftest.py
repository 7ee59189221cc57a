"""Eight simulated CPU devices for the whole test session, set before JAX starts.

With SPMD_TEST_PLATFORM=gpu the GPU is the default backend (`jax.devices()` is
the GPU; float32 matmuls in float32, not TF32) and the tests marked `cpu_mesh`,
which need the eight simulated CPU devices, are left out: the plain run covers
them (bench/gpu_tests.sh runs both). The processes the multi-process tests start
stay on CPU devices (JAX_PLATFORMS=cpu in their environment). See
docs/accelerators.md.

Also the test tiers: a test marked `multiprocess`, `engines` or `bench` is
`slow` too, so `python -m pytest -q -m "not slow"` is the fast tier; and with
`-q` pytest still prints one line per test file. Setting SPMD_TEST_RECORD to a
file path records, per test, which spmd/ files ran, its CPU and wall time and
whether it is slow, and the whole run's (see tests/tiers.py).

And the parallel run (pytest-xdist, `-n auto` in pyproject.toml): one worker per
core and two more, at most eight; the `engines` tests run one after another on one worker
(they share daemons' ports and the 10.200.0.x namespaces); each module that starts
no process runs whole on one worker, and so do the tests that share a module-scoped
fixture; the benchmarks' smoke runs are handed out first, then the tests that start
processes with the slow modules that compute spread among them, the fast tier last.
"""

import atexit
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from bounds import bound, headroom
from commands import OPTIMIZATION_FLAG

STARTED = time.perf_counter()  # before JAX is imported: the run's wall time counts its import
# When the run started, the same clock in every worker (to place each test's end in the run).
RUN_STARTED = float(os.environ.setdefault("SPMD_TEST_RUN_STARTED", str(time.time())))

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # also what child processes inherit


def _share_compilations() -> None:
    """One XLA compilation cache for the whole run: the workers and every process a test
    starts (they inherit the environment) compile a program the run compiled before only
    once. A fresh folder per run, removed at its end by the process that made it; every
    program is cached (no minimum compile time). No size bound: with one, JAX locks the
    folder and sizes it up (a stat of every entry) at every write, which cost a whole run
    a quarter of its CPU time in system calls."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="spmd-tests-xla-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


_share_compilations()


def _share_bytecode() -> None:
    """Python's bytecode written and read where Python keeps it (`__pycache__`, ignored by
    git) for the run and every process it starts, also where PYTHONDONTWRITEBYTECODE is
    set: each module of spmd/ and tests/ (assertions rewritten) is compiled once, not again
    in each worker and in each of the hundreds of processes the tests start (a worker's
    collection: 15 s of CPU without, 9 s with). Installed packages come with theirs."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


_share_bytecode()


def _preload_workers() -> None:
    """The processes `spmd launch` and `spmd.testing.run_processes` start are forked from
    a warm interpreter that imported JAX, flax, optax and orbax once
    (SPMD_LAUNCH_PRELOAD, spmd/_src/clusters/preload.py), not started fresh to import
    them again: a few seconds of CPU less for each of the hundreds of processes the
    tests start. A test of the fresh start sets it to 0 for its launch."""
    os.environ.setdefault("SPMD_LAUNCH_PRELOAD", "1")


_preload_workers()


def _compile_unoptimized() -> None:
    """XLA's CPU backend at optimization level 0 (LLVM's passes off) for the run and the
    processes it starts: the same HLO programs, the same collectives and layouts, at
    about 40% less CPU per compile, which is most of what a test costs. The numbers
    agree with an optimized build's to float rounding (the one-device oracles compile
    the same way). SPMD_TEST_XLA_OPTIMIZE=1 compiles as a user's program does."""
    if os.environ.get("SPMD_TEST_XLA_OPTIMIZE") == "1":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if OPTIMIZATION_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {OPTIMIZATION_FLAG}=0".strip()


_compile_unoptimized()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}
_asked = os.environ.get("SPMD_TEST_PLATFORM", "cpu")
if _asked not in PLATFORMS:
    raise pytest.UsageError(
        f"SPMD_TEST_PLATFORM is one of {sorted(PLATFORMS)}.\n"
        f"Received: SPMD_TEST_PLATFORM={_asked!r}\n"
        "To fix: unset it (the eight CPU devices) or set SPMD_TEST_PLATFORM=gpu on a GPU machine."
    )
ACCELERATOR = PLATFORMS[_asked]
CPU_MESH_MODULE = "pytestmark = pytest.mark.cpu_mesh"
if ACCELERATOR != "cpu":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # many test processes, one GPU
    jax.config.update("jax_platforms", f"{ACCELERATOR},cpu")
    # The oracles are float32; a GPU's default float32 matmul is TF32 (10-bit mantissa).
    jax.config.update("jax_default_matmul_precision", "float32")


def pytest_sessionstart(session):
    """An accelerator run whose default backend is not the accelerator stops at once."""
    if ACCELERATOR != "cpu" and jax.default_backend() == "cpu":
        raise pytest.UsageError(
            f"SPMD_TEST_PLATFORM={_asked} but JAX found no {ACCELERATOR} device"
        )


def pytest_ignore_collect(collection_path, config):
    """On an accelerator run, modules whose every test is `cpu_mesh` are not imported."""
    if ACCELERATOR != "cpu" and collection_path.name.startswith("test_"):
        lines = collection_path.read_text().splitlines()
        return any(line.startswith(CPU_MESH_MODULE) for line in lines) or None
    return None


SLOW_TOO = ("multiprocess", "engines", "bench")
SPMD = str(Path(__file__).resolve().parent.parent / "spmd") + os.sep
MAX_WORKERS = 8  # each worker holds JAX with eight simulated devices (about 1 GiB)
# The order modules are handed to the workers in: those that start processes first.
FIRST = ("bench", "engines", "multiprocess", "slow")


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core and two more (the tests that start processes spend
    much of their time waiting for them, or for a fault to be named: with one more, 2
    cores were 1.75 busy on average), at most MAX_WORKERS."""
    return min(len(os.sched_getaffinity(0)) + 2, MAX_WORKERS)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` that finishes the run after a worker crashes (tests/scheduling.py)."""
    if config.getvalue("dist") == "loadgroup":
        from scheduling import CrashSafeLoadGroupScheduling

        return CrashSafeLoadGroupScheduling(config, log)
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects and xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Marks `slow` every test marked `multiprocess`, `engines` or `bench`; puts the
    `engines` tests in one xdist group and each module that starts no process in a group
    of its own, and so the tests sharing a module-scoped fixture; gives each test's time
    limit the run's headroom (tests/bounds.py); orders the run (`_run_order`)."""
    slow_too = [item for item in items if any(item.get_closest_marker(n) for n in SLOW_TOO)]
    starts_processes = {_module(item) for item in slow_too}
    for item in slow_too:
        item.add_marker(pytest.mark.slow)
    sharing = _sharing_groups([i for i in items if _module(i) in starts_processes])
    for item in items:
        module = _module(item)
        if item.get_closest_marker("engines"):
            item.add_marker(pytest.mark.xdist_group("engines"))
        elif module not in starts_processes:
            # One worker runs the whole module: its module-scoped fixtures (oracles, saved
            # checkpoints, the docs' programs) are computed once, not once per worker
            # (the fast tier alone: a quarter less CPU). A module that starts processes
            # spends its time waiting for them: its tests are spread over the workers,
            # but for those sharing a module-scoped fixture (`_sharing_groups`).
            item.add_marker(pytest.mark.xdist_group(module))
        elif item.nodeid in sharing:
            item.add_marker(pytest.mark.xdist_group(sharing[item.nodeid]))
        limit = item.get_closest_marker("timeout")
        if limit is not None and limit.args and headroom() > 1:
            item.add_marker(pytest.mark.timeout(bound(limit.args[0])), append=False)
    items[:] = _run_order(items)


def _module(item) -> str:
    """The path of the module a test is in (its node id up to the first `::`)."""
    return item.nodeid.split("::", 1)[0]


def _sharing_groups(items: list) -> dict[str, str]:
    """Node id -> xdist group, for the tests of `items` that use a module-scoped fixture:
    one group per set of tests linked by such fixtures (a test using two links theirs),
    named after one of them. Spread over the workers, each worker that ran one of
    them would start the fixture's processes again (a crashed and resumed pair of
    processes, an oracle's fit: 40 s of CPU each, three times in a run of three)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    uses: dict[str, list[str]] = {}
    for item in items:
        module = _module(item)
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        names = [f"{module}::{n}" for n, d in defs.items() if d and d[-1].scope == "module"]
        if names:
            uses[item.nodeid] = names
            for name in names[1:]:
                parent[root(name)] = root(names[0])
    return {nodeid: root(names[0]) for nodeid, names in uses.items()}


def _run_order(items: list) -> list:
    """`items` in the order the workers are handed them, the same on every worker.

    Each module is ranked by its costliest kind of test (FIRST): the benchmarks'
    smoke runs go first (the longest poles); then the units (a test, or a group) of
    the modules that start processes, with the slow modules that compute in the
    worker spread evenly among them, so that a worker waiting for its processes
    leaves its core to one that computes (the processes' tests alone left a third of
    the cores idle for the run's first ten minutes), those units taken one module at a
    time in turn (`_alternating`); the fast tier's modules last,
    short units that even out the end. Each module's tests stay in their order.
    """
    rank: dict[str, int] = {}  # index in (*FIRST, "fast") of the module's costliest kind
    by_module: dict[str, list] = {}
    for item in items:
        module = _module(item)
        kinds = [i for i, name in enumerate(FIRST) if item.get_closest_marker(name)]
        rank[module] = min([rank.get(module, len(FIRST)), *kinds])
        by_module.setdefault(module, []).append(item)

    def units(kinds: set[str]) -> list[list]:
        found: dict[str, list] = {}
        for module in sorted(by_module, key=rank.__getitem__):  # stable: in collection order
            if (*FIRST, "fast")[rank[module]] in kinds:
                for item in by_module[module]:
                    group = item.get_closest_marker("xdist_group")
                    found.setdefault(group.args[0] if group else item.nodeid, []).append(item)
        return list(found.values())

    waiting, computing = _alternating(units({"engines", "multiprocess"})), units({"slow"})
    spread, taken = [], 0
    for i, unit in enumerate(waiting, 1):
        spread.append(unit)
        while taken < len(computing) and (taken + 1) * len(waiting) <= i * len(computing):
            spread.append(computing[taken])
            taken += 1
    spread += computing[taken:]
    ordered = units({"bench"}) + spread + units({"fast"})
    return [item for unit in ordered for item in unit]


def _alternating(units: list[list]) -> list[list]:
    """`units` taken one module at a time, in turn (each module's in their order): a module
    whose tests mostly wait (peers killed, heartbeat timeouts, hangs to name) is spread
    among those whose processes compute, rather than handed to every worker at once (four
    workers all waiting on join_faults left both cores idle for half a minute)."""
    by_module: dict[str, list[list]] = {}
    for unit in units:
        by_module.setdefault(_module(unit[0]), []).append(unit)
    queues = list(by_module.values())
    turns = max((len(q) for q in queues), default=0)
    return [q[turn] for turn in range(turns) for q in queues if turn < len(q)]


def pytest_collection_finish(session):
    """What collection made (the modules imported, JAX's, TensorFlow's, the tests) is moved
    out of the garbage collector's reach: it lives to the end of the run, and each full
    collection would walk it again (about a third of the collector's time in a worker)."""
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Per-file progress under `-q`: the file's path before its dots, not one wall of dots."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.showfspath = True
    if ACCELERATOR != "cpu":
        config.pluginmanager.register(_LeaveOutCpuMesh())
    if os.environ.get("SPMD_TEST_RECORD"):
        worker = getattr(config, "workerinput", {}).get("workerid")  # set on xdist's workers
        recorder = _Recorder(os.environ["SPMD_TEST_RECORD"], worker)
        if worker is None:  # before xdist starts its workers: on a machine this run leaves idle
            recorder.measure_the_machine()
        config.pluginmanager.register(recorder)
        if worker is not None or getattr(config.option, "dist", "no") == "no":
            # Where tests run, the processes they start (a pytest run of their own, too)
            # are not recorded: they would time the reference workload again and write
            # their record where this run writes its own.
            del os.environ["SPMD_TEST_RECORD"]


@pytest.fixture(
    scope="module", params=["1dev", "8dev", pytest.param("2d", marks=pytest.mark.cpu_mesh)]
)
def input_strategy(request):
    """The strategies the input tests place batches with: one device, eight replicas, and a
    4x2 mesh whose batches split over "data" and are replicated over "model"."""
    import spmd  # here, not at the top: the platform is set before spmd is imported

    if request.param == "1dev":
        return spmd.OneDeviceStrategy(jax.devices()[0])
    if request.param == "8dev":
        return spmd.MirroredStrategy()
    return spmd.Strategy(jax.make_mesh((4, 2), ("data", "model")), batch_axes=["data"])


@pytest.fixture(autouse=True)
def _no_preemption_watch_left_open(request):
    """A test that leaves a checkpoint writer open fails, and its SIGTERM watch is closed.

    An open writer keeps the process's SIGTERM handler and its watchdog: a later test's
    SIGTERM (the preemption tests send one to their own process) would then end this
    worker 120 s later, in the middle of another test.
    """
    yield
    preemption = sys.modules.get("spmd._src.checkpoint.preemption")
    if preemption is None or not preemption.open_watchers():
        return
    gc.collect()  # a writer dropped unclosed is no longer watching once collected
    left = preemption.open_watchers()
    for watcher in left:
        watcher.close()
    assert not left, (
        f"{request.node.nodeid} left {len(left)} checkpoint writer(s) open "
        "(CheckpointManager, or a Trainer callback that holds one): close them "
        "(`with spmd.CheckpointManager(...)`, or `.close()` in a `finally`)."
    )


class _LeaveOutCpuMesh:
    """On an accelerator run, the `cpu_mesh` tests are deselected: the default backend is
    the accelerator, and they need the eight CPU devices (the plain run has them)."""

    def pytest_collection_modifyitems(self, config, items):
        cpu_mesh = [item for item in items if item.get_closest_marker("cpu_mesh")]
        config.hook.pytest_deselected(items=cpu_mesh)
        items[:] = [item for item in items if not item.get_closest_marker("cpu_mesh")]


def cpu_seconds() -> float:
    """CPU time of this process (all its threads, XLA's too) and of its finished children,
    also of the workers forked from its preload servers (their children, not its own,
    until the servers end: spmd._src.clusters.preload.cpu_seconds)."""
    from spmd._src.clusters import preload

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime + preload.cpu_seconds()


class _Recorder:
    """Records, per test, the CPU and wall seconds it took (setup and teardown included),
    whether it is slow, which spmd/ files had a function called (the fast tier's tests
    only: what tests/tiers.py checks), and the whole run's.

    The record is `{"run": {"cpu_s", "wall_s", "workers", "reference_cpu_s"}, "tests":
    {nodeid: {"ran", "cpu_s", "wall_s", "slow", "worker", "end_s"}}}` (`end_s`: when the
    test ended, in seconds since the run started; `worker`: xdist's name of the worker
    that ran it); the run's CPU time counts everything since the process started
    (importing JAX, collecting), which no test's does. Under xdist each worker writes its
    own part beside `path` and the controller merges them: the run's CPU is the workers'
    and the controller's, its wall the controller's. `reference_cpu_s` is the machine's
    speed: the CPU seconds of tests/reference_workload.py, measured before the tests
    start (not counted in the run's CPU), or SPMD_TEST_REFERENCE_S where that is set
    (a figure measured before on this machine).
    """

    def __init__(self, path: str, worker: str | None = None):
        self.worker = worker
        self.path, self.seen, self.tests = Path(path), set(), {}
        self.reference: float | None = None
        self.reference_cost = 0.0  # the CPU seconds measuring it took (the run's CPU leaves out)
        self.watching = False  # whether the test running is watched: a fast one

    def measure_the_machine(self) -> None:
        """Times the reference workload (tests/reference_workload.py), or takes
        SPMD_TEST_REFERENCE_S."""
        given = os.environ.get("SPMD_TEST_REFERENCE_S")
        if given:
            try:
                self.reference = float(given)
            except ValueError:
                self.reference = 0.0
            if not 0 < self.reference < float("inf"):
                raise pytest.UsageError(
                    "SPMD_TEST_REFERENCE_S is the reference workload's CPU seconds on this "
                    f"machine, a number above 0.\nReceived: SPMD_TEST_REFERENCE_S={given!r}"
                    "\nTo fix: unset it (the recorder measures it) or give the figure of "
                    "`python tests/reference_workload.py`."
                )
            return
        from reference_workload import cpu_seconds as reference_seconds

        before = cpu_seconds()
        self.reference = reference_seconds()
        self.reference_cost = cpu_seconds() - before

    def _watch(self, on: bool) -> None:
        """Which files a test runs is watched in the fast tier only (what tests/tiers.py
        checks): a profile hook on every call makes a test cost about an eighth more CPU,
        so a slow test, unwatched, costs what it does unrecorded (its "ran" is empty). The
        hook is in the test's thread and the threads it starts; a thread started before
        keeps its hook, idle while no fast test runs."""
        self.watching = on
        sys.setprofile(self._profile if on else None)
        threading.setprofile(self._profile if on else None)

    def _profile(self, frame, event, arg):
        if self.watching and event == "call":
            self.seen.add(frame.f_code.co_filename)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        slow = item.get_closest_marker("slow") is not None
        self.seen.clear()
        cpu, wall = cpu_seconds(), time.perf_counter()
        self._watch(not slow)
        try:
            yield
        finally:
            self._watch(False)
        cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
        ran = sorted({f[len(SPMD) :] for f in self.seen if f.startswith(SPMD)})
        entry = {"ran": ran, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "slow": slow}
        entry["worker"], entry["end_s"] = self.worker, round(time.time() - RUN_STARTED, 3)
        self.tests[item.nodeid.split("@", 1)[0]] = entry  # without xdist's group suffix

    @pytest.hookimpl(trylast=True)  # after xdist has waited for its workers
    def pytest_sessionfinish(self, session):
        run = {"cpu_s": cpu_seconds(), "wall_s": round(time.perf_counter() - STARTED, 3)}
        if self.worker:
            part = self.path.with_name(f"{self.path.name}.{self.worker}")
            part.write_text(json.dumps({"run": run, "tests": self.tests}))
            return
        parts = sorted(self.path.parent.glob(f"{self.path.name}.gw*"))
        if parts:  # the workers, reaped, are the controller's children: counted once
            run["cpu_s"] = time.process_time()
        else:  # the reference workload ran as a child of this process: not the run's
            run["cpu_s"] -= self.reference_cost
        for part in parts:
            record = json.loads(part.read_text())
            self.tests.update(record["tests"])
            run["cpu_s"] += record["run"]["cpu_s"]
            part.unlink()
        run["cpu_s"], run["workers"] = round(run["cpu_s"], 3), len(parts)
        run["reference_cpu_s"] = self.reference
        record = {"run": run, "tests": self.tests}
        self.path.write_text(json.dumps(record, indent=0, sort_keys=True))
