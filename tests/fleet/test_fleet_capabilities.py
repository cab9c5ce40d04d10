"""What an EngineFleet claims (aiosync.capabilities) when its members differ, and its
one generation contract: sampling parameters resolved once, before any member runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from aiosync import Generation, SamplingParams, TransportError
from aiosync.capabilities import (
    EngineSet,
    PausableEngine,
)
from aiosync.engines.fleet import EngineFleet, RespawningEngine
from tests._support.checks import ENGINE_CAPABILITIES


class _Bare:
    """An engine with only the Engine methods: nothing to pause, label or report."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        self.calls.append("wake")

    async def finish_generation(self) -> None:
        self.calls.append("sleep")


class _Full(_Bare):
    """An engine with every optional capability the fleet forwards."""

    def __init__(self, tags: frozenset[str] = frozenset(), offset: int = 0) -> None:
        super().__init__()
        self.asleep_tags = tags
        self.listeners: list[Callable[[], None]] = []
        self.offset = offset
        self.received: list[tuple[list[list[int]], SamplingParams | None, dict[str, Any]]] = []

    async def pause_generation(self, mode: str, clear_cache: bool = True) -> None:
        self.calls.append(f"pause {mode} {clear_cache}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def on_weights_committed(self, version: int) -> None:
        self.calls.append(f"version {version}")

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        self.listeners.remove(listener)

    async def respawn_dead_workers(self) -> list[int]:
        return [0]

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        **keywords: Any,
    ) -> list[Generation]:
        self.received.append(([list(p) for p in prompts], params, keywords))
        return [Generation(token_ids=[p[0] + self.offset]) for p in prompts]


def test_the_fleet_claims_every_capability_it_forwards() -> None:
    fleet = EngineFleet([_Full(), _Bare()])
    for protocol in (*ENGINE_CAPABILITIES, EngineSet, RespawningEngine):
        assert isinstance(fleet, protocol), protocol.__name__
    assert not isinstance(_Bare(), PausableEngine)


async def test_pause_resume_and_version_reach_only_the_members_that_have_them() -> None:
    full, bare = _Full(), _Bare()
    fleet = EngineFleet([full, bare])
    await fleet.pause_generation("keep", clear_cache=False)
    await fleet.on_weights_committed(3)
    await fleet.resume_generation()
    await fleet.prepare_for_generation(["weights"])
    assert full.calls == ["pause keep False", "version 3", "resume", "wake"]
    assert bare.calls == ["wake"]
    with pytest.raises(ValueError, match="mode must be one of"):
        await fleet.pause_generation("later")  # type: ignore[arg-type]
    assert full.calls[-1] == "wake"  # no member was told


def test_asleep_tags_are_unknown_unless_every_member_reports() -> None:
    both = EngineFleet([_Full(frozenset({"weights"})), _Full(frozenset({"kv_cache"}))])
    assert both.asleep_tags == frozenset({"weights", "kv_cache"})
    assert EngineFleet([_Full(frozenset({"weights"})), _Bare()]).asleep_tags is None


class _Dead(_Full):
    """A member whose health check fails (its worker died)."""

    async def check_health(self) -> None:
        raise TransportError("engine worker(s) [0] died")


async def test_discard_notices_reach_the_fleets_listeners_unless_quarantined() -> None:
    well, dead = _Full(), _Dead()
    fleet = EngineFleet([well, dead, _Bare()], on_engine_failure="quarantine")
    heard: list[str] = []

    def second() -> None:
        heard.append("second")

    fleet.add_weights_discarded_listener(lambda: heard.append("first"))
    fleet.add_weights_discarded_listener(second)
    (notify,) = well.listeners  # one relay per member, whatever listens to the fleet
    notify()
    assert heard == ["first", "second"]
    fleet.remove_weights_discarded_listener(second)
    assert await fleet.set_aside_failed(TransportError("the sync failed")) == [
        (
            "engine 1 of 3 (_Dead)",
            "TransportError: engine worker(s) [0] died "
            "(after the sync failed with TransportError('the sync failed'))",
        )
    ]
    heard.clear()
    for engine in (well, dead):
        for notify in engine.listeners:
            notify()
    assert heard == ["first"]  # the quarantined member's notice reaches no one


async def test_respawn_asks_only_the_members_that_respawn() -> None:
    fleet = EngineFleet([_Bare(), _Full()])
    assert await fleet.respawn_dead_workers() == [0]  # no offsets yet: local rank


async def test_sampling_parameters_are_resolved_once_and_extras_pass_through() -> None:
    a, b = _Full(offset=100), _Full(offset=200)
    fleet = EngineFleet([a, b])
    out = await fleet.generate([[1], [2], [3]], max_new_tokens=4, seed=7, timeout_s=5.0)
    assert out == [[101], [202], [103]]  # engine i gets prompts i, i + n, ...
    expected = SamplingParams(max_tokens=4, seed=7)
    assert a.received == [([[1], [3]], expected, {"timeout_s": 5.0})]
    assert b.received == [([[2]], expected, {"timeout_s": 5.0})]


async def test_bad_sampling_parameters_fail_before_any_member_generates() -> None:
    a, b = _Full(), _Full()
    fleet = EngineFleet([a, b])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        await fleet.generate_with_meta([[1], [2]], max_new_tokens=0)
    with pytest.raises(TypeError, match="needs params=SamplingParams"):
        await fleet.generate([[1]])
    assert a.received == b.received == []


async def test_a_member_that_cannot_generate_is_named_before_any_generation() -> None:
    full = _Full()
    fleet = EngineFleet([full, _Bare()])
    with pytest.raises(TypeError, match=r"engine 1 of 2 \(_Bare\) has no generate_with_meta"):
        await fleet.generate([[1], [2]], max_new_tokens=1)
    assert full.received == []
