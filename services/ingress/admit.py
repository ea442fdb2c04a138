"""From a client's connection to a request ready for its priority topic, for HTTP and
WebSocket alike: the client's address (``source_of``) and key (``bearer``), and a
parsed body through the pipeline (``admit_body``)."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from schemas import ClientMeta, InferenceRequest
from seawall_client.clock import Clock
from services.ingress import openai as oai
from services.ingress.pipeline import IngressPipeline, Principal
from services.ingress.policy.filters.geo import TrustedProxies, client_address
from services.ingress.refusals import Refusal


def source_of(conn: HTTPConnection, proxies: TrustedProxies) -> str:
    """The client's address: the rightmost one outside the trusted ``proxies``
    networks, from the TCP peer leftwards through ``X-Forwarded-For`` (a directly
    connected client's header is ignored); empty when unknown."""
    peer = conn.client.host if conn.client else None
    address = client_address(conn.headers.getlist("x-forwarded-for"), peer, proxies)
    return str(address.ip) if address.ip is not None else ""


@dataclass(frozen=True, slots=True)
class Admitted:
    request: InferenceRequest
    principal: Principal
    shape: oai.Shape


async def admit_body(
    pipeline: IngressPipeline,
    parsed: oai.Body,
    principal: Principal,
    *,
    request_id: str,
    reply_to: str,
    timeout_s: float | None,
    session_id: str | None,
    client: ClientMeta,
    clock: Clock,
    region: str | None = None,
) -> Admitted | Refusal:
    """A parsed body of an authenticated client, as it goes onto its priority topic
    (``IngressPipeline.prepare``), with the shape of its answers; or why it may not.
    HTTP and WebSocket requests take this one path; ``region``: where the request was
    counted already (``IngressPipeline.arrive``)."""
    model = parsed.model or next(iter(pipeline.settings.models))
    now = clock.time()
    draft = oai.to_request(
        parsed,
        request_id=request_id,
        tenant=principal.tenant,
        model=model,
        reply_to=reply_to,
        created_at=now,
        timeout_s=timeout_s,
        session_id=session_id,
        client=client,
    )
    if isinstance(draft, Refusal):
        return draft
    prepared = await pipeline.prepare(draft, principal, region)
    if isinstance(prepared, Refusal):
        return prepared
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    shape = oai.Shape(isinstance(parsed, oai.ChatBody), request_id, model, int(now), include_usage)
    return Admitted(prepared, principal, shape)


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, credentials = authorization.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None
