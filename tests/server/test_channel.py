"""DirectChannel's reading of how a compiled call ends (psg_server.channel).

The real channel, compiled graph and death watch are exercised end to end in test_pool.py (results,
call counting, a worker SIGKILLed mid-shard). Which of two things Ray reports first when the actor
under a call dies (the call's channel failing, or the actor's death watch) is a race the tests there
cannot choose; here a stand-in graph plays each ending on purpose, so that every order is covered:
a broken channel must read as a lost actor (the shard is retried), never as the step's own error.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray import exceptions as ray_errors

from psg_server.channel import DirectChannel


class _Graph:
    """What DirectChannel uses of a compiled graph: ``execute_async`` (an awaitable of an awaitable
    of the reply) and ``teardown``."""

    def __init__(self, ending: BaseException | bytes, after_s: float) -> None:
        self.ending = ending
        self.after_s = after_s
        self.torn_down = False

    async def execute_async(self, packed: bytes) -> Any:
        async def reply() -> bytes:
            await asyncio.sleep(self.after_s)
            if isinstance(self.ending, BaseException):
                raise self.ending
            return self.ending + packed

        return reply()

    def teardown(self) -> None:
        self.torn_down = True


def _died() -> ray_errors.ActorDiedError:
    return ray_errors.ActorDiedError()


async def _call(ending: BaseException | bytes, watch_after_s: float | None,
                reply_after_s: float = 0.01) -> tuple[DirectChannel, Any]:
    """Calls a channel whose reply ends with ``ending`` ``reply_after_s`` seconds in and whose watch
    fails with the actor's death ``watch_after_s`` seconds in (None: never); returns the channel and
    the result or the error raised."""
    loop = asyncio.get_running_loop()
    watch: asyncio.Future[Any] = loop.create_future()
    if watch_after_s is not None:
        loop.call_later(watch_after_s, lambda: watch.done() or watch.set_exception(_died()))
    graph = _Graph(ending, reply_after_s)
    channel = DirectChannel(graph, watch, "worker-0")
    try:
        return channel, await channel.call(b"!")
    except BaseException as error:  # noqa: BLE001 (the test reads which one)
        # A channel that gave up on its actor is torn down (the supervisor awaits this at close).
        if not channel.usable:
            assert await channel.wait_closed(5.0) and channel.torn_down and graph.torn_down
        return channel, error


def test_reply_comes_back() -> None:
    channel, result = asyncio.run(_call(b"ok", None))
    assert result == b"ok!"
    assert channel.usable


def test_the_computations_error_is_raised_as_is_and_the_channel_stays() -> None:
    error = ray_errors.RayTaskError("run_packed", "Traceback: ValueError: bad shard", ValueError("bad shard"))
    channel, result = asyncio.run(_call(error, None))
    assert result is error
    assert channel.usable


@pytest.mark.parametrize("broken", [ray_errors.RayChannelError("channel closed"),
                                    TypeError("'RayChannelError' object is not iterable")],
                         ids=["channel-error", "ray-typeerror"])
def test_a_broken_channel_reads_as_the_actors_death(broken: BaseException) -> None:
    # The channel fails first, the watch reports the death a little later: the caller gets the death.
    channel, result = asyncio.run(_call(broken, 0.2))
    assert isinstance(result, ray_errors.ActorDiedError)
    assert result.__cause__ is broken
    assert not channel.usable


def test_a_broken_channel_without_word_from_the_watch_is_a_lost_actor() -> None:
    channel, result = asyncio.run(_call(ray_errors.RayChannelError("channel closed"), None))
    assert isinstance(result, ray_errors.RayActorError)
    assert "direct channel to worker-0 broke (RayChannelError" in str(result)
    assert not channel.usable


def test_the_watch_winning_fails_the_call_with_the_death() -> None:
    # A compiled call whose actor died may never complete: the watch ends it.
    channel, result = asyncio.run(_call(b"never", 0.05, reply_after_s=60.0))
    assert isinstance(result, ray_errors.ActorDiedError)
    assert not channel.usable


def test_a_channel_known_lost_refuses_the_next_call_at_once() -> None:
    async def run() -> Any:
        channel, _ = await _call(b"never", 0.05, reply_after_s=60.0)
        try:
            return await channel.call(b"again")
        except BaseException as error:  # noqa: BLE001
            return error

    assert isinstance(asyncio.run(run()), ray_errors.ActorDiedError)
