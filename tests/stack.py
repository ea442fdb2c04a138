"""``seawall up`` as a user runs it, for the end-to-end tests and the fault benchmark:
every service its own process. ``launch`` starts one on free ports with a fresh topic
and Redis prefix and stops it with SIGTERM, which must leave no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import psutil

from seawall import embedded
from services.common.bus import wait_for_broker
from services.common.settings import CommonSettings
from tests.faults import DelayProxy, TcpProxy


class StackDidNotStart(RuntimeError):
    """``seawall up`` did not say it was up in time (what it printed is the message)."""


@dataclass(frozen=True)
class Stack:
    proc: subprocess.Popen[str]
    url: str
    env: dict[str, str]
    """The environment of commands run beside the stack (``seawall keys``, ...)."""
    settings: CommonSettings

    def cli(
        self, *args: str, timeout_s: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A ``seawall`` command beside the stack (``env``: more of its environment)."""
        return subprocess.run(
            [sys.executable, "-m", "seawall.cli", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        )

    def key(self, tenant: str, tier: str, env: dict[str, str] | None = None) -> dict[str, str]:
        out = self.cli("keys", "create", "--tenant", tenant, "--tier", tier, "--json", env=env)
        doc: dict[str, str] = json.loads(out.stdout)
        return doc

    def metrics_url(self, instance: str) -> str:
        """Where one service instance serves ``/metrics`` (its own port, set by ``up``)."""
        port = self.service(instance).environ()["SEAWALL_METRICS_PORT"]
        return f"http://127.0.0.1:{port}/metrics"

    def service(self, instance: str) -> psutil.Process:
        """The running process of one service instance (``admission``, ``worker-main-0``)."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if child.environ().get("SEAWALL_INSTANCE_ID") == instance:
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        raise LookupError(f"no running {instance}")


def clean_env() -> dict[str, str]:
    """This environment without any ``SEAWALL_`` setting of the developer's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SEAWALL_")}


def spawn_up(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``seawall up ARGS`` in its own session (so a test can signal its whole group)."""
    return subprocess.Popen(
        [sys.executable, "-m", "seawall.cli", "up", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env() if env is None else env,
        start_new_session=True,
    )


def wait_up(proc: subprocess.Popen[str], timeout_s: float = 150) -> str:
    """What ``seawall up`` printed until it said it is up; fails the test (and kills the
    stack) if it does not within ``timeout_s``."""
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        seen.append(line)
        if "seawall is up" in line:
            return "".join(seen)
        if time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    raise StackDidNotStart("the stack did not come up:\n" + "".join(seen))


LOG_TAIL_LINES = 15
LOG_WARNINGS = 30


def print_log_tails(logs: Path) -> None:
    """Each service's last warnings and errors and its last lines, printed for the
    failure report: a test that fails only on a loaded CI machine is diagnosed from
    what the services said."""
    for log in sorted(logs.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        warnings = [x for x in lines if "level=WARNING" in x or "level=ERROR" in x]
        print(f"--- {log.name}: last warnings and errors ---", *warnings[-LOG_WARNINGS:], sep="\n")
        print(f"--- {log.name}: last lines ---", *lines[-LOG_TAIL_LINES:], sep="\n")


@contextmanager
def launch(
    state: Path, redis_url: str, *extra: str, env: dict[str, str] | None = None
) -> Iterator[Stack]:
    """``seawall up`` on a free broker and ingress port, a fresh topic and Redis prefix;
    ``extra`` are more ``up`` options, ``env`` more environment (``SEAWALL_*`` settings
    every service reads). Stopped with SIGTERM, which must leave no process."""
    ingress_port = embedded.free_port()
    prefix = f"e2e{uuid.uuid4().hex[:6]}."
    env = {**clean_env(), **(env or {})}
    env["SEAWALL_ENV_FILE"] = str(state / "stack.env")
    env["SEAWALL_REDIS_PREFIX"] = f"test:{prefix}"
    proc = spawn_up(
        "--broker-port",
        str(embedded.free_port()),
        "--ingress-port",
        str(ingress_port),
        "--redis",
        redis_url,
        "--topic-prefix",
        prefix,
        "--state-dir",
        str(state),
        *extra,
        env=env,
    )
    wait_up(proc)
    settings = CommonSettings(_env_file=str(state / "stack.env"))
    stack = Stack(proc, f"http://127.0.0.1:{ingress_port}", env, settings)
    try:
        yield stack
    except BaseException:
        print_log_tails(state / "logs")
        raise
    finally:
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=90) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], "seawall up left processes behind"


P = TypeVar("P", bound=TcpProxy)


@asynccontextmanager
async def behind_proxy(
    work: Path,
    redis_url: str,
    make_proxy: Callable[[int], P],
    *extra: str,
    env: dict[str, str] | None = None,
) -> AsyncIterator[tuple[Stack, P]]:
    """``seawall up`` on its own embedded broker with a proxy in front of it
    (``make_proxy(broker_port)``): the broker advertises the proxy as its address, so
    every connection of every service (and of the test's clients) passes it. ``env``:
    more of ``launch``'s environment."""
    broker_port = embedded.free_port()
    with make_proxy(broker_port) as proxy:
        bootstrap = f"127.0.0.1:{proxy.port}"
        broker = embedded.broker_process(
            "127.0.0.1", broker_port, work / "broker.log", advertised=bootstrap
        )
        broker.start()
        try:
            await wait_for_broker(bootstrap)
            env = {
                "SEAWALL_KAFKA_BOOTSTRAP": bootstrap,
                "SEAWALL_KAFKA_IDEMPOTENCE": "false",
                **(env or {}),
            }
            with launch(work / "stack", redis_url, *extra, env=env) as stack:
                yield stack, proxy
        finally:
            broker.stop()


@asynccontextmanager
async def behind_delay(
    work: Path, redis_url: str, *extra: str
) -> AsyncIterator[tuple[Stack, DelayProxy]]:
    """``behind_proxy`` with a ``DelayProxy``, starting with no delay; set its
    ``low_s``/``high_s`` to delay."""
    proxy = partial(DelayProxy, "127.0.0.1", low_s=0.0, high_s=0.0)
    async with behind_proxy(work, redis_url, proxy, *extra) as (stack, delay):
        yield stack, delay
