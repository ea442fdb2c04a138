"""WebSocket sessions at ``/v1/ws``: many chat completions over one socket, and replies
that outlive the socket.

Protocol (JSON text frames):

- The upgrade request authenticates as HTTP does (``Authorization: Bearer <key>``,
  the same user-agent and source checks). ``?session_id=<id>`` resumes a session on
  any ingress replica — only one started with the same API key (not another key of
  the tenant, not the key that replaced it at rotation: a session is a key's, as its
  reply topics are); without it a new session starts.
- The server's first frame: ``{"type": "session", "session_id", "resumed", "ping_s",
  "idle_timeout_s", "max_age_s", "max_in_flight"}``.
- The client sends chat-completion bodies (``/v1/chat/completions``'s), each with an
  optional ``"id"`` of its own (echoed on every frame of that request). Each goes
  through the same path as over HTTP — filters, quotas, priority — and several may be
  in flight at once (``ws_max_in_flight``; more are refused).
- Per request the server sends ``{"type": "chunk", "id", "request_id", "text"}`` frames
  as tokens come (when ``"stream": true``), then one final frame: ``{"type":
  "response", "id", "request_id", "response": <chat.completion>}`` or ``{"type":
  "error", "id", "request_id", "status", "error": {...}}`` (OpenAI's error body; the
  status is the HTTP one it would have had).

Close codes: 1000 the client closed; 1012 ingress is stopping (uvicorn's); 1008 the upgrade was
refused (the reason in a preceding error frame); 4001 idle — nothing in flight and
nothing received for ``ws_idle_timeout_s`` (300 s); 4002 the session reached
``ws_max_age_s`` (3,600 s); 4004 no such session for this key (whether it never
existed, ended, or is another key's: the same answer); 4005 the key has
``ws_max_sockets_per_key`` sockets open on this replica (16) and 4006 the key holds
``ws_max_sessions_per_key`` sessions (100) — each after an error frame (status 429, code
``too_many_sockets`` or ``too_many_sessions``), with that code as the close reason. The
server pings every ``ws_ping_s`` (30 s, uvicorn's protocol pings); a client that does
not answer is gone.

In Redis a session is a hash (``RedisKeys.session``: tenant, key id, start, requests
pending), its owed list, and its place in its key's set of live sessions
(``RedisKeys.key_sessions``, which enforces the cap); each expires with the session.
Every write to them is one Lua call that sets the TTL in the same step, or writes
nothing once the session is gone (``SESSION``): a late update — a reply that comes
after the session expired — cannot re-create a session key that never expires.

Replies still owed. A request's wait does not end with its socket: it goes on until
the request's deadline, and a final frame whose socket is gone is appended to the
session's owed list in Redis (``RedisKeys.session_owed``, kept until the session's
maximum age). A client reconnecting with its ``session_id`` — to this replica or any
other — first receives those frames, oldest first, and, while the session still has
requests pending anywhere, keeps receiving them as they come (polled every
``ws_poll_s``). Chunks are not kept (the final frame carries the whole text). What a
replica that dies was waiting for is lost with it, as over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from schemas import ClientMeta, InferenceReply, ReplyChunk
from seawall_client.clock import SYSTEM_CLOCK, Clock
from seawall_client.streams import ReplyRouterClosed
from seawall_client.topics import RedisKeys
from services.common.failures import is_infrastructure
from services.common.lua import Lua
from services.ingress import openai as oai
from services.ingress.admit import Admitted, admit_body, bearer, source_of
from services.ingress.answers import Waiter, deadline_error
from services.ingress.pipeline import IngressPipeline, Principal
from services.ingress.refusals import Refusal, body_too_large
from services.ingress.replies import ReplyRouter

log = logging.getLogger(__name__)

CLOSE_REFUSED = 1008
CLOSE_IDLE = 4001
CLOSE_MAX_AGE = 4002
CLOSE_UNKNOWN_SESSION = 4004
CLOSE_TOO_MANY_SOCKETS = 4005
CLOSE_TOO_MANY_SESSIONS = 4006
MAX_CLIENT_ID = 128
OWED_BATCH = 100
_SESSION_ID = re.compile(r"[0-9a-f]{32}")

SESSION = """
-- A WebSocket session's writes, each atomic with its TTL (one script: the session's
-- keys share the hash tag {session id}; the key's set has its own, {key id}).
-- ARGV[1] the op, ARGV[2] the session's maximum age (ms).
--
-- 'open'    KEYS[1] the key's live sessions (session id -> when it ends, ms);
--           ARGV[3] session id, ARGV[4] the cap. Drops the ended ones; adds this one
--           unless the key holds the cap already; the set expires with its last
--           session. 1 if added, else 0.
-- 'pending' KEYS[1] the session; ARGV[3] the change. Nothing if the session is gone.
-- 'owe'     KEYS[1] the session, KEYS[2] its owed list; ARGV[3] a final frame: kept
--           for the session's next connection, one pending fewer. Nothing if gone.
-- 'requeue' KEYS[1] the session, KEYS[2] its owed list; ARGV[3..] frames to put back
--           first in line (last first). Nothing if gone.
-- 'pending', 'owe' and 'requeue' return 1 if they wrote, 0 if the session is gone. A
-- session hash without a TTL (which only an older version's late update could leave)
-- gets the maximum age.
local op, max_age_ms = ARGV[1], tonumber(ARGV[2])

if op == 'open' then
  local clock = redis.call('TIME')
  local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
    return 0
  end
  redis.call('ZADD', KEYS[1], string.format('%d', now_ms + max_age_ms), ARGV[3])
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', KEYS[1], string.format('%d', tonumber(last[2])))
  return 1
end

local ttl = redis.call('PTTL', KEYS[1])
if ttl == -2 then
  return 0
end
if ttl == -1 then
  ttl = max_age_ms
  redis.call('PEXPIRE', KEYS[1], ttl)
end
if op == 'pending' then
  redis.call('HINCRBY', KEYS[1], 'pending', ARGV[3])
elseif op == 'owe' then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ttl)
  redis.call('HINCRBY', KEYS[1], 'pending', -1)
