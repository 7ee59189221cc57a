"""A worker forked from a preload server (SPMD_LAUNCH_PRELOAD) runs its program as a fresh
interpreter runs it: the same program, started both ways, reports the same (the fresh
start is the oracle); a command the server cannot run so starts fresh; a program that
changes JAX's configuration variables before importing JAX gets them applied, or a clear
error; and the server's workers end with the launcher's handle on them."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from commands import child_env
from multiprocess.procs import alive, wait_gone

from spmd._src.clusters import preload
from spmd.testing import run_processes

PY = sys.executable

# What a program can see of how it was started, as JSON on stdout.
PROBE = r"""
import json, os, sys
import numpy
report = {
    "argv": sys.argv,
    "path0": sys.path[0],
    "path_head": sys.path[1:3],
    "file": globals().get("__file__"),
    "name": __name__,
    "main_is_this": sys.modules["__main__"].__dict__ is globals(),
    "cwd": os.getcwd(),
    "probe_var": os.environ.get("PROBE_VAR"),
    "umask": os.umask(0o022),
    "own_group": os.getpgid(0) == os.getpid(),
    "own_session": os.getsid(0) == os.getpid(),
    "stdin": sys.stdin.read(),
    "stdout_line_buffered": sys.stdout.line_buffering,
    "stderr_line_buffered": sys.stderr.line_buffering,
    "stdout_write_through": sys.stdout.write_through,
    "stdout_encoding": sys.stdout.encoding,
    "jax_imported_before": "jax" in sys.modules,
    "orig_argv_tail": sys.orig_argv[1:],
    "globals": sorted(globals()),
    "stdio": [(s.name, s.mode, s.encoding, s.errors) for s in (sys.stdin, sys.stdout, sys.stderr)],
    "numpy_spec_origin": __import__("importlib.util").util.find_spec("optax").origin,
}
import jax
report["x64"] = bool(jax.config.jax_enable_x64)
report["platforms"] = jax.config.jax_platforms
print(json.dumps(report))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**child_env(), "PYTHONUNBUFFERED": "1", "PROBE_VAR": "seen", **extra}


def _fresh(command: list[str], env: dict[str, str], cwd) -> tuple[int, str, str]:
    done = subprocess.run(
        command,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        start_new_session=True,  # as spmd launch starts a worker
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def _forked(
    command: list[str], env: dict[str, str], cwd, monkeypatch, modules: str = "1"
) -> tuple[int, str, str]:
    """The program's (status, stdout, stderr), forked from a server that preloaded
    `modules` (SPMD_LAUNCH_PRELOAD's value)."""
    monkeypatch.setenv(preload.ENV_PRELOAD, modules)
    monkeypatch.chdir(cwd)
    proc = preload.start(command, env)
    assert isinstance(proc, preload.ForkedProcess), f"not forked: {command}"
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    return proc.wait(timeout=120), out, err


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["script", "code", "module"])
def test_a_forked_worker_sees_what_a_fresh_one_sees(how, tmp_path, monkeypatch):
    """argv, sys.path's head, __file__ and __main__, the working directory, the environment,
    the umask, a session and process group of its own, /dev/null as stdin, the streams'
    buffering and the exit status: the same started fresh and forked. JAX is not
    imported before the program imports it."""
    (tmp_path / "probe.py").write_text(PROBE)
    command = {
        "script": [PY, "probe.py", "a", "b"],
        "code": [PY, "-c", PROBE, "a", "b"],
        "module": [PY, "-m", "probe", "a", "b"],
    }[how]
    env = _env(PROBE_EXIT="3")
    fresh = _fresh(command, env, tmp_path)
    forked = _forked(command, env, tmp_path, monkeypatch)
    assert fresh[0] == forked[0] == 3, (fresh, forked)
    assert json.loads(forked[1]) == json.loads(fresh[1])
    assert json.loads(forked[1])["jax_imported_before"] is False
    assert forked[2] == fresh[2] == "to stderr\n"


