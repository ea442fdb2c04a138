"""``ensure_topics`` reads the broker's answer to ``CreateTopics``: aiokafka hands it back
errors and all, and a topic the broker refused (an ACL, a bad setting) must stop the
process that needs it rather than let it start on a topic that is not there."""

from __future__ import annotations

import pytest
from aiokafka.errors import InvalidReplicationFactorError, TopicAuthorizationFailedError
from aiokafka.protocol.admin import CreateTopicsResponse_v0, CreateTopicsResponse_v1

from seawall_client.kafka import raise_creation_failures

pytestmark = pytest.mark.unit


def test_created_and_already_there_are_no_failure() -> None:
    answer = CreateTopicsResponse_v0(topic_errors=[("a", 0), ("b", 36)])
    raise_creation_failures(answer.topic_errors)


def test_a_topic_the_acls_do_not_let_us_create_stops_us() -> None:
    answer = CreateTopicsResponse_v0(topic_errors=[("a", 0), ("llm.control", 29)])
    with pytest.raises(TopicAuthorizationFailedError, match=r"llm\.control was not created"):
        raise_creation_failures(answer.topic_errors)


def test_the_brokers_message_is_kept() -> None:
    answer = CreateTopicsResponse_v1(
        topic_errors=[("t", 38, "Replication factor: 3 larger than available brokers: 1.")]
    )
    with pytest.raises(InvalidReplicationFactorError, match="larger than available brokers"):
        raise_creation_failures(answer.topic_errors)
