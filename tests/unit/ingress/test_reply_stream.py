"""One request's reply stream (the router's per-request part), without a broker."""

from __future__ import annotations

import asyncio

import pytest

from schemas import InferenceReply, ReplyChunk, ReplyStatus
from services.common.replies import ReplyRouterClosed, ReplyStream

pytestmark = pytest.mark.unit


def chunk(seq: int) -> ReplyChunk:
    return ReplyChunk(request_id="r", seq=seq, text=str(seq))


def terminal(text: str = "") -> InferenceReply:
    return InferenceReply(request_id="r", status=ReplyStatus.OK, text=text, completed_at=1.0)


async def test_chunks_once_then_the_first_terminal_and_nothing_after() -> None:
    stream = ReplyStream("r")
    accepted = [
        stream.deliver(chunk(0)),
        stream.deliver(chunk(1)),
        stream.deliver(chunk(0)),
        stream.deliver(terminal("first")),
        stream.deliver(terminal("second")),
        stream.deliver(chunk(2)),
    ]
    assert accepted == [True, True, False, True, False, False]
    items = [item async for item in stream]
    assert items == [chunk(0), chunk(1), terminal("first")]
    with pytest.raises(StopAsyncIteration):
        await stream.next()


async def test_result_skips_chunks() -> None:
    stream = ReplyStream("r")
    stream.deliver(chunk(0))
    stream.deliver(terminal("t"))
    assert (await stream.result()).text == "t"


async def test_close_wakes_a_waiting_reader_unless_it_is_answered() -> None:
    stream = ReplyStream("r")
    waiting = asyncio.create_task(stream.result())
    await asyncio.sleep(0)
    stream.close(ReplyRouterClosed("gone"))
    with pytest.raises(ReplyRouterClosed):
        await waiting

    answered = ReplyStream("r")
    answered.deliver(terminal("t"))
    answered.close(ReplyRouterClosed("gone"))
    assert (await answered.result()).text == "t"
