"""Where gloo listens: an address of this machine that the other processes can reach.

JAX's gloo collectives advertise the address of this machine's hostname unless
told otherwise. On many machines (cloud images, containers) the hostname
resolves to 127.0.0.1, which no other host can reach: a multi-host CPU job then
fails ("Gloo context initialization failed ... remote=[127.0.0.1]") or hangs
until the heartbeat timeout. spmd instead gives gloo the local address that
routes to the coordinator, or the interface the user names.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket

from spmd._src.errors import ConfigurationError, InitializationError, message, received

__all__ = ["ENV_GLOO_INTERFACE", "check_interface", "gloo_address", "use_gloo_address"]

ENV_GLOO_INTERFACE = "SPMD_GLOO_INTERFACE"  # the network interface gloo uses, e.g. "eth0"


def check_interface(interface: str | None) -> str | None:
    """The interface gloo must use: the argument, else SPMD_GLOO_INTERFACE, else None.

    Raises:
      ConfigurationError: if this machine has no interface of that name.
    """
    name = interface if interface is not None else os.environ.get(ENV_GLOO_INTERFACE) or None
    if name is None:
        return None
    try:
        socket.if_nametoindex(name)
    except (OSError, ValueError):
        have = sorted(n for _, n in socket.if_nameindex())
        raise ConfigurationError(
            message(
                "gloo's network interface must be one of this machine's interfaces.",
                received(interface=name, interfaces_here=have),
                f"give one of {have} (interface= or {ENV_GLOO_INTERFACE}), the one whose "
                "address the other hosts reach; or leave both unset to use the address "
                "that routes to the coordinator.",
            )
        ) from None
    return name


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def _hostname_addresses() -> list[str]:
    """The addresses this machine's hostname resolves to (what gloo would use by itself)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return sorted({info[4][0] for info in infos})


def gloo_address(coordinator: str) -> str:
    """The address of this machine from which the coordinator (`host:port`) is reached.

    For a loopback coordinator, every process is on this machine: 127.0.0.1.
    Otherwise the kernel's route to the coordinator picks the local address
    (a UDP socket's `connect` sends nothing); the other hosts reach this one
    there as they reach the coordinator.

    Raises:
      InitializationError: within seconds, if the coordinator's host does not
        resolve or no route leads to it, naming this hostname, its addresses
        and the fix.
    """
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")
    try:
        info = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
        if _is_loopback(info[4][0]):
            return "::1" if info[0] == socket.AF_INET6 else "127.0.0.1"
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return s.getsockname()[0]
    except (OSError, ValueError, UnicodeError) as e:
        raise InitializationError(
            message(
                "gloo (the CPU collectives) needs an address of this machine that the other "
                "processes reach; spmd takes the one that routes to the coordinator, and "
                "found none.",
                received(
                    coordinator_address=coordinator,
                    hostname=socket.gethostname(),
                    hostname_addresses=_hostname_addresses(),
                    error=str(e),
                ),
                "make the coordinator's host resolvable and routable from this machine, or "
                f"name the interface the hosts share: spmd.initialize(interface='eth0') or "
                f"{ENV_GLOO_INTERFACE}=eth0.",
            )
        ) from None


def use_gloo_address(hostname: str | None, interface: str | None) -> None:
    """Makes JAX's gloo collectives listen at `hostname`, or on `interface`.

    JAX creates them when it starts the CPU backend, with neither argument;
    this fills them in. The wrapper is JAX's own function with keywords bound.
    """
    from jax._src.lib import _jax  # private: JAX gives no other way to pass them

    make = getattr(_jax, "make_gloo_tcp_collectives", None)
    if make is None:
        return
    make = getattr(make, "spmd_original", make)
    bound = {"interface": interface} if interface else {"hostname": hostname}
    wrapper = functools.partial(make, **bound)
    wrapper.spmd_original = make  # type: ignore[attr-defined]
    _jax.make_gloo_tcp_collectives = wrapper
