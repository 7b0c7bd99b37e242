"""/metrics and every model's statistics are open to any client as often as it likes:
server/paced_render.py renders once for all who wait, never an answer older than its
question, and keeps rendering to a quarter of the time however many ask."""

from __future__ import annotations

import asyncio

import pytest

from infergate.clock import FakeClock
from infergate.server.paced_render import PacedRender


class Renderer:
    """A render that takes `took` seconds of the fake clock, held until released."""

    def __init__(self, clock: FakeClock, took: float = 1.0) -> None:
        self.clock, self.took = clock, took
        self.renders = 0
        self.release = asyncio.Event()
        self.fail_next = False
        self.slept: list[float] = []

    async def render(self) -> int:
        await self.release.wait()
        self.clock.advance(self.took)
        self.renders += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("registry broke")
        return self.renders

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock.advance(seconds)

    def paced(self) -> PacedRender[int]:
        return PacedRender(self.render, busy_share=0.25, clock=self.clock, sleep=self.sleep)


async def _until_started(renderer: Renderer, renders: int) -> None:
    for _ in range(100):  # a few loop turns: the render's task starts
        await asyncio.sleep(0)
    assert renderer.renders == renders


def test_askers_share_a_render_and_one_asking_during_it_gets_the_next() -> None:
    async def scenario() -> tuple[list[int], list[int], int]:
        renderer = Renderer(FakeClock())
        paced = renderer.paced()
        first = [asyncio.ensure_future(paced.get()) for _ in range(5)]
        await _until_started(renderer, 0)  # the render started, held
        later = [asyncio.ensure_future(paced.get()) for _ in range(3)]
        renderer.release.set()
        return (
            list(await asyncio.gather(*first)),
            list(await asyncio.gather(*later)),
            renderer.renders,
        )

    first, later, renders = asyncio.run(scenario())
    assert first == [1] * 5  # five askers, one render
    assert later == [2] * 3  # asked during render 1: it may miss what they did, so render 2
    assert renders == 2


def test_a_render_waits_three_times_the_last_ones_time_and_a_lone_ask_after_idle_none() -> None:
    async def scenario() -> list[float]:
        clock = FakeClock()
        renderer = Renderer(clock, took=0.02)
        renderer.release.set()
        paced = renderer.paced()
        assert await paced.get() == 1  # nothing rendered before: no wait
        assert await paced.get() == 2  # right after: waits 3 × 20 ms
        clock.advance(10.0)
        assert await paced.get() == 3  # idle long enough: no wait
        return renderer.slept

    assert asyncio.run(scenario()) == [pytest.approx(0.06)]


def test_a_failed_render_fails_its_askers_and_the_next_ask_renders_again() -> None:
    async def scenario() -> int:
        renderer = Renderer(FakeClock())
        renderer.release.set()
        renderer.fail_next = True
        paced = renderer.paced()
        asks = [asyncio.ensure_future(paced.get()) for _ in range(2)]
        results = await asyncio.gather(*asks, return_exceptions=True)
        assert [str(r) for r in results] == ["registry broke"] * 2
        return await paced.get()

    assert asyncio.run(scenario()) == 2


def test_an_asker_that_leaves_leaves_the_render_to_the_others() -> None:
    async def scenario() -> int:
        renderer = Renderer(FakeClock())
        paced = renderer.paced()
        leaving = asyncio.ensure_future(paced.get())
        staying = asyncio.ensure_future(paced.get())
        await _until_started(renderer, 0)
        leaving.cancel()
        renderer.release.set()
        return await staying

    assert asyncio.run(scenario()) == 1


def test_the_pause_after_a_slow_render_is_at_most_a_second() -> None:
    """A render's time may be a wait that is not its work (a slow NVML sample): paced at
    three times a 4 s render, the next scrape would miss Prometheus's 10 s timeout."""

    async def scenario() -> list[float]:
        renderer = Renderer(FakeClock(), took=4.0)
        renderer.release.set()
        paced = renderer.paced()
        await paced.get()
        await paced.get()
        return renderer.slept

    assert asyncio.run(scenario()) == [pytest.approx(1.0)]
