"""Faults for the end-to-end tests: a TCP proxy that can make a server briefly
unreachable (connections dropped, new ones refused) without touching the server or the
state it keeps."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType
from typing import Self


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; ``cut(seconds)`` drops every open
    connection and closes new ones at once until the time is up."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._down_until = 0.0
        self._closed = False
        self.refused = 0
        """Connections closed at once because the proxy was cut."""
        self._acceptor = threading.Thread(target=self._accept, daemon=True)

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> Self:
        self._acceptor.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            # wakes the acceptor blocked in accept(); close() alone leaves it there
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join(timeout=5)
        self._drop_all()

    def cut(self, seconds: float) -> None:
        with self._lock:
            self._down_until = time.monotonic() + seconds
        self._drop_all()

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def _drop_all(self) -> None:
        with self._lock:
            sockets, self._open = self._open, set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down:
                self.refused += 1
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open -= {src, dst}
