"""Catch-up from a peer: ``EngineFleet.add_engine(engine, source="peer")`` then
``fleet.catch_up()`` over real embedded engines. The new engine takes the version the
fleet serves from an engine that serves it, worker to worker: the trainer's source is
not read and the synchronizer publishes nothing; the copy is verified against the
peer's digests, after which the engine generates the trainer's greedy tokens labelled
with that version. A byte flipped on the receive path fails verification and the engine
serves nothing (its weights invalid) until a catch-up succeeds; a peer of another
tensor-parallel layout is refused before any byte moves; a sync that starts during a
catch-up refits the peer only after the copy, and reaches the new engine too; during a
rolling refit a catch-up does not wait for the sync and copies the version the wave that
committed serves; a peer that dies fails the catch-up with its name, and the engine keeps
waiting.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
import pytest_asyncio
import torch

from aiosync import (
    EngineFleet,
    IPCOptions,
    RefitMismatchError,
    RefitVerificationError,
    SyncError,
    Timeouts,
    TransportError,
    create_weight_synchronizer,
)
from aiosync.capabilities import InFlightPolicy
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.engines.fleet import CatchUp
from tests._support.fleets import drain
from tests._support.sources import HookedSource, hooked_trainer

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
TOKENS = 4
PEER = "engine 0 of 2 (LoggedEngine)"
NEW = "engine 1 of 2 (LoggedEngine)"


class LoggedEngine(EmbeddedEngine):
    """A real embedded engine that appends to ``log`` when it is paused and when a
    catch-up starts writing it; a receive waits for ``hold`` (when set) first."""

    log: list[str] | None = None
    hold: anyio.Event | None = None
    #: Run once a sync paused this engine: the test acts while its wave is in progress.
    on_paused: Callable[[], Awaitable[None]] | None = None

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        if self.log is not None:
            self.log.append(f"pause {self.label}")
        await super().pause_generation(mode, clear_cache)
        if self.on_paused is not None:
            await self.on_paused()

    async def collective_rpc(self, method: str, *call: Any, **named: Any) -> list[Any]:
        if method == "aiosync_peer_receive" and self.log is not None:
            self.log.append(f"receive {self.label}")
            if self.hold is not None:
                await self.hold.wait()
        out = await super().collective_rpc(method, *call, **named)
        if method == "aiosync_peer_verify" and self.log is not None:
            self.log.append(f"verified {self.label}")
        return out

    def __init__(self, label: str, **options: Any) -> None:
        super().__init__(TINY_QWEN3, seed=7, rpc_timeout_s=60, **options)
        self.label = label


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[dict[str, LoggedEngine]]:
    """``peer`` and ``new`` (one worker each), ``tp2`` and ``tp2b`` (tensor-parallel over
    two)."""
    started = {
        "peer": LoggedEngine("peer", num_workers=1),
        "new": LoggedEngine("new", num_workers=1),
        "tp2": LoggedEngine("tp2", tensor_parallel_size=2),
        "tp2b": LoggedEngine("tp2b", tensor_parallel_size=2),
    }
    for engine in started.values():
        await engine.start()
    try:
        yield started
    finally:
        for engine in started.values():
            await engine.shutdown()


@pytest.fixture(autouse=True)
def _no_hooks(engines: dict[str, LoggedEngine]) -> None:
    for engine in engines.values():
        engine.log = engine.hold = engine.on_paused = None


def _served(
    seed: int, *engines: EmbeddedEngine, **fleet_options: Any
) -> tuple[HFModelRunner, HookedSource, list[int], EngineFleet, Any]:
    """A trainer (``seed``), its source, the list of the source's tensor reads, a fleet
    of ``engines`` (and ``fleet_options``) and its synchronizer (IPC)."""
    trainer, source = hooked_trainer(seed)
    reads: list[int] = []
    source.on_tensor = reads.append
    fleet = EngineFleet(engines, **fleet_options)
    sync = create_weight_synchronizer(
        source,
        fleet,
        colocated=True,
        backend="embedded",
        transport=IPCOptions(device="cpu"),
        timeouts=Timeouts(rpc_s=30.0),
    )
    return trainer, source, reads, fleet, sync


@contextlib.asynccontextmanager
async def _joining(
    seed: int, peer: EmbeddedEngine, joiner: EmbeddedEngine
) -> AsyncIterator[tuple[HFModelRunner, list[int], EngineFleet, Any]]:
    """:func:`_served` on ``peer`` alone, synced to version 1 (the source's reads then
    cleared), and ``joiner`` added to the fleet to catch up from the peer: the trainer,
    the reads, the fleet and the open synchronizer."""
    trainer, _source, reads, fleet, sync = _served(seed, peer)
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        reads.clear()
        fleet.add_engine(joiner, source="peer")
        yield trainer, reads, fleet, sync


def _model_bytes(trainer: HFModelRunner) -> int:
    return sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())


async def _holds(engine: EmbeddedEngine, trainer: HFModelRunner) -> bool:
    want = trainer.hf_state_dict()
    (state,) = await engine.hf_state_dicts()
    return state.keys() == want.keys() and all(torch.equal(state[n], t) for n, t in want.items())


async def _serves(engine: EmbeddedEngine, trainer: HFModelRunner, version: int) -> None:
    """``engine`` generates the trainer's greedy tokens, every one labelled ``version``."""
    out = await engine.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
    assert [g.token_ids for g in out] == trainer.generate(PROMPTS, max_new_tokens=TOKENS)
    assert [(g.first_version, g.last_version) for g in out] == [(version, version)] * len(PROMPTS)