@pytest.mark.multiprocess
def test_an_uncaught_error_prints_and_exits_as_in_a_fresh_interpreter(tmp_path, monkeypatch):
    """The traceback names the program's own frames only, and the status is 1."""
    (tmp_path / "fails.py").write_text("def f():\n    return 1 / 0\n\nf()\n")
    command = [PY, "fails.py"]
    fresh = _fresh(command, _env(), tmp_path)
    forked = _forked(command, _env(), tmp_path, monkeypatch)
    assert forked == fresh
    assert forked[0] == 1 and "ZeroDivisionError" in forked[2], forked


@pytest.mark.multiprocess
def test_a_jax_variable_the_program_sets_before_importing_jax_applies(tmp_path, monkeypatch):
    """JAX_ENABLE_X64 and JAX_PLATFORMS set by the program before `import jax` take
    effect as at a fresh import (JAX was imported in the server with neither)."""
    code = (
        "import os, json\n"
        "os.environ['JAX_ENABLE_X64'] = 'true'\n"
        "os.environ['JAX_PLATFORMS'] = 'cpu'\n"
        "import jax, jax.numpy as jnp\n"
        "print(json.dumps([str(jnp.ones(2).dtype), jax.config.jax_platforms]))\n"
    )
    env = _env()
    env.pop("JAX_ENABLE_X64", None)
    fresh = _fresh([PY, "-c", code], env, tmp_path)
    forked = _forked([PY, "-c", code], env, tmp_path, monkeypatch)
    assert forked == fresh
    assert json.loads(forked[1]) == ["float64", "cpu"]


@pytest.mark.multiprocess
def test_unsetting_a_jax_variable_before_importing_jax_is_an_error(tmp_path, monkeypatch):
    """The server imported JAX with JAX_PLATFORMS set; a program that unsets it first
    would get JAX's default platforms from a fresh import, which a forked worker cannot
    give: an ImportError says so, and how to fix it."""
    code = "import os\ndel os.environ['JAX_PLATFORMS']\nimport jax\n"
    status, _, err = _forked([PY, "-c", code], _env(JAX_PLATFORMS="cpu"), tmp_path, monkeypatch)
    assert status == 1
    assert "ImportError: JAX_PLATFORMS was unset by the program" in err, err
    assert "launch without SPMD_LAUNCH_PRELOAD" in err, err


@pytest.mark.multiprocess
def test_numpy_and_random_are_seeded_anew_in_each_worker(tmp_path, monkeypatch):
    code = "import random, numpy\nprint(numpy.random.rand(), random.random())\n"
    draws = {_forked([PY, "-c", code], _env(), tmp_path, monkeypatch)[1] for _ in range(3)}
    assert len(draws) == 3, draws


@pytest.mark.multiprocess
def test_a_module_the_program_would_find_elsewhere_starts_it_fresh(tmp_path, monkeypatch):
    """A script whose folder holds an `optax.py` would import that one when started
    fresh; the server, which imported the installed optax, refuses it and it starts
    fresh, finding its own."""
    (tmp_path / "optax.py").write_text("MINE = True\n")
    (tmp_path / "main.py").write_text("import optax\nprint(optax.MINE)\n")
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    assert preload.start([PY, "main.py"], _env()) is None
    results = run_processes([PY, str(tmp_path / "main.py")], 1, env=_env())
    assert results[0].stdout.strip() == "True"


