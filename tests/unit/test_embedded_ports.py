"""The ports ``seawall up`` and the test stacks hand to servers that bind them a moment
later are picked outside the kernel's ephemeral range, where outgoing connections would
take them first."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from seawall import embedded


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    source = tmp_path / "ip_local_port_range"
    source.write_text("32768\t60999\n")
    assert embedded.ephemeral_ports(source) == range(32768, 61000)


def test_an_unreadable_range_is_unknown(tmp_path: Path) -> None:
    assert embedded.ephemeral_ports(tmp_path / "missing") is None
    garbled = tmp_path / "garbled"
    garbled.write_text("32768")
    assert embedded.ephemeral_ports(garbled) is None


def test_a_picked_port_is_outside_the_ephemeral_range_and_can_be_bound() -> None:
    ephemeral = range(20_000, 65_536)
    for _ in range(50):
        port = embedded.free_port(ephemeral=ephemeral)
        assert embedded.LOWEST_PICKED_PORT <= port < 20_000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_taken_by_a_server_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        held.listen()
        probe.bind(("127.0.0.1", 0))
        taken, free = held.getsockname()[1], probe.getsockname()[1]
        probe.close()
        draws = iter([taken, free])
        monkeypatch.setattr(embedded.random, "SystemRandom", lambda: _Draws(draws))
        assert embedded.free_port(ephemeral=range(0)) == free


class _Draws:
    """Stands in for the random source: the ports to try, in order."""

    def __init__(self, ports: Iterator[int]) -> None:
        self._ports = ports

    def randrange(self, start: int, stop: int) -> int:
        return next(self._ports)
