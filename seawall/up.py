"""``seawall up``: the whole stack on embedded defaults, one OS process per part.

Order: broker, Redis, topics, then the services. It shows what listens where and
each process's state, restarts a crashed service (crash-only services, with backoff),
says when the embedded broker has filled up enough to slow the stack
(``seawall.broker_fill``), and on Ctrl-C or SIGTERM stops everything in reverse order,
leaving no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx
from aiokafka.errors import KafkaError
from rich.console import Console
from rich.table import Table

from seawall import broker_fill, embedded
from seawall.procs import ChildProcess
from seawall_client.kafka import KafkaConfig, ensure_topics
from seawall_client.topics import Topics
from services.common.bus import wait_for_broker
from services.common.secret_files import make_hex_secret
from services.common.settings import CommonSettings

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
STARTUP_RESTARTS = 2
"""Restarts ``seawall up`` waits through before it reports the stack up without a
service that keeps dying (a bad setting, not a passing clash)."""


@dataclass(frozen=True)
class ServiceSpec:
    """A service run as ``python -m <module>``, ``count`` processes."""

    name: str
    module: str
    count: int = 1
    env: dict[str, str] = field(default_factory=dict)
    listens: int | None = None
    """A port it serves on 127.0.0.1 (checked free before start, shown in the table)."""


DEDICATED_POOL = "main-dedicated"
"""The enterprise tier's dedicated pool in ``seawall up``: the main pool's model, on
workers of its own (DESIGN: enterprise gets dedicated capacity)."""


def fleet_env(enterprise_workers: int) -> dict[str, str]:
    """The settings every service of the stack shares about its pools."""
    if not enterprise_workers:
        return {}
    return {
        "SEAWALL_POOLS": f"main,small,{DEDICATED_POOL}",
        "SEAWALL_ENTERPRISE_POOLS": json.dumps({"main": DEDICATED_POOL}),
    }


def default_services(
    workers: int,
    small_workers: int,
    ingress_port: int = 8080,
    canary: Mapping[str, str] | None = None,
    canary_workers: int = 0,
    enterprise_workers: int = 0,
) -> tuple[ServiceSpec, ...]:
    """The services that exist so far, with their process counts: ``enterprise_workers``
    serve the dedicated pool (``fleet_env`` names it); with ``canary``
    (``SEAWALL_CANARY_VERSION`` and any other setting of its workers), also
    ``canary_workers`` workers of that canary release of the main pool, for
    ``seawall canary start --pool main``."""
    canaries = (
        (
            ServiceSpec(
                "worker-canary",
                "services.workers",
                canary_workers,
                {"SEAWALL_POOL": "main", **canary},
            ),
        )
        if canary and canary_workers
        else ()
    )
    return (
        ServiceSpec(
            "ingress",
            "services.ingress",
            1,
            {"SEAWALL_INGRESS_PORT": str(ingress_port)},
            listens=ingress_port,
        ),
        ServiceSpec("admission", "services.admission", 1),
        # Every simulated worker shares this machine: its CPU says nothing about one.
        ServiceSpec(
            "controller", "services.controller", 1, {"SEAWALL_CONTROLLER_HOST_CPU_BREAKER": "false"}
        ),
        ServiceSpec("worker-main", "services.workers", workers, {"SEAWALL_POOL": "main"}),
        ServiceSpec(
            "worker-small",
            "services.workers",
            small_workers,
            {"SEAWALL_POOL": "small", "SEAWALL_SIM_MODEL": "llama-3.2-1b"},
        ),
        ServiceSpec(
            "worker-dedicated",
            "services.workers",
            enterprise_workers,
            {"SEAWALL_POOL": DEDICATED_POOL},
        ),
        *canaries,
    )


@dataclass
class UpOptions:
    kafka_bootstrap: str | None = None
    broker_host: str = "127.0.0.1"
    broker_port: int = 9092
    redis: str = "auto"
    """``auto`` (see ``seawall.embedded``), ``embedded`` (always a private server), or a URL."""
    redis_port: int = 6379
    topic_prefix: str = ""
    partitions: int = 3
    services: tuple[ServiceSpec, ...] = ()
    state_dir: Path = Path(".seawall")
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Part:
    name: str
    address: str
    process: ChildProcess | None = None
    """``None``: not ours (an external broker or Redis)."""
    metrics_url: str = ""
    next_restart: float = 0.0
    listens: int | None = None
    """The port a service serves on, besides its metrics (``ServiceSpec.listens``)."""


class Stack:
    def __init__(self, options: UpOptions, console: Console) -> None:
        self.options = options
        self.console = console
        self.infra: list[Part] = []
        self.services: list[Part] = []
        self.bootstrap = ""
        self.redis_url = ""
        self._pepper_file: Path | None = None
        self._control_keys: Path | None = None
        self._sampling_secret: Path | None = None
        self.fill_alarm = broker_fill.FillAlarm()
        self._next_fill_check = 0.0

    # -- start ---------------------------------------------------------------
    def start(self) -> None:
        self._start_broker()
        self._start_redis()
        o = self.options
        pools = o.env.get("SEAWALL_POOLS", "main,small").split(",")
        topics = Topics(o.topic_prefix, o.partitions, tuple(pools))
        # An external cluster's replication as its services will ask for it (whoever
        # starts first creates the topics); the embedded broker is one node.
        replication = int(os.environ.get("SEAWALL_TOPIC_REPLICATION", "1"))
        created = asyncio.run(ensure_topics(self.broker_config(), topics.specs(), replication))
        if created:
            self.console.print(f"created {len(created)} topics")
        self._pepper_file = self._ensure_pepper()
        self._control_keys = self._ensure_control_keys()
        self._sampling_secret = self._ensure_sampling_secret()
        self._write_stack_env()
        for spec in o.services:
            if spec.listens is not None and embedded.port_in_use("127.0.0.1", spec.listens):
                raise embedded.StackError(
                    f"127.0.0.1:{spec.listens} is already taken, so {spec.name} cannot "
                    "listen there; stop what listens there or choose another port."
                )
        for spec in o.services:
            for i in range(spec.count):
                self.launch(spec, f"{spec.name}-{i}" if spec.count > 1 else spec.name)

    def launch(self, spec: ServiceSpec, name: str) -> Part:
        """Start one process of ``spec`` as the service ``name``."""
        env = {**self.child_env(name), **spec.env}
        proc = ChildProcess(name, [sys.executable, "-m", spec.module], self._log(name), env)
        part = Part(name, "", proc, listens=spec.listens)
        self._start(part)
        self.services.append(part)
        return part

    @staticmethod
    def _start(part: Part) -> None:
        """Start or restart ``part``'s process on a metrics port picked now. A port
        free when picked can be bound by another server before the child binds it (the
        other stacks of a test run share the machine); a crash on the taken port then
        heals on the restart, where reusing the port would fail the same way forever."""
        assert part.process is not None
        assert part.process.env is not None
        port = embedded.free_port()
        part.process.env["SEAWALL_METRICS_PORT"] = str(port)
        part.metrics_url = f"http://127.0.0.1:{port}/metrics"
        part.address = (
            part.metrics_url
            if part.listens is None
            else f"http://127.0.0.1:{part.listens} (metrics :{port})"
        )
        part.process.start()

    def _log(self, name: str) -> Path:
        return self.options.state_dir / "logs" / f"{name}.log"

    def _start_broker(self) -> None:
        o = self.options
        if o.kafka_bootstrap:
            self.bootstrap = o.kafka_bootstrap
            asyncio.run(wait_for_broker(self.broker_config(), timeout_s=15))
            self.infra.append(Part("broker (external)", self.bootstrap))
            return
        proc = embedded.broker_process(o.broker_host, o.broker_port, self._log("broker"))
        proc.start()
        self.bootstrap = f"{o.broker_host}:{o.broker_port}"
        self.infra.append(Part("broker (embedded Tansu)", self.bootstrap, proc))
        deadline = time.monotonic() + 30
        while not embedded.port_in_use(o.broker_host, o.broker_port):
            if time.monotonic() > deadline or not proc.alive:
                raise embedded.StackError(f"the embedded broker did not start:\n{proc.tail()}")
            time.sleep(0.05)
        try:
            asyncio.run(wait_for_broker(self.bootstrap, timeout_s=30))
        except TimeoutError as e:
            raise embedded.StackError(f"the embedded broker did not start:\n{proc.tail()}") from e

    def broker_config(self) -> KafkaConfig:
        """How this process reaches the broker: the embedded one in plaintext (it serves
        neither TLS nor SASL logins: SECURITY.md); an external one as its services will,
        with the ``SEAWALL_KAFKA_*`` security settings of this environment, which they
        inherit."""
        if self.options.kafka_bootstrap is None:
            return KafkaConfig(bootstrap=self.bootstrap)
        return KafkaConfig.from_env({**os.environ, "SEAWALL_KAFKA_BOOTSTRAP": self.bootstrap})

    def _start_redis(self) -> None:
        o = self.options
        mode = o.redis
        if mode not in ("auto", "embedded"):
            if not embedded.redis_answers(mode):
                raise embedded.StackError(f"no Redis answers at {mode}")
            self.redis_url = mode
            self.infra.append(Part("redis (external)", mode))
            return
        local = embedded.redis_url_for("127.0.0.1", o.redis_port)
        if mode == "auto" and embedded.redis_answers(local):
            self.redis_url = local
            self.infra.append(Part("redis (local, shared)", local))
            return
        proc = embedded.redis_process(
            "127.0.0.1", o.redis_port, o.state_dir / "redis", self._log("redis")
        )
        proc.start()
        self.redis_url = local
        self.infra.append(Part("redis (private)", local, proc))
        deadline = time.monotonic() + 10
        while not embedded.redis_answers(local, timeout_s=0.5):
            if time.monotonic() > deadline or not proc.alive:
                raise embedded.StackError(f"Redis did not start:\n{proc.tail()}")
            time.sleep(0.1)

    def _ensure_pepper(self) -> Path | None:
        """The key pepper of this state directory, made (random, owner-only) the first
        time; ``None`` when the environment brings its own."""
        if os.environ.get("SEAWALL_KEY_PEPPER") or os.environ.get("SEAWALL_KEY_PEPPER_FILE"):
            return None
        path = (self.options.state_dir / "pepper").resolve()
        if make_hex_secret(path):
            self.console.print(f"made a key pepper in {path}: keep it with the stack's Redis")
        return path

    def _ensure_control_keys(self) -> Path | None:
        """The control topic's signing keys (``services.common.control_signing``) in
        this state directory, made the first time: the controller's, the workers' and
        one operator's (this login's); ``None`` when the environment brings its own or
        turns signatures off."""
        if os.environ.get("SEAWALL_CONTROL_KEYS_DIR") or (
            os.environ.get("SEAWALL_CONTROL_SIGNATURES", "").strip().lower() == "off"
        ):
            return None
        from seawall.steer import operator
        from services.common.control_signing import ensure_keys

        path = (self.options.state_dir / "control-keys").resolve()
        ensure_keys(path, operator())
        return path

    def _ensure_sampling_secret(self) -> Path | None:
        """The fleet's sampling secret (``services.common.sampling``: the key of the
        canary split's and the shadow sample's hashes) in this state directory, made
        (random, owner-only) the first time; ``None`` when the environment brings its
        own. One file for every admission and worker process, which must decide alike."""
        if os.environ.get("SEAWALL_SAMPLING_SECRET_FILE"):
            return None
        from services.common.sampling import make_secret

        path = (self.options.state_dir / "sampling_secret").resolve()
        make_secret(path)
        return path

    @property
    def stack_env_path(self) -> Path:
        return self.options.state_dir / "stack.env"

    def _write_stack_env(self) -> None:
        """How to reach this stack, for commands and clients run beside it (see
        ``seawall_client.kafka.STACK_ENV_FILE``)."""
        shared = {k: v for k, v in self.child_env("cli").items() if k.startswith("SEAWALL_")}
        shared.pop("SEAWALL_INSTANCE_ID")
        self.options.state_dir.mkdir(parents=True, exist_ok=True)
        # Owner-only from its first byte: it names the stack's Redis and broker (and any
        # credentials they take), which no other user of the machine should read.
        fd = os.open(self.stack_env_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "w") as out:
            out.write("".join(f"{k}={v}\n" for k, v in shared.items()))

    def child_env(self, name: str) -> dict[str, str]:
        o = self.options
        env = {
            "SEAWALL_KAFKA_BOOTSTRAP": self.bootstrap,
            # The embedded broker has no InitProducerId (DESIGN, Platform facts); an
            # external one has, unless SEAWALL_KAFKA_IDEMPOTENCE says otherwise.
            "SEAWALL_KAFKA_IDEMPOTENCE": "false"
            if o.kafka_bootstrap is None
            else os.environ.get("SEAWALL_KAFKA_IDEMPOTENCE", "true"),
            "SEAWALL_REDIS_URL": self.redis_url,
            "SEAWALL_TOPIC_PREFIX": o.topic_prefix,
            "SEAWALL_TOPIC_PARTITIONS": str(o.partitions),
            "SEAWALL_INSTANCE_ID": name,
            "PYTHONUNBUFFERED": "1",
        }
        if o.kafka_bootstrap is None:
            env["SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS"] = os.environ.get(
                "SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS", str(embedded.FETCH_BUSY_WAIT_MS)
            )
            # The embedded broker answers a waiting fetch late: producers ring, readers
            # sleep between rings (services.common.doorbell).
            env["SEAWALL_KAFKA_DOORBELL"] = os.environ.get("SEAWALL_KAFKA_DOORBELL", "true")
            env["SEAWALL_CONTROLLER_FETCH_MAX_WAIT_MS"] = os.environ.get(
                "SEAWALL_CONTROLLER_FETCH_MAX_WAIT_MS", str(embedded.CONTROLLER_FETCH_WAIT_MS)
            )
        if self._pepper_file is not None:
            env["SEAWALL_KEY_PEPPER_FILE"] = str(self._pepper_file)
        if self._control_keys is not None:
            env["SEAWALL_CONTROL_KEYS_DIR"] = str(self._control_keys)
        if self._sampling_secret is not None:
            env["SEAWALL_SAMPLING_SECRET_FILE"] = str(self._sampling_secret)
        # Every request's stages, for `seawall trace` and `seawall load` (blank: none).
        env["SEAWALL_TRACE_DIR"] = os.environ.get(
            "SEAWALL_TRACE_DIR", str((o.state_dir / "traces").resolve())
        )
        env.update(o.env)
        return env

    # -- run -----------------------------------------------------------------
    def supervise(self) -> None:
        """Restart crashed services with backoff; a dead broker or Redis ends the stack
        (their state was in memory: carrying on would hide the loss)."""
        for part in self.infra:
            dead = part.process
            if dead is not None and not dead.alive:
                raise embedded.StackError(
                    f"{part.name} exited with code {dead.returncode}:\n{dead.tail()}"
                )
        now = time.monotonic()
        for part in self.services:
            proc = part.process
            assert proc is not None
            if proc.alive:
                continue
            if part.next_restart == 0.0:
                delay = RESTART_BACKOFF_S[min(proc.restarts, len(RESTART_BACKOFF_S) - 1)]
                part.next_restart = now + delay
                self.console.print(
                    f"[yellow]{part.name} exited with code {proc.returncode}; "
                    f"restarting in {delay:.0f}s[/]"
                )
            elif now >= part.next_restart:
                proc.restarts += 1
                part.next_restart = 0.0
                self._start(part)

    def check_fill(self) -> None:
        """On the embedded broker, at once and then once a ``broker_fill.CHECK_INTERVAL_S``:
        say so when the records it holds passed the alarm's next threshold. A broker
        that does not answer in time is asked again next time (one that died ends the
        stack in ``supervise``); settings the environment makes invalid skip the check
        (the services say what is wrong with them)."""
        now = time.monotonic()
        if self.options.kafka_bootstrap is not None or now < self._next_fill_check:
            return
        self._next_fill_check = now + broker_fill.CHECK_INTERVAL_S
        try:
            settings = CommonSettings(_env_file=None, kafka_bootstrap=self.bootstrap)
            found = asyncio.run(broker_fill.read_fill(settings))
        except (KafkaError, OSError, TimeoutError, ValueError):  # ValueError: bad settings
            return
        if found is not None and self.fill_alarm.passed(found.records):
            self.console.print(f"[yellow]{broker_fill.warning(found)}[/]", highlight=False)

    def wait_healthy(self, stop: threading.Event, timeout_s: float = 90.0) -> None:
        """Wait until every service answers on its metrics endpoint, a stop is
        requested, or ``timeout_s`` has passed. A service that dies meanwhile is
        restarted as ``supervise`` would, so the stack reported up is one whose services
        serve; one still dying after ``STARTUP_RESTARTS`` restarts is not waited for
        (the table shows it exited)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.supervise()
            if all(self.healthy(p) or self._given_up(p) for p in self.services):
                return
            if stop.wait(0.2):
                return

    @staticmethod
    def _given_up(part: Part) -> bool:
        assert part.process is not None
        return not part.process.alive and part.process.restarts >= STARTUP_RESTARTS

    @staticmethod
    def healthy(part: Part) -> bool:
        if not part.metrics_url:
            return False
        try:
            return httpx.get(part.metrics_url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def table(self) -> Table:
        t = Table(title="seawall")
        for col in ("part", "address", "pid", "state"):
            t.add_column(col)
        for part in [*self.infra, *self.services]:
            proc = part.process
            if proc is None:
                state, pid = "external", "-"
            else:
                if not proc.alive:
                    state = f"exited ({proc.returncode})"
                elif part in self.services:
                    state = "healthy" if self.healthy(part) else "starting"
                else:
                    state = "running"
                if proc.restarts:
                    state += f", {proc.restarts} restarts"
                pid = str(proc.pid)
            t.add_row(part.name, part.address or "-", pid, state)
        return t

    # -- stop ----------------------------------------------------------------
    def stop(self, grace_s: float = 25.0) -> None:
        self.stack_env_path.unlink(missing_ok=True)
        for part in reversed(self.services):
            assert part.process is not None
            part.process.stop(grace_s)
        for part in reversed(self.infra):
            if part.process is not None:
                part.process.stop(5.0)


def run(options: UpOptions, console: Console | None = None) -> int:
    console = console or Console()
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(options, console)
    try:
        stack.start()
        stack.wait_healthy(stop)
        console.print(stack.table())
        console.print(f"logs: {options.state_dir / 'logs'}")
        console.print("[bold green]seawall is up[/] — Ctrl-C stops it", highlight=False)
        while not stop.wait(0.5):
            stack.supervise()
            stack.check_fill()
        console.print("stopping…")
        return 0
    except embedded.StackError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 2
    finally:
        stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        console.print("stopped")