@pytest.mark.multiprocess
def test_a_preloaded_package_that_grows_its_path_when_imported_is_found_in_its_place(
    tmp_path, monkeypatch
):
    """A package may add folders to its own __path__ when imported (TensorFlow does): the
    server's copy then lists more folders than a fresh lookup finds, yet it is the same
    package, the same __init__.py, and the worker is forked and imports it as a fresh
    interpreter does (it was refused as found elsewhere). The package is installed in a
    user site-packages folder (PYTHONUSERBASE), which the server's sys.path has too."""
    site = tmp_path / "user" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    package = site / "site-packages" / "grows"
    (package / "more").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import os\n__path__.append(os.path.join(os.path.dirname(__file__), 'more'))\n"
    )
    (package / "more" / "extra.py").write_text("WHERE = 'more'\n")
    command = [PY, "-c", "import grows.extra\nprint(grows.extra.WHERE, len(grows.__path__))"]
    env = _env(PYTHONUSERBASE=str(tmp_path / "user"))
    fresh = _fresh(command, env, tmp_path)
    assert fresh == (0, "more 2\n", ""), fresh
    assert _forked(command, env, tmp_path, monkeypatch, modules="numpy,grows") == fresh


@pytest.mark.multiprocess
def test_a_worker_finds_the_packages_of_its_own_homes_user_site(tmp_path, monkeypatch):
    """Python's site puts ~/.local/lib/pythonX.Y/site-packages before the installed
    packages: a launch with another HOME, whose user site holds its own copy of a package
    the server imported (typing_extensions, which JAX imports), imports that copy, forked
    as fresh (a server of its own: it was served by the one of the other HOME, and
    imported the installed one)."""
    import typing_extensions

    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = tmp_path / "home" / ".local" / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    source = open(typing_extensions.__file__).read()  # noqa: SIM115
    (site / "typing_extensions.py").write_text(source + "\nWHO = 'mine'\n")
    command = [PY, "-c", "import jax, typing_extensions as t\nprint(t.WHO, t.__file__)"]
    _forked([PY, "-c", "pass"], _env(), tmp_path, monkeypatch)  # the usual HOME's server
    _, out, _ = _same_both_ways(command, tmp_path, monkeypatch, HOME=str(tmp_path / "home"))
    assert out == f"mine {site / 'typing_extensions.py'}\n"


@pytest.mark.multiprocess
def test_a_pythonpath_that_finds_the_servers_packages_where_it_imported_them_forks(
    tmp_path, monkeypatch
):
    """PYTHONPATH naming the folder the server's numpy comes from finds that same numpy:
    nothing is shadowed, and the worker is forked (it was refused, as for a folder
    holding a numpy of its own)."""
    import numpy

    folder = os.path.dirname(os.path.dirname(numpy.__file__))
    command = [PY, "-c", "import numpy\nprint(numpy.__file__)"]
    _, out, _ = _same_both_ways(command, tmp_path, monkeypatch, PYTHONPATH=folder)
    assert out.strip() == numpy.__file__


@pytest.mark.parametrize(
    "command",
    [
        [PY, "-u", "-c", "print(1)"],  # an option of the interpreter's own
        ["bash", "-c", "true"],  # another program
        [PY, "missing.py"],  # a fresh interpreter reports the missing file itself
        [PY],  # no program
    ],
)
def test_a_command_a_warm_interpreter_cannot_run_starts_fresh(command, tmp_path, monkeypatch):
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    assert preload.start(command, _env()) is None


def test_without_the_variable_nothing_is_forked(monkeypatch):
    monkeypatch.setenv(preload.ENV_PRELOAD, "0")
    assert preload.start([PY, "-c", "pass"], _env()) is None


@pytest.mark.multiprocess
def test_the_variables_an_import_sets_are_set_when_the_program_imports_it(tmp_path, monkeypatch):
    """JAX's import sets TPU_SKIP_MDS_QUERY (no TPU chips here: else libtpu, loaded to
    compile for a topology, asks a cloud metadata server for minutes), TPU_LIBRARY_PATH
    and TF_CPP_MIN_LOG_LEVEL: a forked worker has them once its program imports JAX,
    not before, and keeps a value the program set first, as a fresh interpreter."""
    code = (
        "import os\n"
        "names = ('TPU_SKIP_MDS_QUERY', 'TPU_LIBRARY_PATH', 'TF_CPP_MIN_LOG_LEVEL')\n"
        "print([os.environ.get(n) for n in names])\n"
        "os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n"
        "import jax\n"
        "print([os.environ.get(n) for n in names])\n"
    )
    command = [PY, "-c", code]
    fresh = _fresh(command, _env(), tmp_path)
    assert fresh[0] == 0 and "'1'" in fresh[1].splitlines()[1], fresh
    assert _forked(command, _env(), tmp_path, monkeypatch) == fresh


