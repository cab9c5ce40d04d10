"""PEFT (LoRA) trainers: what a ``PeftModel`` is made of, and what the refits support.

A ``peft.get_peft_model(model, LoraConfig(...))`` trainer holds the base
model's weights under PEFT's names (``base_model.model.`` prefix; a targeted
``nn.Linear``'s weight under ``...q_proj.base_layer.weight``) next to the
adapters (``...q_proj.lora_A.<adapter>.weight [r, in]``,
``...lora_B.<adapter>.weight [out, r]``) and the trained copies of
``modules_to_save`` (``...lm_head.modules_to_save.<adapter>.weight``).

This module serves both refits of such a trainer:

* the **merged** refit (``DTensorRefitSource``): :class:`MergedPeft` renames the
  module tensors back to the base model's checkpoint names and :class:`LoraMerge`
  computes ``W + scaling · B @ A`` for one targeted module, as
  ``merge_and_unload()`` would, without touching the trainer's modules;
* the **adapter-only** refit (``LoRAAdapterRefitSource``): the checks below.

Unsupported configurations raise ``ValueError`` naming the option, when the
source is built. peft is imported only when the model is a PEFT model (it is
then already imported), so plain trainers never import it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aiosync.errors import RefitMismatchError

from ._torch_names import _strip_wrapper_prefixes

__all__: list[str] = []

#: The prefix ``PeftModel`` puts before the base model's own names (LoRA and
#: the other non-prompt-learning tuners: ``PeftModel.base_model.model``).
BASE_PREFIX = "base_model.model."

#: ``init_lora_weights`` values that rewrite the base weights when the adapter is
#: created (``W_res = W - scaling · B0 @ A0``): the trainer's base is then not the
#: checkpoint the engine loaded, so the adapter alone would be applied to the wrong base.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

#: ``LoraConfig`` options neither refit supports, and what they do.
_UNSUPPORTED_OPTIONS = {
    "lora_bias": "a trained bias on lora_B",
    "target_parameters": "LoRA on raw parameters such as fused MoE experts",
    "trainable_token_indices": "trainable embedding rows",
    "layer_replication": "base layers duplicated in memory",
}

_MERGED_HINT = (
    "DTensorRefitSource(peft_model) refits the merged weights (W + scaling · B @ A) instead"
)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank must call it), else itself."""
    if hasattr(tensor, "full_tensor") and hasattr(tensor, "placements"):
        return tensor.full_tensor()
    return tensor


def find_peft_model(model: nn.Module) -> Any | None:
    """``model`` (already unwrapped) if it is a ``peft.PeftModel``, else None.

    Raises:
        ValueError: ``model`` holds PEFT tuner layers but is not the ``PeftModel``
            (e.g. ``peft_model.base_model`` or the injected base model).
    """
    if "peft" not in sys.modules:  # nothing can be a PEFT model before peft is imported
        return None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(model, PeftModel):
        return model
    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} holds PEFT adapter layers but is not the PeftModel: pass "
            "the PeftModel that peft.get_peft_model returned"
        )
    return None


def require_peft_model(model: nn.Module) -> Any:
    """The ``PeftModel`` at ``model`` (already unwrapped).

    Raises:
        TypeError: ``model`` is not a ``peft.PeftModel``.
    """
    found = find_peft_model(model)
    if found is None:
        raise TypeError(
            f"expected a peft.PeftModel (peft.get_peft_model(model, LoraConfig(...))), got "
            f"{type(model).__name__}"
        )
    return found


def active_adapter(peft_model: Any) -> str:
    """The name of the one active adapter.

    Raises:
        ValueError: several adapters are active at once.
    """
    active = list(peft_model.active_adapters)
    if len(active) != 1:
        raise ValueError(
            f"several active adapters {active} are not supported: a refit carries one "
            "adapter; activate one with peft_model.set_adapter(name)"
        )
    return str(active[0])


