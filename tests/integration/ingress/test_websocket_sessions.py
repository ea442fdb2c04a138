"""WebSocket sessions belong to the key that started them, each key's sockets and
sessions are capped, and no session key in Redis can outlive its TTL — against the
running ingress on the real broker and Redis, with a real WebSocket client."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from schemas import Tier
from seawall_client.topics import RedisKeys
from services.ingress.service import IngressService
from tests.integration.ingress.conftest import Downstream, Keys, eventually, new_key
from tests.integration.ingress.test_websocket import ask, auth, frame, url

pytestmark = pytest.mark.integration


def key_id_of(key: str) -> str:
    return key.split("_")[0].removeprefix("sk-sw-")


async def closed_with(ws: ClientConnection) -> tuple[int, str, list[dict[str, object]]]:
    """Read until the server closes: its close code and reason, and the frames before."""
    frames = []
    while True:
        try:
            frames.append(await frame(ws, timeout_s=10))
        except ConnectionClosed as closed:
            assert closed.rcvd is not None
            return closed.rcvd.code, closed.rcvd.reason, frames


async def start_session(ingress: IngressService, key: str) -> str:
    """A new session, its socket closed at once: its id."""
    async with connect(url(ingress), additional_headers=auth(key)) as ws:
        first = await frame(ws)
    assert first["type"] == "session"
    assert first["resumed"] is False
    return str(first["session_id"])


async def session_keys_without_ttl(ingress: IngressService, redis: aioredis.Redis) -> list[str]:
    """The test's session keys (hashes, owed lists, keys' session sets) with no TTL."""
    prefix = ingress.settings.redis_prefix
    names = [
        n.decode() async for n in redis.scan_iter(match=f"{prefix}*", count=1000) if b"session" in n
    ]
    return [n for n in names if await redis.pttl(n) == -1]


async def test_a_session_is_resumed_only_by_the_key_that_started_it(
    ingress: IngressService, keys: Keys, redis: aioredis.Redis
) -> None:
    """Another key of the same tenant gets what a made-up session id gets — 4004 and no
    frame — so it learns nothing of the session; the key that started it resumes it."""
    session_id = await start_session(ingress, keys.pro)
    colleague = await new_key(ingress.keystore, "pro-co", Tier.PRO)
    async with connect(url(ingress, session_id), additional_headers=auth(colleague)) as ws:
        taken = await closed_with(ws)
    async with connect(url(ingress, "0" * 32), additional_headers=auth(colleague)) as ws:
        made_up = await closed_with(ws)
    async with connect(url(ingress, "not-a-session"), additional_headers=auth(colleague)) as ws:
        malformed = await closed_with(ws)
    assert taken == made_up == malformed == (4004, "", [])
    # the session is untouched by the attempts, and still its key's
    stored = await redis.hgetall(RedisKeys(ingress.settings.redis_prefix).session(session_id))
    assert stored[b"key_id"] == key_id_of(keys.pro).encode()
    async with connect(url(ingress, session_id), additional_headers=auth(keys.pro)) as ws:
        resumed = await frame(ws)
    assert (resumed["session_id"], resumed["resumed"]) == (session_id, True)


async def test_a_session_of_an_older_version_without_its_key_is_not_resumed(
    ingress: IngressService, keys: Keys, redis: aioredis.Redis
) -> None:
    """Sessions written before they were bound to a key (tenant only) cannot be claimed
    by whichever key of the tenant asks first: they are unknown."""
    session_id = await start_session(ingress, keys.pro)
    await redis.hdel(RedisKeys(ingress.settings.redis_prefix).session(session_id), "key_id")
    async with connect(url(ingress, session_id), additional_headers=auth(keys.pro)) as ws:
        assert (await closed_with(ws))[0] == 4004


@pytest.mark.parametrize("ingress", [{"ws_max_sockets_per_key": 2}], indirect=True)
async def test_sockets_over_the_per_key_cap_are_refused_with_4005(
    ingress: IngressService, keys: Keys
) -> None:
    first = await connect(url(ingress), additional_headers=auth(keys.pro))
    second = await connect(url(ingress), additional_headers=auth(keys.pro))
    try:
        assert (await frame(first))["type"] == (await frame(second))["type"] == "session"
        async with connect(url(ingress), additional_headers=auth(keys.pro)) as third:
            code, reason, frames = await closed_with(third)
        assert (code, reason) == (4005, "too_many_sockets")
        assert [(f["type"], f["status"]) for f in frames] == [("error", 429)]
        assert frames[0]["error"]["code"] == "too_many_sockets"  # type: ignore[index]
        # another key, even of the same tenant, has its own count
        colleague = await new_key(ingress.keystore, "pro-co", Tier.PRO)
        async with connect(url(ingress), additional_headers=auth(colleague)) as other:
            assert (await frame(other))["type"] == "session"
    finally:
        await second.close()
    # under the cap again once a socket is gone (the server sees it go at once)
    deadline = time.monotonic() + 10
    while True:
        async with connect(url(ingress), additional_headers=auth(keys.pro)) as again:
            try:
                if (await frame(again))["type"] == "session":
                    break
            except ConnectionClosed:
                pass
        assert time.monotonic() < deadline, "the closed socket's place was never given back"
        await asyncio.sleep(0.05)
    await first.close()


@pytest.mark.parametrize(
    "ingress", [{"ws_max_sessions_per_key": 2, "ws_max_age_s": 3.0}], indirect=True
)
async def test_sessions_over_the_per_key_cap_are_refused_with_4006_until_one_ends(
    ingress: IngressService, keys: Keys, redis: aioredis.Redis
) -> None:
    """Live sessions count, open socket or not; resuming one is not a new one; another
    key has its own; an ended session (its maximum age) gives its place back."""
    one = await start_session(ingress, keys.pro)
    await start_session(ingress, keys.pro)
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        code, reason, frames = await closed_with(ws)
    assert (code, reason) == (4006, "too_many_sessions")
    assert frames[0]["error"]["code"] == "too_many_sessions"  # type: ignore[index]
    assert frames[0]["status"] == 429
    async with connect(url(ingress, one), additional_headers=auth(keys.pro)) as ws:
        assert (await frame(ws))["resumed"] is True
    colleague = await new_key(ingress.keystore, "pro-co", Tier.PRO)
    await start_session(ingress, colleague)

    live = RedisKeys(ingress.settings.redis_prefix).key_sessions(key_id_of(keys.pro))
    assert await redis.zcard(live) == 2
    assert 0 < await redis.pttl(live) <= 3000
    assert await session_keys_without_ttl(ingress, redis) == []
    await asyncio.sleep(3.2)  # both sessions reach their maximum age
    await start_session(ingress, keys.pro)
    assert await redis.zcard(live) == 1  # the ended ones were dropped


@pytest.mark.parametrize("ingress", [{"key_cache_s": 0}], indirect=True)
async def test_a_late_update_after_the_session_expired_recreates_no_key_without_a_ttl(
    ingress: IngressService, keys: Keys, downstream: Downstream, redis: aioredis.Redis
) -> None:
    """The session's hash expires (here early, as at the end of its TTL) while its socket
    still has a request in flight; the reply then comes, and another request is sent:
    the counts of pending requests they update must not bring the hash back without a
    TTL (HINCRBY on a missing key creates it, with none)."""
    layout = RedisKeys(ingress.settings.redis_prefix)
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        session_id = str((await frame(ws))["session_id"])
        session = layout.session(session_id)
        await ws.send(ask("a", "before the end"))
        ((_, _, first),) = await downstream.take(1)
        assert await redis.pttl(session) > 0
        await redis.pexpire(session, 1)

        async def expired() -> bool:
            return not await redis.exists(session)

        await eventually(expired)
        await downstream.answer(first, "after the end")  # its socket is still there
        assert (await frame(ws))["id"] == "a"
        await ws.send(ask("b", "another one"))
        second = (await downstream.take(2))[1][2]
        await downstream.answer(second, "still no session")
        assert (await frame(ws))["id"] == "b"
    # each count is one Redis call right after the frame went out
    await asyncio.sleep(0.5)
    assert not await redis.exists(session)
    assert not await redis.exists(layout.session_owed(session_id))
    assert await session_keys_without_ttl(ingress, redis) == []


async def test_every_session_key_has_a_ttl_through_a_reconnect_with_a_reply_owed(
    ingress: IngressService, keys: Keys, downstream: Downstream, redis: aioredis.Redis
) -> None:
    async with connect(url(ingress), additional_headers=auth(keys.pro)) as ws:
        session_id = str((await frame(ws))["session_id"])
        await ws.send(ask("owed", "answer me later"))
        ((_, _, request),) = await downstream.take(1)
    await downstream.answer(request, "kept")
    owed = RedisKeys(ingress.settings.redis_prefix).session_owed(session_id)

    async def kept() -> bool:  # the reply, for the session's next connection
        return bool(await redis.exists(owed))

    await eventually(kept)
    assert await session_keys_without_ttl(ingress, redis) == []
    async with connect(url(ingress, session_id), additional_headers=auth(keys.pro)) as ws:
        assert (await frame(ws))["resumed"] is True
        assert (await frame(ws))["id"] == "owed"
    assert await session_keys_without_ttl(ingress, redis) == []
