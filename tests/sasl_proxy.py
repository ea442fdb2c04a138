"""A SASL-authenticating front for the embedded broker, for the client tests.

Tansu 0.6.0 cannot log a SCRAM user in (SECURITY.md, "Kafka connections": its
credential store keeps none), and Apache Kafka cannot run here. So the tests that show
a client authenticating put this in front of a real Tansu, as the TLS tests put a TLS
terminator: it speaks Kafka's SASL exchange itself (``SaslHandshake``, then
``SaslAuthenticate`` frames, KIP-152) — SCRAM-SHA-256/512 by ``scramp``'s server (RFC
5802/7677, not a re-implementation of ours) and PLAIN (RFC 4616) — and, once a client has
logged in, relays its bytes to the broker unchanged. A client that sends anything else
before logging in, or fails to, is cut off, as Apache Kafka does
(``SaslServerAuthenticator``: ``ILLEGAL_SASL_STATE``, ``SASL_AUTHENTICATION_FAILED``).
The broker advertises the front's address, so every connection a client opens after
the bootstrap comes back through it.

Frames (Kafka protocol guide): ``int32`` size, then a request header — ``int16`` API
key, ``int16`` version, ``int32`` correlation id, nullable ``int16``-length client id,
and tagged fields from the flexible versions on (``SaslAuthenticate`` v2) — and the
body; a response starts with the correlation id (and tagged fields where flexible).
"""

from __future__ import annotations

import asyncio
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

from scramp import ScramException, ScramMechanism

from tests.relays import RelayServer, pipe

API_VERSIONS = 18
SASL_HANDSHAKE = 17
SASL_AUTHENTICATE = 36
SASL_AUTHENTICATION_FAILED = 58
UNSUPPORTED_SASL_MECHANISM = 33
SCRAM = ("SCRAM-SHA-512", "SCRAM-SHA-256")
MECHANISMS = (*SCRAM, "PLAIN")


def _uvarint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _put_uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        if value < 0x80:
            out.append(value)
            return bytes(out)
        out.append((value & 0x7F) | 0x80)
        value >>= 7


def _skip_tags(data: bytes, at: int) -> int:
    count, at = _uvarint(data, at)
    for _ in range(count):
        _, at = _uvarint(data, at)
        size, at = _uvarint(data, at)
        at += size
    return at


@dataclass(frozen=True, slots=True)
class Request:
    api_key: int
    version: int
    correlation_id: int
    body: bytes

    @classmethod
    def parse(cls, frame: bytes, *, flexible: bool) -> Request:
        api_key, version, correlation_id, client_len = struct.unpack_from(">hhih", frame)
        at = 10 + max(client_len, 0)
        if flexible:
            at = _skip_tags(frame, at)
        return cls(api_key, version, correlation_id, frame[at:])


def _string(value: str | None) -> bytes:
    if value is None:
        return struct.pack(">h", -1)
    raw = value.encode()
    return struct.pack(">h", len(raw)) + raw


def handshake_response(correlation_id: int, mechanism: str) -> bytes:
    error = 0 if mechanism in MECHANISMS else UNSUPPORTED_SASL_MECHANISM
    body = struct.pack(">hi", error, len(MECHANISMS)) + b"".join(_string(m) for m in MECHANISMS)
    return struct.pack(">i", correlation_id) + body


def authenticate_response(
    request: Request, token: bytes, error: int = 0, message: str | None = None
) -> bytes:
    if request.version >= 2:  # flexible: header v1, compact fields
        raw = None if message is None else message.encode()
        text = b"\x00" if raw is None else _put_uvarint(len(raw) + 1) + raw
        body = (
            struct.pack(">h", error)
            + text
            + _put_uvarint(len(token) + 1)
            + token
            + struct.pack(">q", 0)
            + b"\x00"
        )
        return struct.pack(">i", request.correlation_id) + b"\x00" + body
    body = struct.pack(">h", error) + _string(message) + struct.pack(">i", len(token)) + token
    if request.version >= 1:
        body += struct.pack(">q", 0)  # session lifetime: none
    return struct.pack(">i", request.correlation_id) + body


