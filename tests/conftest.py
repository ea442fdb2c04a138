"""The test harness: a real Kafka-compatible broker and a real Redis, never stand-ins.

Broker: ``SEAWALL_TEST_KAFKA_BOOTSTRAP`` if set; else testcontainers' Kafka where a
Docker engine answers; else the embedded broker (Tansu) on a free port. Redis:
``SEAWALL_TEST_REDIS_URL`` if set; else testcontainers' Redis where Docker answers; else
the local Redis on 127.0.0.1:6379 if it answers; else a private one on a free port.
Every test gets its own topic prefix and Redis key prefix, so tests never meet.

Tiers: tests under ``tests/unit`` are marked ``unit``, ``tests/integration``
``integration`` and ``tests/e2e`` ``e2e``; ``pytest -m unit`` runs one tier alone.
"""

from __future__ import annotations

import os

# Tests never read the connection file of a stack a developer may be running here.
os.environ["SEAWALL_ENV_FILE"] = os.devnull

import asyncio
import contextlib
import gc
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from seawall import embedded
from seawall_client.kafka import ensure_topics
from seawall_client.topics import Topics
from services.common import tracing
from services.common.bus import topics_of, wait_for_broker
from services.common.settings import CommonSettings

TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).relative_to(TESTS).parts[0]
        if tier in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(autouse=True)
def _asyncio_stacks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """pytest-timeout shows the main thread sitting in the event loop's ``select``, which
    says nothing about what a hung async test waited for. Shortly before the timeout,
    print the stack of every pending asyncio task (found through the garbage collector:
    the loop belongs to pytest-asyncio, not to us), so the report names the await."""
    marker = request.node.get_closest_marker("timeout")
    if marker and marker.args:
        timeout = float(marker.args[0])
    else:  # --timeout on the command line, else the ini file (as pytest-timeout reads them)
        option = request.config.getoption("timeout", None)
        timeout = float(option if option is not None else request.config.getini("timeout"))
    if timeout <= 0:  # no timeout: nothing to report before it
        yield
        return
    timer = threading.Timer(max(timeout - 20, timeout / 2), _print_pending_tasks)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _print_pending_tasks() -> None:
    tasks = [t for t in gc.get_objects() if isinstance(t, asyncio.Task) and not t.done()]
    stacks = [(task, _await_chain(task)) for task in tasks]
    # Ours first: CI keeps only the head and the tail of a long report, and a hang is
    # explained by the task of ours that waits, not by the libraries' idle loops.
    stacks.sort(key=lambda pair: not any(_ours(line) for line in pair[1]))
    print(f"--- {len(tasks)} pending asyncio tasks near the timeout ---", file=sys.stderr)
    for task, chain in stacks:
        print(f"{task.get_name()}:", file=sys.stderr)
        for line in chain:
            print(f"  {line}", file=sys.stderr)
        print(f"  waiting on {task!r}"[:300], file=sys.stderr)


def _await_chain(task: asyncio.Task[Any]) -> list[str]:
    """The task's await chain, outermost first, one ``file:line in function`` each."""
    lines = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return lines


def _ours(line: str) -> bool:
    return any(f"{TESTS.parent.name}/{part}/" in line for part in ("services", "seawall", "tests"))


def _docker_answers() -> bool:
    if os.environ.get("SEAWALL_TEST_NO_DOCKER"):
        return False
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        client.close()
        return True
    except Exception:
        return False


@dataclass(frozen=True)
class Broker:
    bootstrap: str
    idempotence: bool
    """The embedded broker has no InitProducerId (DESIGN, Platform facts)."""


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    if os.environ.get("SEAWALL_TEST_KAFKA_BOOTSTRAP"):
        yield Broker(os.environ["SEAWALL_TEST_KAFKA_BOOTSTRAP"], idempotence=True)
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as kafka:
            yield Broker(kafka.get_bootstrap_server(), idempotence=True)
        return
    port = embedded.free_port()
    proc = embedded.broker_process(
        "127.0.0.1", port, tmp_path_factory.mktemp("broker") / "broker.log"
    )
    proc.start()
    try:
        asyncio.run(wait_for_broker(f"127.0.0.1:{port}", timeout_s=30))
        yield Broker(f"127.0.0.1:{port}", idempotence=False)
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("SEAWALL_TEST_REDIS_URL"):
        yield os.environ["SEAWALL_TEST_REDIS_URL"]
        return
    if _docker_answers():
        from testcontainers.redis import RedisContainer

        with RedisContainer() as container:
            host = container.get_container_host_ip()
            yield f"redis://{host}:{container.get_exposed_port(6379)}/0"
        return
    local = embedded.redis_url_for("127.0.0.1", 6379)
    if embedded.redis_answers(local):
        yield local
        return
    with private_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@contextlib.contextmanager
def private_redis(work: Path) -> Iterator[str]:
    """A Redis of the test's own on a free port (its files under ``work``): its URL."""
    port = embedded.free_port()
    proc = embedded.redis_process("127.0.0.1", port, work / "data", work / "redis.log")
    proc.start()
    url = embedded.redis_url_for("127.0.0.1", port)
    try:
        for _ in range(200):  # a refused connection returns at once: wait between tries
            if embedded.redis_answers(url, timeout_s=0.2):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"private Redis did not start:\n{proc.tail()}")
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def control_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's control signing keys (``services.common.control_signing``): the
    controller's, the workers' and the test operator's, all trusted."""
    from services.common.control_signing import ensure_keys
    from tests.signing import OPERATOR

    keys = tmp_path_factory.mktemp("control-keys")
    ensure_keys(keys, OPERATOR)
    return keys


@pytest.fixture(scope="session")
def sampling_secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's sampling secret (``services.common.sampling``): one file, as every
    admission replica and worker of a fleet shares one."""
    from services.common.sampling import make_secret

    path = tmp_path_factory.mktemp("sampling") / "sampling_secret"
    make_secret(path)
    return path


@pytest.fixture
def settings(
    broker: Broker, redis_url: str, control_keys: Path, sampling_secret: Path
) -> CommonSettings:
    """Settings for one test: its own topic prefix and Redis key prefix."""
    tag = uuid.uuid4().hex[:10]
    return CommonSettings(
        control_keys_dir=control_keys,
        sampling_secret_file=sampling_secret,
        kafka_bootstrap=broker.bootstrap,
        kafka_idempotence=broker.idempotence,
        redis_url=redis_url,
        topic_prefix=f"t{tag}.",
        redis_prefix=f"test:{tag}:",
        topic_partitions=3,
        instance_id=f"test-{tag}",
    )


@pytest.fixture
async def topics(settings: CommonSettings) -> Topics:
    """The fleet's topics, created on the broker under the test's prefix."""
    t = topics_of(settings)
    await ensure_topics(settings.kafka_bootstrap, t.specs())
    return t


@pytest.fixture
async def redis(settings: CommonSettings) -> AsyncIterator[aioredis.Redis]:
    """A client on the real Redis; the test's keys are deleted afterwards."""
    client = aioredis.Redis.from_url(settings.redis_url)
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(match=f"{settings.redis_prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
def trace_sink() -> Iterator[tracing.MemorySink]:
    """Every span recorded in this process while the test runs (tracing on)."""
    sink = tracing.MemorySink()
    tracing.use([sink])
    try:
        yield sink
    finally:
        tracing.use([])
