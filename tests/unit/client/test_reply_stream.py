"""One request's reply stream (the router's per-request part), without a broker:
duplicates dropped, and two generations of one request never spliced."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import InferenceReply, ReasonCode, ReplyChunk, ReplyStatus
from seawall_client.clock import ManualClock
from seawall_client.streams import ReplyItem, ReplyRouterClosed, ReplyRoutes, ReplyStream

pytestmark = pytest.mark.unit


def chunk(seq: int, gen: int = 0, text: str | None = None) -> ReplyChunk:
    return ReplyChunk(
        request_id="r", seq=seq, text=str(seq) if text is None else text, generation=gen
    )


def terminal(text: str = "", gen: int = 0) -> InferenceReply:
    return InferenceReply(
        request_id="r", status=ReplyStatus.OK, text=text, completed_at=1.0, generation=gen
    )


def drain(stream: ReplyStream) -> list[ReplyItem]:
    items = []
    while not stream._queue.empty():
        item = stream._queue.get_nowait()
        assert not isinstance(item, ReplyRouterClosed)
        items.append(item)
    return items


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
    assert accepted == [
        "delivered",
        "delivered",
        "duplicate",
        "delivered",
        "duplicate",
        "duplicate",
    ]
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


def test_a_newer_generation_takes_over_while_no_text_was_delivered() -> None:
    stream = ReplyStream("r")
    assert stream.deliver(chunk(0, gen=1, text="")) == "delivered"
    assert stream.deliver(chunk(0, gen=2, text="b")) == "delivered"  # seq counts anew
    assert stream.deliver(chunk(1, gen=1, text="a")) == "superseded"
    assert stream.deliver(terminal("a", gen=1)) == "superseded"
    assert stream.deliver(terminal("b", gen=2)) == "delivered"
    assert [i.generation for i in drain(stream)] == [1, 2, 2]


def test_a_newer_generation_after_text_ends_the_stream_with_an_error() -> None:
    stream = ReplyStream("r")
    stream.deliver(chunk(0, gen=1, text="hello"))
    assert stream.deliver(chunk(0, gen=2, text="other")) == "interrupted"
    items = drain(stream)
    assert items[0] == chunk(0, gen=1, text="hello")
    end = items[1]
    assert isinstance(end, InferenceReply)
    assert (end.status, end.reason) == (ReplyStatus.ERROR, ReasonCode.STREAM_INTERRUPTED)
    assert stream.deliver(terminal("other", gen=2)) == "duplicate"  # the stream is over


def test_a_terminal_reply_of_another_generation_never_follows_streamed_text() -> None:
    stream = ReplyStream("r")
    stream.deliver(chunk(0, gen=1, text="hel"))
    assert stream.deliver(terminal("hello there", gen=2)) == "interrupted"
    assert stream.terminal is not None
    assert stream.terminal.reason is ReasonCode.STREAM_INTERRUPTED


def test_rejections_carry_no_generation_and_always_end_the_stream() -> None:
    stream = ReplyStream("r")
    stream.deliver(chunk(0, gen=3, text="x"))
    rejected = InferenceReply(request_id="r", status=ReplyStatus.EXPIRED, completed_at=1.0)
    assert stream.deliver(rejected) == "delivered"


@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(0, 4), st.booleans()), min_size=1, max_size=30
    )
)
def test_what_is_delivered_is_one_generation_in_order_and_its_terminal_matches(
    arrivals: list[tuple[int, int, bool]],
) -> None:
    """Any interleaving of three generations' chunks and terminal replies (each
    generation streams seq 0.. in order, and its terminal text is its chunks' text):
    the reader gets one generation's chunks, each once, and either that generation's
    terminal reply — whose text is what was streamed — or the interruption error."""
    gens = {g: {"seq": 0, "done": False} for g in (1, 2, 3)}
    stream = ReplyStream("r")
    for gen, _, last in arrivals:
        g = gens[gen]
        if g["done"]:
            continue
        if last:
            text = "".join(f"{gen}.{i} " for i in range(int(g["seq"])))
            stream.deliver(terminal(text, gen=gen))
            g["done"] = True
        else:
            stream.deliver(chunk(int(g["seq"]), gen=gen, text=f"{gen}.{g['seq']} "))
            g["seq"] = int(g["seq"]) + 1
    items = drain(stream)
    chunks = [i for i in items if isinstance(i, ReplyChunk)]
    assert len({c.generation for c in chunks}) <= 1
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    ends = [i for i in items if isinstance(i, InferenceReply)]
    assert len(ends) <= 1
    if ends and ends[0].reason is not ReasonCode.STREAM_INTERRUPTED:
        streamed = "".join(c.text for c in chunks)
        assert ends[0].text == streamed


def test_routes_are_settled_only_when_no_reply_can_still_come() -> None:
    """What decides whether a reply topic's owner may delete it on close."""
    clock = ManualClock()
    routes = ReplyRoutes(clock)
    assert routes.settled(due_s=60)  # nothing ever asked
    routes.register("answered")
    assert not routes.settled(due_s=60)  # waiting
    routes.route(InferenceReply(request_id="answered", status=ReplyStatus.OK, completed_at=1.0))
    routes.unregister("answered")
    assert routes.settled(due_s=60)  # its terminal reply came: nothing more will
    routes.register("given-up")
    routes.unregister("given-up")  # timed out: the fleet may still answer it
    assert not routes.settled(due_s=60)
    clock.advance(59)
    assert not routes.settled(due_s=60)
    clock.advance(1)
    assert routes.settled(due_s=60)
