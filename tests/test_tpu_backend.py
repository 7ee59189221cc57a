"""JAX's TPU backend on a host with no TPU chip: spmd keeps libtpu from starting (and printing).

The programs run in child processes without JAX_PLATFORMS (which the test session
sets, and which silences libtpu by itself), as a user's program runs.
"""

import subprocess
import sys

import pytest
from jax._src import hardware_utils, xla_bridge

from spmd._src.clusters import tpu_backend
from tests.commands import child_env

# What libtpu prints on the first jax.devices() of a host with no TPU chip.
LIBTPU_NOISE = (
    "Failed to find host bounds for accelerator type",
    "Logging before InitGoogle()",
    "unexpected worker hostname",
    "Source Location Trace",
    "libtpu_init_utils.cc",
)
MARK = "END OF THE CPU PART"
PROGRAM = f"""
import sys
import numpy as np
import spmd

spmd.initialize()
import jax, jax.numpy as jnp

strategy = spmd.MirroredStrategy()
step = strategy.step(lambda state, batch: (state + jnp.sum(batch), jnp.mean(batch)))
state, loss = step(jnp.zeros(()), np.ones((strategy.num_replicas_in_sync, 2), np.float32))
print("PLATFORMS", sorted({{d.platform for d in jax.devices()}}), float(loss), flush=True)
print({MARK!r}, file=sys.stderr, flush=True)
tpu = spmd.TPUStrategy(topology=spmd.topology("v5e:2x2"))
lowered, _ = tpu.step(lambda s, b: (s + jnp.sum(b), 0.0)).lower(
    jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32)
)
compiled = lowered.compile()
print("COMPILED", sorted({{d.platform for d in tpu.mesh.devices.flat}}), compiled is not None)
"""
no_chip = pytest.mark.skipif(
    hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0, reason="this host has a TPU"
)


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**child_env("JAX_PLATFORMS", "JAX_FORCE_TPU_INIT"), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
@no_chip
def test_a_program_on_a_host_without_a_tpu_hears_nothing_from_libtpu_and_compiles_for_one():
    pytest.importorskip("libtpu", reason="libtpu speaks only where it is installed")
    done = run(PROGRAM)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PLATFORMS ['cpu'] 1.0" in done.stdout, done.stdout
    before_the_topology = done.stderr.split(MARK)[0]
    assert not [n for n in LIBTPU_NOISE if n in before_the_topology], before_the_topology
    assert "COMPILED ['tpu'] True" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow  # 6 s of CPU: over the fast tier's share (tests/tiers.py)
@no_chip
@pytest.mark.parametrize(
    "imports",
    [
        "import spmd._src.checkpoint",
        "from spmd._src.trainer.trainer import Trainer",
        "import spmd.testing",
        "import spmd\nfrom flax import nnx",  # jax and flax used directly, no spmd.X yet
        "import spmd._src.clusters.initialize",
    ],
)
def test_any_import_path_into_spmd_keeps_libtpu_quiet(imports):
    """However spmd's modules come in (or the program uses jax itself after `import spmd`),
    JAX's TPU backend is kept from starting before the program's first jax.devices()."""
    pytest.importorskip("libtpu", reason="libtpu speaks only where it is installed")
    done = run(f"{imports}\nimport jax\nprint('PLATFORMS', [d.platform for d in jax.devices()])\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PLATFORMS ['cpu']" in done.stdout, done.stdout
    assert not [n for n in LIBTPU_NOISE if n in done.stderr], done.stderr


def test_importing_spmd_imports_no_jax():
    done = run("import sys, spmd\nprint('JAX', 'jax' in sys.modules)\n")
    assert done.returncode == 0 and "JAX False" in done.stdout, done.stderr[-3000:]


@no_chip
def test_jax_platforms_the_user_set_is_never_overridden():
    pytest.importorskip("libtpu", reason="JAX tries the TPU only where libtpu is installed")
    code = (
        "import spmd, jax\n"
        "jax.config.update('jax_platforms', 'tpu,cpu')\n"
        "spmd.initialize()\n"
        "jax.devices()\n"
    )
    done = run(code)
    assert done.returncode != 0
    assert "Unable to initialize backend 'tpu'" in done.stderr, done.stderr[-3000:]
    assert tpu_backend.NO_CHIP not in done.stderr  # libtpu itself was asked, as the user said


@no_chip
def test_on_a_host_without_a_tpu_asking_for_it_says_why_there_is_none():
    code = "import spmd, jax\nspmd.initialize()\njax.devices('tpu')\n"
    done = run(code)
    assert done.returncode != 0
    assert tpu_backend.NO_CHIP in done.stderr, done.stderr[-3000:]


@pytest.fixture
def registry(monkeypatch):
    """A registry of JAX's backend factories not yet started: a TPU and a CUDA factory."""
    made = []
    cuda = xla_bridge.BackendRegistration(lambda: made.append("cuda"), 200, True)
    tpu = xla_bridge.BackendRegistration(lambda: made.append("tpu"), 300, True)
    factories = {"cuda": cuda, "tpu": tpu}
    monkeypatch.setattr(xla_bridge, "_backend_factories", factories)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(tpu_backend, "_wrapped", [])
    monkeypatch.setattr(tpu_backend, "_tpu_asked_for", lambda: False)
    return factories, made


def test_only_the_tpu_factory_is_wrapped(registry):
    factories, made = registry
    cuda = factories["cuda"]
    assert tpu_backend.skip_without_chips()
    assert factories["cuda"] is cuda  # CUDA is found as before
    assert (factories["tpu"].priority, factories["tpu"].fail_quietly) == (300, True)
    assert made == []  # nothing started


def test_without_a_chip_the_tpu_factory_fails_before_libtpu(registry, monkeypatch):
    factories, made = registry
    monkeypatch.setattr(tpu_backend, "_tpu_present", lambda: False)
    tpu_backend.skip_without_chips()
    with pytest.raises(RuntimeError, match="no TPU chip"):
        factories["tpu"].factory()
    assert made == []


@pytest.mark.parametrize("why", ["chip", "asked"])
def test_with_a_chip_or_when_asked_the_tpu_factory_is_jax_s(registry, monkeypatch, why):
    factories, made = registry
    monkeypatch.setattr(tpu_backend, "_tpu_present", lambda: why == "chip")
    monkeypatch.setattr(tpu_backend, "_tpu_asked_for", lambda: why == "asked")
    tpu_backend.skip_without_chips()
    factories["tpu"].factory()
    assert made == ["tpu"]


def test_once_the_backends_started_nothing_changes(registry, monkeypatch):
    factories, _ = registry
    tpu = factories["tpu"]
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not tpu_backend.skip_without_chips()
    assert factories["tpu"] is tpu
