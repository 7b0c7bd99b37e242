"""The request path's connections to Redis (engine/cluster/channel.py), against a real
redis-server: a command written without waiting for its reply never hands that reply to a
later call, and a call cut off leaves no half-read connection behind."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ResponseError

from infergate.engine.cluster.channel import Channel
from infergate.engine.cluster.redis_limits import admit_answer
from tests.redis_server import RedisProcess


async def test_a_call_gets_its_own_reply_after_commands_not_waited_for(
    redis_server: RedisProcess,
) -> None:
    unread: list[ResponseError] = []
    channel = Channel(redis_server.url, 5.0, unread.append)
    try:
        assert not await channel.send(channel.pack("INCR", "n"))  # nothing open yet: not sent
        assert await channel.call(channel.pack("PING")) == b"PONG"  # raw replies
        for _ in range(3):
            assert await channel.send(channel.pack("INCR", "n"))
        await channel.call(channel.pack("SET", "word", "x"))
        assert await channel.send(channel.pack("INCR", "word"))  # answered with an error
        assert await channel.call(channel.pack("GET", "n")) == b"3"
        assert [str(e) for e in unread] == ["value is not an integer or out of range"]
    finally:
        await channel.close()


async def test_a_call_cut_off_leaves_no_reply_behind(redis_server: RedisProcess) -> None:
    channel = Channel(redis_server.url, 5.0)
    try:
        await channel.call(channel.pack("SET", "k", "v"))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):  # BLPOP answers after 5 s: cut off first
                await channel.call(channel.pack("BLPOP", "nothing", 5))
        # Its connection is closed, not left with the BLPOP's answer to come: the next
        # call, on a new one, gets its own at once.
        assert await channel.call(channel.pack("GET", "k")) == b"v"
    finally:
        await channel.close()


@pytest.mark.parametrize("reply", [b"OK", 0, [1], [1, b"0"], [7, 0], [1, -1], None])
def test_an_admission_answer_that_is_not_code_and_wait_is_redis_failing(reply: object) -> None:
    """Something behind redis_url that speaks RESP but not our script (a misrouted proxy):
    its +OK was unpacked as codes 79 and 75, which admitted every request past every
    limit, and :0 was a 500 with the Redis breaker closed. Each is Redis failing now (a
    ResponseError: the breaker, then fail_mode), never an admission."""
    with pytest.raises(ResponseError, match="not \\[code, wait\\]"):
        admit_answer(reply)
    assert admit_answer([1, 0]) == (1, 0)
    assert admit_answer([0, 250_000]) == (0, 250_000)
