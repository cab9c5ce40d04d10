"""``LoRAAdapterRefitSource``: a PEFT LoRA trainer's adapter alone, as PEFT saves it.

The adapter-only refit (``aiosync.lora``): megabytes of ``lora_A``/``lora_B``
tensors instead of the whole model, loaded by the engine as a LoRA adapter.
The names and the config are those of PEFT's own adapter directory
(``adapter_model.safetensors``, ``adapter_config.json``), so the tensors also
load with ``PeftModel.from_pretrained``, vLLM's ``LoRARequest`` and SGLang's
``/load_lora_adapter``.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from aiosync.errors import RefitMismatchError
from aiosync.lora import LoRAAdapterSource
from aiosync.sources import RefitManifest

from ._peft import (
    active_adapter,
    check_adapter_only,
    check_lora,
    full_tensor,
    lora_layers,
    require_peft_model,
)
from ._torch_names import _strip_wrapper_prefixes, _unwrap
from .torch_source import _hf_config_of

__all__ = ["LoRAAdapterRefitSource"]


class LoRAAdapterRefitSource(LoRAAdapterSource):
    """The refit source of a PEFT LoRA trainer's adapter: its tensors only, PEFT's names.

    The manifest is exactly what ``peft.get_peft_model_state_dict(model)`` (and
    ``save_pretrained``'s ``adapter_model.safetensors``) holds for the adapter,
    in its order, identical on every rank: per targeted module
    ``base_model.model.<path>.lora_A.weight [r, in_features]`` then
    ``base_model.model.<path>.lora_B.weight [out_features, r]``, in the
    adapter's dtype (usually fp32) or ``dtype``. ``r`` is the module's rank
    (``rank_pattern`` may vary it). :meth:`lora_adapter_config` is the matching
    ``adapter_config.json``.

    On a sharded trainer (FSDP2 ``fully_shard``, DTensor parameters) every rank
    must call :meth:`iter_weights`: each tensor is gathered (``full_tensor()``,
    a collective) one at a time, and every rank receives the full tensors.

    Args:
        peft_model: the ``peft.PeftModel`` (``peft.get_peft_model(model,
            LoraConfig(...))``), also inside FSDP2/DDP/``torch.compile`` wrappers.
        dtype: manifest dtype of the floating-point tensors (fp32 adapters → a
            bf16 engine); None keeps the adapter's.
        adapter_name: the adapter to send; None: the active one.

    Raises:
        TypeError: ``peft_model`` is not a PEFT model (inside its wrappers), or
            ``dtype``/``adapter_name`` is malformed.
        ValueError: naming the unsupported option: an unknown adapter, several
            active adapters (with ``adapter_name=None``), a PEFT type other than
            LoRA (IA3, prefix tuning, ...), DoRA (``use_dora``) or another LoRA
            variant, ``lora_bias``, ``target_parameters``,
            ``trainable_token_indices``, ``layer_replication``, LoRA on a
            non-linear layer (embeddings, quantized layers), ``modules_to_save``
            or ``bias`` other than ``"none"`` (whole trained tensors a LoRA
            adapter does not carry: refit merged with ``DTensorRefitSource``
            instead), or an ``init_lora_weights`` that rewrote the base weights
            (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA).
    """

    def __init__(
        self,
        peft_model: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        adapter_name: str | None = None,
    ) -> None:
        if not isinstance(peft_model, nn.Module):
            raise TypeError(
                f"peft_model must be a torch.nn.Module, got {type(peft_model).__name__}"
            )
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        if adapter_name is not None and not isinstance(adapter_name, str):
            raise TypeError(f"adapter_name must be a str or None, got {adapter_name!r}")
        self.model = peft_model
        self.dtype = dtype
        self._peft = require_peft_model(_unwrap(peft_model))
        self.adapter_name: str = (
            active_adapter(self._peft) if adapter_name is None else adapter_name
        )
        self._config = check_lora(self._peft, self.adapter_name)
        check_adapter_only(self._peft, self.adapter_name, self._config)
        self._manifest: RefitManifest | None = None

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """``{saved name: live tensor}`` (DTensors as they are): PEFT's selection and names."""
        from peft import get_peft_model_state_dict

        # keep_vars: references to the live (possibly sharded) parameters, nothing gathered.
        selected = get_peft_model_state_dict(
            self._peft,
            state_dict=self._peft.state_dict(keep_vars=True),
            adapter_name=self.adapter_name,
            save_embedding_layers=False,
        )
        # PEFT keeps wrapper names from inside the model (activation checkpointing); a
        # plain model, which is what loads the adapter, has none.
        return {_strip_wrapper_prefixes(name): t for name, t in selected.items()}

    def _target_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def prepare_refit_info(self) -> RefitManifest:
        """``{peft_name: (shape, dtype)}`` in :meth:`iter_weights` order.

        Shapes only: no gather, no collective. Cached: the model's structure
        must not change afterwards.
        """
        if self._manifest is None:
            self._manifest = {
                name: (tuple(t.shape), self._target_dtype(t.dtype))
                for name, t in self._adapter_tensors().items()
            }
        return dict(self._manifest)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(peft_name, tensor)``: full, manifest shape and dtype, in order.

        Tensors are on the parameters' device, contiguous, and never share
        memory with the trainer's parameters (an adapter is small: a copy is
        made where no gather or cast made one), so they stay valid after the
        next optimizer step.

        Raises:
            RefitMismatchError: the adapter's tensors changed since
                :meth:`prepare_refit_info`.
        """
        manifest = self.prepare_refit_info()
        live = self._adapter_tensors()
        if list(live) != list(manifest):
            raise RefitMismatchError(
                f"adapter {self.adapter_name!r} changed since prepare_refit_info: "
                f"{len(live)} tensors now, {len(manifest)} before"
            )
        for name, (shape, dtype) in manifest.items():
            tensor = live[name].detach()
            local = getattr(tensor, "_local_tensor", tensor)
            if tensor.dtype.is_floating_point and hasattr(tensor, "placements"):
                tensor = tensor.to(dtype)  # cast the shard: the gather moves engine-dtype bytes
            out = full_tensor(tensor).to(dtype)
            del tensor
            if tuple(out.shape) != shape:
                raise RefitMismatchError(f"{name}: shape {tuple(out.shape)}, manifest {shape}")
            if out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                out = out.clone(memory_format=torch.contiguous_format)
            yield name, out.contiguous()
            del out

    def lora_adapter_config(self) -> dict[str, Any]:
        """The adapter's ``adapter_config.json``, as ``save_pretrained`` writes it, JSON-able.

        PEFT's ``LoraConfig.to_dict()`` with sets as sorted lists, enums as
        their values (``peft_type: "LORA"``, ``task_type``), ``inference_mode``
        true, ``base_model_name_or_path`` from the base model when the config
        has none, and ``target_modules`` resolved to the list of module-name
        suffixes PEFT targeted (``["k_proj", "q_proj", ...]``, also for
        ``"all-linear"`` or a regex), or to the targeted modules' full names
        when the suffixes would target more (``layers_to_transform`` aside).
        ``peft.LoraConfig(**config)`` rebuilds it.
        """
        config = self._config
        out = config.to_dict()
        out["peft_type"] = "LORA"
        out["target_modules"] = self._target_modules()
        out["inference_mode"] = True
        base = self._peft.get_base_model()
        out["base_model_name_or_path"] = (
            config.base_model_name_or_path or getattr(base, "name_or_path", None) or None
        )
        jsonable = {str(k): _jsonable(v, str(k)) for k, v in sorted(out.items())}
        json.dumps(jsonable)  # fail here, naming nothing silently, rather than in the engine
        return jsonable

    def hf_config(self) -> Any | None:
        """The base model's HF config (a transformers ``PretrainedConfig``): the
        adapter is applied to the engine's base model, so the transports compare
        the two at init (:class:`aiosync.sources.ConfigSource`). None: the base
        model holds no HF config."""
        return _hf_config_of(self._peft.get_base_model())

    def _target_modules(self) -> list[str]:
        """The targeted modules as ``target_modules`` suffixes, checked to target just them."""
        from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists

        targeted = set(lora_layers(self._peft, self.adapter_name))
        suffixes = sorted({path.rsplit(".", 1)[-1] for path in targeted})
        probe = copy.copy(self._config)
        probe.target_modules = set(suffixes)
        base = self._peft.get_base_model()
        tuners = {
            _strip_wrapper_prefixes(f"{p}.").rstrip(".")
            for p, m in base.named_modules()
            if isinstance(m, BaseTunerLayer)
        }
        matched = set()
        for path, _ in base.named_modules():
            path = _strip_wrapper_prefixes(f"{path}.").rstrip(".")
            inside = any(path.startswith(f"{t}.") for t in tuners)
            if path and not inside and check_target_module_exists(probe, path):
                matched.add(path)
        # A restrictive regex can target fewer modules than its suffixes would; then
        # full names (valid suffixes of themselves) keep PEFT and vLLM to exactly those.
        return suffixes if matched == targeted else sorted(targeted)


def _jsonable(value: Any, field: str) -> Any:
    """``value`` with sets as sorted lists and enums as values; TypeError for the rest."""
    if isinstance(value, enum.Enum):  # first: PEFT's enums are str subclasses
        return _jsonable(value.value, field)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v, field) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_jsonable(v, field) for v in value)
    if isinstance(value, list | tuple):
        return [_jsonable(v, field) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value), field)
    raise TypeError(f"adapter config field {field!r} holds a {type(value).__name__}")
