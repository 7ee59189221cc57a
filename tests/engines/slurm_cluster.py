"""A one-node Slurm cluster in a temporary folder: munged, slurmctld and slurmd.

This machine's hostname with 2 CPUs, proctrack/linuxproc and task/none, every
state file and socket under the folder. The daemons run in the foreground as
children of the test and are stopped by PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from spmd._src.clusters.launch import free_port

from .support import clean_env

CONF = """\
ClusterName=spmdtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/d
SlurmctldPidFile={dir}/ctld.pid
SlurmdPidFile={dir}/d.pid
SlurmctldLogFile={dir}/ctld.log
SlurmdLogFile={dir}/d.log
NodeName={host} CPUs=2 State=UNKNOWN
PartitionName=spmd Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """Starts the three daemons; `env` is what Slurm's commands need; `stop()` ends all."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen] = []
        self.host = socket.gethostname().split(".")[0]
        self.env = {**clean_env(), "SLURM_CONF": str(folder / "slurm.conf")}

    def start(self, timeout: float = 60) -> None:
        """Writes the configuration, starts the daemons, waits for the node to be idle."""
        d = self.folder
        for sub in ("ctld", "d"):
            (d / sub).mkdir(mode=0o700)
        (d / "slurm.conf").write_text(
            CONF.format(host=self.host, dir=d, ctld_port=free_port(), d_port=free_port())
        )
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munge = [f"--socket={d}/munge.sock", f"--key-file={key}", f"--pid-file={d}/munged.pid"]
        munge += [f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"]
        self._daemon(["munged", "--foreground", "--force", *munge])
        self._wait(lambda: (d / "munge.sock").exists(), 10, "munged's socket")
        self._daemon(["slurmctld", "-D", "-i"])
        self._daemon(["slurmd", "-D"])
        self._wait(self._idle, timeout, "sinfo to show the node idle")

    def _daemon(self, argv: list[str]) -> None:
        log = open(self.folder / f"{argv[0]}.out", "w")  # noqa: SIM115 (lives as long as the daemon)
        self.procs.append(
            subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        )

    def _idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-o", "%T"], timeout=10, check=False)
        return out.strip() == "idle"

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"waited {timeout} s for {what}:\n{self.logs()}")

    def run(self, argv: list[str], timeout: float, check: bool = True) -> str:
        """Runs a Slurm command against this cluster; its output."""
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{argv} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return done.stdout + done.stderr

    def logs(self) -> str:
        """The daemons' logs, for a failure's message."""
        parts = []
        for name in ("munged.out", "slurmctld.out", "slurmd.out", "ctld.log", "d.log"):
            path = self.folder / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text()[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancels every job, then stops the daemons by PID (SIGTERM, SIGKILL after 10 s)."""
        if self.procs:
            subprocess.run(
                ["scancel", "--full", "-u", "root"],
                env=self.env,
                capture_output=True,
                timeout=10,
                check=False,
            )
            time.sleep(1)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
