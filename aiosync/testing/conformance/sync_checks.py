"""The kit's cells of one sync and its options: ``plain``, ``verify_*``, ``bad_verify``,
``trace``, ``delta``, ``kv_scales``, ``verify_engine``.

Each ``check_*`` takes a case, a started :class:`~.engines.KitEngine` and a trainer and
asserts one cell: a declared option is honoured (and lands bit-exact); an undeclared
one is refused (:class:`~aiosync.UnsupportedOptionError` at construction, or the
transport's ``NotImplementedError``), never silently dropped.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from aiosync import (
    RefitVerificationError,
    SyncOptions,
    TrainCluster,
    UnsupportedOptionError,
    VersionEventKind,
)

from .cases import TransportCase
from .engines import EmbeddedKitEngine, KitEngine
from .trainers import CORRUPTED, KV_SCALES, PROMPTS, KitTrainer, box_patch_bytes, patch_bytes


async def _sync(sync: Any) -> None:
    await sync.mark_stale()
    await sync.sync_weights()


async def _assert_serves(engine: KitEngine, trainer: KitTrainer, version: int) -> None:
    """The engine generates the trainer's greedy tokens, every token under ``version``."""
    generations = await engine.generate(PROMPTS, 4)
    assert [list(g.token_ids) for g in generations] == trainer.generate(PROMPTS, 4)
    assert {(g.first_version, g.last_version) for g in generations} == {(version, version)}