@pytest.mark.multiprocess
def test_another_import_time_environment_gets_a_server_of_its_own(tmp_path, monkeypatch):
    """JAX reads JAX_ENABLE_X64 when imported: a worker whose launch environment sets it
    is forked from a server that imported JAX so."""
    code = "import jax.numpy as jnp\nprint(jnp.ones(1).dtype)\n"
    plain = _forked([PY, "-c", code], _env(), tmp_path, monkeypatch)
    wide = _forked([PY, "-c", code], _env(JAX_ENABLE_X64="1"), tmp_path, monkeypatch)
    assert (plain[1].strip(), wide[1].strip()) == ("float32", "float64")


@pytest.mark.multiprocess
@pytest.mark.parametrize("merged", [False, True], ids=["two_pipes", "stderr_to_stdout"])
def test_communicate_reads_what_popen_reads(tmp_path, monkeypatch, merged):
    """Popen's stdout/stderr arguments and communicate(): text with universal newlines,
    stderr into stdout, a timeout that keeps what was read; as a fresh Popen of the same
    program gives."""
    code = (
        "import sys, time\n"
        "print('out\\r\\none', flush=True)\n"
        "print('err', file=sys.stderr, flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n"
        "print('late')\n"
        "sys.exit(5)\n"
    )
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    stderr = subprocess.STDOUT if merged else subprocess.PIPE
    fresh = subprocess.Popen(
        [PY, "-c", code, "0"], env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    forked = preload.start([PY, "-c", code, "0"], _env(), cwd=tmp_path, stderr=stderr, text=True)
    assert isinstance(forked, preload.ForkedProcess)
    assert forked.communicate(timeout=60) == fresh.communicate(timeout=60)
    assert forked.returncode == fresh.returncode == 5
    slow = preload.start([PY, "-c", code, "3"], _env(), stderr=stderr, text=True)
    with pytest.raises(subprocess.TimeoutExpired):
        slow.communicate(timeout=1)
    out, _ = slow.communicate(timeout=60)
    assert out.startswith("out\none\n") and out.endswith("late\n"), out


@pytest.mark.multiprocess
def test_waits_answer_as_popens_from_any_thread(monkeypatch):
    """kill() from another thread ends a worker that a wait() without a timeout is
    blocked on; wait(timeout=0) on an ended worker gives its status; a communicate()
    timed out carries what was read."""
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    code = "import sys, time\nprint('before', flush=True)\ntime.sleep(float(sys.argv[1]))\n"
    sleeper = preload.start([PY, "-c", code, "60"], _env())
    timer = threading.Timer(1.0, sleeper.kill)
    timer.start()
    started = time.monotonic()
    assert sleeper.wait() == -signal.SIGKILL and time.monotonic() - started < 30
    quick = preload.start([PY, "-c", code, "0"], _env())
    quick.communicate(timeout=60)
    assert quick.wait(timeout=0) == 0
    slow = preload.start([PY, "-c", code, "60"], _env(), text=True)
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        slow.communicate(timeout=5)
    assert timed_out.value.output == "before\n"
    slow.kill()
    slow.wait(timeout=30)


def test_an_output_a_forked_worker_cannot_take_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"stderr is subprocess.PIPE.*Received: 'log.txt'"):
        preload.start([PY, "-c", "pass"], _env(), stderr="log.txt")


