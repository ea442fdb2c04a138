"""The Kafka ACLs a deployment grants (``seawall.kafka_acl``, applied by compose/ and the
Kubernetes manifests) are enough for a running stack, and each principal needs only its
own: every request every process made — the services, faust's, the operator's CLI and a
tenant's SDK over the Kafka ingress — held against the ACLs of the principal it would
log in as, by Apache Kafka's own rules for which operation each request needs
(``tests.acl_audit``).

Apache Kafka cannot run here and the embedded broker checks no ACL: the requests are
read on their way to a real embedded broker (``AuditingProxy``) and decided by
``seawall.kafka_acl.allows``, whose matching is the ``StandardAuthorizer``'s (its unit
tests). A check no ACL grants fails the test, naming the principal, operation and
resource; so does a principal of seawall's that made no request at all (a process not
attributed to its principal would pass unseen otherwise).
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import httpx
import pytest

from seawall.kafka_acl import (
    ADMISSION,
    CONTROLLER,
    INGRESS,
    OPERATOR,
    PRINCIPALS,
    SERVICES,
    WORKERS,
    allows,
    producer_acls,
    service_acls,
)
from seawall_client import SeawallClient
from tests.acl_audit import AuditingProxy, Check
from tests.stack import Stack, behind_proxy

pytestmark = pytest.mark.e2e

PRODUCER = "producer-acme"


UP = "seawall up"


def principal_of(client_id: str) -> str:
    """The principal a process logs in as in compose/, from its client id
    (``seawall-<instance>``: ``seawall up`` names its services' instances; the test
    names the CLI's, the producer's and ``up``'s own)."""
    instance = client_id.removeprefix("seawall-")
    for name, principal in (
        ("up", UP),
        ("ingress", INGRESS),
        ("admission", ADMISSION),
        ("controller", CONTROLLER),
        ("worker-", WORKERS),
        ("operator", OPERATOR),
        (PRODUCER, PRODUCER),
    ):
        if instance.startswith(name):
            return principal
    return f"unattributed client id {client_id!r}"


OPERATOR_ENV = {"SEAWALL_INSTANCE_ID": "operator"}
"""The CLI as the operator runs it (its client id names it: ``principal_of``)."""


def operator(stack: Stack, *args: str) -> str:
    return stack.cli(*args, env=OPERATOR_ENV).stdout


def key(stack: Stack, tenant: str, tier: str) -> dict[str, str]:
    return stack.key(tenant, tier, env=OPERATOR_ENV)


async def traffic(stack: Stack) -> str:
    """A little of everything the stack does; the producer's API key id."""
    vip, basic = key(stack, "acme-vip", "enterprise"), key(stack, "acme-basic", "basic")
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        for caller, stream in ((vip, True), (basic, False), (vip, False)):
            body = {
                "model": "default",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "stream": stream,
            }
            r = await http.post(
                "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {caller['key']}"},
            )
            assert r.status_code == 200, r.text
    tenant = key(stack, "acme-kafka", "pro")
    config = dataclasses.replace(stack.settings.kafka, instance_id=PRODUCER)
    async with SeawallClient(api_key=tenant["key"], kafka=config) as client:
        reply = await client.complete(prompt="over the Kafka ingress", max_tokens=8)
        assert reply.status == "ok", reply
    operator(stack, "quota", "set", "--tenant", "acme-basic", "--rps", "3")
    operator(stack, "quota", "clear", "--tenant", "acme-basic")
    operator(stack, "quota", "list")
    operator(stack, "events")
    operator(stack, "alerts")
    status = json.loads(operator(stack, "status", "--json"))
    assert status["workers"], status
    return tenant["key_id"]


async def test_every_request_of_a_running_stack_is_allowed_to_its_principal(
    tmp_path: Path, redis_url: str
) -> None:
    audit = partial(AuditingProxy, principal_of=principal_of)
    # `up` itself is `up` (its services are named by `up`), and so is the CLI beside it
    # unless a command says otherwise (OPERATOR_ENV).
    env = {"SEAWALL_INSTANCE_ID": "up"}
    async with behind_proxy(tmp_path, redis_url, audit, "--workers", "1", env=env) as (
        stack,
        proxy,
    ):
        key_id = await traffic(stack)
        prefix = stack.settings.topic_prefix
    checks = set(proxy.checks)

    acls = service_acls(prefix) + producer_acls(PRODUCER, [key_id], prefix)
    # `up` creates the fleet's topics before its services start, as any of them may:
    # in compose/ a service does, under its own principal.
    for c in (c for c in checks if c.principal == UP):
        assert c.operation in ("CREATE", "DESCRIBE"), c
        assert all(allows(acls, s, c.operation, c.resource, c.name) for s in SERVICES), c
    refused = sorted(
        (
            c
            for c in checks
            if c.principal != UP and not allows(acls, c.principal, c.operation, c.resource, c.name)
        ),
        key=lambda c: (c.principal, c.operation, c.name),
    )
    assert refused == [], "\n".join(_line(c) for c in refused)
    seen = {c.principal for c in checks}
    assert set(PRINCIPALS) | {PRODUCER} <= seen, seen


def _line(c: Check) -> str:
    return f"{c.principal}: {c.operation} {c.resource} {c.name}"
