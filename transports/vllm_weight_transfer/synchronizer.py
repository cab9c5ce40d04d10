"""Drive vLLM's own weight-transfer API with aiosync's versions and events.

vLLM (0.32, ``vllm.distributed.weight_transfer``) ships a trainer→engine weight
transfer of its own, in four phases that its workers expose as RPCs and its
``AsyncLLM`` / HTTP server / Ray actors expose to the trainer:

1. ``init_weight_transfer_engine(init_info)`` — once: the workers join the
   backend's group (``"nccl"``: a NCCL communicator with the trainer as rank 0;
   ``"ipc"``: CUDA-IPC handles, colocated).
2. ``start_weight_update()`` — per update: the workers start vLLM's layerwise
   reload (``initialize_layerwise_reload``).
3. ``update_weights(update_info)`` — per update (possibly per chunk): names,
   dtypes and shapes; the workers receive and ``load_weights``.
4. ``finish_weight_update()`` — the workers finish the reload
   (``finalize_layerwise_reload``: ``process_weights_after_loading``).

On the trainer side ``WeightTransferTrainerFactory.trainer_init(init_info,
client=..., source=...)`` builds a ``TrainerWeightTransferEngine`` whose
``send_weights()`` runs phases 2–4 through a four-method client
(``VLLMWeightSyncClient``) and pushes the bytes.

:class:`VLLMWeightTransferSynchronizer` is an aiosync
:class:`~aiosync.WeightSynchronizer` whose ``send`` phase is that
``send_weights()``: the training loop keeps aiosync's versions, events,
timeouts and coalescing, and vLLM moves the bytes with its own backend
(no aiosync worker extension needed on the engine; the engine must be built
with ``weight_transfer_config=WeightTransferConfig(backend=...)``).
Use aiosync's own transports (``aiosync.transports.collective`` / ``aiosync.transports.ipc``
with the worker extension) where vLLM's backends do not run: its ``nccl`` and
``ipc`` backends need CUDA, so on CPU only aiosync's gloo and shared-memory
paths exist. See ``docs/vllm.md``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Protocol, Unpack, runtime_checkable

import anyio
import anyio.to_thread

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.errors import SyncError, TransportError
from aiosync.options import TransportCapabilities
from aiosync.sources import RefitManifest, RefitSource
from aiosync.synchronizer import KVScales, SharedKeywords, WeightSynchronizer

__all__ = [
    "LLMWeightSyncClient",
    "ReleasingClient",
    "VLLMWeightTransferSynchronizer",
    "VersionRecordingClient",
    "refit_weight_source",
    "vllm_weight_transfer_available",
]


# A client is vLLM's object (HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient)
# or LLMWeightSyncClient: its optional methods are typed here, checked with isinstance.
@runtime_checkable
class ReleasingClient(Protocol):
    """A client that can release the trainer connection on every worker."""

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave vLLM's transfer group; the engine keeps serving."""
        ...


@runtime_checkable
class VersionRecordingClient(Protocol):
    """A client that records aiosync's version in the engine (``GET /get_weight_version``)
    without running phase 4 again."""

    def set_weight_version(self, version: str) -> None:
        """Label the engine's weights with ``version`` (its string form)."""
        ...


@runtime_checkable
class _SenderReporting(Protocol):
    """vLLM's trainer engine saying whether this trainer rank sends (others only gather)."""

    is_sender: bool


