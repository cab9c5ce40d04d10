"""``LoRAAdapterSynchronizer``: adapter-only refits through the engine's own LoRA API.

What verl and prime-rl do for speed with a LoRA trainer: only the adapter's
tensors travel (megabytes, not the model's gigabytes), and the engine loads
them as a LoRA adapter named after the weight version
(:func:`aiosync.lora_adapter_name`, ``"aiosync-v{version}"``) that every later
generation applies. The base weights are never touched.

One refit:

1. iterate ``policy.iter_weights()`` (a worker thread), checking each tensor
   against the manifest (names, order, shapes, dtypes) and copying it to a CPU,
   contiguous tensor;
2. unless ``verify=False``, digest each tensor in the same thread
   (:func:`~aiosync.transports.lora.adapter_digests`: tensor ``i`` sampled with
   ``sample_key(version, i)``, or every byte with ``verify=True``);
3. build a :class:`~aiosync.LoRAAdapter` (``name``, ``version``, the tensors,
   ``policy.lora_adapter_config()``, ``verify``, the digests) and ``await
   generation.load_lora_adapter(adapter)`` (each engine of a fleet
   concurrently). The engine unloads the adapter it replaces and refuses to
   generate from the start of the load until one succeeds (never a
   half-loaded adapter, never a silent fallback); it checks the digests
   before the adapter goes live, a mismatch being
   :class:`~aiosync.errors.RefitVerificationError` (the sync fails as any
   failed load does).

Versions, events, timeouts and discard epochs are the base class's, exactly as
for full refits; the ``COMMITTED`` event's ``nbytes`` is the adapter's
:attr:`~aiosync.LoRAAdapter.nbytes`.

``init_communicator()`` checks, before any byte moves, that the manifest is a
LoRA adapter in PEFT's saved layout (``aiosync/transports/lora/_layout.py``)
whose config agrees with it, and that every adapted layer exists in each
engine's base model with matching shapes (``lora_A`` ``[r, in_features]``,
``lora_B`` ``[out_features, r]`` against the base ``[out_features, in_features]``,
from the engine's ``expected_manifest()``, a
:class:`~aiosync.capabilities.ManifestReporting` engine; another is warned about
and checked by its own load). A :class:`~aiosync.lora.LoRAChecking` engine (vLLM,
SGLang) is asked too.

An adapter-only refit cannot restore discarded base weights: a level-2 sleep,
or SGLang's memory saver without a CPU backup, make the next sync fail with
:class:`~aiosync.errors.SyncError` (sleep at level 1, or keep a CPU backup).
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, ClassVar, Unpack

import anyio
import torch

from aiosync._fanout import each_named
from aiosync.capabilities import ManifestReporting, ValidityReporting, engines_of
from aiosync.errors import RefitMismatchError, SyncError
from aiosync.lora import (
    LoRAAdapter,
    LoRAAdapterSource,
    LoRAChecking,
    LoRAEngine,
    lora_adapter_name,
)
from aiosync.options import TransportCapabilities
from aiosync.sources import RefitManifest
from aiosync.synchronizer import KVScales, SharedKeywords, WeightSynchronizer

from .._ranks import TrainerRanks
from .._verify import Verify, check_verify
from ._digests import adapter_digests
from ._layout import AdaptedModule, adapted_modules, check_adapter_config, check_against_base

__all__ = ["LoRAAdapterSynchronizer"]


class LoRAAdapterSynchronizer(WeightSynchronizer):
    """Refits a LoRA trainer's adapter into engines that serve LoRA adapters.

    Moves no FP8 KV-cache scales: an adapter-only refit leaves the base model,
    and with them its scales, alone, so ``sync_weights(kv_scales=...)`` raises
    NotImplementedError before any event.

    Args:
        policy: the trainer's :class:`~aiosync.LoRAAdapterSource` (e.g.
            ``aiosync.refit.LoRAAdapterRefitSource``): the adapter's tensors under
            PEFT's saved names, and ``lora_adapter_config()``.
        generation: a :class:`~aiosync.lora.LoRAEngine` (the embedded engine,
            ``SGLangHTTPBackend``, vLLM's backend), an :class:`~aiosync.EngineFleet`
            of them, or a list (loaded concurrently). None on the trainer ranks
            other than 0 of a sharded trainer.
        **shared: ``sync_timeout_s``, ``event_backlog``, ``in_flight``,
            ``initial_version``, ``on_failure``
            (:class:`~aiosync.synchronizer.SharedKeywords`): as
            :class:`~aiosync.WeightSynchronizer`.
        timeouts: every limit (:class:`~aiosync.Timeouts`); default ``Timeouts()``.
        process_group: a sharded trainer's ``torch.distributed`` group (gloo, whose
            timeout bounds the agreement). Every rank runs a synchronizer and
            makes the same calls, since the source's gathers are collectives; only
            group rank 0 holds the engine and loads the adapter. A sync commits on
            every rank or fails on every rank with the same typed error: the ranks
            agree (a small ``all_gather_object``, as the IPC transport does) once
            every rank has read the adapter, before rank 0 loads it (an adapter
            a rank failed to produce is never loaded), and once more on the load.
        verify: the engines check each tensor they received against the
            trainer's digest before the adapter goes live
            (:mod:`aiosync.transports._verify`): ``"sample"`` (the default; each
            tensor's first and last byte plus 4096 bytes in runs of 8 drawn afresh per sync
            and tensor), ``True`` (every byte) or ``False`` (no digests). A
            mismatch fails the sync with :class:`~aiosync.errors.RefitVerificationError`
            naming the tensor and the engine, which then refuses to generate
            until a sync lands. Which bytes each engine checks: ``docs/reliability.md``.

    Raises:
        TypeError: ``policy`` has no ``lora_adapter_config()``, or an engine has
            no ``load_lora_adapter`` (the message names it).
        ValueError: no engine on group rank 0, the same engine twice, a
            timeout not finite and > 0, or ``verify`` not True, False or ``"sample"``.
    """

    #: What it can do, as data (:class:`~aiosync.TransportCapabilities`): the factory
    #: refuses a shared option outside it; the conformance kit runs its cells.
    capabilities = TransportCapabilities(
        verify=frozenset({False, "sample", True}),
        kv_scales=False,
        sharded_trainer=True,
    )

    kv_scales_refusal: ClassVar[str] = (
        "an adapter-only refit leaves the base model, and with it the FP8 KV-cache scales, "
        "alone: sync_weights(kv_scales=...) needs a full refit"
    )

    def __init__(
        self,
        policy: LoRAAdapterSource,
        generation: Any,
        *,
        process_group: Any = None,
        verify: Verify = "sample",
        **shared: Unpack[SharedKeywords],
    ) -> None:
        verify = check_verify(verify)
        if not callable(getattr(policy, "lora_adapter_config", None)):
            raise TypeError(
                "LoRAAdapterSynchronizer refits a LoRA adapter: policy must be a "
                "LoRAAdapterSource (with lora_adapter_config()), e.g. "
                f"aiosync.refit.LoRAAdapterRefitSource; got {type(policy).__name__}"
            )
        ranks = TrainerRanks.driving(process_group, generation)
        engines = _lora_engines(generation) if ranks.is_driver else ()
        super().__init__(
            policy,
            generation,
            ranks=ranks,
            **shared,
        )
        self.policy: LoRAAdapterSource = policy
        #: The engines loaded, in fleet order (empty on the non-driving ranks).
        self.engines: tuple[Any, ...] = engines
        #: The per-tensor check (``True``, ``"sample"`` or ``False``); may be
        #: changed between syncs.
        self.verify: Verify = verify
        self._ranks = ranks
        # The adapter's manifest with int dimensions, after init_communicator.
        self._adapter: RefitManifest = {}
        self._config: dict[str, Any] = {}
        #: The layers the adapter adapts, ``{module: AdaptedModule}`` (after
        #: :meth:`init_communicator`).
        self.modules: dict[str, AdaptedModule] = {}
        if any(_invalid(engine) for engine in engines):
            self._invalidate_engine_weights()

    async def open(self, sync: WeightSynchronizer) -> None:
        """Check the adapter against its config and every engine's base model.

        Raises:
            TypeError: ``lora_adapter_config()`` is not a JSON-able dict.
            RefitMismatchError: the manifest is not a LoRA adapter in PEFT's saved
                layout, disagrees with its config, or targets a layer the engine's
                model lacks or has with other shapes (names the first offender).
            ValueError: an engine is not configured for this adapter (vLLM without
                ``enable_lora`` or with ``max_lora_rank`` below its rank; SGLang without
                ``--enable-lora`` or with ``--max-lora-rank`` below it).
            TransportError, SyncTimeoutError: an engine cannot be asked. With several
                engines the message names the engine.
            On a sharded trainer every rank raises the same error.
        """
        self._check_open()
        error: BaseException | None = None
        try:
            manifest: RefitManifest = {
                name: (tuple(int(d) for d in shape), dtype)
                for name, (shape, dtype) in (await self._read_manifest()).items()
            }
            config = _json_config(self.policy.lora_adapter_config())
            modules = adapted_modules(manifest)
            check_adapter_config(config, modules)
            if self.engines:
                await self._each(lambda i, engine: self._check_engine(i, engine, config, modules))
            await self._check_model_configs()
        except Exception as exc:
            if not self._ranks.sharded:
                raise
            error = exc
        # Every rank raises the same error, or none does.
        await self._ranks.agree(iter(()), error)
        self._adapter, self._config, self.modules = manifest, config, modules

    async def _check_engine(
        self, index: int, engine: Any, config: Mapping[str, Any], modules: Mapping[str, Any]
    ) -> None:
        base = await engine.expected_manifest() if isinstance(engine, ManifestReporting) else None
        if base is None:
            warnings.warn(
                f"cannot check the LoRA adapter's target layers against {self._label(index)} "
                "before the first load (it offers no expected_manifest()); a mismatch "
                "surfaces as the engine's refusal of the load",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            check_against_base(modules, base)
        if isinstance(engine, LoRAChecking):
            targets = sorted({m.target for m in modules.values()})
            await engine.check_lora_adapter(config, targets, max(m.rank for m in modules.values()))

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        """The fleet's engines changed: :meth:`open` again over the engines now in it."""
        await self.open(sync)

    async def close(self, sync: WeightSynchronizer) -> None:
        """Nothing of its own to release (the engines keep their adapters)."""

    async def send(self, sync: WeightSynchronizer, version: int, kv_scales: KVScales | None) -> int:
        # Every rank iterates (a sharded source's gathers are collectives); the
        # ranks agree that each read the whole adapter before rank 0 loads it (an
        # adapter some rank failed to produce is never served), then on the load.
        # One process: each agreement raises this process's own error, if any.
        weights = self.policy.iter_weights()
        failed: BaseException | None = None
        tensors: dict[str, torch.Tensor] = {}
        digests: dict[str, int] = {}
        verify = self.verify
        try:
            read = functools.partial(
                _read, weights, self._adapter, self._ranks.is_driver, verify, version
            )
            tensors, digests = await anyio.to_thread.run_sync(read)
        except BaseException as exc:
            failed = exc
        await self._ranks.agree(weights, failed)
        # The same count as the driver's adapter.nbytes on every rank: the events agree.
        nbytes = _manifest_nbytes(self._adapter)
        try:
            if self._ranks.is_driver:
                nbytes = await self._load(version, tensors, verify, digests)
        except BaseException as exc:
            failed = exc
        await self._ranks.agree(weights, failed)
        return nbytes

    async def _load(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        verify: Verify,
        digests: dict[str, int],
    ) -> int:
        for i, engine in enumerate(self.engines):
            if _invalid(engine):
                raise SyncError(
                    f"{self._label(i)} holds no valid base weights (discarded, e.g. by the "
                    "memory saver without a CPU backup): an adapter-only refit cannot restore them"
                )
        adapter = LoRAAdapter(
            lora_adapter_name(version), version, tensors, dict(self._config), verify, digests
        )
        if isinstance(self.generation, LoRAEngine):  # one engine, or a fleet (it fans out)
            await self.generation.load_lora_adapter(adapter)
        else:
            await self._each(lambda i, engine: engine.load_lora_adapter(adapter))
        return adapter.nbytes

    async def _each(self, call: Callable[[int, Any], Awaitable[Any]]) -> list[Any]:
        return await each_named(self.engines, call, self._label)

    def _label(self, index: int) -> str:
        return f"engine {index} of {len(self.engines)} ({type(self.engines[index]).__name__})"

    def __repr__(self) -> str:
        info = {
            "engines": [type(e).__name__ for e in self.engines],
            "modules": len(self.modules),
            "weight_version": self.weight_version,
        }
        return f"LoRAAdapterSynchronizer({info})"