@pytest.mark.multiprocess
def test_a_server_beyond_the_limit_replaces_an_idle_one_never_a_busy_one(tmp_path, monkeypatch):
    """With room for one server: a second import-time environment replaces the first
    server once its worker ended; while that worker runs, the second starts fresh."""
    preload.close_servers()
    monkeypatch.setattr(preload, "_MAX_SERVERS", 1)
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    code = "import jax.numpy as jnp\nprint(jnp.ones(1).dtype)\n"
    try:
        sleeper = preload.start([PY, "-c", "import time; time.sleep(60)"], _env())
        assert isinstance(sleeper, preload.ForkedProcess)
        assert preload.start([PY, "-c", code], _env(JAX_ENABLE_X64="1")) is None  # busy
        sleeper.kill()
        sleeper.wait(timeout=30)
        wide = preload.start([PY, "-c", code], _env(JAX_ENABLE_X64="1"))
        assert isinstance(wide, preload.ForkedProcess), "the idle server was not replaced"
        assert wide.communicate(timeout=120)[0].decode().strip() == "float64"
        assert len(preload._servers) == 1
    finally:
        preload.close_servers()


@pytest.mark.multiprocess
def test_a_worker_let_go_by_the_launcher_is_killed_with_its_group(tmp_path, monkeypatch):
    """Closing the launcher's handle (as a dead launcher does) kills the worker's whole
    process group, a child of the worker's too."""
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    proc = preload.start([PY, "-c", code], _env())
    grandchild = int(proc.stdout.readline())
    assert alive(proc.pid) and alive(grandchild)
    proc._conn.close()  # the launcher's end of the worker's socket, as when it dies
    assert wait_gone([proc.pid, grandchild], 10) == []


@pytest.mark.multiprocess
def test_signals_and_exit_statuses_reach_the_launcher(tmp_path, monkeypatch):
    """terminate() ends a worker with -SIGTERM; wait() times out as Popen's does."""
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    proc = preload.start([PY, "-c", "import time; time.sleep(60)"], _env())
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    proc.terminate()
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert proc.returncode == -signal.SIGTERM


@pytest.mark.multiprocess
def test_the_workers_cpu_time_is_counted(tmp_path, monkeypatch):
    """A forked worker is the server's child, not the launcher's: its CPU time counts in
    preload.cpu_seconds() once it ended (the test recorder adds it)."""
    before = preload.cpu_seconds()
    code = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
    assert _forked([PY, "-c", code], _env(), tmp_path, monkeypatch)[0] == 0
    assert preload.cpu_seconds() - before >= 0.5


@pytest.mark.multiprocess
def test_a_cluster_of_forked_workers_computes_as_fresh_ones(monkeypatch):
    """Two processes of one cluster, forked, and the same two started fresh, gather each
    other's values (a collective across the processes) to the same sum."""
    code = (
        "import jax, jax.numpy as jnp, spmd\n"
        "from jax.experimental import multihost_utils\n"
        "spmd.initialize()\n"
        "x = jnp.arange(8.0) * (jax.process_index() + 1)\n"
        "total = float(multihost_utils.process_allgather(x).sum())\n"
        "print(f'sum={total} devices={jax.device_count()}', flush=True)\n"
    )
    outputs = {}
    for value in ("0", "1"):
        monkeypatch.setenv(preload.ENV_PRELOAD, value)
        got = run_processes([PY, "-c", code], 2, devices_per_process=2, env=child_env())
        # gloo's "[Gloo] Rank N is connected" lines come from its threads, at any time: one
        # may be cut by the program's line (no newline yet), so the line is found by its tag
        outputs[value] = [re.findall(r"sum=(\S+) devices=(\d+)", r.stdout) for r in got]
    assert outputs["0"] == outputs["1"] == [[("84.0", "4")], [("84.0", "4")]]


