"""A prompt's token count and sensitive-data screening, off the event loop when long.

Ingress counts and screens every prompt before it publishes it (``IngressPipeline.
prepare``). For a short prompt that is tens of microseconds; for a 16 KiB one built to
make the screen work hardest, 2-3 ms of pure Python (bench/screen_bomb.py), during which
ingress's event loop answers no one: every other tenant's request waits behind it.
``Screener`` hands long prompts to worker processes instead (threads would hold the GIL
just the same), and screens short ones inline, where handing over would cost more than
the work.

A worker is ``python -m services.common.screening``: a fresh interpreter that imports
only the screen and the token counter (not the service, as multiprocessing's spawn would
by re-importing ``__main__``), reads length-prefixed pickled ``(texts, policy)`` frames
on its stdin and answers each with a pickled ``Analysis`` on its stdout, one at a time,
and exits when its stdin closes: with its service, however that ends (it ignores
SIGINT and SIGTERM, which are its service's to act on). A worker that
dies is replaced, and the prompt it held is screened inline: a prompt is always
screened, never passed unscreened. Pickle crosses only between the service and the
child it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from services.common.sensitive import Screening, SensitivePolicy, screen
from services.common.tokenizer import count_tokens

log = logging.getLogger(__name__)

_FRAME = struct.Struct(">I")
WORKER_SUFFIX = ".screen"
"""A worker's instance id is its owner's with this suffix (``SEAWALL_INSTANCE_ID``)."""
STOP_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Analysis:
    tokens: int
    """The prompt's tokens as sent (``count_tokens`` of each text, summed)."""
    screenings: tuple[Screening, ...]
    """Each text's screening, in order."""
    redacted_tokens: int
    """The tokens of the texts as forwarded, redacted (``tokens`` if nothing was)."""


def analyse(texts: Sequence[str], policy: SensitivePolicy) -> Analysis:
    """Count and screen ``texts`` under a tenant's ``policy``: the work itself, the same
    inline or in a worker."""
    tokens = sum(count_tokens(t) for t in texts)
    screenings = tuple(screen(t, policy) for t in texts)
    redacted = tokens
    if any(sc.text != t for sc, t in zip(screenings, texts, strict=True)):
        redacted = sum(count_tokens(sc.text) for sc in screenings)
    return Analysis(tokens, screenings, redacted)


class _Worker:
    """One worker process and the exchange in flight with it (one at a time)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lock = asyncio.Lock()

    @classmethod
    async def start(cls, owner: str) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.common.screening",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            # Named as its owner's worker, not as its owner: whatever finds a service's
            # process by its instance id (`seawall up`'s tools, the tests) finds the service.
            env={**os.environ, "SEAWALL_INSTANCE_ID": owner + WORKER_SUFFIX},
        )
        worker = cls(proc)
        await worker.call(("warm 4111 1111 1111 1111 pwd: x",), "redact")  # imports, compiles
        return worker

    async def call(self, texts: Sequence[str], policy: SensitivePolicy) -> Analysis:
        payload = pickle.dumps((tuple(texts), policy), protocol=pickle.HIGHEST_PROTOCOL)
        # Shielded, the lock held inside: a caller that gives up leaves the exchange to
        # finish, so no answer is left in the pipe for the next caller to read as its own.
        return await asyncio.shield(self._exchange(payload))

    async def _exchange(self, payload: bytes) -> Analysis:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None
        assert stdout is not None
        async with self.lock:
            stdin.write(_FRAME.pack(len(payload)) + payload)
            await stdin.drain()
            (size,) = _FRAME.unpack(await stdout.readexactly(_FRAME.size))
            answer = pickle.loads(await stdout.readexactly(size))
        assert isinstance(answer, Analysis)
        return answer

    async def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


class Screener:
    """``analyse`` inline for prompts under ``offload_chars`` characters in all; in one of
    ``workers`` processes for longer ones once started (``workers`` 0, not started, or
    closed: always inline). The workers' instance id is ``<owner>.screen``."""

    def __init__(self, workers: int, offload_chars: int, owner: str = "service") -> None:
        self._owner = owner
        self._size = workers
        self._offload_chars = offload_chars
        self._workers: list[_Worker] = []
        self._next = 0
        self._respawning: set[asyncio.Task[None]] = set()
        self.replaced = 0
        """Workers replaced after dying."""
        self.offloaded = 0
        """Prompts a worker screened."""

    async def start(self) -> None:
        """Start the workers; each has screened once when this returns."""
        starting = (_Worker.start(self._owner) for _ in range(self._size))
        self._workers = list(await asyncio.gather(*starting))

    async def analyse(self, texts: Sequence[str], policy: SensitivePolicy) -> Analysis:
        if not self._workers or sum(map(len, texts)) < self._offload_chars:
            return analyse(texts, policy)
        worker = self._pick()
        try:
            answer = await worker.call(texts, policy)
        except (asyncio.IncompleteReadError, ConnectionError, pickle.UnpicklingError) as e:
            self._replace(worker, e)
            return analyse(texts, policy)
        self.offloaded += 1
        return answer

    def _pick(self) -> _Worker:
        """An idle worker if there is one, else the next in turn."""
        for w in self._workers:
            if not w.lock.locked():
                return w
        self._next = (self._next + 1) % len(self._workers)
        return self._workers[self._next]

    def _replace(self, worker: _Worker, error: BaseException) -> None:
        if worker not in self._workers:
            return  # another caller saw it die first
        log.warning("a screening worker died: replacing it", extra={"error": repr(error)})
        self._workers.remove(worker)
        self.replaced += 1
        with contextlib.suppress(ProcessLookupError):
            worker.proc.kill()

        async def respawn() -> None:
            try:
                new = await _Worker.start(self._owner)
            except (OSError, asyncio.IncompleteReadError) as e:
                log.error("a screening worker did not start", extra={"error": repr(e)})
                return
            if self._size:  # not closed meanwhile
                self._workers.append(new)
            else:
                await new.stop()

        task = asyncio.get_running_loop().create_task(respawn())
        self._respawning.add(task)
        task.add_done_callback(self._respawning.discard)

    async def close(self) -> None:
        """Stop the workers; idempotent. Later prompts are screened inline."""
        self._size = 0
        workers, self._workers = self._workers, []
        await asyncio.gather(*(w.stop() for w in workers))


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """A worker's loop: a frame in, an ``Analysis`` out, until stdin closes."""
    while head := stdin.read(_FRAME.size):
        if len(head) < _FRAME.size:
            return
        (size,) = _FRAME.unpack(head)
        texts, policy = pickle.loads(stdin.read(size))
        answer = pickle.dumps(analyse(texts, policy), protocol=pickle.HIGHEST_PROTOCOL)
        stdout.write(_FRAME.pack(len(answer)) + answer)
        stdout.flush()


if __name__ == "__main__":
    # A terminal's Ctrl-C or a SIGTERM to the process group is the service's to handle:
    # the worker goes when the service closes its stdin, after the service's drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # From the module by its name, not this ``__main__`` copy: the answers' class must
    # unpickle as ``services.common.screening.Analysis`` in the service.
    from services.common import screening

    with contextlib.suppress(BrokenPipeError):
        screening._serve(sys.stdin.buffer, sys.stdout.buffer)
