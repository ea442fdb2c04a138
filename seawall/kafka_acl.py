"""Who may do what on Apache Kafka: the ACLs of a seawall deployment, one principal per
service (``seawall kafka-secrets``, compose/ and the Kubernetes manifests apply them).

Each service gets what it does and nothing more — the table in SECURITY.md, "Trust
boundaries", as ACL entries for Kafka's ``StandardAuthorizer`` (KRaft) with
``allow.everyone.if.no.acl.found=false``:

- every service may ``CREATE`` (and so ``DESCRIBE``) the fleet's shared topics
  (``Topics.specs``, the dispatch topics of any pool, canary pools included): whichever
  starts first creates them, as on the embedded broker;
- ``READ`` where it consumes, ``WRITE`` where it produces, ``READ`` on its own
  consumer groups;
- ingress alone creates, reads and deletes its own reply topics, and describes and
  deletes idle ones (``services/ingress/reply_sweeper.py``); the controller alone owns
  its faust app's internal topics and group;
- the operator's CLI reads the audit, control, alert, telemetry and dead-letter topics,
  writes control events (each also signed with an operator key: SECURITY.md) and the
  audit of the keys it manages, and describes every topic and group for the lags
  ``seawall status`` shows.

``allows`` decides a check as the ``StandardAuthorizer`` does (``LITERAL`` and
``PREFIXED`` patterns, ``ALL``, and the implied ``DESCRIBE`` of ``READ``, ``WRITE``,
``DELETE`` and ``ALTER``, ``DESCRIBE_CONFIGS`` of ``ALTER_CONFIGS``:
``org.apache.kafka.metadata.authorizer.StandardAuthorizerData`` and ``AclEntry`` in
Apache Kafka 3.9); ``tests/integration/test_kafka_acls.py`` holds every request a
running stack made against it. ``kafka_acls_commands`` writes them out for
``kafka-acls.sh``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from seawall_client.topics import Topics

Pattern = Literal["LITERAL", "PREFIXED"]
Resource = Literal["TOPIC", "GROUP", "CLUSTER", "TRANSACTIONAL_ID"]

INGRESS: Final = "seawall-ingress"
ADMISSION: Final = "seawall-admission"
WORKERS: Final = "seawall-workers"
CONTROLLER: Final = "seawall-controller"
OPERATOR: Final = "seawall-operator"
SERVICES: Final = (INGRESS, ADMISSION, WORKERS, CONTROLLER)
PRINCIPALS: Final = (*SERVICES, OPERATOR)
"""Every principal seawall's own processes log in as (``User:<name>``)."""
ADMIN: Final = "admin"
"""The broker's own principal (inter-broker and controller listeners, ``super.users``)
and the one ``kafka-acls.sh`` applies the ACLs as."""

_IMPLIES: Final = {
    "DESCRIBE": {"READ", "WRITE", "DELETE", "ALTER", "DESCRIBE"},
    "DESCRIBE_CONFIGS": {"ALTER_CONFIGS", "DESCRIBE_CONFIGS"},
}
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True, slots=True)
class Acl:
    """``ALLOW User:<principal>`` each of ``operations`` on ``resource`` ``name``
    (matched as ``pattern``), from any host."""

    principal: str
    operations: frozenset[str]
    resource: Resource
    name: str
    pattern: Pattern = "LITERAL"

    def matches(self, resource: str, name: str) -> bool:
        if resource != self.resource:
            return False
        if self.pattern == "PREFIXED":
            return name.startswith(self.name)
        return self.name in ("*", name)

    def grants(self, operation: str) -> bool:
        return "ALL" in self.operations or bool(
            self.operations & _IMPLIES.get(operation, {operation})
        )


def _acl(principal: str, ops: str, resource: Resource, name: str, pattern: Pattern) -> Acl:
    return Acl(principal, frozenset(ops.split(",")), resource, name, pattern)


