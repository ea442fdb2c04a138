"""``seawall up`` starts the embedded stack and leaves no process behind when stopped."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from seawall import embedded
from seawall.up import ServiceSpec, Stack, UpOptions
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


def test_a_service_whose_metrics_port_was_taken_is_restarted_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port ``up`` picked free was bound by another server before the service bound
    it (a parallel test stack did this in CI, and its pool served nothing): the service
    dies, is restarted on a port picked anew, and ``up`` waits for it before it reports
    the stack up."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        pick_free = embedded.free_port
        monkeypatch.setattr(embedded, "free_port", lambda: next(picks, None) or pick_free())
        stack = Stack(UpOptions(state_dir=tmp_path), Console(file=io.StringIO()))
        part = stack.launch(ServiceSpec("stand-in", "tests.metrics_only"), "stand-in")
        try:
            stack.wait_healthy(threading.Event(), timeout_s=60)
            assert part.process is not None
            assert part.process.restarts == 1
            assert stack.healthy(part)
            assert f":{taken}/" not in part.metrics_url
            assert "Address already in use" in part.process.tail(50)
        finally:
            stack.stop()
