"""What each principal asks a Kafka broker for, as Apache Kafka's authorizer sees it.

``AuditingProxy`` sits in front of a real broker (as ``tests.faults.DelayProxy`` does),
reads every request it relays, decodes it with aiokafka's own request classes (the
ones the clients sent it with: faust's included, it uses aiokafka) and records the
``(principal, operation, resource type, name)`` checks Apache Kafka's authorizer makes
for it. The table is Kafka's own: "Operations and Resources on Protocols" in the
security documentation (``docs/security.html``), e.g. ``Produce`` needs ``WRITE`` on the
topic, ``OffsetCommit`` ``READ`` on the group and the topic, ``FindCoordinator``
``DESCRIBE`` on the group. A request this module cannot decode is recorded as such: a
test sees it rather than passing over it.

The embedded broker checks nothing; the checks recorded are held against the ACLs
compose/ grants (``seawall.kafka_acl``) by the test that uses this.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiokafka.protocol
from aiokafka.protocol.api import RequestStruct

from tests.faults import TcpProxy


@dataclass(frozen=True, slots=True)
class Check:
    principal: str
    operation: str  # READ, WRITE, CREATE, DELETE, DESCRIBE, DESCRIBE_CONFIGS, ...
    resource: str  # TOPIC, GROUP, CLUSTER
    name: str


def _request_classes() -> dict[tuple[int, int], type[RequestStruct]]:
    out: dict[tuple[int, int], type[RequestStruct]] = {}
    for module in pkgutil.iter_modules(aiokafka.protocol.__path__):
        mod = importlib.import_module(f"aiokafka.protocol.{module.name}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, RequestStruct) and hasattr(cls, "API_VERSION"):
                out[(cls.API_KEY, cls.API_VERSION)] = cls
    return out


_CLASSES = _request_classes()
_NOTHING_TO_AUTHORIZE = {17, 18, 36}  # SaslHandshake, ApiVersions, SaslAuthenticate


def _skip_header(frame: bytes, flexible: bool) -> bytes:
    (client_len,) = struct.unpack_from(">h", frame, 8)
    at = 10 + max(client_len, 0)
    if flexible:  # request header v2: tagged fields after the client id
        count = frame[at]
        assert count == 0, "tagged header fields: not sent by aiokafka"
        at += 1
    return frame[at:]


def _names(items: Any) -> list[str]:
    """The names in a decoded array of topics (each a struct whose first field is the
    topic's name, or a bare name)."""
    return [i if isinstance(i, str) else next(iter(i.values())) for i in items or ()]


def checks_of(principal: str, frame: bytes) -> list[Check]:
    """The authorizer's checks for one request frame (its API key, version, ...)."""
    api_key, version = struct.unpack_from(">hh", frame)
    if api_key in _NOTHING_TO_AUTHORIZE:
        return []
    cls = _CLASSES.get((api_key, version))
    if cls is None:
        return [Check(principal, f"UNDECODED api {api_key} v{version}", "?", "?")]
    body = cls.decode(_skip_header(frame, cls.FLEXIBLE_VERSION)).to_object()

    def on(operation: str, resource: str, names: list[str]) -> list[Check]:
        return [Check(principal, operation, resource, n) for n in names]

    match api_key:
        case 0:  # Produce
            return on("WRITE", "TOPIC", _names(body["topics"]))
        case 1:  # Fetch (a consumer's)
            return on("READ", "TOPIC", _names(body["topics"]))
        case 2:  # ListOffsets
            return on("DESCRIBE", "TOPIC", _names(body["topics"]))
        case 3:  # Metadata: None = every topic, filtered to those described
            return on("DESCRIBE", "TOPIC", _names(body["topics"]))
        case 8:  # OffsetCommit
            return on("READ", "GROUP", [body["consumer_group"]]) + on(
                "READ", "TOPIC", _names(body["topics"])
            )
        case 9:  # OffsetFetch
            return on("DESCRIBE", "GROUP", [body["consumer_group"]]) + on(
                "DESCRIBE", "TOPIC", _names(body["topics"])
            )
        case 10:  # FindCoordinator: type 0 a group, 1 a transactional id
            key = body.get("coordinator_key", body.get("consumer_group"))
            if body.get("coordinator_type", 0) != 0:
                return [Check(principal, "DESCRIBE", "TRANSACTIONAL_ID", key)]
            return on("DESCRIBE", "GROUP", [key])
        case 11 | 12 | 13 | 14:  # JoinGroup, Heartbeat, LeaveGroup, SyncGroup
            return on("READ", "GROUP", [body["group"]])
        case 15:  # DescribeGroups
            return on("DESCRIBE", "GROUP", list(body["groups"]))
        case 16:  # ListGroups: the groups described, filtered; nothing refused
            return []
        case 19:  # CreateTopics
            return on("CREATE", "TOPIC", _names(body["create_topic_requests"]))
        case 20:  # DeleteTopics
            return on("DELETE", "TOPIC", _names(body["topics"]))
        case 21:  # DeleteRecords
            return on("DELETE", "TOPIC", _names(body["topics"]))
        case 22:  # InitProducerId, not transactional: WRITE on any topic will do (KIP-679)
            return [Check(principal, "IDEMPOTENT_WRITE", "CLUSTER", "kafka-cluster")]
        case 32:  # DescribeConfigs
            return [
                Check(principal, "DESCRIBE_CONFIGS", _config_resource(r[0]), r[1])
                for r in (tuple(r.values()) for r in body["resources"])
            ]
        case 37:  # CreatePartitions
            return on("ALTER", "TOPIC", _names(body["topic_partitions"]))
    return [Check(principal, f"UNMAPPED api {api_key} v{version}", "?", "?")]


def _config_resource(code: int) -> str:
    return {2: "TOPIC", 4: "CLUSTER"}.get(code, f"config-resource {code}")


def client_id_of(frame: bytes) -> str:
    (size,) = struct.unpack_from(">h", frame, 8)
    return frame[10 : 10 + size].decode() if size >= 0 else ""


class AuditingProxy(TcpProxy):
    """A ``TcpProxy`` in front of a broker (which advertises the proxy, so every later
    connection comes back through it) that records what each request a client sends
    needs of the authorizer (``checks``), for the principal ``principal_of`` names from
    the request's client id: in production a process logs in as the principal of its
    service, and its client id names its instance (``seawall-<instance>``)."""

    def __init__(self, target_port: int, principal_of: Callable[[str], str]) -> None:
        super().__init__("127.0.0.1", target_port)
        self.principal_of = principal_of
        self.checks: set[Check] = set()

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        if dst.getpeername()[1] != self._target[1]:
            super()._forward(src, dst)  # the broker's answers, passed on as they come
            return
        with contextlib.suppress(EOFError):
            while True:
                head = _read_exactly(src, 4)
                frame = _read_exactly(src, struct.unpack(">i", head)[0])
                principal = self.principal_of(client_id_of(frame))
                try:
                    found = checks_of(principal, frame)
                except Exception as e:  # a test must see it, not lose it
                    api_key, version = struct.unpack_from(">hh", frame)
                    what = f"UNDECODED api {api_key} v{version}: {e!r}"
                    found = [Check(principal, what, "?", "?")]
                with self._lock:
                    self.checks.update(found)
                dst.sendall(head + frame)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)
