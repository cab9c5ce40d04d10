"""Module names → HF checkpoint names: wrapper prefixes, tied weights, conversion reversal.

A trainer's ``state_dict`` keys are the *module's* names, which differ from the
checkpoint's in three ways this module undoes, one tensor at a time:

1. wrappers add prefixes (``torch.compile``: ``_orig_mod.``, DDP: ``module.``,
   FSDP1 / activation checkpointing: ``_fsdp_wrapped_module.``,
   ``_checkpoint_wrapped_module.``);
2. tied weights appear under two names (``lm_head.weight`` aliases
   ``model.embed_tokens.weight``), but the checkpoint stores one;
3. transformers 5.x fuses some checkpoint tensors in memory (Qwen3-MoE experts:
   ``mlp.experts.gate_up_proj [E, 2*Im, H]`` on the module,
   ``mlp.experts.{e}.{gate,up}_proj.weight [Im, H]`` on disk). The reversal is
   transformers' own :func:`transformers.core_model_loading.revert_weight_conversion`
   (what ``save_pretrained`` applies), called per tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__: list[str] = []

#: Wrapper attribute names that hold the wrapped module; each adds ``"<name>."``
#: to every state-dict key below it.
_WRAPPER_ATTRS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module")

# ``module.`` (DDP) is stripped only at the front: inside a model it may be a real name.
_WRAPPER_PREFIX_RE = re.compile(
    r"(?:(?<=^)|(?<=\.))(?:_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\."
)

#: ``(module_key, tensor) -> {hf_name: tensor}``: one module tensor to its checkpoint tensors.
Reverter = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def _strip_wrapper_prefixes(key: str) -> str:
    """``"_orig_mod.module.model.norm.weight"`` → ``"model.norm.weight"``."""
    key = _WRAPPER_PREFIX_RE.sub("", key)
    while key.startswith("module."):
        key = _WRAPPER_PREFIX_RE.sub("", key.removeprefix("module."))
    return key


def _unwrap(model: nn.Module) -> nn.Module:
    """The innermost module under wrapper attributes (compile, DDP, FSDP1, checkpointing)."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        for attr in _WRAPPER_ATTRS:
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module):
                model = inner
                break
    return model


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{tied_name: source_name}`` as the model declares them (HF ``_tied_weights_keys``),
    only when its config really ties them (``tie_word_embeddings``)."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    default = getattr(config, "tie_word_embeddings", False)
    if not getattr(text_config, "tie_word_embeddings", default):
        return {}
    tied: dict[str, str] = {}
    for prefix, sub in model.named_modules():
        keys = getattr(sub, "_tied_weights_keys", None)
        if not isinstance(keys, Mapping):
            continue
        for target, source in keys.items():
            dot = f"{prefix}." if prefix else ""
            tied[f"{dot}{target}"] = f"{dot}{source}"
    return tied


def _local_identity(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage, seen through a DTensor wrapper."""
    local = getattr(tensor, "_local_tensor", tensor)
    return id(local) if local.device.type == "meta" else local.untyped_storage().data_ptr()


def _dedup_tied(
    entries: list[tuple[str, torch.Tensor]], tied: Mapping[str, str]
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Drop the tied name of each real tie, as ``save_pretrained`` does.

    A name the config ties (``tied``, ``{name: source}``) is dropped when it is
    the same tensor as its source: the same object (zero-size tensors
    included) or the same non-empty storage, offset and shape. One that holds
    a tensor of its own is a *broken* tie (``lm_head`` replaced or re-wrapped
    after ``tie_weights()``, e.g. by per-parameter ``distribute_tensor``): it
    is trained separately, its values drift from the source's, and dropping it
    would discard them, so it is kept. Other aliases (one storage view under
    two names the config does not tie) are kept once, under the first name.

    Returns:
        ``(kept entries, {broken tied name: its source name})``.
    """
    by_name = dict(entries)
    dropped: set[str] = set()
    broken: dict[str, str] = {}
    for name, source in tied.items():
        if name not in by_name or source not in by_name:
            continue
        if _same_tensor(by_name[name], by_name[source]):
            dropped.add(name)  # a real tie: the checkpoint stores the source only
        else:
            broken[name] = source
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    kept: list[tuple[str, torch.Tensor]] = []
    for name, tensor in entries:
        if name in dropped:
            continue
        key = _storage_key(tensor)
        local = getattr(tensor, "_local_tensor", tensor)
        if local.numel() > 0 and key in seen:
            continue  # an alias the config does not declare: sent once, as save_pretrained does
        seen.add(key)
        kept.append((name, tensor))
    return kept, broken


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    local = getattr(tensor, "_local_tensor", tensor)
    return _local_identity(tensor), int(local.storage_offset()), tuple(tensor.shape)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor under two names: the same object, or the same non-empty storage view.

    Zero-size tensors have no storage to compare (their data pointers may all
    be 0), so only the object tells.
    """
    if a is b:
        return True
    local = getattr(a, "_local_tensor", a)
    return local.numel() > 0 and _storage_key(a) == _storage_key(b)


def _hf_reverter(model: nn.Module) -> Reverter | None:
    """transformers' checkpoint-format reversal for ``model``, or None if not an HF model."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers is optional for plain modules
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    conversions = _model_conversions(model)
    if conversions is not None and not conversions:
        return None  # nothing to revert: module names are the checkpoint's
    # Without the cache every call re-derives the mapping by walking every submodule:
    # O(tensors) per tensor, minutes per refit on a 19k-tensor MoE (case C10).
    target: Any = model if conversions is None else _FixedConversions(model, conversions)

    def revert(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(revert_weight_conversion(target, {key: tensor}))

    return revert


class _FixedConversions:
    """``model`` as ``revert_weight_conversion`` sees it, with its conversion list
    computed once (the function reads ``model._weight_conversions`` when present)."""

    def __init__(self, model: nn.Module, conversions: list[Any]) -> None:
        self._model = model
        self._weight_conversions = conversions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _model_conversions(model: Any) -> list[Any] | None:
    """The conversions ``save_pretrained`` reverses for ``model`` (transformers 5.x:
    those attached by ``from_pretrained``, else the built-in mapping without prefix
    changes); None if this transformers version does not expose them."""
    attached = getattr(model, "_weight_conversions", None)
    if attached is not None:
        return list(attached)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return None
    mapping = get_model_conversion_mapping(model, add_legacy=False)
    return [c for c in mapping if not isinstance(c, PrefixChange)]


def _hf_checkpoint_order(
    model: nn.Module, meta_state: dict[str, torch.Tensor]
) -> list[tuple[str, tuple[int, ...]]] | None:
    """``save_pretrained``'s names, shapes and order for ``meta_state`` (meta tensors, keyed
    by unwrapped module names): transformers' whole-state-dict reversal, which sorts the
    keys naturally when a conversion applies. None if ``model`` is not an HF model."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    reverted = revert_weight_conversion(model, dict(meta_state))
    return [(name, tuple(t.shape)) for name, t in reverted.items()]


def _adapter_reverter(adapter: Any) -> Reverter:
    """A torchtitan-style ``StateDictAdapter`` (``to_hf(state_dict) -> dict``) as a reverter."""
    to_hf = getattr(adapter, "to_hf", None)
    if not callable(to_hf):
        raise TypeError(
            f"state_dict_adapter must have a to_hf(state_dict) method, got {type(adapter).__name__}"
        )

    def revert(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(to_hf({key: tensor}))

    return revert