def vllm_weight_transfer_available() -> bool:
    """True when the installed vLLM has the trainer-side weight-transfer API."""
    try:
        from vllm.distributed.weight_transfer import (  # noqa: F401
            WeightSource,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return False
    return True


def refit_weight_source(policy: RefitSource, manifest: RefitManifest | None = None) -> Any:
    """vLLM's ``WeightSource`` over an aiosync :class:`~aiosync.RefitSource`.

    ``metadata()`` is ``prepare_refit_info()`` (HF checkpoint names, shapes,
    dtypes, in order), or ``manifest`` when given (already read); iteration is
    ``iter_weights()``, a fresh pass each time.

    Raises:
        ImportError: vLLM (with ``vllm.distributed.weight_transfer``) is not installed.
    """
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    class _RefitWeightSource(WeightSource):
        def __init__(self, source: RefitSource) -> None:
            self._source = source
            self._meta: list[Any] | None = None

        def metadata(self) -> list[Any]:
            if self._meta is None:
                info = manifest if manifest is not None else self._source.prepare_refit_info()
                self._meta = [
                    ParamMeta(name, dtype, tuple(int(d) for d in shape))
                    for name, (shape, dtype) in info.items()
                ]
            return self._meta

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return iter(self._source.iter_weights())

    return _RefitWeightSource(policy)


class LLMWeightSyncClient:
    """vLLM's four-method ``VLLMWeightSyncClient`` over an in-process ``vllm.LLM``.

    ``AsyncLLM`` has these methods itself and vLLM ships HTTP and Ray clients;
    the synchronous ``LLM`` only reaches its workers through ``collective_rpc``,
    which is what this adapter calls (the worker methods of the same names).
    Methods block; vLLM's trainer engine calls them from its own threads.

    Args:
        llm: a ``vllm.LLM`` built with ``weight_transfer_config``.
        timeout_s: limit of each call, seconds (vLLM's own RPC timeout: after it
            fires, vLLM's executor may hand the late reply to the next call, so
            treat the engine as broken and restart it).
    """

    def __init__(self, llm: Any, *, timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> None:
        self.llm = llm
        self.timeout_s = timeout_s

    def _rpc(self, method: str, **kwargs: Any) -> None:
        self.llm.collective_rpc(method, timeout=self.timeout_s, kwargs=kwargs)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Phase 1 on every worker."""
        self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        """Phase 2 on every worker."""
        self._rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        """Phase 3 on every worker."""
        self._rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Phase 4 on every worker, then record ``weight_version`` in the engine."""
        self._rpc("finish_weight_update")
        if weight_version is not None:
            self.set_weight_version(weight_version)

    def set_weight_version(self, version: str) -> None:
        """Record ``version`` in the engine (what ``GET /get_weight_version`` answers)."""
        self.llm.llm_engine.set_weight_version(version)

    def shutdown_weight_transfer_engine(self) -> None:
        """Release the trainer connection on every worker (inference continues)."""
        self._rpc("shutdown_weight_transfer_engine")


class VLLMWeightTransferSynchronizer(WeightSynchronizer):
    """An aiosync synchronizer whose bytes move through vLLM's weight-transfer engine.

    Args:
        policy: the trainer's refit source (HF checkpoint names).
        generation: the engine as the loop sees it (e.g.
            :class:`aiosync.engines.vllm.backend.VLLMGenerationBackend`); not used to
            move bytes.
        init_info: vLLM's trainer init info, e.g.
            ``NCCLTrainerInitInfo(master_address=..., master_port=...,
            world_size=1 + num_workers, rank=trainer_rank)``.
        client: a ``VLLMWeightSyncClient`` (``HTTPVLLMWeightSyncClient``,
            ``RayVLLMWeightSyncClient``, :class:`LLMWeightSyncClient`); when it
            is a :class:`VersionRecordingClient` the engine learns aiosync's
            version too, when a :class:`ReleasingClient` shutdown releases it.
        timeouts: every limit (:class:`~aiosync.Timeouts`); ``sync_s`` bounds
            one ``sync_weights`` and the handshake of ``init_communicator``.
        **shared: ``sync_timeout_s``, ``event_backlog``, ``in_flight``,
            ``initial_version``, ``on_failure``
            (:class:`~aiosync.synchronizer.SharedKeywords`): as
            :class:`~aiosync.WeightSynchronizer`.

    ``sync_weights(kv_scales=...)`` raises NotImplementedError before anything
    moves: vLLM's API carries no FP8 KV-cache scales.

    Raises:
        ImportError: the installed vLLM has no ``vllm.distributed.weight_transfer``.
    """

    capabilities = TransportCapabilities(kv_scales=False)
    kv_scales_refusal = (
        "vLLM's weight-transfer API carries no FP8 KV-cache scales; "
        "use aiosync.transports.collective for kv_scales"
    )

    def __init__(
        self,
        policy: RefitSource,
        generation: Any,
        *,
        init_info: Any,
        client: Any,
        **shared: Unpack[SharedKeywords],
    ) -> None:
        if not vllm_weight_transfer_available():
            raise ImportError(
                "the installed vLLM has no vllm.distributed.weight_transfer "
                "(vLLM >= 0.32 provides it); use aiosync.transports.collective / "
                "aiosync.transports.ipc"
            )
        super().__init__(
            policy,
            generation,
            **shared,
        )
        self.init_info = init_info
        self.client = client
        self._engine: Any = None
        self._source: Any = None
        self._nbytes = 0

    async def open(self, sync: WeightSynchronizer) -> None:
        """Phase 1: rendezvous with vLLM's workers through ``trainer_init``.

        Raises:
            TransportError: vLLM's handshake failed (its message included).
        """
        self._check_open()
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        manifest = await self._read_manifest()
        await self._check_model_configs()
        self._source = refit_weight_source(self.policy, manifest)
        self._nbytes = sum(dtype.itemsize * _numel(shape) for shape, dtype in manifest.values())
        init = functools.partial(
            WeightTransferTrainerFactory.trainer_init,
            self.init_info,
            client=self.client,
            source=self._source,
        )
        try:
            with anyio.fail_after(self.sync_timeout_s):
                self._engine = await anyio.to_thread.run_sync(init, abandon_on_cancel=True)
        except (SyncError, TimeoutError):
            raise
        except Exception as exc:
            raise TransportError(f"vLLM weight-transfer init failed: {exc}") from exc

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        """The fleet's engines changed: :meth:`open` again over the engines now in it."""
        await self.open(sync)

    async def send(self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None) -> int:
        # kv_scales is None here: capabilities.kv_scales is False (checked by the base).
        engine = self._engine
        if engine is None:
            raise SyncError("await init_communicator() before sync_weights()")
        sender = engine.is_sender if isinstance(engine, _SenderReporting) else True
        try:
            await anyio.to_thread.run_sync(engine.send_weights, abandon_on_cancel=True)
            if sender and isinstance(self.client, VersionRecordingClient):
                # Record aiosync's version in vLLM too (GET /get_weight_version).
                await anyio.to_thread.run_sync(self.client.set_weight_version, str(version))
        except SyncError:
            raise
        except Exception as exc:
            raise TransportError(f"vLLM send_weights failed: {exc}") from exc
        return self._nbytes

    async def close(self, sync: WeightSynchronizer) -> None:
        """Tear down vLLM's transfer group (the engine keeps serving). Idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            await anyio.to_thread.run_sync(engine.shutdown)
            if isinstance(self.client, ReleasingClient):
                with contextlib.suppress(Exception):  # the engine may be gone already
                    await anyio.to_thread.run_sync(self.client.shutdown_weight_transfer_engine)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