def service_acls(prefix: str = "") -> list[Acl]:
    """The ACLs of seawall's principals for a deployment whose topic and group names
    start with ``prefix`` (``SEAWALL_TOPIC_PREFIX``)."""
    t = Topics(prefix)
    requests, dispatch, replies = f"{prefix}llm.requests.", f"{prefix}llm.dispatch.", t.reply("")
    shared = [s.name for s in t.specs() if not s.name.startswith((requests, dispatch))]
    out: list[Acl] = []

    def allow(principal: str, ops: str, *names: str, prefixed: bool = False) -> None:
        for name in names:
            out.append(_acl(principal, ops, "TOPIC", name, "PREFIXED" if prefixed else "LITERAL"))

    def group(principal: str, name: str, prefixed: bool = False) -> None:
        out.append(_acl(principal, "READ", "GROUP", name, "PREFIXED" if prefixed else "LITERAL"))

    for service in SERVICES:  # whoever starts first creates the fleet's topics
        allow(service, "CREATE", *shared)
        allow(service, "CREATE", requests, dispatch, prefixed=True)

    allow(INGRESS, "READ", t.ingress, t.quota_hints, t.control)
    allow(INGRESS, "WRITE", t.arrivals, t.audit, t.deadletter)
    allow(INGRESS, "WRITE", requests, replies, prefixed=True)
    allow(INGRESS, "CREATE,READ,DELETE", t.reply("ingress-"), prefixed=True)
    allow(INGRESS, "DESCRIBE,DELETE", replies, prefixed=True)  # the idle-topic sweeper
    group(INGRESS, f"{prefix}seawall.ingress")

    allow(ADMISSION, "READ", t.telemetry, t.completions, t.control)
    allow(ADMISSION, "READ", requests, prefixed=True)
    allow(ADMISSION, "WRITE", t.quota_hints, t.audit, t.deadletter)
    allow(ADMISSION, "WRITE", dispatch, replies, prefixed=True)
    group(ADMISSION, f"{prefix}seawall.admission", prefixed=True)

    allow(WORKERS, "READ", t.control)
    allow(WORKERS, "READ,WRITE", dispatch, prefixed=True)  # retries and shadows re-dispatch
    allow(WORKERS, "WRITE", t.telemetry, t.completions, t.audit, t.deadletter)
    allow(WORKERS, "WRITE", replies, prefixed=True)
    group(WORKERS, f"{prefix}seawall.workers.", prefixed=True)

    app_id = f"{prefix}seawall-controller"
    allow(CONTROLLER, "READ", t.telemetry, t.arrivals, t.control)
    allow(CONTROLLER, "WRITE", t.control, t.alerts, t.audit, t.deadletter)
    allow(CONTROLLER, "ALL", f"{app_id}-", prefixed=True)  # faust's changelog, repartition
    group(CONTROLLER, app_id, prefixed=True)

    allow(OPERATOR, "READ", t.audit, t.control, t.alerts, t.deadletter, t.telemetry)
    allow(OPERATOR, "WRITE", t.control, t.audit)  # keys created and revoked are audited
    # `seawall status`: every consumer group's lag (committed and end offsets).
    allow(OPERATOR, "DESCRIBE", f"{prefix}llm.", f"{app_id}-", prefixed=True)
    out.append(_acl(OPERATOR, "DESCRIBE", "GROUP", f"{prefix}seawall", "PREFIXED"))
    return out


def producer_acls(principal: str, key_ids: Iterable[str], prefix: str = "") -> list[Acl]:
    """A tenant application's ACLs (SECURITY.md, "Trust boundaries"): write the ingress
    topic, and own the reply topics of its API keys (``llm.reply.<key id>.``)."""
    t = Topics(prefix)
    out = [_acl(principal, "WRITE", "TOPIC", t.ingress, "LITERAL")]
    for key_id in key_ids:
        out.append(
            _acl(principal, "CREATE,READ,WRITE,DELETE", "TOPIC", t.key_replies(key_id), "PREFIXED")
        )
    return out


def allows(acls: Sequence[Acl], principal: str, operation: str, resource: str, name: str) -> bool:
    """Whether an ALLOW-only ``acls`` lets ``principal`` do ``operation`` on ``resource``
    ``name``. ``IDEMPOTENT_WRITE`` on the cluster: granted by ``WRITE`` on any topic
    (KIP-679, Kafka 3.0)."""
    mine = [a for a in acls if a.principal == principal]
    if operation == "IDEMPOTENT_WRITE" and resource == "CLUSTER":
        return any(a.resource == "TOPIC" and a.grants("WRITE") for a in mine)
    return any(a.matches(resource, name) and a.grants(operation) for a in mine)


def kafka_acls_commands(
    acls: Sequence[Acl], bootstrap: str, command_config: str, tool: str = "kafka-acls.sh"
) -> list[str]:
    """The ``kafka-acls.sh --add`` command lines that grant ``acls``: one per set of
    principals, pattern type, operations and names alike (the tool grants every
    combination of the principals, operations and resources it is given, and each call
    starts a JVM); adding an ACL that exists already changes nothing, so the lines can
    be rerun."""
    by_grant: dict[tuple[str, Pattern, Resource, tuple[str, ...]], list[str]] = {}
    for a in acls:
        if not _NAME.match(a.principal) or not _NAME.match(a.name):
            raise ValueError(f"not a name for an ACL: {a.principal!r} / {a.name!r}")
        key = (a.principal, a.pattern, a.resource, tuple(sorted(a.operations)))
        by_grant.setdefault(key, []).append(a.name)
    by_names: dict[tuple[Pattern, Resource, tuple[str, ...], tuple[str, ...]], list[str]] = {}
    for (principal, pattern, resource, ops), granted in by_grant.items():
        by_names.setdefault((pattern, resource, ops, tuple(granted)), []).append(principal)
    lines = []
    for (pattern, resource, ops, names), principals in by_names.items():
        flag = {"TOPIC": "--topic", "GROUP": "--group"}[resource]
        parts = [
            tool,
            "--bootstrap-server",
            bootstrap,
            "--command-config",
            command_config,
            "--add",
            *(arg for p in principals for arg in ("--allow-principal", f"User:{p}")),
            "--resource-pattern-type",
            pattern.lower(),
            *(arg for op in ops for arg in ("--operation", _tool_operation(op))),
            *(arg for name in names for arg in (flag, name)),
        ]
        lines.append(shlex.join(parts))
    return lines


def _tool_operation(op: str) -> str:
    """``kafka-acls.sh`` spells operations in CamelCase (``DescribeConfigs``)."""
    return "".join(word.capitalize() for word in op.split("_"))
