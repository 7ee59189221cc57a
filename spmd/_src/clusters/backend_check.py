"""Whether JAX's backends start here, asked of a child process: one clear error, not XLA's output.

A malformed XLA_FLAGS makes XLA end the process with a fatal log line, and a
JAX_PLATFORMS naming a platform this machine lacks raises a long chained
traceback after the platform library's own log lines. `spmd env` asks a child
process to start the backends first and, if it cannot, says why in one message.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from spmd._src.errors import ConfigurationError, message, received

__all__ = ["check_backends_start", "check_device_count"]

_PROBE = "import jax; jax.devices()"
_PROBE_TIMEOUT = 300.0  # seconds: a GPU or TPU backend can take a while to start
_UNKNOWN_FLAG = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.*)")
_BAD_VALUE = re.compile(r"Couldn't interpret value (.*) for flag (\w+)\.")
_DEVICE_COUNT = "xla_force_host_platform_device_count"
_FLAG = re.compile(r"--(\w+)=(\S*)")


def _last_error(stderr: str) -> str:
    """The last "SomeError: text" line of a Python traceback, or the last line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if _EXCEPTION.match(line)]
    return (errors or lines or ["(no output)"])[-1][:400]


def check_device_count(flags: str) -> None:
    """Raises unless XLA_FLAGS' simulated CPU device count, where given, is a positive integer.

    XLA reads it when the CPU backend starts: "abc" ends the process after its
    whole usage text, 0 and negative counts fail with messages that do not name it.

    Raises:
      ConfigurationError: naming the flag, its value and the fix.
    """
    for name, value in _FLAG.findall(flags):
        if name == _DEVICE_COUNT and not (value.isdigit() and int(value) > 0):
            raise ConfigurationError(
                message(
                    f"XLA_FLAGS' --{_DEVICE_COUNT} is the number of simulated CPU devices: "
                    "a positive integer.",
                    received(XLA_FLAGS=flags, flag=f"--{_DEVICE_COUNT}", value=value),
                    f"set e.g. XLA_FLAGS=--{_DEVICE_COUNT}=8, or remove the flag (one CPU "
                    "device); spmd launch --devices-per-process 8 sets it for each process.",
                )
            )


def check_backends_start(env: dict[str, str] | None = None) -> None:
    """Raises ConfigurationError if JAX's backends cannot start with this environment.

    Only asks (a child process, a few seconds) when XLA_FLAGS or JAX_PLATFORMS is set.

    Raises:
      ConfigurationError: naming the unknown XLA flag, or the platform that cannot start.
    """
    env = dict(os.environ if env is None else env)
    flags, platforms = env.get("XLA_FLAGS", ""), env.get("JAX_PLATFORMS", "")
    if not flags.strip() and not platforms.strip():
        return
    check_device_count(flags)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return  # slow, not broken: the real start reports whatever it is
    if done.returncode == 0:
        return
    unknown = _UNKNOWN_FLAG.search(done.stderr)
    if unknown is not None:
        raise ConfigurationError(
            message(
                "XLA_FLAGS must hold only flags this XLA knows, each as --name=value.",
                received(XLA_FLAGS=flags, unknown=unknown[1].strip()),
                f"remove {unknown[1].strip()} from XLA_FLAGS or correct its spelling "
                "(XLA's flags: https://openxla.org/xla/flags_guidance).",
            )
        )
    bad = _BAD_VALUE.search(done.stderr)
    if bad is not None:
        flag, value = bad[2], bad[1]
        raise ConfigurationError(
            message(
                f"XLA_FLAGS' --{flag} takes a value of its type.",
                received(XLA_FLAGS=flags, flag=f"--{flag}", value=value),
                f"correct the value of --{flag} in XLA_FLAGS, or remove the flag "
                "(XLA's flags: https://openxla.org/xla/flags_guidance).",
            )
        )
    error = _last_error(done.stderr)
    if platforms.strip():
        raise ConfigurationError(
            message(
                f"JAX_PLATFORMS={platforms} names the platforms JAX must start, and this "
                "machine cannot start them.",
                received(JAX_PLATFORMS=platforms, error=error),
                "unset JAX_PLATFORMS (JAX then picks what this machine has), or name one it "
                "has, e.g. JAX_PLATFORMS=cpu.",
            )
        )
    raise ConfigurationError(
        message(
            "JAX's backends must start with this environment's XLA_FLAGS.",
            received(XLA_FLAGS=flags, error=error),
            "check each flag in XLA_FLAGS, or unset it to see whether it is the cause.",
        )
    )