elseif op == 'requeue' then
  for i = 3, #ARGV do
    redis.call('LPUSH', KEYS[2], ARGV[i])
  end
  redis.call('PEXPIRE', KEYS[2], ttl)
else
  return redis.error_reply('unknown op ' .. tostring(op))
end
return 1
"""


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _error_frame(
    client_id: str | None, request_id: str | None, error: oai.ApiError
) -> dict[str, Any]:
    return {
        "type": "error",
        "id": client_id,
        "request_id": request_id,
        "status": error.status,
        **error.body(),
    }


class _Socket:
    """One connection: its sends serialised, its session, its requests in flight."""

    def __init__(self, ws: WebSocket, session_id: str, principal: Principal) -> None:
        self.ws = ws
        self.session_id = session_id
        self.principal = principal
        self.in_flight: set[asyncio.Task[None]] = set()
        self.open = True
        self._lock = asyncio.Lock()

    async def send(self, frame: dict[str, Any]) -> bool:
        """Whether the frame went out (``False``: the socket is gone)."""
        if not self.open:
            return False
        async with self._lock:
            try:
                await self.ws.send_text(json.dumps(frame))
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.open = False
                return False
        return True


class WebSocketSessions:
    """The ``/v1/ws`` endpoint (see the module docstring)."""

    def __init__(
        self,
        pipeline: IngressPipeline,
        router: ReplyRouter,
        redis: aioredis.Redis,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = pipeline.settings
        self._pipeline = pipeline
        self._router = router
        self._redis = redis
        self._keys = RedisKeys(pipeline.settings.redis_prefix)
        self._clock = clock
        self._script = Lua(redis, SESSION)
        self._sockets: dict[str, int] = {}
        """Sockets open on this replica, by key id (none: no entry)."""

    # -- the connection ----------------------------------------------------------
    async def serve(self, ws: WebSocket) -> None:
        principal = await self._authenticate(ws)
        if principal is None:
            return
        key_id = principal.key_id
        if self._sockets.get(key_id, 0) >= self.settings.ws_max_sockets_per_key:
            await self._refuse_over_cap(
                ws,
                CLOSE_TOO_MANY_SOCKETS,
                "too_many_sockets",
                "Too many WebSockets open with this API key.",
            )
            return
        self._sockets[key_id] = self._sockets.get(key_id, 0) + 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                left = self._sockets[key_id] - 1
                if left:
                    self._sockets[key_id] = left
                else:
                    del self._sockets[key_id]

        try:
            await self._serve(ws, principal, release)
        finally:
            release()

    async def _serve(
        self, ws: WebSocket, principal: Principal, release: Callable[[], None]
    ) -> None:
        """The socket's life once it holds its place under the key's cap (``release``
        gives the place back: when the socket is gone, before its requests end)."""
        session_id, resumed = await self._session(ws, principal)
        if session_id is None:
            return
        socket = _Socket(ws, session_id, principal)
        s = self.settings
        await socket.send(
            {
                "type": "session",
                "session_id": session_id,
                "resumed": resumed,
                "ping_s": s.ws_ping_s,
                "idle_timeout_s": s.ws_idle_timeout_s,
                "max_age_s": s.ws_max_age_s,
                "max_in_flight": s.ws_max_in_flight,
            }
        )
        poller = asyncio.create_task(self._deliver_owed(socket)) if resumed else None
        try:
            code = await self._receive(socket)
            if code is not None:
                with contextlib.suppress(RuntimeError, OSError):
                    await ws.close(code)
        finally:
            socket.open = False
            release()  # the socket is gone; what it asked goes on without it
            if poller is not None:
                poller.cancel()
            # The requests in flight go on until their deadlines: their finals are owed.
            if socket.in_flight:
                await asyncio.gather(*socket.in_flight, return_exceptions=True)

    async def _authenticate(self, ws: WebSocket) -> Principal | None:
        pipeline = self._pipeline
        refusal = pipeline.check_user_agent(ws.headers.get("user-agent"))
        principal = (
            refusal
            if refusal is not None
            else await pipeline.authenticate(
                bearer(ws.headers.get("authorization")),
                source=source_of(ws, self.settings.proxies),
            )
        )
        if isinstance(principal, Principal):
            return principal
        await ws.accept()
        await ws.send_text(json.dumps(_error_frame(None, None, oai.error_for_refusal(principal))))
        await ws.close(CLOSE_REFUSED)
        return None

    async def _refuse_over_cap(self, ws: WebSocket, code: int, reason: str, text: str) -> None:
        if ws.application_state == WebSocketState.CONNECTING:
            await ws.accept()
        error = oai.ApiError(429, reason, text)
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            await ws.send_text(json.dumps(_error_frame(None, None, error)))
            await ws.close(code, reason)

    async def _session(self, ws: WebSocket, principal: Principal) -> tuple[str | None, bool]:
        """The session's id and whether it was resumed; ``None`` when the asked-for one
        is not this key's (or no longer exists): closed with 4004, the same answer
        whichever, so that nobody learns another key's session ids exist; or when the
        key holds its cap of sessions: closed with 4006."""
        wanted = ws.query_params.get("session_id")
        await ws.accept()
        if wanted:
            owner = (
                await self._redis.hmget(self._keys.session(wanted), ["tenant", "key_id"])
                if _SESSION_ID.fullmatch(wanted)
                else [None, None]
            )
            if [_text(v) for v in owner] != [principal.tenant, principal.key_id]:
                await ws.close(CLOSE_UNKNOWN_SESSION)
                return None, False
            return wanted, True
        s = self.settings
        session_id = uuid.uuid4().hex
        # The key's set first (its own slot): a failure after it leaves a place taken
        # until the session would have ended, never a session past the cap.
        opened = await self._script(
            [self._keys.key_sessions(principal.key_id)],
            ["open", self._max_age_ms(), session_id, s.ws_max_sessions_per_key],
        )
        if not opened:
            await self._refuse_over_cap(
                ws,
                CLOSE_TOO_MANY_SESSIONS,
                "too_many_sessions",
                "Too many WebSocket sessions with this API key: resume one "
                "(?session_id=) or wait for one to end.",
            )
            return None, False
        key = self._keys.session(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                key,
                mapping={
                    "tenant": principal.tenant,
                    "key_id": principal.key_id,
                    "started_at": self._clock.time(),
                },
            )
            pipe.pexpire(key, self._max_age_ms())
            await pipe.execute()
        return session_id, False

    async def _receive(self, socket: _Socket) -> int | None:
        """Read requests until the client leaves (``None``) or a timeout closes the
        socket (its close code)."""
        s = self.settings
        started = await self._started_at(socket.session_id)
        idle_since = time.monotonic()
        while True:
            age_left = started + s.ws_max_age_s - self._clock.time()
            if age_left <= 0:
                return CLOSE_MAX_AGE
            wait_s = age_left
            if not socket.in_flight:
                idle_left = idle_since + s.ws_idle_timeout_s - time.monotonic()
                if idle_left <= 0:
                    return CLOSE_IDLE
                wait_s = min(wait_s, idle_left)
            try:
                async with asyncio.timeout(min(wait_s, 1.0)):  # not wait_for: see wait_set
                    text = await socket.ws.receive_text()
            except TimeoutError:
                if socket.in_flight:
                    idle_since = time.monotonic()  # a request in flight is not idleness
                continue
            except (WebSocketDisconnect, RuntimeError):
                return None
            except KeyError:  # a binary frame
                text = ""
            idle_since = time.monotonic()
            self._accept(socket, text)

    def _accept(self, socket: _Socket, text: str) -> None:
        """Parse one client frame and start its request (or answer why not); a frame
        over the request limit is answered before it is parsed (with no ``id``: reading
        it would be parsing it)."""
        client_id: str | None = None
        if len(text) * 4 > (limit := self.settings.max_request_bytes) and (
            len(text.encode()) > limit
        ):
            error = oai.error_for_refusal(body_too_large(limit))
            self._spawn(socket, socket.send(_error_frame(None, None, error)))
            return
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("id"), str):
            client_id = data.pop("id")[:MAX_CLIENT_ID]
        if len(socket.in_flight) >= self.settings.ws_max_in_flight:
            error = oai.ApiError(
                429, "too_many_in_flight", "Too many requests in flight on this socket."
            )
            self._spawn(socket, socket.send(_error_frame(client_id, None, error)))
            return
        # Not larger than the frame: non-ASCII text is kept as it came, not escaped.
        body = (
            json.dumps(data, ensure_ascii=False).encode()
            if isinstance(data, dict)
            else text.encode()
        )
        self._spawn(socket, self._request(socket, client_id, body))

    def _spawn(self, socket: _Socket, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        socket.in_flight.add(task)
        task.add_done_callback(socket.in_flight.discard)

    # -- one request -------------------------------------------------------------
    async def _request(self, socket: _Socket, client_id: str | None, body: bytes) -> None:
        request_id = uuid.uuid4().hex
        try:
            await self._run(socket, client_id, request_id, body)
        except Exception as e:  # this request's failure: answered, the socket goes on
            unavailable = is_infrastructure(e)
            log.warning(
                "a WebSocket request failed",
                extra={"request_id": request_id, "error": type(e).__name__},
            )
            error = (
                oai.ApiError(503, "unavailable", "The service is unavailable; retry later.")
                if unavailable
                else oai.ApiError(500, "internal_error", "The request failed.")
            )
            await socket.send(_error_frame(client_id, request_id, error))

    async def _run(
        self, socket: _Socket, client_id: str | None, request_id: str, body: bytes
    ) -> None:
        admitted = await self._admit(socket, body, request_id)
        if isinstance(admitted, Refusal):
            await socket.send(_error_frame(client_id, request_id, oai.error_for_refusal(admitted)))
            return
        req = admitted.request
        stream = self._router.register(request_id)
        try:
            await (await self._pipeline.publish(req))
        except BaseException:
            self._router.unregister(request_id)
            raise
        await self._pending(socket.session_id, +1)
        waiter = Waiter(self._pipeline, self._router, stream, req, self._clock)
        try:
            final = await self._answer(
                socket, client_id, request_id, waiter, admitted.shape, req.stream
            )
        finally:
            await waiter.close()
        if not await socket.send(final):
            await self._owe(socket.session_id, final)
        else:
            await self._pending(socket.session_id, -1)

    async def _admit(self, socket: _Socket, body: bytes, request_id: str) -> Admitted | Refusal:
        too_large = IngressPipeline.check_size(body, self.settings.max_request_bytes)
        if too_large is not None:
            return too_large
        parsed = oai.parse_body(body, oai.ChatBody)
        if isinstance(parsed, Refusal):
            return parsed
        ws = socket.ws
        return await admit_body(
            self._pipeline,
            parsed,
            socket.principal,
            request_id=request_id,
            reply_to=self._router.topic,
            timeout_s=None,
            session_id=parsed.user or socket.session_id,
            client=ClientMeta(
                user_agent=(ws.headers.get("user-agent") or "")[:512],
                client_ip=source_of(ws, self.settings.proxies),
            ),
            clock=self._clock,
        )

    async def _answer(
        self,
        socket: _Socket,
        client_id: str | None,
        request_id: str,
        waiter: Waiter,
        shape: oai.Shape,
        stream: bool,
    ) -> dict[str, Any]:
        """Chunks as they come, if the client asked to stream (while its socket is
        there); the final frame."""
        while True:
            try:
                item = await waiter.next()
            except ReplyRouterClosed:
                stopping = oai.ApiError(503, "shutting_down", "Ingress is stopping.")
                return _error_frame(client_id, request_id, stopping)
            if isinstance(item, TimeoutError):
                return _error_frame(client_id, request_id, deadline_error())
            if isinstance(item, ReplyChunk):
                if stream:
                    await socket.send(
                        {
                            "type": "chunk",
                            "id": client_id,
                            "request_id": request_id,
                            "text": item.text,
                        }
                    )
                continue
            assert isinstance(item, InferenceReply)
            error = oai.error_for_reply(item, self.settings.retry_after_s)
            if error is not None:
                return _error_frame(client_id, request_id, error)
            return {
                "type": "response",
                "id": client_id,
                "request_id": request_id,
                "response": shape.response(item),
            }

    # -- the session in Redis ----------------------------------------------------
    async def _started_at(self, session_id: str) -> float:
        raw = await self._redis.hget(self._keys.session(session_id), "started_at")
        return float(raw) if raw is not None else self._clock.time()

    def _max_age_ms(self) -> int:
        return int(self.settings.ws_max_age_s * 1000)

    async def _pending(self, session_id: str, delta: int) -> None:
        """Count a request pending for the session (or one fewer); a session that is
        gone counts nothing (and is not re-created)."""
        await self._script([self._keys.session(session_id)], ["pending", self._max_age_ms(), delta])

    async def _owe(self, session_id: str, frame: dict[str, Any]) -> None:
        """Keep a final frame for the session's next connection (as long as the session
        lives; one that is gone keeps nothing)."""
        key, owed = self._keys.session(session_id), self._keys.session_owed(session_id)
        await self._script([key, owed], ["owe", self._max_age_ms(), json.dumps(frame)])

    async def _deliver_owed(self, socket: _Socket) -> None:
        """Send what the session is owed, then go on while requests are pending."""
        key, owed = (
            self._keys.session(socket.session_id),
            self._keys.session_owed(socket.session_id),
        )
        while socket.open:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.lpop(owed, OWED_BATCH)
                pipe.hget(key, "pending")
                frames, pending = await pipe.execute()
            frames = frames or []
            for i, raw in enumerate(frames):
                if not await socket.send(json.loads(raw)):
                    # gone again: what was not sent goes back first in line, in order
                    # (unless the session ended meanwhile: then nothing is owed)
                    await self._script(
                        [key, owed], ["requeue", self._max_age_ms(), *reversed(frames[i:])]
                    )
                    return
            if not frames and int(pending or 0) <= 0:
                return
            if not frames:
                await asyncio.sleep(self.settings.ws_poll_s)