def auth_bytes(request: Request) -> bytes:
    if request.version >= 2:
        size, at = _uvarint(request.body, 0)
        return request.body[at : at + size - 1]
    (size,) = struct.unpack_from(">i", request.body)
    return request.body[4 : 4 + size]


class SaslFront(RelayServer):
    """Listens on ``port``; a client that logs in as one of ``users`` (name to
    password) is relayed to the broker on ``upstream``. ``logins`` counts the logins
    by (mechanism, user); ``refusals`` the connections cut off, by reason."""

    def __init__(self, port: int, upstream: int, users: dict[str, str]) -> None:
        super().__init__(port)
        self.upstream = upstream
        self.logins: Counter[tuple[str, str]] = Counter()
        self.refusals: Counter[str] = Counter()
        self._auth_info = {
            name: {
                user: ScramMechanism(name).make_auth_info(password, iteration_count=4096)
                for user, password in users.items()
            }
            for name in SCRAM
        }
        self._users = users

    async def relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        try:
            if await self._login(reader, writer, up_reader, up_writer):
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            up_writer.close()

    async def _login(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> bool:
        """Run one client's SASL exchange; whether it logged in."""
        mechanism: str | None = None
        server = None
        user: list[str] = []  # the name the SCRAM exchange looked up
        while True:
            frame = await _read_frame(reader)
            api_key = struct.unpack_from(">h", frame)[0]
            if api_key == API_VERSIONS:  # before the handshake: the broker answers
                up_writer.write(struct.pack(">i", len(frame)) + frame)
                await up_writer.drain()
                _send(writer, await _read_frame(up_reader))
                continue
            request = Request.parse(
                frame, flexible=api_key == SASL_AUTHENTICATE and _version(frame) >= 2
            )
            if api_key == SASL_HANDSHAKE and mechanism is None:
                (size,) = struct.unpack_from(">h", request.body)
                mechanism = request.body[2 : 2 + size].decode()
                _send(writer, handshake_response(request.correlation_id, mechanism))
                if mechanism not in MECHANISMS:
                    self.refusals["mechanism"] += 1
                    return False
                continue
            if api_key != SASL_AUTHENTICATE or mechanism is None:
                self.refusals["not_authenticated"] += 1
                return False
            token = auth_bytes(request)
            if mechanism == "PLAIN":
                _, user, password = token.decode().split("\x00")
                if self._users.get(user) != password:
                    return self._fail(writer, request, "PLAIN")
                _send(writer, authenticate_response(request, b""))
                self.logins[("PLAIN", user)] += 1
                return True
            try:
                if server is None:
                    known = self._auth_info[mechanism]

                    def lookup(
                        name: str, known: dict[str, Any] = known, user: list[str] = user
                    ) -> Any:
                        user.append(name)
                        return known[name]

                    server = ScramMechanism(mechanism).make_server(lookup)
                    server.set_client_first(token.decode())
                    first = server.get_server_first().encode()
                    _send(writer, authenticate_response(request, first))
                    continue
                server.set_client_final(token.decode())
            except (ScramException, KeyError):
                return self._fail(writer, request, mechanism)
            _send(writer, authenticate_response(request, server.get_server_final().encode()))
            self.logins[(mechanism, user[-1])] += 1
            return True

    def _fail(self, writer: asyncio.StreamWriter, request: Request, mechanism: str) -> bool:
        self.refusals[f"{mechanism} failed"] += 1
        _send(
            writer,
            authenticate_response(
                request, b"", SASL_AUTHENTICATION_FAILED, "Authentication failed"
            ),
        )
        return False


def _version(frame: bytes) -> int:
    return int(struct.unpack_from(">h", frame, 2)[0])


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = struct.unpack(">i", await reader.readexactly(4))
    return await reader.readexactly(size)


def _send(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(struct.pack(">i", len(payload)) + payload)