def _base_paths(peft_model: Any) -> list[tuple[str, nn.Module]]:
    """``(path relative to the base model, module)``, wrapper prefixes stripped."""
    out: list[tuple[str, nn.Module]] = []
    for path, module in peft_model.named_modules():
        path = _strip_wrapper_prefixes(f"{path}.").rstrip(".")
        if path.startswith(BASE_PREFIX):
            out.append((path.removeprefix(BASE_PREFIX), module))
    return out


def lora_layers(peft_model: Any, adapter: str) -> dict[str, nn.Module]:
    """``{module path in the base model: LoRA layer}`` for the layers that hold ``adapter``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {
        path: module
        for path, module in _base_paths(peft_model)
        if isinstance(module, BaseTunerLayer) and adapter in _adapters_of(module)
    }


def _adapters_of(layer: nn.Module) -> set[str]:
    names: set[str] = set()
    for attr in getattr(layer, "adapter_layer_names", ()):
        held = getattr(layer, attr, None)
        if isinstance(held, nn.ModuleDict | nn.ParameterDict):
            names.update(held.keys())
    return names


def check_lora(peft_model: Any, adapter: str) -> Any:
    """The checks both refits share; returns ``adapter``'s ``LoraConfig``.

    Supported: ``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``,
    ``alpha_pattern``, ``target_modules`` (list, regex or ``"all-linear"``),
    ``exclude_modules``, ``layers_to_transform``, ``fan_in_fan_out``,
    ``lora_dropout``, several adapters, on ``nn.Linear`` (and GPT-2 ``Conv1D``) layers.

    Raises:
        ValueError: naming the unsupported option: an unknown adapter, a PEFT
            type other than LoRA (IA3, prefix tuning, ...), DoRA (``use_dora``)
            or another LoRA variant, ``lora_bias``, ``target_parameters``,
            ``trainable_token_indices``, ``layer_replication``, or a LoRA layer
            that is not a plain linear one (embeddings, convolutions, quantized
            bitsandbytes/GPTQ layers, ...).
    """
    from peft.tuners import lora
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    configs = peft_model.peft_config
    if adapter not in configs:
        raise ValueError(f"no adapter named {adapter!r}; the model has {sorted(configs)}")
    config = configs[adapter]
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    if peft_type != "LORA":
        raise ValueError(
            f"peft_type={peft_type} (adapter {adapter!r}) is not supported: only LoRA "
            "(peft.LoraConfig) adapters can be refit"
        )
    if getattr(config, "use_dora", False):
        raise ValueError(
            "use_dora=True (DoRA) is not supported: its magnitude vector rescales each merged "
            "weight and vLLM does not load DoRA adapters"
        )
    for field in dataclasses.fields(config):
        if field.metadata.get("is_lora_variant") and getattr(config, field.name, None):
            raise ValueError(
                f"{field.name}={getattr(config, field.name)!r} (a LoRA variant) is not supported"
            )
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if getattr(config, option, None):
            raise ValueError(f"{option}={getattr(config, option)!r} ({what}) is not supported")
    for path, module in _base_paths(peft_model):
        if isinstance(module, AuxiliaryTrainingWrapper) and not isinstance(
            module, ModulesToSaveWrapper
        ):
            raise ValueError(f"{path}: {type(module).__name__} is not supported")
        if not isinstance(module, BaseTunerLayer) or adapter not in _adapters_of(module):
            continue
        if not isinstance(module, lora.Linear):
            raise ValueError(
                f"LoRA on {path} ({type(module).__name__}) is not supported: only linear "
                "layers (nn.Linear, Conv1D) are, not embeddings, convolutions or quantized layers"
            )
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is not None:
            raise ValueError(f"{path}: the LoRA variant {type(variant).__name__} is not supported")
    return config


def check_adapter_only(peft_model: Any, adapter: str, config: Any) -> None:
    """What an adapter-only refit cannot carry, on top of :func:`check_lora`.

    Raises:
        ValueError: ``modules_to_save`` (full trained modules, not LoRA tensors:
            vLLM's LoRA loader does not take them), ``bias`` other than
            ``"none"`` (trained base biases), or an ``init_lora_weights`` that
            rewrote the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA).
    """
    from peft.utils.other import ModulesToSaveWrapper

    saved = sorted(
        path
        for path, module in _base_paths(peft_model)
        if isinstance(module, ModulesToSaveWrapper) and adapter in module.modules_to_save
    )
    if saved or getattr(config, "modules_to_save", None):
        names = saved or sorted(config.modules_to_save)
        raise ValueError(
            f"modules_to_save={names} cannot travel as a LoRA adapter (vLLM loads LoRA tensors "
            f"only); {_MERGED_HINT}"
        )
    bias = getattr(config, "bias", "none")
    if bias != "none":
        raise ValueError(
            f"bias={bias!r} trains the base model's biases, which a LoRA adapter does not carry; "
            f"{_MERGED_HINT}"
        )
    init = str(getattr(config, "init_lora_weights", True)).lower()
    if init.startswith(_BASE_REWRITING_INITS):
        raise ValueError(
            f"init_lora_weights={config.init_lora_weights!r} rewrote the trainer's base weights, "
            f"so the adapter does not apply to the engine's base checkpoint; {_MERGED_HINT}"
        )


@dataclass(frozen=True, slots=True, eq=False)
class LoraMerge:
    """How one targeted module's checkpoint weight is merged: ``W + scaling · B @ A``."""

    path: str  # the module's path in the base model (for messages)
    layer: nn.Module  # PEFT's ``lora.Linear`` holding A, B, scaling and fan_in_fan_out
    adapter: str

    def merged(self, base: torch.Tensor) -> torch.Tensor:
        """The merged weight, full (DTensors gathered), in ``base``'s dtype.

        The arithmetic is PEFT's (``lora.Linear.get_delta_weight`` then ``merge``):
        ``delta = transpose(B @ A, fan_in_fan_out) * scaling``, the product in
        fp32 (PEFT does so for fp16/bf16 adapters on CPU) and rounded to the
        adapters' dtype, then ``W + delta`` rounded once to ``W``'s dtype, so
        the result equals ``merge_and_unload()``'s bit for bit (for fp32 adapters
        on any device). Nothing is written to the trainer's tensors.

        Raises:
            RefitMismatchError: an adapter was merged into the base weight
                (``merge_adapter()``) since the source was built.
        """
        layer: Any = self.layer
        if layer.merged:
            raise RefitMismatchError(
                f"{self.path}: adapter(s) {layer.merged_adapters} are merged into the base weight "
                "(merge_adapter()); call unmerge_adapter() before a refit"
            )
        weight = full_tensor(base.detach())
        lora_a = full_tensor(layer.lora_A[self.adapter].weight.detach())
        lora_b = full_tensor(layer.lora_B[self.adapter].weight.detach())
        delta = lora_b.float() @ lora_a.float()
        if layer.fan_in_fan_out:
            delta = delta.T
        delta = (delta * layer.scaling[self.adapter]).to(lora_b.dtype)
        del lora_a, lora_b
        return torch.add(weight, delta).to(weight.dtype)


