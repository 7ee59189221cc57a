"""gloo's address: the one that routes to the coordinator, or the interface named; errors teach."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

import spmd
from spmd._src.clusters import gloo as cluster_gloo
from spmd._src.clusters.gloo import (
    ENV_GLOO_INTERFACE,
    check_interface,
    gloo_address,
    use_gloo_address,
)
from spmd._src.errors import ConfigurationError, InitializationError

from .support import clean_env


def test_loopback_coordinator_means_loopback():
    assert gloo_address("127.0.0.1:1234") == "127.0.0.1"
    assert gloo_address("localhost:1234") in ("127.0.0.1", "::1")


def test_an_address_of_this_machine_is_its_own():
    ip = socket.gethostbyname(socket.gethostname())
    assert gloo_address(f"{ip}:1234") == ip


def test_unresolvable_coordinator_fails_at_once_naming_hostname_and_fix(monkeypatch):
    def no_dns(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(cluster_gloo.socket, "getaddrinfo", no_dns)
    start = time.monotonic()
    with pytest.raises(InitializationError) as e:
        gloo_address("host0.example:2222")
    assert time.monotonic() - start < 5
    text = str(e.value)
    assert "host0.example:2222" in text and f"hostname={socket.gethostname()!r}" in text
    assert "interface=" in text and ENV_GLOO_INTERFACE in text


def test_interface_is_the_argument_else_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_GLOO_INTERFACE, raising=False)
    assert check_interface(None) is None
    assert check_interface("lo") == "lo"
    monkeypatch.setenv(ENV_GLOO_INTERFACE, "lo")
    assert check_interface(None) == "lo"


def test_unknown_interface_is_a_configuration_error_listing_the_real_ones(monkeypatch):
    with pytest.raises(ConfigurationError, match=r"interface='nope0'.*'lo'"):
        check_interface("nope0")
    monkeypatch.setenv(ENV_GLOO_INTERFACE, "nope0")
    with pytest.raises(ConfigurationError, match=ENV_GLOO_INTERFACE):
        spmd.initialize()


def test_initialize_checks_the_interface_before_anything_else():
    with pytest.raises(ConfigurationError, match="interfaces_here"):
        spmd.initialize(interface="nope0")


@pytest.fixture
def restore_gloo():
    from jax._src.lib import _jax

    original = _jax.make_gloo_tcp_collectives
    yield original
    _jax.make_gloo_tcp_collectives = original


def test_use_gloo_address_binds_jaxs_own_function_once(restore_gloo):
    from jax._src.lib import _jax

    use_gloo_address("10.200.0.1", None)
    use_gloo_address(None, "veth0")
    made = _jax.make_gloo_tcp_collectives
    assert made.func is restore_gloo and made.keywords == {"interface": "veth0"}
    use_gloo_address("10.200.0.2", None)
    made = _jax.make_gloo_tcp_collectives
    assert made.func is restore_gloo and made.keywords == {"hostname": "10.200.0.2"}


@pytest.mark.engines
def test_no_route_to_the_coordinator_fails_within_seconds(two_hosts):
    code = "from spmd._src.clusters.gloo import gloo_address; gloo_address('10.99.0.1:2222')"
    start = time.monotonic()
    done = subprocess.run(
        ["ip", "netns", "exec", two_hosts[0], sys.executable, "-c", code],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - start < 30
    assert done.returncode != 0 and "InitializationError" in done.stderr, done.stderr
    assert "10.99.0.1:2222" in done.stderr and "hostname=" in done.stderr
