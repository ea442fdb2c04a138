"""The signature a record on the ingress topic carries in its headers: part of the wire
contract, so that a producer in any language can sign (``seawall_client.signing`` is
seawall's implementation; the README, "Producing to llm.ingress", is the recipe)."""

from __future__ import annotations

from typing import Any

HEADER_KEY_ID = "seawall-key-id"
HEADER_TIMESTAMP = "seawall-timestamp"
HEADER_SIGNATURE = "seawall-signature"
SIGNING_LABEL = "seawall-record-signing-v1"
CANONICAL_PREFIX = "seawall-record-v1"
SIGNATURE_VERSION = "v1"

RECORD_HEADERS: dict[str, Any] = {
    "x-seawall-record-headers": {
        HEADER_KEY_ID: "the API key's id: the 12 hex characters of sk-sw-<key id>_<secret>",
        HEADER_TIMESTAMP: "the Unix time of signing, in whole seconds (decimal ASCII)",
        HEADER_SIGNATURE: f"'{SIGNATURE_VERSION}=' + hex(HMAC-SHA256(signing_key, canonical))",
    },
    "x-seawall-signing": {
        "signing_key": f"HMAC-SHA256(key = the API key's UTF-8 bytes, message = '{SIGNING_LABEL}')",
        "canonical": f"'{CANONICAL_PREFIX}' LF timestamp LF key_id LF "
        "hex(SHA-256(the record's value bytes, exactly as produced))",
        "window_s": "the timestamp must lie within SEAWALL_SIGNATURE_WINDOW_S (300) of "
        "ingress's clock",
        "reply_to": "a reply topic of the signing key: <prefix>llm.reply.<key id>.<owner>, "
        "created by the producer before it sends",
        "request_id": "unique per tenant: a second record with a signed request id is a "
        "replay and is refused",
    },
}
"""What the JSON Schemas of the records producers sign carry beside their fields."""