async def test_a_new_engine_catches_up_from_a_peer_and_the_trainer_sends_nothing(
    engines: dict[str, LoggedEngine],
) -> None:
    peer, new = engines["peer"], engines["new"]
    trainer, _source, reads, fleet, sync = _served(71, peer)
    async with sync, sync.subscribe() as events:
        await sync.mark_stale()
        await sync.sync_weights()
        assert len(reads) == len(trainer.hf_state_dict())
        await drain(events)
        reads.clear()

        fleet.add_engine(new, source="peer")
        assert fleet.catching_up == {NEW: None}
        assert fleet.serving == [peer] and fleet.versions == {PEER: 1, NEW: None}
        done = await fleet.catch_up()

        # Every byte came from the peer: the trainer's source was not read, its
        # synchronizer published nothing (no sync, no commit: no byte it sent).
        assert done == [CatchUp(NEW, PEER, 1, _model_bytes(trainer))]
        assert reads == []
        assert await drain(events) == []
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert await _holds(new, trainer)
        assert fleet.catching_up == {} and fleet.serving == [peer, new]
        assert fleet.versions == {PEER: 1, NEW: 1}
        await _serves(new, trainer, 1)

        # In service: the next sync reaches it from the trainer like the peer.
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.5)
        await sync.mark_stale()
        await sync.sync_weights()
        assert fleet.versions == {PEER: 2, NEW: 2}
        assert [await _holds(e, trainer) for e in (peer, new)] == [True, True]
        await fleet.prepare_for_generation()
        await _serves(new, trainer, 2)


async def test_a_copy_corrupted_in_transit_fails_verification_and_the_engine_does_not_serve(
    engines: dict[str, LoggedEngine],
) -> None:
    peer, new = engines["peer"], engines["new"]
    async with _joining(72, peer, new) as (trainer, reads, fleet, _sync):
        # One bit of the 4th tensor's first byte flips as the new engine receives it.
        ((name, _part, _dtype),) = [(await new.collective_rpc("aiosync_peer_manifest"))[0][3]]
        await new.collective_rpc("aiosync_test_arm_transit_fault", (3, 0, 0x01))
        with pytest.raises(RefitVerificationError) as failed:
            await fleet.catch_up()
        assert str(failed.value) == (
            f"{NEW}: its copy of {PEER}'s version 1 differs from the peer's in worker 0: "
            f"[{name!r}]; it serves nothing until a catch-up or a sync succeeds"
        )
        assert fleet.serving == [peer] and fleet.versions == {PEER: 1, NEW: None}
        assert fleet.catching_up == {NEW: f"RefitVerificationError: {failed.value}"}
        assert [s["weights_valid"] for s in await new.status()] == [False]
        with pytest.raises(SyncError, match="weights are not valid"):
            await new.generate(PROMPTS, max_new_tokens=TOKENS)
        # Every tensor but the corrupted one is the trainer's.
        (state,) = await new.hf_state_dicts()
        want = trainer.hf_state_dict()
        assert [n for n in want if not torch.equal(state[n], want[n])] == [name]

        # The fault was one-shot: the next catch-up is verified and the engine serves.
        assert await fleet.catch_up() == [CatchUp(NEW, PEER, 1, _model_bytes(trainer))]
        assert reads == []
        assert fleet.serving == [peer, new] and fleet.versions == {PEER: 1, NEW: 1}
        await _serves(new, trainer, 1)


async def test_a_peer_of_another_layout_is_refused_before_any_byte_moves(
    engines: dict[str, LoggedEngine],
) -> None:
    peer, tp2 = engines["peer"], engines["tp2"]
    async with _joining(73, peer, tp2) as (_trainer, reads, fleet, _sync):
        before = await tp2.hf_state_dicts()
        with pytest.raises(RefitMismatchError) as refused:
            await fleet.catch_up()
        assert str(refused.value) == (
            f"{NEW} cannot catch up from {PEER}: 2 worker(s) against the peer's 1 (a "
            "catch-up copies worker to worker: the same tensor-parallel layout on both sides)"
        )
        # Nothing moved: its weights are as they were, and valid.
        after = await tp2.hf_state_dicts()
        assert all(
            a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
            for a, b in zip(before, after, strict=True)
        )
        assert [s["weights_valid"] for s in await tp2.status()] == [True, True]
        assert fleet.serving == [peer] and fleet.versions == {PEER: 1, NEW: None}
        assert fleet.catching_up == {NEW: f"RefitMismatchError: {refused.value}"}
        assert reads == []