@pytest.mark.multiprocess
def test_what_importing_did_to_the_interpreter_waits_for_the_programs_import(tmp_path, monkeypatch):
    """Importing orbax adds a handler to the root logger (absl's first log calls
    logging.basicConfig()); flax raises the recursion limit; numpy and IPython add warnings
    filters. A program's own logging.basicConfig(level=INFO) before `import orbax` then
    configures logging, as in a fresh interpreter; and after the import the interpreter is
    as a fresh one's."""
    code = (
        "import json, logging, sys, warnings\n"
        "before = [len(logging.root.handlers), sys.getrecursionlimit(), len(warnings.filters)]\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')\n"
        "import orbax.checkpoint, flax.nnx\n"
        "logging.getLogger('probe').info('info shows')\n"
        "after = [len(logging.root.handlers), sys.getrecursionlimit(), len(warnings.filters)]\n"
        "one = sys.modules['logging'] is logging\n"  # not a second logging beside the held one
        "print(json.dumps([before, after, logging.root.level, one]))\n"
    )
    fresh = _fresh([PY, "-c", code], _env(), tmp_path)
    forked = _forked([PY, "-c", code], _env(), tmp_path, monkeypatch)
    assert forked[:2] == fresh[:2]
    assert json.loads(forked[1])[-1] is True
    assert "probe: info shows" in forked[2] and "probe: info shows" in fresh[2], forked[2]


