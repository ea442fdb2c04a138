"""Faults for the end-to-end tests: a TCP proxy that can make a server briefly
unreachable (connections dropped, new ones refused) without touching the server or the
state it keeps, and one that delays every byte by a random 100–500 ms."""

from __future__ import annotations

import contextlib
import queue
import random
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
            self._forward(src, dst)
        except OSError:
            pass
        finally:
            self._release(src, dst)

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        """Pass what ``src`` sends on to ``dst`` until it closes (subclasses look)."""
        while data := src.recv(65536):
            dst.sendall(data)

    def _release(self, src: socket.socket, dst: socket.socket) -> None:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._open -= {src, dst}


class DelayProxy(TcpProxy):
    """A ``TcpProxy`` that holds every chunk of data, in each direction, for a random
    delay in ``[low_s, high_s]`` before passing it on, keeping each direction's order
    (a chunk never overtakes the one before it: its delivery time is at least that one's).
    ``delayed`` counts the chunks it held."""

    def __init__(
        self, target_host: str, target_port: int, low_s: float = 0.1, high_s: float = 0.5
    ) -> None:
        super().__init__(target_host, target_port)
        self.low_s, self.high_s = low_s, high_s
        self._rng = random.Random()
        self._rng_lock = threading.Lock()
        self.delayed = 0

    def _delay(self) -> float:
        with self._rng_lock:
            self.delayed += 1
            return self._rng.uniform(self.low_s, self.high_s)

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        held: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
        sender = threading.Thread(target=self._send_later, args=(held, dst), daemon=True)
        sender.start()
        last_due = 0.0
        try:
            while data := src.recv(65536):
                last_due = max(last_due, time.monotonic() + self._delay())
                held.put((last_due, data))
        finally:  # what is held goes out before the sockets are shut
            held.put(None)
            sender.join()

    @staticmethod
    def _send_later(held: queue.Queue[tuple[float, bytes] | None], dst: socket.socket) -> None:
        while (item := held.get()) is not None:
            due, data = item
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                dst.sendall(data)
            except OSError:
                return
