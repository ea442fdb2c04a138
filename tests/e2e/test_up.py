"""``seawall up`` starts the embedded stack and leaves no process behind when stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from seawall import embedded
from tests.stack import spawn_up, wait_up


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    port = embedded.free_port()
    proc = spawn_up("--broker-port", str(port), "--state-dir", str(tmp_path / "state"), *extra)
    return proc, port


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc, port = _start(
        tmp_path,
        "--redis",
        "embedded",
        "--redis-port",
        str(embedded.free_port()),
        "--workers",
        "1",
        "--small-workers",
        "0",
    )
    yield proc, port
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_up_then_stop_leaves_no_child(stack: tuple[subprocess.Popen[str], int], how: str) -> None:
    proc, port = stack
    banner = wait_up(proc, timeout_s=60)
    assert f"127.0.0.1:{port}" in banner
    assert "redis (private)" in banner
    assert "worker-main" in banner
    assert "healthy" in banner
    children = _descendants(proc.pid)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert "tansu" in names
    assert "redis-server" in names or "valkey-server" in names
    assert "services.workers" in names
    assert embedded.port_in_use("127.0.0.1", port)

    if how == "ctrl-c":  # the terminal sends SIGINT to the whole foreground group
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
    assert not embedded.port_in_use("127.0.0.1", port)


def test_a_taken_broker_port_is_reported_not_moved(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        argv = [
            sys.executable,
            "-m",
            "seawall.cli",
            "up",
            "--broker-port",
            str(taken),
            "--state-dir",
            str(tmp_path),
        ]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"127.0.0.1:{taken} is already taken" in out.stdout
