"""Child processes that never outlive ``seawall up``.

Each child runs in its own process group, so a Ctrl-C in the terminal reaches only
``seawall up``, and gets ``PR_SET_PDEATHSIG`` (Linux): should ``seawall up`` itself be
killed with SIGKILL, the kernel sends the child SIGTERM. A normal stop sends SIGTERM,
waits for the grace period, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess:
    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                preexec_fn=_die_with_parent,
                # Its own process group: Ctrl-C in the terminal reaches only `seawall up`,
                # which then stops the children in order (services before the broker).
                process_group=0,
            )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, wait ``grace_s``, then SIGKILL; idempotent."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
