"""vLLM-specific hooks of the worker extension: reload bracketing and status.

vLLM's model is not a plain ``nn.Module`` holding checkpoint tensors: after the
first load, ``process_weights_after_loading`` turns parameters into kernel
formats (fused/quantized layouts and, on vLLM's CPU worker, oneDNN or sgl-kernel
packed weights whose original ``weight`` parameter is replaced by an empty
tensor). A second ``model.load_weights(...)`` on such a model either fails on a
shape check or writes into tensors the kernels no longer read.

vLLM's own answer is *layerwise reload*
(``vllm.model_executor.model_loader.reload``): ``initialize_layerwise_reload(model)``
restores each layer's checkpoint-format parameters (on the meta device, then
materialized as its weights arrive), every ``load_weights`` call buffers a
layer until all its weights arrived, processes it with the layer's
``process_weights_after_loading`` (the same post-load step as at startup,
quantization included) and copies the result into the original kernel
tensors; ``finalize_layerwise_reload(model, model_config)`` finishes layers
that were not complete (attention scales, untouched layers). A tied head
(``tie_word_embeddings``) loads nothing there (the tied tensor reaches the
embedding), so its processing is re-run afterwards
(:class:`~aiosync.engines.vllm._layout.TiedHeads`): on vLLM's CPU worker the
logits GEMM reads the head's own packed copy of the embedding. Layerwise reload
keeps *references* to the tensors it is given until their layer is complete,
while aiosync's receivers pass views of bucket buffers that they reuse or unmap
once ``load_weights`` returns. So when a ``load_weights`` call (one bucket)
returns, the tensors of that call that a still incomplete layer holds (its
``LayerReloadingInfo.loaded_weights``) are replaced there by clones; every
other tensor was already copied into its layer and is not copied again. With
the trainer's checkpoint order that is at most the one layer a bucket boundary
cuts (``q_proj`` arriving before ``v_proj`` of ``qkv_proj``), plus layers that
wait for ``finalize_layerwise_reload`` (attention scales). The bytes cloned in
the last bracket are in :meth:`VLLMWorkerMixin.aiosync_vllm_status`. vLLM's own
weight transfer engines bracket their receive the same way
(``start_weight_update`` / ``finish_weight_update``).

:class:`VLLMWorkerMixin` brackets every aiosync receive that loads into the
live model (``aiosync_ipc_receive``, ``aiosync_collective_receive``,
``aiosync_collective_commit``) with those two calls, tags the errors of the
collective RPCs with their type (vLLM passes only a worker error's message to
its client), and adds a status RPC and the LoRA adapter shape check. The
shard-aware receive (``aiosync_sharded_receive``) runs in the same bracket; its
boxes go through :class:`~aiosync.engines.vllm._layout.VLLMLayoutModel`, which
also reports what this worker holds of each HF tensor (``aiosync_sharded_layout``).
It must come **before** the receiver mixins in the MRO::

    class AiosyncWorkerExtension(VLLMWorkerMixin, IPCWorkerMixin, CollectiveWorkerMixin): ...

Outside vLLM (the embedded engine, where the worker has no ``vllm_config``) the
brackets are no-ops, so one extension class serves both engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from aiosync.errors import TransportError
from aiosync.transports import validity

from ._delta import HostCopy
from ._layout import TiedHeads, VLLMLayoutModel
from ._lora import LORA_PAIR_NAME

__all__ = ["VLLMWorkerMixin", "lora_target_problems"]

_log = logging.getLogger(__name__)


class VLLMWorkerMixin:
    """Brackets aiosync receives with vLLM's layerwise reload; reports worker status.

    Attributes:
        aiosync_reloads: completed reload brackets on this worker (a count).
        aiosync_last_reload_s: seconds the last bracket took (load + post-processing).
        aiosync_cloned_bytes: bytes the last bracket cloned because an incomplete
            layer still held them when their ``load_weights`` call returned.
        aiosync_cloned_tensors: how many tensors those were.
    """

    aiosync_reloads: int = 0
    aiosync_last_reload_s: float = 0.0
    aiosync_cloned_bytes: int = 0
    aiosync_cloned_tensors: int = 0
    _aiosync_checkpoint: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
    _aiosync_lora_base: dict[str, tuple[int, ...]] | None = None
    _aiosync_vllm_layout: VLLMLayoutModel | None = None
    _aiosync_host_copy: HostCopy | None = None
    _aiosync_delta_refused: bool = False
    #: Set by the receivers' init calls (``WorkerIdentityMixin``).
    aiosync_keep_delta_base: bool = False
    aiosync_weights_valid: bool = True

    # -- the receiver RPCs: bracketed loads, typed errors ------------------------

    def aiosync_ipc_receive(self, *args: Any, **kwargs: Any) -> Any:
        """``IPCWorkerMixin.aiosync_ipc_receive`` inside a vLLM reload bracket."""
        return self._aiosync_bracketed(super().aiosync_ipc_receive, *args, **kwargs)  # type: ignore[misc]

    def aiosync_ipc_init(self, plan: Mapping[str, Any], delta: bool = False) -> Any:
        """``IPCWorkerMixin.aiosync_ipc_init``, checked against the checkpoint if enabled."""
        with self._aiosync_expected_manifest(plan):
            return super().aiosync_ipc_init(plan, delta)  # type: ignore[misc]

    def aiosync_collective_init(self, **kwargs: Any) -> Any:
        """``CollectiveWorkerMixin.aiosync_collective_init``: errors tagged with their
        type, checked against the checkpoint if enabled."""
        with self._aiosync_expected_manifest(kwargs.get("plan")):
            return self._aiosync_typed(super().aiosync_collective_init, **kwargs)  # type: ignore[misc]

    def aiosync_collective_receive(self, *args: Any, **kwargs: Any) -> Any:
        """``CollectiveWorkerMixin.aiosync_collective_receive`` inside a vLLM reload bracket."""
        return self._aiosync_bracketed(super().aiosync_collective_receive, *args, **kwargs)  # type: ignore[misc]

    def aiosync_collective_stage(self, *args: Any, **kwargs: Any) -> Any:
        """``CollectiveWorkerMixin.aiosync_collective_stage``, errors tagged with their type."""
        return self._aiosync_typed(super().aiosync_collective_stage, *args, **kwargs)  # type: ignore[misc]

    def aiosync_collective_commit(self, *args: Any, **kwargs: Any) -> Any:
        """``CollectiveWorkerMixin.aiosync_collective_commit`` inside a vLLM reload bracket."""
        return self._aiosync_bracketed(super().aiosync_collective_commit, *args, **kwargs)  # type: ignore[misc]

    # -- the shard-aware receiver: the model's layout, boxes into its layers ------

    def aiosync_sharded_layout(self, *args: Any, **kwargs: Any) -> Any:
        """``ShardedWorkerMixin.aiosync_sharded_layout``, errors tagged with their type."""
        return self._aiosync_typed(super().aiosync_sharded_layout, *args, **kwargs)  # type: ignore[misc]

    def aiosync_sharded_init(self, **kwargs: Any) -> Any:
        """``ShardedWorkerMixin.aiosync_sharded_init``, errors tagged with their type."""
        return self._aiosync_typed(super().aiosync_sharded_init, **kwargs)  # type: ignore[misc]

    def aiosync_sharded_receive(self, *args: Any, **kwargs: Any) -> Any:
        """``ShardedWorkerMixin.aiosync_sharded_receive`` inside a vLLM reload bracket.

        The bracket is needed even for unquantized models: vLLM's
        ``process_weights_after_loading`` repacks them on some platforms (its CPU
        worker packs every linear weight for oneDNN/sgl-kernel and empties the
        ``weight`` parameter, and packs a copy of the embedding for the logits),
        so a box written into the live parameter would be lost there. Inside the
        bracket, :class:`~aiosync.engines.vllm._layout.VLLMLayoutModel` writes
        each box into the layer's checkpoint-format tensors and processes a layer
        as soon as all of it arrived, as vLLM's own reload does.
        """
        if getattr(self, "vllm_config", None) is not None:
            # Described from the live model (its ties), never from the reload's
            # meta tensors: build it before the bracket if init did not.
            self._aiosync_typed(self._aiosync_layout_model)
        return self._aiosync_bracketed(self._aiosync_sharded_boxes, *args, **kwargs)

    def _aiosync_sharded_boxes(self, *args: Any, **kwargs: Any) -> Any:
        receive = super().aiosync_sharded_receive  # type: ignore[misc]
        model = self._aiosync_layout_model()
        if not isinstance(model, VLLMLayoutModel):
            return receive(*args, **kwargs)
        try:
            # A delta rewrites only the layers its patches touched.
            with model.receiving(whole=kwargs.get("delta") is None):
                return receive(*args, **kwargs)
        except BaseException:
            validity.mark_invalid(self)
            raise

    def _aiosync_layout_model(self) -> Any:
        """The model as the shard-aware receiver sees it: in vLLM a
        :class:`~aiosync.engines.vllm._layout.VLLMLayoutModel` over the worker's
        model (built once per model object), elsewhere the model itself.

        Raises:
            TransportError: the vLLM model cannot be described exactly (quantized,
                LoRA-enabled, a layer type it does not know).
        """
        config = getattr(self, "vllm_config", None)
        if config is None:
            return super()._aiosync_layout_model()  # type: ignore[misc]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        cached = self._aiosync_vllm_layout
        if cached is None or cached.model is not model:
            cached = VLLMLayoutModel(model, config)
            self._aiosync_vllm_layout = cached
        return cached

    # -- delta patches: a host copy, then a reload of the touched layers -----------

    def _aiosync_patch_model(self) -> Any:
        """In vLLM, the worker's :class:`~aiosync.engines.vllm._delta.HostCopy` once a
        full receive filled it (None before, or when the copy is not kept: every sync
        is then full); elsewhere the model itself where it applies patches."""
        if getattr(self, "vllm_config", None) is None:
            return super()._aiosync_patch_model()  # type: ignore[misc]
        host = self._aiosync_host_copy
        if not self.aiosync_keep_delta_base or host is None or not host.valid:
            return None
        if host.layout.model is not self.model_runner.get_model():  # type: ignore[attr-defined]
            return None  # the model was rebuilt: the copy is of another one
        return host

    def _aiosync_host_for_receive(self) -> HostCopy | None:
        """The host copy a receive writes (built on first use, from the live model:
        before the reload puts its layers on the meta device); None when no delta
        synchronizer feeds this worker (the copy is freed) or the model cannot be
        described (every sync is then full)."""
        if not self.aiosync_keep_delta_base:
            self._aiosync_host_copy = None
            return None
        try:
            layout = self._aiosync_layout_model()
        except TransportError as exc:
            if not self._aiosync_delta_refused:
                _log.warning("delta syncs into this vLLM worker are full syncs: %s", exc)
            self._aiosync_delta_refused = True
            self._aiosync_host_copy = None
            return None
        host = self._aiosync_host_copy
        if host is None or host.layout is not layout:
            host = self._aiosync_host_copy = HostCopy(layout)
            _log.info("vLLM worker keeps a %.1f MB host copy for delta syncs", host.nbytes / 1e6)
        return host

    # -- manifest check against the checkpoint ------------------------------------

    def aiosync_vllm_check_manifest(self, enabled: bool = True) -> dict[str, Any]:
        """Compare the trainer's manifest with the checkpoint vLLM loaded, at init.

        vLLM's model has no ``expected_manifest()`` in HF names (its parameters
        are fused: ``qkv_proj``, ``gate_up_proj``, expert tensors), so by default
        a name the engine does not know is found only when ``load_weights``
        rejects it, mid-transfer. Enabled, the receivers' init RPCs compare the
        trainer's names and shapes with the safetensors headers of the local
        checkpoint folder (``model_config.model``), dtype being the engine's
        ``model_config.dtype``, and raise :class:`~aiosync.errors.RefitMismatchError`
        naming the first differences **before any byte moves** (cases C3, C4).
        Off by default: checkpoints may hold tensors a trainer never sends
        (``mtp.*`` of Qwen3-Next) and quantized checkpoints hold other names.

        Returns:
            ``{"enabled": bool, "tensors": int}`` (tensors in the checkpoint).

        Raises:
            ValueError: the model is not a local folder of unquantized safetensors.
        """
        if not enabled:
            self._aiosync_checkpoint = None
            return {"enabled": False, "tensors": 0}
        config = self.vllm_config.model_config  # type: ignore[attr-defined]
        manifest = _checkpoint_manifest(config)
        self._aiosync_checkpoint = manifest
        return {"enabled": True, "tensors": len(manifest)}

    @contextmanager
    def _aiosync_expected_manifest(self, plan: Mapping[str, Any] | None) -> Iterator[None]:
        """Offer the receivers ``model.expected_manifest()`` for the init call.

        Entries follow the trainer's order (then the checkpoint's extra names),
        so only names, shapes and dtypes are compared, as vLLM's loader takes
        names in any order.
        """
        checkpoint = getattr(self, "_aiosync_checkpoint", None)
        model = self.model_runner.model  # type: ignore[attr-defined]
        if checkpoint is None or plan is None or hasattr(model, "expected_manifest"):
            yield
            return
        from aiosync.transports.packing import BucketPlan

        try:
            trainer_names = list(BucketPlan.from_json(plan).manifest())
        except Exception:  # the receiver reports the malformed plan itself
            trainer_names = []
        expected = {n: checkpoint[n] for n in trainer_names if n in checkpoint}
        expected.update((n, spec) for n, spec in checkpoint.items() if n not in expected)
        model.expected_manifest = lambda: expected
        try:
            yield
        finally:
            del model.expected_manifest

    # -- LoRA adapters ---------------------------------------------------------

    def aiosync_vllm_checkpoint_manifest(self) -> dict[str, Any]:
        """The local checkpoint's tensors from their safetensors headers, msgpack-safe.

        Returns:
            ``{"manifest": [[hf_name, [dims...], dtype_name], ...] | None, "reason": str}``:
            dtype is the engine's (``model_config.dtype``); None (``reason``
            says why) outside vLLM or where the model is not a local,
            unquantized safetensors folder.
        """
        config = getattr(self, "vllm_config", None)
        if config is None:
            return {"manifest": None, "reason": "not a vLLM worker"}
        from aiosync.transports.packing import dtype_name

        try:
            manifest = _checkpoint_manifest(config.model_config)
        except ValueError as exc:
            return {"manifest": None, "reason": str(exc)}
        return {
            "manifest": [[n, list(shape), dtype_name(dt)] for n, (shape, dt) in manifest.items()],
            "reason": "",
        }

    def aiosync_vllm_check_lora(
        self, shapes: Mapping[str, Sequence[int]] | None = None, targets: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Check a LoRA adapter against the engine's LoRA target modules and base weights.

        Two things vLLM does not check: an adapted module outside the engine's
        ``target_modules`` option (vLLM wraps only those), and the shapes.
        vLLM copies ``lora_A`` ``[r, in_features]`` and ``lora_B``
        ``[out_features, r]`` into the slots of its LoRA layers without checking
        ``in_features``/``out_features``: a too-narrow tensor is copied into part
        of the slot and the adapter is served half-written (measured on vLLM
        0.32). Each ``<module>.lora_A.weight`` / ``.lora_B.weight`` (PEFT saved
        names, any ``base_model.model.`` prefix) is checked against
        ``<module>.weight`` ``[out_features, in_features]`` in the safetensors
        headers of the local checkpoint (``model_config.model``).

        Args:
            shapes: ``{peft_name: [rows, cols]}`` of the adapter's lora_A/lora_B tensors.
            targets: more adapted module names (``q_proj``, ``down_proj``, ...)
                to check against ``target_modules``.

        Returns:
            ``{"checked": bool, "problems": [str, ...], "reason": str}``;
            ``checked`` is False (``reason`` says why) when the shapes could not
            be checked: outside vLLM, or where the model is not a local,
            unquantized safetensors folder. A module absent from the checkpoint
            is left to vLLM (which rejects unknown modules).
        """
        config = getattr(self, "vllm_config", None)
        if config is None:
            return {"checked": False, "problems": [], "reason": "not a vLLM worker"}
        shapes = dict(shapes or {})
        pairs = {n: m for n in shapes if (m := LORA_PAIR_NAME.fullmatch(n)) is not None}
        modules = set(targets) | {m["module"].rsplit(".", 1)[-1] for m in pairs.values()}
        lora_config = getattr(config, "lora_config", None)
        model = self.model_runner.model  # type: ignore[attr-defined]
        problems = lora_target_problems(
            sorted(modules),
            getattr(lora_config, "target_modules", None),
            getattr(model, "packed_modules_mapping", None) or {},
        )
        base = getattr(self, "_aiosync_lora_base", None)
        if base is None:
            try:
                base = {n: spec[0] for n, spec in _checkpoint_manifest(config.model_config).items()}
            except ValueError as exc:
                return {"checked": False, "problems": problems, "reason": str(exc)}
            self._aiosync_lora_base = base
        for name, match in pairs.items():
            shape = shapes[name]
            module = match["module"]
            for prefix in ("base_model.model.", ""):
                if module.startswith(prefix) and f"{module[len(prefix) :]}.weight" in base:
                    weight = f"{module[len(prefix) :]}.weight"
                    break
            else:
                continue
            out_features, in_features = base[weight][0], base[weight][-1]
            if match["kind"] == "A" and shape[-1] != in_features:
                problems.append(
                    f"{name} has shape {list(shape)}, {weight} {list(base[weight])} needs "
                    f"[r, {in_features}]"
                )
            if match["kind"] == "B" and shape[0] != out_features:
                problems.append(
                    f"{name} has shape {list(shape)}, {weight} {list(base[weight])} needs "
                    f"[{out_features}, r]"
                )
        return {"checked": True, "problems": problems, "reason": ""}

    # -- status ----------------------------------------------------------------

    def aiosync_vllm_status(self) -> dict[str, Any]:
        """This worker's state, JSON-safe.

        Returns:
            ``{"rank": int, "device": str, "in_vllm": bool, "weights_valid": bool,
            "sleep_mode": bool, "reloads": int, "last_reload_s": float,
            "cloned_bytes": int, "cloned_tensors": int, "delta_copy_bytes": int}``.
            ``sleep_mode`` is False on platforms where vLLM's ``sleep``/``wake_up``
            release nothing (its CPU worker). ``cloned_*``: what the last reload
            bracket cloned (see the module docs). ``delta_copy_bytes``: host
            memory of the copy kept for delta syncs (:mod:`._delta`).
        """
        config = getattr(self, "vllm_config", None)
        return {
            "rank": int(getattr(self, "rank", 0)),
            "device": str(getattr(self, "device", "cpu")),
            "in_vllm": config is not None,
            "weights_valid": validity.is_valid(self),
            "sleep_mode": bool(
                config is not None and getattr(config.model_config, "enable_sleep_mode", False)
            ),
            "reloads": int(self.aiosync_reloads),
            "last_reload_s": float(self.aiosync_last_reload_s),
            "cloned_bytes": int(self.aiosync_cloned_bytes),
            "cloned_tensors": int(self.aiosync_cloned_tensors),
            "delta_copy_bytes": self._aiosync_host_copy.nbytes if self._aiosync_host_copy else 0,
        }

    def _aiosync_weight_modules(self) -> list[torch.nn.Module]:
        """vLLM's layers repack what they load (the CPU build leaves the parameters
        empty; quantized kernels change layouts): no module state is the live weights.

        Raises:
            NotImplementedError: always (``on_failure="serve_previous"`` needs it).
        """
        raise NotImplementedError(
            "a vLLM worker cannot keep a copy of its live weights: its layers repack "
            "what they load; on_failure='serve_previous' is not available on vLLM"
        )

    def _aiosync_live_weights(self) -> Mapping[str, torch.Tensor]:
        """In vLLM, what each layer computes with, read back through its kernels
        (:meth:`aiosync_vllm_read_weights`), the part this worker holds of every HF
        tensor of its layout (vocabulary padding rows dropped); elsewhere the model's."""
        if getattr(self, "vllm_config", None) is None:
            return super()._aiosync_live_weights()  # type: ignore[misc]
        from aiosync.transports.packing import dtype_from_name

        layout = self._aiosync_layout_model().weight_layout()
        out: dict[str, torch.Tensor] = {}
        for name, shape, dtype, raw in self.aiosync_vllm_read_weights(list(layout)):
            tensor = torch.frombuffer(bytearray(raw), dtype=dtype_from_name(dtype)).reshape(shape)
            local = layout[name].local_shape
            if tuple(tensor.shape) != local and tensor.ndim:
                tensor = tensor[: local[0]]  # vLLM pads the vocabulary rows
            out[name] = tensor
        return out

    def aiosync_vllm_read_weights(self, names: Sequence[str]) -> list[list[Any]]:
        """This worker's live weights under their checkpoint names, read back
        from what vLLM computes with (a diagnostic: compare them bit for bit
        with the trainer's after a refit).

        A name's module is looked up in the model under the checkpoint's path,
        a packed module standing for its parts (``packed_modules_mapping``:
        ``q_proj`` is rows ``output_sizes[0]`` of ``qkv_proj``). A linear
        layer's weight is read through its kernel: vLLM's CPU worker packs it
        for oneDNN and leaves ``weight`` empty, so the layer's
        ``quant_method.apply`` is run on an identity matrix (each output
        element is one weight times 1 plus zeros: exact), giving
        ``weight.T``. Other tensors (embeddings, norms) are read as they are.
        Tensor parallel: this worker's shard. Unquantized models whose module
        paths follow the checkpoint (Qwen3, Llama) only.

        Args:
            names: checkpoint names (``model.layers.0.self_attn.q_proj.weight``).

        Returns:
            ``[[name, [dims...], dtype_name, raw bytes], ...]`` in ``names`` order.

        Raises:
            ValueError: a name has no module in the model.
        """
        from aiosync.transports.packing import dtype_name

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = getattr(model, "packed_modules_mapping", None) or {}
        parts = {part: (whole, i) for whole, ps in packed.items() for i, part in enumerate(ps)}
        out: list[list[Any]] = []
        for name in names:
            path, _, leaf = name.rpartition(".")
            parent, _, module_name = path.rpartition(".")
            part = parts.get(module_name)
            if part is not None:
                path = f"{parent}.{part[0]}" if parent else part[0]
            try:
                module = model.get_submodule(path)
            except AttributeError as exc:
                raise ValueError(f"{name}: no module {path} in the vLLM model") from exc
            if leaf == "weight" and hasattr(module, "input_size_per_partition"):
                tensor = _linear_weight(module)
            else:
                tensor = getattr(module, leaf).detach()
            if part is not None:
                sizes = [int(n) for n in module.output_partition_sizes]
                start = sum(sizes[: part[1]])
                tensor = tensor[start : start + sizes[part[1]]]
            tensor = tensor.contiguous().cpu()
            raw = tensor.view(torch.uint8).numpy().tobytes()
            out.append([name, list(tensor.shape), dtype_name(tensor.dtype), raw])
        return out

    # -- helpers ---------------------------------------------------------------

    def _aiosync_bracketed(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        with self._aiosync_reload():
            result = self._aiosync_typed(call, *args, **kwargs)
        self.aiosync_reloads += 1
        self.aiosync_last_reload_s = time.perf_counter() - start
        return result

    def _aiosync_typed(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``call``; inside vLLM, re-raise its error with the type in the message.

        vLLM hands a worker's exception to its client as a plain ``Exception``
        holding ``str(exc)`` only; ``[aiosync:TypeName] message`` lets
        :mod:`aiosync.engines.vllm.backend` re-raise ``RefitMismatchError``,
        ``TransportError`` or ``SyncTimeoutError`` as themselves.
        """
        if getattr(self, "vllm_config", None) is None:
            return call(*args, **kwargs)
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            raise RuntimeError(f"[aiosync:{type(exc).__name__}] {exc}") from exc

    @contextmanager
    def _aiosync_reload(self) -> Iterator[None]:
        """vLLM's layerwise reload around the loads; nothing outside vLLM.

        ``finalize_layerwise_reload`` runs even when the receive failed: it
        returns the layers to their kernel tensors, so the next refit starts
        from a consistent model (the receiver has already marked the weights
        invalid, and the trainer's version stays stale). Then each tied head
        whose embedding was reloaded, but which the reload did not process
        itself, is processed again from the weight it shares
        (:class:`~aiosync.engines.vllm._layout.TiedHeads`; on CUDA that
        processing does nothing, and the head reads the shared weight).
        """
        config = getattr(self, "vllm_config", None)
        if config is None:
            yield
            return
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        loader = self.model_runner.model  # type: ignore[attr-defined]
        original = loader.load_weights
        self.aiosync_cloned_bytes = self.aiosync_cloned_tensors = 0
        infos: list[Any] = []
        # The ties, read before the reload gives each layer a parameter of its own.
        heads = TiedHeads(model)
        # Delta syncs: the receive writes the host copy too (built from the live model).
        host = self._aiosync_host_for_receive()
        if host is not None:
            host.begin()
            host.layout.tee = host.record_box

        def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
            # Layerwise reload keeps the tensors it is given until their whole
            # layer has arrived; the receivers hand it views of buffers they
            # reuse (or unmap) as soon as load_weights returns. Clone what an
            # incomplete layer still holds then, on failure too (the receiver
            # drops its mappings before finalize_layerwise_reload reads them).
            storages: set[int] = set()
            if host is not None:
                weights = host.record_full(weights)
            try:
                return original(_noting_storages(weights, storages))
            finally:
                tensors, nbytes = _clone_held_views(infos, storages)
                self.aiosync_cloned_tensors += tensors
                self.aiosync_cloned_bytes += nbytes

        with set_current_vllm_config(config):
            initialize_layerwise_reload(model)
            # Every layer's reload state; reset in place as layers complete.
            infos.extend(i for m in model.modules() if (i := LAYERWISE_INFO.get(m)) is not None)
            loader.load_weights = load_weights
            ok = False
            try:
                yield
                ok = True
            finally:
                del loader.load_weights
                stale = heads.left_stale()  # before finalize resets the progress
                # A delta leaves the layers it did not touch unloaded, by design:
                # finalize puts their kernel tensors back (and would warn for each).
                with _quiet_layerwise(host is not None and host.rewrote):
                    finalize_layerwise_reload(model, config.model_config)
                heads.reprocess(stale)  # re-packs on CPU; on CUDA nothing is packed
                if host is not None:
                    host.layout.tee = None
                    host.end(ok)
        # State derived from the old weights (vLLM's reload_weights does the same).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            hook = getattr(self.model_runner, reset, None)  # type: ignore[attr-defined]
            if hook is not None:
                hook()


class _DropUnloaded(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


@contextmanager
def _quiet_layerwise(quiet: bool) -> Iterator[None]:
    """Silence vLLM's "Failed to load weights" for layers a delta did not touch."""
    if not quiet:
        yield
        return
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    drop = _DropUnloaded()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _linear_weight(layer: Any) -> torch.Tensor:
    """``layer.weight`` ``[out_features, in_features]`` of a vLLM linear layer,
    recovered through its kernel as ``apply(identity).T`` (no bias: it is a
    separate argument of ``apply``)."""
    dtype = layer.params_dtype
    device = next((p.device for p in layer.parameters()), torch.device("cpu"))
    eye = torch.eye(int(layer.input_size_per_partition), dtype=dtype, device=device)
    with torch.no_grad():
        return layer.quant_method.apply(layer, eye).T


def _noting_storages(
    weights: Iterable[tuple[str, torch.Tensor]], storages: set[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` unchanged; adds the address of each tensor's storage to ``storages``."""
    for name, tensor in weights:
        storages.add(tensor.untyped_storage().data_ptr())
        yield name, tensor


def _clone_held_views(infos: Sequence[Any], storages: set[int]) -> tuple[int, int]:
    """Replace, in the loader calls that incomplete layers buffer, every tensor
    on one of ``storages`` by a clone; returns ``(tensors, bytes)`` cloned.

    ``infos`` are vLLM's ``LayerReloadingInfo`` of the model's layers: a layer
    still loading holds ``loaded_weights``, a list of ``(param_name,
    inspect.BoundArguments)`` of its weight loader calls, replayed once all its
    weights arrived (a complete layer's list is empty). A tensor the model's
    ``load_weights`` derived by a copy (a cast) lives on another storage and is
    left alone; views (a tensor-parallel ``narrow``) are cloned at their own size.
    """
    if not storages:
        return 0, 0
    tensors = nbytes = 0
    for info in infos:
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.device.type != "meta"
                    and value.untyped_storage().data_ptr() in storages
                ):
                    bound.arguments[key] = value.clone()
                    tensors += 1
                    nbytes += value.nbytes
    return tensors, nbytes


def lora_target_problems(
    targets: Sequence[str],
    allowed: Sequence[str] | None,
    packed: Mapping[str, Sequence[str]],
) -> list[str]:
    """The adapted modules outside vLLM's ``target_modules`` option, as one message.

    vLLM wraps a module for LoRA only if its name's last part, or the packed
    module holding it (``packed_modules_mapping``: ``qkv_proj`` holds ``q_proj``,
    ``k_proj``, ``v_proj``; ``gate_up_proj`` holds ``gate_proj``, ``up_proj``),
    is in ``target_modules`` (``vllm.lora.utils.is_in_target_modules``; the
    engine option ``lora_target_modules``); None allows every module.

    Args:
        targets: the adapter's module names (``q_proj``, ...).
        allowed: the engine's ``LoRAConfig.target_modules``.
        packed: the model's ``packed_modules_mapping``.

    Returns:
        ``[]``, or one message naming the modules outside and the option.
    """
    if allowed is None:
        return []
    allowed_set = set(allowed)
    outside = [
        t
        for t in targets
        if t not in allowed_set
        and not any(t in children and parent in allowed_set for parent, children in packed.items())
    ]
    if not outside:
        return []
    return [
        f"the adapter targets {outside}, outside the engine's LoRA target_modules "
        f"{sorted(allowed_set)} (vLLM option lora_target_modules / --lora-target-modules)"
    ]


def _checkpoint_manifest(model_config: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{hf_name: (shape, engine dtype)}`` from the safetensors headers of a local folder."""
    from safetensors import safe_open

    if getattr(model_config, "quantization", None) is not None:
        raise ValueError(
            f"checkpoint manifest check needs an unquantized model, this one is "
            f"{model_config.quantization!r}"
        )
    folder = Path(str(model_config.model))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise ValueError(f"no local safetensors checkpoint at {folder}")
    dtype = model_config.dtype
    manifest: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                manifest[name] = (tuple(f.get_slice(name).get_shape()), dtype)
    return manifest
