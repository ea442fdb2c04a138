"""``seawall submit``: one request through the client SDK, its tokens printed as they
arrive, then a one-line summary (logfmt) of the terminal reply.

The request names its key by the key id only. A full key (``sk-sw-<key id>_<secret>``,
as ``seawall keys create`` prints it) is accepted too: its key id is read from it and
the secret never leaves this process.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TextIO

from aiokafka.errors import KafkaError
from pydantic import TypeAdapter, ValidationError

from schemas import ChatMessage, InferenceReply, ReplyChunk, ReplyStatus
from seawall_client import ReplyRouterClosed, SeawallClient
from seawall_client.signing import KEY_PREFIX, key_id_of
from services.common.settings import CommonSettings

SERVED = frozenset({ReplyStatus.OK, ReplyStatus.DEGRADED})
_MESSAGES: TypeAdapter[list[ChatMessage]] = TypeAdapter(list[ChatMessage])


def check_key(key: str | None) -> str:
    """The API key ``--key`` gave: the client signs each record with it (only its id and
    the signature travel)."""
    if key is None:
        raise ValueError(
            "give --key (or SEAWALL_API_KEY): the key as `seawall keys create` printed it"
        )
    if key_id_of(key) is None:
        raise ValueError(f"not a seawall key: expected {KEY_PREFIX}<key id>_<secret>")
    return key


def request_input(
    prompt: str | None, system: str | None, messages_json: str | None
) -> tuple[str | None, list[ChatMessage] | None]:
    """``(prompt, messages)`` for the SDK: a bare prompt, a system prompt and the user's
    prompt as chat messages, or the messages given as JSON."""
    if messages_json is not None:
        if prompt is not None or system is not None:
            raise ValueError("--messages-json takes the place of the prompt and --system")
        try:
            messages = _MESSAGES.validate_json(messages_json)
        except ValidationError as e:
            raise ValueError(f"--messages-json: {e.errors()[0]['msg']}") from None
        if not messages:
            raise ValueError("--messages-json: give at least one message")
        return None, messages
    if prompt is None:
        raise ValueError("give a prompt (or --messages-json)")
    if system is None:
        return prompt, None
    return None, [
        ChatMessage(role="system", content=system),
        ChatMessage(role="user", content=prompt),
    ]


@dataclass(frozen=True, slots=True)
class Submitted:
    reply: InferenceReply
    ttft_s: float | None
    latency_s: float
    attempts: int


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def summary_line(s: Submitted) -> str:
    r = s.reply
    fields = [
        f"status={r.status.value}",
        f"reason={r.reason.value}",
        f"prompt_tokens={r.prompt_tokens}",
        f"completion_tokens={r.completion_tokens}",
        f"ttft_ms={_ms(s.ttft_s)}",
        f"latency_ms={_ms(s.latency_s)}",
        f"worker={r.worker_id or '-'}",
        f"attempts={s.attempts}",
    ]
    if r.message:
        fields.append(f"message={json.dumps(r.message)}")
    return " ".join(fields)


async def submit(
    settings: CommonSettings,
    key: str,
    prompt: str | None,
    messages: list[ChatMessage] | None,
    *,
    max_tokens: int,
    timeout_s: float,
    stream: bool,
    out: TextIO | None,
) -> Submitted:
    """Send one request; write its text to ``out`` (as it streams in) unless ``None``.
    ``TimeoutError`` when no terminal reply came within ``timeout_s``."""
    async with SeawallClient(api_key=key, kafka=settings.kafka, timeout_s=timeout_s) as client:
        started = time.monotonic()
        first: float | None = None
        reply: InferenceReply | None = None
        if stream:
            async for item in client.stream(prompt, messages=messages, max_tokens=max_tokens):
                if isinstance(item, ReplyChunk):
                    first = time.monotonic() if first is None else first
                    if out is not None:
                        out.write(item.text)
                        out.flush()
                else:
                    reply = item
        else:
            reply = await client.complete(prompt, messages=messages, max_tokens=max_tokens)
        assert reply is not None, "a call ends with its terminal reply"
        latency = time.monotonic() - started
        if out is not None:
            if first is None:  # nothing streamed: a plain, static or refused reply
                out.write(reply.text)
            if first is not None or reply.text:
                out.write("\n")
        return Submitted(
            reply, None if first is None else first - started, latency, client.stats.attempts
        )


def run(
    settings: CommonSettings,
    key: str,
    prompt: str | None,
    messages: list[ChatMessage] | None,
    *,
    max_tokens: int,
    timeout_s: float,
    stream: bool,
    as_json: bool,
    stdout: TextIO,
    stderr: TextIO,
) -> int:
    """The command: the text (or with ``as_json`` the terminal reply as JSON) on
    ``stdout``, the summary on ``stderr``; 0 when the reply is ok or degraded."""
    try:
        result = asyncio.run(
            submit(
                settings,
                key,
                prompt,
                messages,
                max_tokens=max_tokens,
                timeout_s=timeout_s,
                stream=stream,
                out=None if as_json else stdout,
            )
        )
    except TimeoutError:
        stderr.write(f"error: no terminal reply within {timeout_s:g} s\n")
        return 1
    except (KafkaError, ReplyRouterClosed, OSError) as e:
        stderr.write(f"error: the broker did not answer ({type(e).__name__}: {e})\n")
        return 1
    if as_json:
        stdout.write(result.reply.model_dump_json() + "\n")
    stderr.write(summary_line(result) + "\n")
    return 0 if result.reply.status in SERVED else 1