async def test_a_sync_started_during_a_catch_up_refits_the_peer_after_the_copy(
    engines: dict[str, LoggedEngine],
) -> None:
    peer, new = engines["peer"], engines["new"]
    async with _joining(74, peer, new) as (trainer, reads, fleet, sync):
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.25)
        log: list[str] = []
        peer.log = new.log = log
        new.hold = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(fleet.catch_up)
            await anyio.wait_all_tasks_blocked()
            assert log == ["receive new"]  # the copy holds the peer
            await sync.mark_stale()
            tg.start_soon(sync.sync_weights)
            await anyio.wait_all_tasks_blocked()
            # The sync waits for the copy: it has neither paused the peer nor read a tensor.
            assert log == ["receive new"] and reads == []
            new.hold.set()
        # Then it refit both: the new engine was in service at version 1 when it began.
        assert log[:2] == ["receive new", "verified new"]
        assert sorted(log[2:]) == ["pause new", "pause peer"]
        assert fleet.versions == {PEER: 2, NEW: 2}
        assert [await _holds(e, trainer) for e in (peer, new)] == [True, True]


async def test_a_catch_up_during_a_rolling_refit_copies_the_wave_that_committed(
    engines: dict[str, LoggedEngine],
) -> None:
    peer, new, other = engines["peer"], engines["new"], engines["tp2"]
    trainer, _source, reads, fleet, sync = _served(
        75, peer, other, refit="rolling", max_unavailable=1
    )
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        fleet.add_engine(new, source="peer")
        peer_label, other_label, new_label = (f"engine {i} of 3 (LoggedEngine)" for i in range(3))
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(0.5)
        paused, go = anyio.Event(), anyio.Event()

        async def hold() -> None:
            paused.set()
            await go.wait()

        other.on_paused = hold
        async with anyio.create_task_group() as tg:
            await sync.mark_stale()
            tg.start_soon(sync.sync_weights)
            await paused.wait()  # the first wave (the peer) committed; the second is paused
            assert fleet.versions == {peer_label: 2, other_label: 1, new_label: None}
            read = len(reads)
            # The catch-up does not wait for the sync: it copies the version the peer serves.
            assert await fleet.catch_up() == [
                CatchUp(new_label, peer_label, 2, _model_bytes(trainer))
            ]
            assert len(reads) == read
            await _serves(new, trainer, 2)
            go.set()
        assert (sync.weight_version, set(fleet.versions.values())) == (2, {2})
        assert [await _holds(e, trainer) for e in (peer, new)] == [True, True]


async def test_a_tensor_parallel_engine_catches_up_rank_by_rank(
    engines: dict[str, LoggedEngine],
) -> None:
    peer, new = engines["tp2"], engines["tp2b"]
    async with _joining(77, peer, new) as (_trainer, reads, fleet, _sync):
        held = await peer.hf_state_dicts()
        # Each rank's slices (the replicated tensors on both ranks) move once, rank to rank.
        nbytes = sum(t.numel() * t.element_size() for state in held for t in state.values())
        assert await fleet.catch_up() == [CatchUp(NEW, PEER, 1, nbytes)]
        assert reads == []
        copied = await new.hf_state_dicts()
        assert [s.keys() == h.keys() for s, h in zip(copied, held, strict=True)] == [True, True]
        assert all(torch.equal(s[n], h[n]) for s, h in zip(copied, held, strict=True) for n in h)
        # The same slices compute the same tokens, labelled with the peer's version.
        want = await peer.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
        got = await new.generate_with_meta(PROMPTS, max_new_tokens=TOKENS)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        assert {(g.first_version, g.last_version) for g in got} == {(1, 1)}


async def test_a_peer_that_dies_fails_the_catch_up_naming_it_and_the_engine_keeps_waiting(
    engines: dict[str, LoggedEngine],
) -> None:
    # Last in the module: the peer's worker is replaced (its weights are its initial ones).
    peer, new = engines["peer"], engines["new"]
    async with _joining(76, peer, new) as (_trainer, reads, fleet, _sync):
        new.log, new.hold = [], anyio.Event()
        failed: list[BaseException] = []

        async def catch_up() -> None:
            try:
                await fleet.catch_up(timeout_s=10.0)
            except Exception as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(catch_up)
            await anyio.wait_all_tasks_blocked()
            assert new.log == ["receive new"]  # the peer's send is under way
            pid = peer.pids[0]
            os.kill(pid, signal.SIGKILL)
        (error,) = failed
        assert isinstance(error, TransportError)
        assert str(error).startswith(
            f"{PEER}: engine worker 0 died: process {pid} exited with code -9"
        )
        assert fleet.catching_up == {NEW: f"TransportError: {error}"}
        assert fleet.serving == [peer] and fleet.versions == {PEER: 1, NEW: None}
        assert reads == []
    assert await peer.respawn_dead_workers() == [0]