async def check_plain(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Two syncs: each leaves every worker holding exactly the trainer's tensors, the
    synchronizer at the next version and not stale, the engine serving it."""
    async with case.build(trainer, engine) as sync:
        assert sync.weight_version == 0
        for version in (1, 2):
            if version == 2:
                trainer.step(seed=version)
            await _sync(sync)
            assert (sync.weight_version, sync.policy_version, sync.is_stale) == (
                version,
                version,
                False,
            )
            assert await engine.holds(trainer.state())
        await _assert_serves(engine, trainer, 2)


async def _check_option(
    case: TransportCase, engine: KitEngine, trainer: KitTrainer, options: SyncOptions
) -> None:
    """Declared: a sync with ``options`` lands bit-exact. Undeclared: refused at build."""
    name, value = next(iter(options.given().items()))
    refusal = case.capabilities.refusal(name, value)
    if refusal is not None:
        try:
            case.build(trainer, engine, sync=options)
        except UnsupportedOptionError as error:
            assert refusal in str(error), (refusal, str(error))
            return
        raise AssertionError(f"{case.name} built with undeclared {name}={value!r}")
    async with case.build(trainer, engine, sync=options) as sync:
        await _sync(sync)
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert getattr(sync, name) == value
        assert await engine.holds(trainer.state())


async def check_verify_true(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    await _check_option(case, engine, trainer, SyncOptions(verify=True))


async def check_verify_sample(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    await _check_option(case, engine, trainer, SyncOptions(verify="sample"))


async def check_bad_verify(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """A ``verify=`` that is neither True, False nor "sample", given to the transport's
    constructor: ``ValueError`` before anything is built. A transport that declares no
    check (``verify`` is ``{False}``) takes no ``verify=`` and refuses ``verify=True``."""
    if case.capabilities.verify == frozenset({False}):
        await _check_option(case, engine, trainer, SyncOptions(verify=True))
        return
    module, name = case.options.transport
    cls = getattr(importlib.import_module(module), name)
    topology: dict[str, Any] = {}
    if not case.colocated:
        topology = {"train_cluster": TrainCluster(), "inference_world_size": engine.workers}
    for bad in ("full", "off", "Sample", 1, 0, None):
        try:
            cls(trainer, engine.generation, verify=bad, **topology)
        except ValueError as error:
            assert str(error) == f"verify must be True, False or 'sample', got {bad!r}"
        else:
            raise AssertionError(f"{name} took verify={bad!r}")


async def check_trace(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared: a traced sync records ``last_trace`` (None before). Else refused."""
    options = SyncOptions(trace=True)
    if not case.capabilities.trace:
        await _check_option(case, engine, trainer, options)
        return
    async with case.build(trainer, engine, sync=options) as sync:
        assert sync.last_trace is None
        await _sync(sync)
        assert isinstance(sync.last_trace, dict) and sync.last_trace
        assert await engine.holds(trainer.state())


async def check_delta(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared: the first sync is full, the next move exactly the changed bits' patches
    (per box on a shard-aware plan), an unchanged trainer moves 0 bytes, and every worker
    ends bit-identical. Undeclared: refused at build."""
    options = SyncOptions(delta=True)
    if not case.capabilities.delta:
        await _check_option(case, engine, trainer, options)
        return
    full = trainer.full_bytes()
    async with case.build(trainer, engine, sync=options) as sync, sync.subscribe() as events:

        async def committed() -> tuple[bool, int]:
            await _sync(sync)
            async for event in events:
                if event.kind is VersionEventKind.COMMITTED:
                    return event.delta, event.nbytes
            raise AssertionError("no COMMITTED event")

        plan = getattr(sync, "transfer_plan", None)
        if plan is not None:  # shard-aware: every receiver's slices (replicated ones each)
            full = sum(plan.receiver_nbytes)
        assert await committed() == (False, full)  # no baseline yet
        for seed in (1, 2):
            before = trainer.state()
            trainer.step(seed)
            after = trainer.state()
            want = box_patch_bytes(plan, before, after) if plan else patch_bytes(before, after)
            assert await committed() == (True, want)
            assert 0 < want < full
            assert await engine.holds(after)
        assert await committed() == (True, 0)  # nothing changed: the version still moves
        assert sync.weight_version == 4
        await _assert_serves(engine, trainer, 4)
        if not isinstance(engine, EmbeddedKitEngine):
            return
        # A live weight written behind the transport's back: verify_engine() names it and
        # makes the synchronizer stale; the next sync is full and heals every worker, the
        # one after it a delta again.
        await engine.corrupt(CORRUPTED, trainer.state()[CORRUPTED] * 3)
        try:
            await sync.verify_engine()
        except RefitVerificationError as error:
            assert CORRUPTED in str(error), str(error)
        else:
            raise AssertionError("verify_engine() missed a corrupted live weight")
        assert (sync.is_stale, sync.weight_version) == (True, 4)
        trainer.step(seed=3)
        assert await committed() == (False, full)
        assert await engine.holds(trainer.state())
        await sync.verify_engine()
        trainer.step(seed=4)
        assert (await committed())[0] is True
        assert await engine.holds(trainer.state())


async def check_kv_scales(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared: the scales reach every worker with the weights. Undeclared:
    ``NotImplementedError`` (the transport's ``kv_scales_refusal``) before any byte."""
    async with case.build(trainer, engine) as sync:
        if not case.capabilities.kv_scales:
            before = await engine.states()
            await sync.mark_stale()
            try:
                await sync.sync_weights(kv_scales=KV_SCALES)
            except NotImplementedError as error:
                assert str(error) == type(sync).kv_scales_refusal
            else:
                raise AssertionError(f"{case.name} took kv_scales it does not declare")
            assert (sync.weight_version, sync.is_stale) == (0, True)
            after = await engine.states()
            assert all(
                torch.equal(a[n], b[n]) for a, b in zip(before, after, strict=True) for n in a
            )
            return
        await sync.mark_stale()
        await sync.sync_weights(kv_scales=KV_SCALES)
        assert (sync.weight_version, sync.is_stale) == (1, False)
        want = {
            f"model.layers.{layer}.self_attn.{kv}_scale": value
            for layer, value in KV_SCALES.items()
            for kv in "kv"
        }
        assert await engine.kv_scales() == [want] * engine.workers
        assert await engine.holds(trainer.state())
        # A scale named in full travels alone; a layer without attention is refused
        # before anything moves (the manifest has 2 layers).
        await sync.mark_stale()
        await sync.sync_weights(kv_scales={"model.layers.1.self_attn.v_scale": 0.125})
        want["model.layers.1.self_attn.v_scale"] = 0.125
        assert await engine.kv_scales() == [want] * engine.workers
        await sync.mark_stale()
        try:
            await sync.sync_weights(kv_scales={7: 1.0})
        except ValueError as error:
            assert "layer index 7 is not an attention layer" in str(error), str(error)
        else:
            raise AssertionError("a scale of layer 7 was taken")
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (2, 3, True)
        assert await engine.kv_scales() == [want] * engine.workers


async def check_verify_engine(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared: after a sync ``verify_engine()`` counts every worker and tensor at the
    version; once the trainer moved on unsynced, it raises ``RefitVerificationError``
    naming a tensor and the synchronizer is stale. Undeclared: ``NotImplementedError``."""
    async with case.build(trainer, engine) as sync:
        await _sync(sync)
        if not case.capabilities.verify_engine:
            try:
                await sync.verify_engine()
            except (NotImplementedError, TypeError):
                # A refusal compares nothing: healthy weights are not called wrong.
                assert (sync.is_stale, sync.weight_version) == (False, 1)
                return
            raise AssertionError(f"{case.name} verified an engine it does not declare to")
        report = await sync.verify_engine()
        assert (report["workers"], report["version"]) == (engine.workers, 1)
        assert report["tensors"] > 0
        trainer.step(seed=5)
        try:
            await sync.verify_engine()
        except RefitVerificationError as error:
            first = next(iter(trainer.prepare_refit_info()))  # the step changed every tensor
            assert repr(first) in str(error) or f" {first} " in str(error), str(error)
        else:
            raise AssertionError("verify_engine() missed a trainer that moved on")
        assert (sync.is_stale, sync.weight_version) == (True, 1)
        await sync.sync_weights()
        assert await engine.holds(trainer.state())
        healed = await sync.verify_engine()
        # The re-sync rewrites the same policy version: nothing new was published.
        assert (healed["version"], sync.weight_version, sync.is_stale) == (1, 1, False)