def _lora_engines(generation: Any) -> tuple[Any, ...]:
    """The engines behind ``generation`` (:func:`~aiosync.capabilities.engines_of`),
    each a :class:`~aiosync.lora.LoRAEngine`.

    Raises:
        ValueError: no engine, or the same engine twice.
        TypeError: an engine cannot load LoRA adapters (the message names it).
    """
    engines = engines_of(generation, what="engine")
    for i, engine in enumerate(engines):
        if not isinstance(engine, LoRAEngine):
            where = f"engine {i} of {len(engines)}" if len(engines) > 1 else "the engine"
            raise TypeError(
                f"{where} ({type(engine).__name__}) has no load_lora_adapter(adapter): it cannot "
                "serve adapter-only refits (aiosync's embedded, SGLang and vLLM backends can)"
            )
    return engines


def _invalid(engine: object) -> bool:
    """Whether ``engine`` says its base weights cannot be trusted (one that does not say can)."""
    return isinstance(engine, ValidityReporting) and not engine.weights_valid


def _json_config(config: Any) -> dict[str, Any]:
    """``lora_adapter_config()`` as a plain dict, checked JSON-able (adapter_config.json)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"lora_adapter_config() must return a dict, got {type(config).__name__}")
    try:
        return dict(json.loads(json.dumps(dict(config))))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"lora_adapter_config() must be JSON-able: {exc}") from exc


def _collect(
    weights: Iterator[tuple[str, torch.Tensor]], manifest: RefitManifest, keep: bool
) -> dict[str, torch.Tensor]:
    """The source's tensors, checked against ``manifest`` (order, shapes, dtypes);
    CPU, contiguous copies when ``keep`` (else only checked: a non-driving rank)."""
    expected = iter(manifest.items())
    out: dict[str, torch.Tensor] = {}
    for index, (name, tensor) in enumerate(weights):
        entry = next(expected, None)
        if entry is None:
            raise RefitMismatchError(
                f"the source yielded {name!r} after all {len(manifest)} manifest entries"
            )
        want, (shape, dtype) = entry
        if name != want:
            raise RefitMismatchError(
                f"the source yielded {name!r} where its manifest has {want!r} (entry {index})"
            )
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RefitMismatchError(
                f"{name}: the manifest says {tuple(shape)} {dtype}, the source yielded "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
        if keep:
            out[name] = tensor.detach().to("cpu", copy=True).contiguous()
    missing = [name for name, _ in expected]
    if missing:
        raise RefitMismatchError(
            f"the source ended {len(missing)} tensor(s) early; first missing: {missing[:3]}"
        )
    return out


def _read(
    weights: Iterator[tuple[str, torch.Tensor]],
    manifest: RefitManifest,
    keep: bool,
    verify: Verify,
    version: int,
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """:func:`_collect`, then (when ``keep``) the tensors' digests: ``({peft_name:
    CPU tensor}, {peft_name: digest})`` (blocking)."""
    tensors = _collect(weights, manifest, keep)
    return tensors, adapter_digests(tensors, verify, version) if keep else {}


def _manifest_nbytes(manifest: RefitManifest) -> int:
    """Bytes of the tensors ``manifest`` describes."""
    total = 0
    for shape, dtype in manifest.values():
        numel = 1
        for d in shape:
            numel *= int(d)
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total