@pytest.mark.multiprocess
@pytest.mark.parametrize("flag, variable, forked", [([], "0", False), (["--preload"], "0", True)])
def test_spmd_launch_preload_forks_the_workers(flag, variable, forked, tmp_path):
    """`spmd launch --preload` forks each worker from a server (its parent is not the
    launcher); without it, and with SPMD_LAUNCH_PRELOAD=0, each is the launcher's child."""
    code = "import os\nprint('parent', os.getppid())\n"
    env = {**child_env(), preload.ENV_PRELOAD: variable}
    launcher = subprocess.Popen(
        [PY, "-m", "spmd", "launch", "-n", "2", *flag, "--", PY, "-c", code],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, out
    parents = {int(line.split()[-1]) for line in out.splitlines() if " parent " in line}
    assert len(parents) == 1, out
    assert (launcher.pid not in parents) == forked, (launcher.pid, out)


def _same_both_ways(command, tmp_path, monkeypatch, **env) -> tuple[int, str, str]:
    """The program's (status, stdout, stderr), the same started fresh and forked."""
    fresh = _fresh(command, _env(**env), tmp_path)
    forked = _forked(command, _env(**env), tmp_path, monkeypatch)
    assert forked == fresh
    return forked


@pytest.mark.multiprocess
def test_interrupts_syntax_errors_and_unnormalized_paths_end_as_in_a_fresh_interpreter(
    tmp_path, monkeypatch
):
    """An uncaught KeyboardInterrupt ends the worker by SIGINT after the same traceback; a
    syntax error prints no traceback header; a script given as sub/../prog.py has that
    path as its __file__."""
    status, _, err = _same_both_ways([PY, "-c", "raise KeyboardInterrupt"], tmp_path, monkeypatch)
    assert status == -signal.SIGINT and "KeyboardInterrupt" in err
    status, _, err = _same_both_ways([PY, "-c", "x = ("], tmp_path, monkeypatch)
    assert status == 1 and "SyntaxError" in err and "Traceback" not in err
    (tmp_path / "sub").mkdir()
    (tmp_path / "prog.py").write_text("print(__file__)\n")
    _, out, _ = _same_both_ways([PY, "sub/../prog.py"], tmp_path, monkeypatch)
    assert out.strip().endswith("sub/../prog.py")


@pytest.mark.multiprocess
def test_the_programs_garbage_is_collected_as_in_a_fresh_interpreter(tmp_path, monkeypatch):
    """The collector on, with Python's thresholds; a cycle the program drops is finalized
    by gc.collect(), one left at exit when the interpreter ends: the same started fresh
    and forked. (What the server's imports made is frozen out of the collector's reach,
    gc.freeze, so that no collection in a worker walks it: not the program's objects.)"""
    (tmp_path / "cycles.py").write_text(
        "import gc\n"
        "class C:\n"
        "    def __del__(self):\n"
        "        print('finalized', self.name, flush=True)\n"
        "a = C(); a.name = 'by gc.collect()'; a.itself = a; del a\n"
        "print(gc.isenabled(), gc.get_threshold(), gc.collect() > 0)\n"
        "b = C(); b.name = 'at exit'; b.itself = b; del b\n"
    )
    _, out, _ = _same_both_ways([PY, "cycles.py"], tmp_path, monkeypatch)
    assert out.splitlines() == [
        "finalized by gc.collect()",
        "True (700, 10, 10) True",
        "finalized at exit",
    ]


@pytest.mark.multiprocess
def test_the_time_zone_is_the_workers_own(tmp_path, monkeypatch):
    """`time` reads TZ when imported: a launch environment with another TZ gets a server
    of its own, and the program the zone it was given."""
    code = "import time\nprint(time.tzname, time.timezone)\n"
    _same_both_ways([PY, "-c", code], tmp_path, monkeypatch)
    _, out, _ = _same_both_ways([PY, "-c", code], tmp_path, monkeypatch, TZ="Asia/Tokyo")
    assert "-32400" in out


@pytest.mark.multiprocess
def test_a_package_the_program_puts_on_sys_path_itself_is_an_import_error(tmp_path, monkeypatch):
    """A program that puts its own typing_extensions first on sys.path, then imports it,
    gets its own from a fresh start; a forked worker, which has the server's already,
    says so (an ImportError naming both and the fix), and again on a second try: never
    the server's in silence."""
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    (vendor / "typing_extensions.py").write_text("WHO = 'vendored'\n")
    code = (
        f"import sys\nsys.path.insert(0, {str(vendor)!r})\n"
        "for attempt in range(2):\n"
        "    try:\n"
        "        import typing_extensions\n"
        "        print(typing_extensions.WHO)\n"
        "    except ImportError as e:\n"
        "        print('ImportError', e)\n"
    )
    assert _fresh([PY, "-c", code], _env(), tmp_path)[1].split() == ["vendored", "vendored"]
    _, out, _ = _forked([PY, "-c", code], _env(), tmp_path, monkeypatch)
    lines = out.splitlines()
    assert len(lines) == 2 and all(line.startswith("ImportError") for line in lines), out
    assert str(vendor) in lines[0] and "PYTHONPATH" in lines[0], out


@pytest.mark.multiprocess
def test_a_module_of_a_namespace_package_the_program_puts_on_sys_path_is_an_import_error(
    tmp_path, monkeypatch
):
    """`google` is a namespace package (protobuf's, which JAX imports): a program that puts
    a folder with its own google/protobuf first on sys.path, then imports it, gets that
    one from a fresh start; a forked worker, which has the server's google.protobuf
    already, says so (an ImportError naming it), never the server's in silence."""
    package = tmp_path / "vendor" / "google" / "protobuf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("WHO = 'vendored'\n")
    code = (
        f"import sys\nsys.path.insert(0, {str(tmp_path / 'vendor')!r})\n"
        "try:\n"
        "    import google.protobuf\n"
        "    print(google.protobuf.WHO)\n"
        "except ImportError as e:\n"
        "    print('ImportError', e)\n"
    )
    assert _fresh([PY, "-c", code], _env(), tmp_path)[1] == "vendored\n"
    _, out, _ = _forked([PY, "-c", code], _env(), tmp_path, monkeypatch)
    assert out.startswith("ImportError Module 'google.protobuf' would be imported from"), out
    assert str(package) in out and "PYTHONPATH" in out, out


@pytest.mark.multiprocess
def test_a_namespace_package_beside_the_script_starts_it_fresh(tmp_path, monkeypatch):
    """`google` is a namespace package (no __file__) in the server; a google.py beside
    the script is what a fresh start imports: the script starts fresh."""
    (tmp_path / "google.py").write_text("WHO = 'mine'\n")
    (tmp_path / "main.py").write_text("import google\nprint(google.WHO)\n")
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    assert preload.start([PY, "main.py"], _env()) is None


@pytest.mark.multiprocess
def test_a_sitecustomize_on_the_pythonpath_starts_the_worker_fresh(tmp_path, monkeypatch):
    """site imports sitecustomize from PYTHONPATH when a fresh interpreter starts; the
    server started long before: such a worker starts fresh."""
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "sitecustomize.py").write_text("import os\nos.environ['RAN'] = '1'\n")
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path / "pp"), _env()["PYTHONPATH"]]))
    assert preload.start([PY, "-c", "pass"], env) is None