class MergedPeft:
    """A ``PeftModel`` seen as its base model's checkpoint with the active adapter merged.

    Args:
        peft_model: the (unwrapped) ``PeftModel``.
        tied: ``{tied name: source name}`` of the base model (``_tied_aliases``).

    Raises:
        ValueError: an unsupported configuration (:func:`check_lora`), several
            active adapters, adapters already merged into the base weights, or
            LoRA on a tied weight (merging would change both names' tensor).
    """

    def __init__(self, peft_model: Any, tied: Mapping[str, str]) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper

        self.peft_model = peft_model
        self.adapter = active_adapter(peft_model)
        check_lora(peft_model, self.adapter)
        self.base_model: nn.Module = peft_model.get_base_model()
        paths = _base_paths(peft_model)
        # Every tuner layer, also those holding only inactive adapters: their
        # ``base_layer`` tensors are renamed all the same.
        self._tuners: dict[str, Any] = {
            path: module for path, module in paths if isinstance(module, BaseTunerLayer)
        }
        self._saved = {
            path: module for path, module in paths if isinstance(module, ModulesToSaveWrapper)
        }
        tied_names = {*tied, *tied.values()}
        for path, layer in self._tuners.items():
            if layer.merged:
                raise ValueError(
                    f"{path}: adapter(s) {layer.merged_adapters} are merged into the base weight "
                    "(merge_adapter()); call unmerge_adapter() before building the source"
                )
            if self.adapter in _adapters_of(layer) and f"{path}.weight" in tied_names:
                raise ValueError(
                    f"LoRA on {path}, whose weight is tied (tie_word_embeddings), is not "
                    "supported: the merge would change the tensor both names share"
                )
        self._merges: dict[str, LoraMerge] = {}

    def checkpoint_tensors(
        self, raw: list[tuple[str, str, torch.Tensor]]
    ) -> list[tuple[str, str, torch.Tensor]]:
        """The base model's tensors among the ``PeftModel``'s, under checkpoint names.

        Args:
            raw: ``(key, module_key, tensor)`` of the wrapped model's state dict,
                ``key`` without wrapper prefixes (relative to the ``PeftModel``).

        Returns:
            ``(base key, module_key, tensor)`` in ``raw``'s order: a targeted
            layer's ``base_layer.X`` as ``X`` (its LoRA tensors dropped, its
            weight merged: see :meth:`merge_for`), a ``modules_to_save``
            module as the active adapter's trained copy (else the original).

        Raises:
            RefitMismatchError: a tensor outside the base model (``base_model.model.``).
        """
        self._merges = {}
        out: list[tuple[str, str, torch.Tensor]] = []
        for key, module_key, tensor in raw:
            if not key.startswith(BASE_PREFIX):
                raise RefitMismatchError(f"{key!r} is not a tensor of the PEFT model's base model")
            name = self._base_name(key.removeprefix(BASE_PREFIX))
            if name is not None:
                out.append((name, module_key, tensor))
        return out

    def _base_name(self, key: str) -> str | None:
        """``key``'s checkpoint name, or None for a tensor the checkpoint does not hold."""
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            path, rest = ".".join(parts[:cut]), parts[cut:]
            layer = self._tuners.get(path)
            if layer is not None:
                if rest[0] != "base_layer":
                    return None  # the adapters' tensors (of every adapter)
                name = ".".join([path, *rest[1:]])
                if rest[1:] == ["weight"] and self.adapter in _adapters_of(layer):
                    self._merges[name] = LoraMerge(path, layer, self.adapter)
                return name
            wrapper: Any = self._saved.get(path)
            if wrapper is not None:
                if self.adapter in wrapper.modules_to_save:
                    own = ["modules_to_save", self.adapter]
                    return ".".join([path, *rest[2:]]) if rest[:2] == own else None
                return ".".join([path, *rest[1:]]) if rest[0] == "original_module" else None
        return key

    def merge_for(self, name: str) -> LoraMerge | None:
        """The merge of checkpoint tensor ``name`` (after :meth:`checkpoint_tensors`), if any."""
        return self._merges.get(name)

    def check_unchanged(self) -> None:
        """Raises RefitMismatchError if the active adapter changed since the source was built."""
        active = list(self.peft_model.active_adapters)
        if active != [self.adapter]:
            raise RefitMismatchError(
                f"the active adapter changed from {self.adapter!r} to {active} since the source "
                "was built; build a new source for the new adapter"
            )
