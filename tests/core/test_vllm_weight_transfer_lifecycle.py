"""VLLMWeightTransferSynchronizer's lifecycle on CPU, without vLLM installed.

vLLM's trainer side (``vllm.distributed.weight_transfer``: ``ParamMeta``,
``WeightSource``, ``WeightTransferTrainerFactory.trainer_init``) is provided here
by a small in-process stand-in that runs the same four phases through the
synchronizer's client and hands the source's tensors to it directly (vLLM's NCCL
and IPC backends need CUDA; tests/vllm cover the real API). What is under test
is aiosync's part: argument checks before ``SYNC_STARTED``, versions, events.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from core_harness import ArraySource, RecordingEngine

from aiosync import VersionEventKind
from aiosync.transports.vllm_weight_transfer import (
    ReleasingClient,
    VersionRecordingClient,
    VLLMWeightTransferSynchronizer,
)


@dataclass(frozen=True)
class _ParamMeta:
    name: str
    dtype: Any
    shape: tuple[int, ...]


class _WeightSource:
    """vLLM's ``WeightSource`` base: ``metadata()`` and iteration."""


class _TrainerEngine:
    """vLLM's trainer engine: ``send_weights()`` runs phases 2-4 through the client."""

    def __init__(self, client: Any, source: Any) -> None:
        self.client, self.source = client, source
        self.shut_down = False

    def send_weights(self) -> None:
        meta = self.source.metadata()
        self.client.start_weight_update()
        tensors = dict(iter(self.source))
        self.client.update_weights(
            {"names": [m.name for m in meta], "tensors": [tensors[m.name] for m in meta]}
        )
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.shut_down = True


class _Factory:
    @staticmethod
    def trainer_init(init_info: Any, *, client: Any, source: Any) -> _TrainerEngine:
        client.init_weight_transfer_engine(init_info)
        return _TrainerEngine(client, source)


@pytest.fixture
def vllm_api(monkeypatch: pytest.MonkeyPatch) -> None:
    api = types.ModuleType("vllm.distributed.weight_transfer")
    api.ParamMeta = _ParamMeta  # type: ignore[attr-defined]
    api.WeightSource = _WeightSource  # type: ignore[attr-defined]
    api.WeightTransferTrainerFactory = _Factory  # type: ignore[attr-defined]
    for name, module in (
        ("vllm", types.ModuleType("vllm")),
        ("vllm.distributed", types.ModuleType("vllm.distributed")),
        ("vllm.distributed.weight_transfer", api),
    ):
        monkeypatch.setitem(sys.modules, name, module)


class PhaseClient:
    """A four-phase client whose workers are this dict: it records every phase."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.weights: dict[str, np.ndarray] = {}
        self.version: str | None = None

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        self.phases.append("init")

    def start_weight_update(self) -> None:
        self.phases.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.phases.append("update")
        for name, tensor in zip(update_info["names"], update_info["tensors"], strict=True):
            self.weights[name] = np.array(tensor, copy=True)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.phases.append("finish")

    def set_weight_version(self, version: str) -> None:
        self.version = version

    def shutdown_weight_transfer_engine(self) -> None:
        self.phases.append("release")


def _drained(events: Any) -> list[tuple[VersionEventKind, int]]:
    out = []
    while (event := events.receive_nowait()) is not None:
        out.append((event.kind, event.version))
    return out


def _source() -> ArraySource:
    source = ArraySource()
    # An attention layer, so that a well-formed layer index is one the manifest has.
    source.weights["model.layers.0.self_attn.q_proj.weight"] = np.ones((2, 2), np.float32)
    return source


@pytest.mark.parametrize(
    ("kv_scales", "error", "match"),
    [
        ({0: 0.5}, NotImplementedError, "carries no FP8 KV-cache scales"),
        ({}, NotImplementedError, "carries no FP8 KV-cache scales"),
        ({0: "big"}, TypeError, "must be a float"),
        ({0: -1.0}, ValueError, "finite and > 0"),
    ],
)
async def test_bad_kv_scales_raise_before_sync_started_and_leave_the_engine_untouched(
    vllm_api: None, kv_scales: Any, error: type[Exception], match: str
) -> None:
    source, client, engine = _source(), PhaseClient(), RecordingEngine()
    sync = VLLMWeightTransferSynchronizer(source, engine, init_info={}, client=client)
    async with sync:
        assert client.phases == ["init"]
        events = sync.subscribe()
        source.step()
        await sync.mark_stale()
        with pytest.raises(error, match=match):
            await sync.sync_weights(kv_scales=kv_scales)
        assert _drained(events) == [(VersionEventKind.STALE, 1)]
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (0, 1, True)
        # Nothing reached vLLM's workers: no phase ran after the handshake.
        assert (client.phases, client.weights, client.version) == (["init"], {}, None)
        # The engine was not marked untrustworthy: once synced it is not stale.
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert _drained(events) == [
            (VersionEventKind.SYNC_STARTED, 1),
            (VersionEventKind.COMMITTED, 1),
        ]


async def test_a_sync_runs_vllms_phases_records_the_version_and_shutdown_releases(
    vllm_api: None,
) -> None:
    source, client = _source(), PhaseClient()
    assert isinstance(client, VersionRecordingClient) and isinstance(client, ReleasingClient)
    sync = VLLMWeightTransferSynchronizer(source, RecordingEngine(), init_info={}, client=client)
    async with sync:
        source.step()
        await sync.mark_stale()
        await sync.sync_weights()
        assert client.phases == ["init", "start", "update", "finish"]
        assert client.version == "1"
        assert set(client.weights) == set(source.weights)
        assert all(np.array_equal(client.weights[n], w) for n, w in source.weights.items())
    assert client.phases[-1] == "release"


class _FourPhaseOnly:
    """vLLM's minimal client: the four phases, neither optional method."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: Any) -> None:
        self.calls.append("update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


async def test_a_client_without_the_optional_methods_syncs_and_shuts_down(
    vllm_api: None,
) -> None:
    client = _FourPhaseOnly()
    assert not isinstance(client, VersionRecordingClient)
    assert not isinstance(client, ReleasingClient)
    sync = VLLMWeightTransferSynchronizer(_source(), RecordingEngine(), init_info={}, client=client)
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
    assert client.calls == ["init", "start", "update", "finish"]