@pytest.mark.multiprocess
def test_a_zip_application_starts_fresh(tmp_path, monkeypatch):
    import zipapp

    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("print('zipped')\n")
    zipapp.create_archive(tmp_path / "app", tmp_path / "app.pyz")
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    assert preload.start([PY, "app.pyz"], _env()) is None


@pytest.mark.multiprocess
def test_the_server_outlives_the_thread_that_started_it(tmp_path, monkeypatch):
    """A server started from a thread that then ends keeps serving (no PR_SET_PDEATHSIG
    on it: that signal comes when the starting thread ends, not the process)."""
    import threading

    preload.close_servers()
    monkeypatch.setenv(preload.ENV_PRELOAD, "1")
    monkeypatch.chdir(tmp_path)
    first: list = []
    thread = threading.Thread(
        target=lambda: first.append(preload.start([PY, "-c", "pass"], _env()))
    )
    thread.start()
    thread.join()
    assert first[0].wait(timeout=60) == 0
    later = preload.start([PY, "-c", "print('still')"], _env())
    assert isinstance(later, preload.ForkedProcess)
    assert later.stdout.read() == b"still\n" and later.wait(timeout=60) == 0


@pytest.mark.parametrize("empty", [False, True], ids=["entries", "an_empty_entry"])
@pytest.mark.parametrize("mode", ["script", "code", "module"])
def test_the_path_a_worker_gets_first_is_a_fresh_interpreters(mode, empty, tmp_path):
    """The entries a fresh interpreter puts before the installed ones (the script's folder,
    or the working directory; then PYTHONPATH, relative entries made absolute, duplicates
    dropped) are those a forked worker gets: a fresh `python` (no JAX: milliseconds) is
    the oracle."""
    from spmd._src.clusters import preload_server

    (tmp_path / "lib").mkdir()
    (tmp_path / "show.py").write_text("import json, sys\nprint(json.dumps(sys.path))\n")
    # An empty entry (PYTHONPATH="/x:") is the working directory.
    pythonpath = os.pathsep.join(["lib", str(tmp_path / "lib"), "lib", *([""] if empty else [])])
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": pythonpath}
    command, target = {
        "script": ([PY, "show.py"], "show.py"),
        "code": ([PY, "-c", (tmp_path / "show.py").read_text()], "<code>"),
        "module": ([PY, "-m", "show"], "show"),
    }[mode]
    fresh = json.loads(subprocess.run(command, env=env, cwd=tmp_path, capture_output=True).stdout)
    request = {"mode": mode, "target": target, "env": env, "cwd": str(tmp_path)}
    own = preload_server._own_path(request)
    expected = fresh[: len(own)]
    if mode == "code":
        own[0] = ""  # python -c puts '' (the working directory as it changes)
    assert own == expected


def test_configuration_variables_read_as_jax_reads_them():
    """JAX's truth values (y, yes, t, true, on, 1 and their negatives, any case), integers
    and text; anything else for a truth value is an ImportError naming the variable."""
    from spmd._src.clusters.preload_server import _parse

    assert [_parse("V", v, False) for v in ("Yes", "ON", "1", "f", "off", "0")] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert _parse("V", "7", 3) == 7 and _parse("V", "cpu", "gpu") == "cpu"
    with pytest.raises(ImportError, match="'maybe' for environment 'V'"):
        _parse("V", "maybe", True)
