"""``seawall.kafka_acl``: the StandardAuthorizer's matching, each role's limits, and the
``kafka-acls.sh`` lines that grant exactly the ACLs (what a running stack needs of
them: ``tests/e2e/test_kafka_acls.py``)."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seawall.kafka_acl import (
    ADMISSION,
    CONTROLLER,
    INGRESS,
    OPERATOR,
    WORKERS,
    Acl,
    allows,
    kafka_acls_commands,
    producer_acls,
    service_acls,
)

pytestmark = pytest.mark.unit

P = "acme."  # a deployment's topic prefix


def acl(ops: str, name: str, pattern: str = "LITERAL", resource: str = "TOPIC") -> Acl:
    return Acl("u", frozenset(ops.split(",")), resource, name, pattern)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("granted", "operation", "name", "allowed"),
    [
        (acl("READ", "t"), "READ", "t", True),
        (acl("READ", "t"), "READ", "t2", False),  # literal: the name itself only
        (acl("READ", "t"), "WRITE", "t", False),
        (acl("READ", "t"), "DESCRIBE", "t", True),  # READ implies DESCRIBE
        (acl("WRITE", "t"), "DESCRIBE", "t", True),
        (acl("DELETE", "t"), "DESCRIBE", "t", True),
        (acl("ALTER", "t"), "DESCRIBE", "t", True),
        (acl("CREATE", "t"), "DESCRIBE", "t", False),  # CREATE implies nothing
        (acl("DESCRIBE", "t"), "READ", "t", False),
        (acl("ALTER_CONFIGS", "t"), "DESCRIBE_CONFIGS", "t", True),
        (acl("ALL", "t"), "DELETE", "t", True),
        (acl("READ", "*"), "READ", "anything", True),  # the wildcard
        (acl("READ", "llm.reply.", "PREFIXED"), "READ", "llm.reply.k1.x", True),
        (acl("READ", "llm.reply.", "PREFIXED"), "READ", "llm.replx", False),
        (acl("READ", "t", resource="GROUP"), "READ", "t", False),  # a topic is no group
    ],
)
def test_matching_is_the_standard_authorizers(
    granted: Acl, operation: str, name: str, allowed: bool
) -> None:
    assert allows([granted], "u", operation, "TOPIC", name) is allowed
    assert not allows([granted], "someone-else", operation, "TOPIC", name)


def test_idempotent_writes_come_with_a_write_on_any_topic() -> None:
    """KIP-679: a producer id is granted to a principal that may write some topic."""
    assert allows([acl("WRITE", "t")], "u", "IDEMPOTENT_WRITE", "CLUSTER", "kafka-cluster")
    assert not allows([acl("READ", "t")], "u", "IDEMPOTENT_WRITE", "CLUSTER", "kafka-cluster")


ACLS = service_acls(P)
KEY, OTHER_KEY = "k1", "k2"
PRODUCER = producer_acls("producer-acme", [KEY], P)


@pytest.mark.parametrize(
    ("principal", "operation", "topic"),
    [
        # Only ingress puts requests on the priority topics: none may jump the queue.
        (ADMISSION, "WRITE", "llm.requests.vip"),
        (WORKERS, "WRITE", "llm.requests.vip"),
        (OPERATOR, "WRITE", "llm.requests.vip"),
        ("producer-acme", "WRITE", "llm.requests.vip"),
        # Only admission (and workers re-dispatching) dispatch.
        (INGRESS, "WRITE", "llm.dispatch.main"),
        (CONTROLLER, "WRITE", "llm.dispatch.main"),
        # Control events come from the controller and operators only.
        (INGRESS, "WRITE", "llm.control"),
        (ADMISSION, "WRITE", "llm.control"),
        (WORKERS, "WRITE", "llm.control"),
        # Only workers report telemetry and completions (MACed too).
        (INGRESS, "WRITE", "llm.telemetry"),
        (ADMISSION, "WRITE", "llm.completions"),
        # Prompts: read by their consumers only.
        (WORKERS, "READ", "llm.requests.standard"),
        (CONTROLLER, "READ", "llm.dispatch.main"),
        (OPERATOR, "READ", "llm.ingress"),
        ("producer-acme", "READ", "llm.ingress"),
        # A tenant's producer: no other key's replies, no deleting them.
        ("producer-acme", "READ", f"llm.reply.{OTHER_KEY}.app"),
        ("producer-acme", "DELETE", f"llm.reply.{OTHER_KEY}.app"),
        ("producer-acme", "READ", "llm.reply.ingress-ingress"),
        # Replies are deleted by their owner or ingress's sweeper, nobody else.
        (ADMISSION, "DELETE", f"llm.reply.{KEY}.app"),
        (WORKERS, "DELETE", f"llm.reply.{KEY}.app"),
        # Nothing outside the deployment's prefix.
        (INGRESS, "READ", "other.llm.ingress"),
    ],
)
def test_no_role_reaches_what_is_not_its_own(principal: str, operation: str, topic: str) -> None:
    name = topic if topic.startswith("other.") else P + topic
    assert not allows(ACLS + PRODUCER, principal, operation, "TOPIC", name)


@pytest.mark.parametrize(
    ("principal", "operation", "topic"),
    [
        ("producer-acme", "WRITE", "llm.ingress"),
        ("producer-acme", "CREATE", f"llm.reply.{KEY}.app"),
        ("producer-acme", "READ", f"llm.reply.{KEY}.app"),
        ("producer-acme", "DELETE", f"llm.reply.{KEY}.app"),
        (INGRESS, "WRITE", "llm.requests.vip"),
        (INGRESS, "DELETE", f"llm.reply.{KEY}.app"),  # the sweeper
        (ADMISSION, "WRITE", "llm.dispatch.main@v2"),  # a canary pool
        (WORKERS, "READ", "llm.dispatch.small"),
        (CONTROLLER, "WRITE", "llm.control"),
        (CONTROLLER, "CREATE", "seawall-controller-decisions-changelog"),
        (OPERATOR, "WRITE", "llm.control"),
    ],
)
def test_each_role_reaches_its_own(principal: str, operation: str, topic: str) -> None:
    assert allows(ACLS + PRODUCER, principal, operation, "TOPIC", P + topic)


def test_the_groups_are_each_services_own() -> None:
    assert allows(ACLS, WORKERS, "READ", "GROUP", f"{P}seawall.workers.main")
    assert not allows(ACLS, WORKERS, "READ", "GROUP", f"{P}seawall.admission")
    assert allows(ACLS, ADMISSION, "READ", "GROUP", f"{P}seawall.admission.completions")
    assert not allows(ACLS, INGRESS, "READ", "GROUP", f"{P}seawall.workers.main")
    assert allows(ACLS, OPERATOR, "DESCRIBE", "GROUP", f"{P}seawall.workers.main")
    assert not allows(ACLS, OPERATOR, "READ", "GROUP", f"{P}seawall.workers.main")


def granted_by(lines: list[str]) -> set[tuple[str, str, str, str, str]]:
    """Every (principal, pattern, operation, resource, name) the command lines grant:
    the tool grants each combination of what one line names."""
    out = set()
    for line in lines:
        args = shlex.split(line)
        assert args[0] == "kafka-acls.sh"
        assert "--add" in args
        rest = [a for a in args[1:] if a != "--add"]  # the one flag without a value
        values: dict[str, list[str]] = {}
        for flag, value in zip(rest[::2], rest[1::2], strict=True):
            values.setdefault(flag, []).append(value)
        (pattern,) = values["--resource-pattern-type"]
        resources = [("TOPIC", n) for n in values.get("--topic", [])]
        resources += [("GROUP", n) for n in values.get("--group", [])]
        for principal in values["--allow-principal"]:
            for op in values["--operation"]:
                for resource, name in resources:
                    out.add((principal, pattern, op, resource, name))
    return out


def expected_grants(acls: list[Acl]) -> set[tuple[str, str, str, str, str]]:
    camel = {
        "READ": "Read",
        "WRITE": "Write",
        "CREATE": "Create",
        "DELETE": "Delete",
        "DESCRIBE": "Describe",
        "ALL": "All",
    }
    return {
        (f"User:{a.principal}", a.pattern.lower(), camel[op], a.resource, a.name)
        for a in acls
        for op in a.operations
    }


def test_the_command_lines_grant_exactly_the_acls() -> None:
    lines = kafka_acls_commands(ACLS, "kafka:19092", "/run/secrets/admin.properties")
    assert granted_by(lines) == expected_grants(ACLS)
    assert len(lines) < len(ACLS)  # grouped: each line starts a JVM


@given(
    st.lists(
        st.builds(
            Acl,
            st.sampled_from(["a", "b", "c"]),
            st.frozensets(st.sampled_from(["READ", "WRITE", "DESCRIBE"]), min_size=1),
            st.sampled_from(["TOPIC", "GROUP"]),
            st.sampled_from(["t1", "t2", "x."]),
            st.sampled_from(["LITERAL", "PREFIXED"]),
        ),
        max_size=12,
    )
)
def test_any_set_of_acls_is_granted_exactly(acls: list[Acl]) -> None:
    lines = kafka_acls_commands(acls, "k:1", "c")
    assert granted_by(lines) == expected_grants(acls)


def test_a_name_that_would_break_the_command_line_is_refused() -> None:
    with pytest.raises(ValueError, match="not a name"):
        kafka_acls_commands([acl("READ", "t --operation All")], "k:1", "c")
