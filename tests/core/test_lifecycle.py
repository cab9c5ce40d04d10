"""The lifecycle the base class owns for every transport (issue "One lifecycle").

Argument checks before any event, the discard listener, the version label, the
colocated bracket, ``async with`` initialization, timeouts, the one error
reducer, the one engine-set normalization and the sampling contract.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import pytest
from core_harness import ArraySource, CopySynchronizer, RecordingEngine

import aiosync
from aiosync import (
    KVScales,
    RefitMismatchError,
    SamplingParams,
    SyncError,
    SyncTimeoutError,
    Timeouts,
    TransportError,
    VersionEventKind,
    WeightSynchronizer,
)
from aiosync._fanout import most_telling
from aiosync.capabilities import DiscardNotifier, PausableEngine, SleepReporting, engines_of
from aiosync.generation import sampling_params


class AttentionSource(ArraySource):
    """Two layers' attention projections: the manifest's attention layers are 0 and 1."""

    def __init__(self) -> None:
        self.weights = {
            f"model.layers.{i}.self_attn.q_proj.weight": np.zeros((2, 2), np.float32)
            for i in range(2)
        }
        self.threads: list[str] = []

    def prepare_refit_info(self) -> dict[str, Any]:
        self.threads.append(threading.current_thread().name)
        return super().prepare_refit_info()

    def offload_before_refit(self) -> None:
        self.threads.append(threading.current_thread().name)

    def offload_after_refit(self) -> None:
        self.threads.append(threading.current_thread().name)


class ManifestSync(CopySynchronizer):
    """A transport that reads its manifest at init, as every real one does."""

    async def open(self, sync: WeightSynchronizer) -> None:
        await self._read_manifest()


class NoKVScales(ManifestSync):
    capabilities = aiosync.TransportCapabilities(kv_scales=False)
    kv_scales_refusal = "adapter-only refits leave the KV-cache scales alone"


def drained(subscription: Any) -> list[tuple[VersionEventKind, int]]:
    events = []
    while (event := subscription.receive_nowait()) is not None:
        events.append((event.kind, event.version))
    return events


@pytest.mark.parametrize(
    ("kv_scales", "error", "match"),
    [
        ({5: 0.5}, ValueError, "layer index 5 is not an attention layer"),
        ({"model.layers.7.self_attn.k_scale": 0.5}, RefitMismatchError, "layers.7"),
        ({0: "half"}, TypeError, "must be a float"),
        ({0: -1.0}, ValueError, "finite and > 0"),
        ([0.5], TypeError, "must be a mapping"),
    ],
)
async def test_a_bad_kv_scales_raises_before_any_event_and_leaves_no_dirty_flag(
    engine: RecordingEngine, kv_scales: Any, error: type[Exception], match: str
) -> None:
    source = AttentionSource()
    async with ManifestSync(source, engine) as sync:
        await sync.mark_stale()
        await sync.sync_weights()  # committed: not stale, nothing dirty
        events = sync.subscribe()
        before = {k: v.copy() for k, v in engine.weights.items()}
        with pytest.raises(error, match=match):
            await sync.sync_weights(kv_scales)
        assert drained(events) == []
        assert (sync.is_stale, sync.weight_version, sync.transfers) == (False, 1, [1])
        assert all(np.array_equal(engine.weights[k], v) for k, v in before.items())
        # The checks run although nothing is stale: the caller learns of its bug at once.
        await sync.mark_stale()
        await sync.sync_weights({1: 0.25})
        assert sync.kv_scales_seen[-1] == {1: 0.25}
        assert (sync.weight_version, sync.is_stale) == (2, False)


async def test_a_transport_without_kv_scales_refuses_them_before_any_event(
    engine: RecordingEngine,
) -> None:
    async with NoKVScales(AttentionSource(), engine) as sync:
        await sync.mark_stale()
        events = sync.subscribe()
        with pytest.raises(NotImplementedError, match="leave the KV-cache scales alone"):
            await sync.sync_weights({})
        assert drained(events) == []
        assert (sync.transfers, sync.weight_version) == ([], 0)
        await sync.sync_weights()
        assert sync.weight_version == 1


async def test_async_with_initializes_and_reads_the_manifest_off_the_event_loop(
    engine: RecordingEngine,
) -> None:
    source = AttentionSource()
    async with ManifestSync(source, engine) as sync:
        await sync.mark_stale()
        await sync.sync_weights()  # no init_communicator() call: the block did it
        assert sync.weight_version == 1
    main = threading.current_thread().name
    assert source.threads and main not in source.threads


class FailingInit(CopySynchronizer):
    async def init_communicator(self) -> None:
        raise TransportError("no engine at the address")


async def test_a_set_up_error_propagates_from_async_with_and_shuts_down(
    source: ArraySource, engine: RecordingEngine
) -> None:
    sync = FailingInit(source, engine)
    with pytest.raises(TransportError, match="no engine at the address"):
        async with sync:
            pytest.fail("the block must not run")
    with pytest.raises(SyncError, match="shut down"):
        await sync.mark_stale()


class ListeningEngine(RecordingEngine):
    def __init__(self) -> None:
        super().__init__()
        self.listeners: list[Callable[[], None]] = []

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def discard(self) -> None:
        for listener in list(self.listeners):
            listener()


async def test_the_base_registers_the_discard_listener_and_removes_it_on_shutdown(
    source: ArraySource,
) -> None:
    engines = [ListeningEngine(), ListeningEngine()]
    assert all(isinstance(e, DiscardNotifier) for e in engines)
    sync = CopySynchronizer(source, engines[0])
    fleet_sync = CopySynchronizer(source, engines)  # type: ignore[arg-type]
    assert [len(e.listeners) for e in engines] == [2, 1]
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        assert not sync.is_stale
        engines[0].discard()
        assert sync.is_stale and fleet_sync.is_stale
    await fleet_sync.shutdown()
    assert [e.listeners for e in engines] == [[], []]


class SleepyEngine(RecordingEngine):
    """Reports what it released; its KV-cache wake can hang (a stuck server)."""

    def __init__(self, asleep: frozenset[str] | None) -> None:
        super().__init__()
        self._asleep = asleep
        self.hang_kv_wake = False
        self.kv_wake_cancelled = False

    @property
    def asleep_tags(self) -> frozenset[str] | None:
        return self._asleep

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        await super().prepare_for_generation(tags)
        if self.hang_kv_wake and tags == ["kv_cache"]:
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.kv_wake_cancelled = True
                raise


class ColocatedSync(ManifestSync):
    async def send(self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None) -> int:
        async with self._colocated_refit():
            self.generation.calls.append(("transfer", None))
            return await super().send(sync, version, kv_scales)


@pytest.mark.parametrize(
    ("asleep", "expected"),
    [
        (None, [("weights",), None, ("kv_cache",)]),
        (frozenset({"weights", "kv_cache"}), [("weights",), None, ("kv_cache",)]),
        (frozenset({"kv_cache"}), [None, ("kv_cache",)]),
        (frozenset(), [None]),
    ],
)
async def test_the_colocated_bracket_wakes_only_what_slept_and_offloads_in_a_thread(
    asleep: frozenset[str] | None, expected: list[tuple[str, ...] | None]
) -> None:
    engine = SleepyEngine(asleep)
    assert isinstance(engine, SleepReporting)
    source = AttentionSource()
    async with ColocatedSync(source, engine) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
    assert [tags for _, tags in engine.calls] == expected
    assert [name for name, _ in engine.calls].count("transfer") == 1
    main = threading.current_thread().name
    assert len(source.threads) == 3 and main not in source.threads


async def test_after_a_failure_the_kv_wake_is_bounded_by_after_failure_s() -> None:
    engine = SleepyEngine(None)
    engine.hang_kv_wake = True
    source = AttentionSource()
    timeouts = Timeouts(after_failure_s=0.05)
    async with ColocatedSync(source, engine, timeouts=timeouts) as sync:
        sync.fail_after_entries = 1
        await sync.mark_stale()
        with pytest.raises(RuntimeError, match="link dropped after 1 entries"):
            await sync.sync_weights()
        # The hung wake was cut by the clean-up limit, not left to block the error.
        assert engine.kv_wake_cancelled
        assert (sync.is_stale, sync.weight_version) == (True, 0)


class OffloadFailsSource(AttentionSource):
    def offload_after_refit(self) -> None:
        raise RuntimeError("trainer offload broke")


async def test_a_failed_clean_up_after_a_failed_sync_is_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with ColocatedSync(OffloadFailsSource(), SleepyEngine(None)) as sync:
        sync.fail_after_entries = 1
        await sync.mark_stale()
        with pytest.raises(RuntimeError, match="link dropped after 1 entries"):
            await sync.sync_weights()
    [record] = [r for r in caplog.records if "clean-up after a failed sync" in r.getMessage()]
    assert record.getMessage() == (
        "colocated refit: the clean-up after a failed sync also failed: "
        "RuntimeError: trainer offload broke"
    )
    assert record.exc_info is None  # a secondary failure: no second traceback


class PausingEngine(RecordingEngine):
    def __init__(self) -> None:
        super().__init__()
        self.versions: list[int] = []

    async def pause_generation(
        self, mode: aiosync.InFlightPolicy, clear_cache: bool = True
    ) -> None:
        self.calls.append(("pause", (mode,)))

    async def resume_generation(self) -> None:
        self.calls.append(("resume", None))

    async def on_weights_committed(self, version: int) -> None:
        self.versions.append(version)


async def test_the_engine_is_paused_labelled_once_and_resumed(source: ArraySource) -> None:
    engine = PausingEngine()
    assert isinstance(engine, PausableEngine)
    async with CopySynchronizer(source, engine) as sync:
        await sync.mark_stale()
        await sync.sync_weights(in_flight="abort")
        sync.fail_after_entries = 0
        await sync.mark_stale()
        with pytest.raises(RuntimeError):
            await sync.sync_weights()
    assert engine.calls == [("pause", ("abort",)), ("resume", None)] * 1 + [
        ("pause", ("wait",)),
        ("resume", None),
    ]
    assert engine.versions == [1]  # the failed sync labelled nothing


class UnresumableEngine(PausingEngine):
    async def resume_generation(self) -> None:
        raise ConnectionError("engine gone")


async def test_a_failed_resume_after_a_failed_sync_is_one_log_line_and_the_sync_error_raises(
    source: ArraySource, caplog: pytest.LogCaptureFixture
) -> None:
    engine = UnresumableEngine()
    async with CopySynchronizer(source, engine) as sync:
        sync.fail_after_entries = 0
        await sync.mark_stale()
        with pytest.raises(RuntimeError, match="link dropped after 0 entries"):
            await sync.sync_weights()
    [record] = [r for r in caplog.records if "resuming generation" in r.getMessage()]
    assert record.getMessage() == (
        "resuming generation after a failed sync: ConnectionError: engine gone"
    )
    assert record.exc_info is None  # a secondary failure: no second traceback


def test_timeouts_keywords_override_their_field_and_bad_limits_are_refused() -> None:
    t = Timeouts(sync_s=60, after_failure_s=1)
    assert t.with_keywords(rpc_timeout_s=5) == Timeouts(sync_s=60, rpc_s=5, after_failure_s=1)
    assert t.with_keywords() is t
    for bad in (0, -1, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match=r"Timeouts\.rpc_s"):
            Timeouts(rpc_s=bad)  # type: ignore[arg-type]


def test_a_synchronizer_takes_timeouts_and_the_older_keyword(
    source: ArraySource, engine: RecordingEngine
) -> None:
    sync = CopySynchronizer(source, engine, timeouts=Timeouts(sync_s=60), sync_timeout_s=7)
    assert (sync.sync_timeout_s, sync.timeouts.sync_s, sync.timeouts.rpc_s) == (7, 7, 120.0)
    with pytest.raises(TypeError, match=r"aiosync\.Timeouts"):
        CopySynchronizer(source, engine, timeouts={"sync_s": 1})  # type: ignore[arg-type]


async def test_the_sync_limit_comes_from_timeouts(
    source: ArraySource, engine: RecordingEngine
) -> None:
    async with CopySynchronizer(source, engine, timeouts=Timeouts(sync_s=0.05)) as sync:
        sync.gate = anyio.Event()  # never set: the transfer blocks after its first entry
        await sync.mark_stale()
        with pytest.raises(SyncTimeoutError, match=r"exceeded 0\.05 s"):
            await sync.sync_weights()


def test_sampling_params_validate_and_the_keyword_form_is_the_same_contract() -> None:
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=3, logprobs=True)
    assert (
        sampling_params(
            None, {"max_new_tokens": 4, "temperature": 0.7, "seed": 3, "logprobs": True}
        )
        == params
    )
    assert sampling_params(params, {"temperature": 0.0}) == SamplingParams(
        max_tokens=4, seed=3, logprobs=True
    )
    assert sampling_params(params) is params
    assert SamplingParams(max_tokens=1).greedy
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0.0)
    with pytest.raises(TypeError, match="unknown sampling keyword"):
        sampling_params(None, {"max_new_tokens": 2, "top_k": 5})
    with pytest.raises(TypeError, match="max_new_tokens="):
        sampling_params(None, {"temperature": 1.0})
    with pytest.raises(TypeError, match="not both"):
        sampling_params(None, {"max_new_tokens": 2, "max_tokens": 2})


async def test_most_telling_prefers_typed_errors_and_keeps_the_rest_as_notes() -> None:
    timeout = SyncTimeoutError("rank 1 timed out")
    mismatch = RefitMismatchError("shape differs")
    plain = RuntimeError("boom")
    nested = BaseExceptionGroup("outer", [plain, BaseExceptionGroup("inner", [timeout, mismatch])])
    chosen = most_telling(nested)
    assert chosen is mismatch
    assert "meanwhile: RuntimeError('boom')" in (mismatch.__notes__ or [])
    cancelled = anyio.get_cancelled_exc_class()()
    assert most_telling(BaseExceptionGroup("g", [cancelled, plain])) is plain
    assert most_telling(plain) is plain


def test_engines_of_is_the_one_engine_set_normalization() -> None:
    a, b = RecordingEngine(), RecordingEngine()

    class Fleet:
        engines = (a, b)

    assert engines_of(a) == (a,)
    assert engines_of([a, b]) == (a, b)
    assert engines_of(Fleet()) == (a, b)
    with pytest.raises(ValueError, match="at least one SGLang server"):
        engines_of([], what="SGLang server")
    with pytest.raises(ValueError, match="the same engine appears twice"):
        engines_of([a, a])


async def _trio_round_trip() -> tuple[int, bool]:
    async with CopySynchronizer(ArraySource(), RecordingEngine()) as sync:
        events = sync.subscribe()
        await sync.mark_stale()
        await sync.sync_weights()
        return sync.weight_version, drained(events) == [
            (VersionEventKind.STALE, 1),
            (VersionEventKind.SYNC_STARTED, 1),
            (VersionEventKind.COMMITTED, 1),
        ]


def test_the_core_runs_on_trio() -> None:
    # docs/loop.md's claim: the core (base class, events) is anyio and runs on trio;
    # the transports that use pyzmq's asyncio sockets need asyncio.
    pytest.importorskip("trio")
    assert anyio.run(_trio_round_trip, backend="trio") == (1, True)


async def test_a_resumed_trainer_continues_its_versions(
    source: ArraySource, engine: RecordingEngine
) -> None:
    async with CopySynchronizer(source, engine, initial_version=40) as sync:
        assert (sync.policy_version, sync.weight_version, sync.is_stale) == (40, 40, False)
        assert await sync.mark_stale() == 41
        await sync.sync_weights()
        assert (sync.weight_version, sync.transfers) == (41, [41])
    with pytest.raises(ValueError, match="initial_version must be >= 0"):
        CopySynchronizer(source, engine, initial_version=-1)


class NonDriverRank(CopySynchronizer):
    """A sharded trainer's rank that does not hold the engine (its generation is None)."""

    def _drives_generation(self) -> bool:
        return False

    async def send(self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None) -> int:
        self.transfers.append(version)
        return 0


