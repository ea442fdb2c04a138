"""seawall's client: send requests to a seawall fleet over Kafka and await their replies.

    from seawall_client import SeawallClient

    async with SeawallClient(api_key="sk-sw-…") as client:
        reply = await client.complete("Summarise this ticket: …", max_tokens=64)

This distribution (``seawall-client``) holds what a producer needs and nothing of the
servers: the wire contract (``schemas``), its codec (``serde``), topic names
(``topics``), record signing (``signing``), retries with a budget (``retry``), reply
routing (``streams``) and the Kafka plumbing (``kafka``). It depends on aiokafka and
pydantic only; the seawall services build on the same modules.
"""

from seawall_client.client import ClientStats, RequestTooLarge, SeawallClient, SyncSeawallClient
from seawall_client.kafka import KafkaConfig
from seawall_client.retry import RetryPolicy
from seawall_client.streams import ReplyRouterClosed

__all__ = [
    "ClientStats",
    "KafkaConfig",
    "ReplyRouterClosed",
    "RequestTooLarge",
    "RetryPolicy",
    "SeawallClient",
    "SyncSeawallClient",
]
