"""A strategy over one process's devices in a job of several says so: its processes train apart."""

import pytest

from spmd.testing import run_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

CODE = """
import warnings
import spmd
spmd.initialize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    spmd.{name}()
said = [w for w in caught if "MultiWorkerMirroredStrategy()" in str(w.message)]
print("WARNED" if said else "QUIET", *{{w.filename for w in said}})
"""


@pytest.mark.parametrize(
    "name, said",
    [
        ("MirroredStrategy", "WARNED <string>"),  # at the user's line (python -c: <string>)
        ("MultiWorkerMirroredStrategy", "QUIET"),
        ("OneDeviceStrategy", "QUIET"),  # one device by name: a local run, as asked
    ],
)
def test_a_local_strategy_under_several_processes_warns_naming_multi_worker(name, said):
    results = run_processes(CODE.format(name=name), 2, devices_per_process=2)
    assert [r.stdout.strip().splitlines()[-1] for r in results] == [said, said]