async def test_refit_if_stale_is_the_same_call_on_a_rank_without_the_engine(
    source: ArraySource,
) -> None:
    async with NonDriverRank(source, None) as sync:  # type: ignore[arg-type]
        assert await aiosync.refit_if_stale(sync) is False
        await sync.mark_stale()
        assert await aiosync.refit_if_stale(sync) is True
        assert (sync.transfers, sync.weight_version) == ([1], 1)
    async with CopySynchronizer(source, None) as driver:  # type: ignore[arg-type]
        await driver.mark_stale()
        with pytest.raises(TypeError, match="must be an engine"):
            await aiosync.refit_if_stale(driver)


async def test_an_engine_has_one_owner_and_a_superseded_one_is_told_why(
    engine: RecordingEngine,
) -> None:
    a_source, b_source = ArraySource(), ArraySource()
    b_source.step()
    async with CopySynchronizer(a_source, engine) as a, CopySynchronizer(b_source, engine) as b:
        await a.mark_stale()
        await a.sync_weights()
        await b.mark_stale()
        await b.sync_weights()  # the engine now serves B's weights
        assert np.array_equal(engine.weights["a"], b_source.weights["a"])
        assert (a.is_stale, a.weight_version, b.is_stale) == (True, 1, False)
        assert await a.mark_stale() == 2
        with pytest.raises(
            aiosync.OwnershipError, match=f"owner {b.owner}\\) committed its version 1"
        ):
            await aiosync.refit_if_stale(a)
        assert a.transfers == [1]  # refused before anything moved
        await a.init_communicator()  # the explicit take-over
        await a.sync_weights()
        assert np.array_equal(engine.weights["a"], a_source.weights["a"])
        assert (a.is_stale, b.is_stale, a.weight_version) == (False, True, 2)


