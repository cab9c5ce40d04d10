"""The shared lifecycle on the HTTP transport, against a real test-server process.

A bad ``kv_scales`` is refused before anything is published or posted; the
discard listener the base class registers is gone after ``shutdown()``; one
``SamplingParams`` and the keyword form are the same request.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import pytest

from aiosync import (
    EngineFleet,
    RefitMismatchError,
    SamplingParams,
    SGLangHTTPBackend,
    VersionEventKind,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.transports.http import HTTPWeightSynchronizer

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024
LAYERS = TINY_QWEN3["num_hidden_layers"]


@pytest.fixture
def server(server_pair: tuple[Any, Any]) -> Any:
    first, _ = server_pair
    first.reset()
    yield first
    first.reset()


class _Bodies(httpx.AsyncHTTPTransport):
    """A real transport that keeps the JSON body of every ``/generate`` it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.generate: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            self.generate.append(json.loads(request.content))
        return await super().handle_async_request(request)


@pytest.mark.parametrize(
    ("kv_scales", "error", "match"),
    [
        ({LAYERS: 0.5}, ValueError, rf"layer index {LAYERS} is not an attention layer"),
        ({0: "0.5"}, TypeError, r"kv_scales\[0\] must be a float, got str"),
        (
            {f"model.layers.{LAYERS}.self_attn.k_scale": 0.5},
            RefitMismatchError,
            rf"has no 'model\.layers\.{LAYERS}\.self_attn\.' tensors",
        ),
    ],
    ids=["layer-without-attention", "value-not-a-float", "name-without-attention"],
)
async def test_a_bad_kv_scale_is_refused_before_anything_is_published_or_posted(
    server: Any,
    make_trainer: Any,
    state_equal: Any,
    kv_scales: dict[Any, Any],
    error: type[Exception],
    match: str,
) -> None:
    trainer = make_trainer(seed=80)
    before = server.state_dict()
    async with (
        SGLangHTTPBackend(server.url) as backend,
        HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES) as sync,
    ):
        server.reset()
        async with sync.subscribe() as events:
            await sync.mark_stale()
            with pytest.raises(error, match=match):
                await sync.sync_weights(kv_scales=kv_scales)
            first = events.receive_nowait()
            assert first is not None and first.kind is VersionEventKind.STALE
            assert events.receive_nowait() is None  # no SYNC_STARTED, no FAILED
        assert (sync.policy_version, sync.weight_version, sync.is_stale) == (1, 0, True)
        assert backend.weights_valid and not sync._engine_dirty
        # Not a byte, not a request: the server holds its own weights still.
        assert server.log() == []
        assert trainer.events == []
        state_equal(server.state_dict(), before)
        # The same synchronizer then syncs normally.
        await sync.sync_weights(kv_scales={0: 0.5})
        assert (sync.weight_version, sync.is_stale) == (1, False)
        state_equal(server.state_dict(), trainer.expected())


async def test_the_discard_listener_is_removed_on_shutdown(server: Any, make_trainer: Any) -> None:
    async with SGLangHTTPBackend(server.url) as backend:
        sync = HTTPWeightSynchronizer(make_trainer(seed=81), backend, bucket_bytes=BUCKET_BYTES)
        # One listener, registered by the base class (not by the transport too).
        assert backend._listeners == [sync._invalidate_engine_weights]
        async with sync:
            await sync.mark_stale()
            await sync.sync_weights()
            assert not sync.is_stale
            backend._discard_weights("test: the server dropped its weights")
            assert sync.is_stale
        assert backend._listeners == []
        # A shut-down synchronizer hears no later discard.
        backend.note_weights_loaded()
        dirty_before = sync._discards
        backend._discard_weights("test: dropped again")
        assert sync._discards == dirty_before


async def test_every_server_of_a_fleet_or_a_list_loses_its_listener_on_shutdown(
    server_pair: tuple[Any, Any], make_trainer: Any
) -> None:
    trainer = make_trainer(seed=83)
    async with (
        SGLangHTTPBackend(server_pair[0].url) as first,
        SGLangHTTPBackend(server_pair[1].url) as second,
    ):
        fleet = create_weight_synchronizer(
            trainer, [first, second], colocated=True, backend="sglang"
        )
        plain = HTTPWeightSynchronizer(trainer, [first, second])
        syncs = (fleet, plain)

        def theirs(notifier: Any) -> list[Any]:
            return [
                f.__self__ for f in notifier._listeners if getattr(f, "__self__", None) in syncs
            ]

        # The plain list's synchronizer listens on each server; the fleet's on its fleet,
        # which relays its members' notices (unless quarantined: case C36).
        members = fleet.generation
        assert isinstance(members, EngineFleet)
        assert theirs(first) == theirs(second) == [plain]
        assert theirs(members) == [fleet]
        second._discard_weights("test: one server dropped its weights")
        assert fleet._engine_dirty and plain._engine_dirty
        await fleet.shutdown()
        await plain.shutdown()
        assert theirs(first) == theirs(second) == theirs(members) == []


