"""A real Redis Cluster of three primaries from the ``redis-server`` (or bundled
``valkey-server``) binary: the slots split in three, the nodes introduced to each other,
and the cluster's state ``ok`` before it is used."""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from seawall import embedded

SLOTS = 16384


def cluster_command(client: redis.Redis, *args: object) -> Any:
    return client.execute_command("CLUSTER", *args)  # type: ignore[no-untyped-call]


def cluster_port() -> int:
    """A free port a cluster node may take: at most 55535 (its cluster bus listens 10,000
    higher), with that bus port free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20_000, 55_535)
        if not embedded.port_in_use("127.0.0.1", port) and not embedded.port_in_use(
            "127.0.0.1", port + 10_000
        ):
            return port
    raise AssertionError("no free port pair for a cluster node")


def _node(binary: str, work: Path, timeout_s: float = 15.0) -> tuple[int, subprocess.Popen[bytes]]:
    """One cluster-enabled server on a free port, answering (or exited: its port was
    taken between choosing it and binding it)."""
    port = cluster_port()
    data = work / f"node-{port}"
    data.mkdir(parents=True)
    proc = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(data / "nodes.conf"),
            "--cluster-node-timeout",
            "5000",
            "--dir",
            str(data),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=(data / "log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                log = (data / "log").read_text(errors="replace")[-2000:]
                assert time.monotonic() < deadline, f"a cluster node did not start:\n{log}"
                time.sleep(0.05)
    finally:
        client.close()
    return port, proc


@contextmanager
def redis_cluster(work: Path, nodes: int = 3) -> Iterator[list[int]]:
    """Start the cluster; yield its nodes' ports; stop it (every process) at the end."""
    binary = embedded.redis_binary()
    assert binary is not None, "no redis-server or bundled valkey-server"
    ports: list[int] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        while len(ports) < nodes:
            assert len(procs) < nodes + 3, f"cluster nodes keep exiting (logs under {work})"
            port, proc = _node(binary, work)
            procs.append(proc)
            if proc.poll() is None:  # up (a port another process took meanwhile: again)
                ports.append(port)
        clients = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=2) for p in ports]
        share = SLOTS // nodes
        for i, client in enumerate(clients):
            last = SLOTS - 1 if i == nodes - 1 else (i + 1) * share - 1
            cluster_command(client, "ADDSLOTSRANGE", i * share, last)
        for port in ports[1:]:
            cluster_command(clients[0], "MEET", "127.0.0.1", port)
        deadline = time.monotonic() + 30
        for client in clients:
            while b"cluster_state:ok" not in cluster_command(client, "INFO"):
                assert time.monotonic() < deadline, "the cluster did not reach state ok"
                time.sleep(0.1)
        for client in clients:
            client.close()
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