async def test_a_restarted_trainer_on_a_served_engine_starts_stale(
    source: ArraySource, engine: RecordingEngine
) -> None:
    async with CopySynchronizer(source, engine) as first:
        for _ in range(4):
            await first.mark_stale()
            await first.sync_weights()
    # A new synchronizer (versions from 0) finds the engine serving another's weights.
    async with CopySynchronizer(ArraySource(), engine) as restarted:
        assert (restarted.policy_version, restarted.is_stale) == (0, True)
        await restarted.sync_weights()
        assert (restarted.weight_version, restarted.is_stale, restarted.transfers) == (
            0,
            False,
            [0],
        )


class ConfiguredSource(ArraySource):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config

    def hf_config(self) -> dict[str, Any]:
        return self.config


class ConfiguredEngine(RecordingEngine):
    def __init__(self, config: dict[str, Any] | None) -> None:
        super().__init__()
        self.config = config

    async def expected_config(self) -> dict[str, Any] | None:
        return self.config


class ConfigCheckingSync(CopySynchronizer):
    async def init_communicator(self) -> None:
        await self._check_model_configs()
        await super().init_communicator()


async def test_config_drift_is_refused_at_init_naming_the_engine_and_fields() -> None:
    trainer = {"model_type": "qwen3", "rope_theta": 1e6, "rms_norm_eps": 1e-6, "eos_token_id": 1}
    same = ConfiguredEngine({**trainer, "eos_token_id": 2})
    drifted = ConfiguredEngine({**trainer, "rope_theta": 1e4})
    silent = ConfiguredEngine(None)
    async with ConfigCheckingSync(ConfiguredSource(trainer), same) as sync:
        assert sync.weight_version == 0
    with pytest.raises(RefitMismatchError) as info:
        async with ConfigCheckingSync(ConfiguredSource(trainer), [same, silent, drifted]):  # type: ignore[arg-type]
            pytest.fail("init must refuse the drifted engine")
    assert str(info.value).startswith(
        "engine 2 of 3 (ConfiguredEngine): the model config of the engine differs"
    )
    assert "rope_parameters.rope_theta: trainer 1000000.0, engine 10000.0" in str(info.value)