async def test_sampling_params_and_the_keyword_form_are_the_same_request(
    server: Any, make_trainer: Any, prompts: list[list[int]]
) -> None:
    tap = _Bodies()
    async with SGLangHTTPBackend(server.url, transport=tap) as backend:
        by_params = await backend.generate_with_meta(prompts, SamplingParams(max_tokens=4))
        by_keywords = await backend.generate_with_meta(prompts, max_new_tokens=4)
        # Equal but for the server's request id and cache statistics.
        assert [replace(g, meta_info={}) for g in by_params] == [
            replace(g, meta_info={}) for g in by_keywords
        ]
        assert [len(g.token_ids) for g in by_params] == [4] * len(prompts)
        assert tap.generate[0] == tap.generate[1]
        assert tap.generate[0]["sampling_params"] == {
            "max_new_tokens": 4,
            "temperature": 0.0,
            "top_p": 1.0,
            "ignore_eos": False,
        }
        # Keywords beside params override its fields; generate() is the token ids.
        sampled = SamplingParams(
            max_tokens=9, temperature=0.7, seed=5, ignore_eos=True, logprobs=True
        )
        tokens = await backend.generate(prompts, sampled, max_new_tokens=3, logprobs=False)
        assert [len(t) for t in tokens] == [3] * len(prompts)
        body = tap.generate[-1]
        assert body["sampling_params"]["max_new_tokens"] == 3
        assert body["sampling_params"]["sampling_seed"] == 5
        assert "return_logprob" not in body
        with pytest.raises(TypeError, match="unknown sampling keyword"):
            await backend.generate_with_meta(prompts, max_new_tokens=2, top_k=3)
        assert len(tap.generate) == 3  # the refused call sent nothing


@pytest.fixture(scope="module")
def legacy_server_proc(server_workdir: Any, dense_config: Any) -> Any:
    """An SGLang from before the weight-update session (``--no-weight-update-session``)."""
    from .conftest import TestServer

    proc = TestServer(server_workdir, dense_config, "--no-weight-update-session")
    try:
        yield proc
    finally:
        proc.close()


async def test_a_commit_by_another_synchronizer_mid_sync_fails_the_sync_and_taints_both(
    legacy_server_proc: Any, make_trainer: Any, state_equal: Any
) -> None:
    # An SGLang without sessions: B can commit into the server while A's buckets move.
    # Then the server holds a mix of both, so A must not commit over it and B, whose
    # claim A's later buckets broke, must turn stale.
    import threading

    import anyio

    from aiosync import OwnershipError

    server = legacy_server_proc
    server.reset()
    a, b = make_trainer(seed=71), make_trainer(seed=72)
    async with SGLangHTTPBackend(server.url) as backend:
        sync_a = HTTPWeightSynchronizer(a, backend, bucket_bytes=BUCKET_BYTES)
        sync_b = HTTPWeightSynchronizer(b.inner, backend, bucket_bytes=BUCKET_BYTES)
        async with sync_a, sync_b:
            await sync_a.mark_stale()
            await sync_a.sync_weights()  # A owns the server
            a.step(seed=73)
            await sync_a.mark_stale()
            await sync_b.mark_stale()
            streaming, intruded = threading.Event(), threading.Event()
            seen: list[str] = []

            def hold(name: str) -> None:
                seen.append(name)
                if len(seen) == 3:
                    streaming.set()
                    intruded.wait(60)

            a.on_tensor = hold
            outcome: dict[str, BaseException | None] = {}

            async def run_a() -> None:
                try:
                    await sync_a.sync_weights()
                    outcome["a"] = None
                except Exception as exc:
                    outcome["a"] = exc

            async def intrude() -> None:
                await anyio.to_thread.run_sync(streaming.wait, 60)
                try:
                    await sync_b.sync_weights()
                finally:
                    intruded.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(run_a)
                tg.start_soon(intrude)
            a.on_tensor = None
            failure = outcome["a"]
            assert isinstance(failure, OwnershipError)
            assert "committed its version 1" in str(failure)
            assert "may hold a mix of both" in str(failure)
            assert (sync_a.weight_version, sync_a.is_stale) == (1, True)
            assert (sync_b.weight_version, sync_b.is_stale) == (1, True)
            # A takes the engine over explicitly; its sync lands whole.
            await sync_a.init_communicator()
            await sync_a.sync_weights()
            assert (sync_a.weight_version, sync_a.is_stale) == (2, False)
            state_equal(server.state_dict(), a.expected())
            with pytest.raises(OwnershipError, match="no longer owns its engine"):
                await sync_b.sync_weights()
