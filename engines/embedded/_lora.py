"""LoRA adapters on a transformers model with PEFT, unmerged: the base weights stay as loaded.

:class:`PeftAdapters` is how the embedded engine's ``HFModelRunner`` (and with it
the SGLang-contract test server) serves adapter-only refits. PEFT
itself does the work: ``get_peft_model`` / ``PeftModel.add_adapter`` inject the
adapter's ``lora_A``/``lora_B`` next to the target ``nn.Linear`` layers (the
base ``weight`` tensors are the same objects, untouched), and
``set_peft_model_state_dict`` loads the tensors, named as PEFT saves them
(``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight``
``[r, in_features]`` and ``...lora_B.weight`` ``[out_features, r]``). The
forward pass then computes ``W x + scale · B (A x)`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``), as PEFT does.

peft is imported on the first load only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from aiosync.errors import RefitMismatchError
from aiosync.transports.lora._layout import check_lora_kind

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel

__all__ = ["PeftAdapters", "lora_config_from_dict"]

_log = logging.getLogger(__name__)


def lora_config_from_dict(config: Mapping[str, Any]) -> LoraConfig:
    """A PEFT ``LoraConfig`` from an ``adapter_config.json`` dict.

    Keys this PEFT version does not know (written by a newer one) are dropped;
    ``init_lora_weights`` is forced to PEFT's plain default (PiSSA, OLoRA, LoftQ...
    would rewrite the base weights on injection) and ``inference_mode`` to True.

    Raises:
        RefitMismatchError: not a LoRA config (``peft_type``), a DoRA adapter
            (``use_dora``), ``modules_to_save`` (full tensors, not an adapter), or
            values PEFT rejects.
    """
    from peft import LoraConfig

    # A config without peft_type is PEFT's LoRA default.
    check_lora_kind(config, "adapter_config.json", peft_type="LORA")
    items = dict(config)
    items.pop("peft_type", None)
    known = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    unknown = sorted(set(items) - known)
    if unknown:
        _log.debug("adapter_config.json keys unknown to this PEFT version, ignored: %s", unknown)
    kwargs = {key: value for key, value in items.items() if key in known}
    # PiSSA, OLoRA, LoftQ... rewrite (or decompose) the base weights on injection;
    # the tensors are loaded right after anyway, so inject with PEFT's plain init.
    kwargs["init_lora_weights"] = True
    kwargs["inference_mode"] = True
    try:
        return LoraConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise RefitMismatchError(f"adapter_config.json rejected by PEFT: {exc}") from exc


class PeftAdapters:
    """The LoRA adapters of one model, by name; at most one is active per forward.

    Not thread-safe: the caller (``HFModelRunner``) holds its model lock
    around every call and every forward pass.

    Args:
        model: the transformers model; PEFT wraps its target linear layers in place.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self._peft: PeftModel | None = None

    @property
    def names(self) -> list[str]:
        """Loaded adapters, in load order."""
        return [] if self._peft is None else list(self._peft.peft_config)

    def load(
        self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
    ) -> None:
        """Inject adapter ``name`` and load ``tensors`` into it (cast to the model's dtype).

        On any failure the adapter is removed again: nothing half-loaded stays.

        Args:
            name: the adapter id (no ``.``), e.g. ``"aiosync-v3"``.
            tensors: ``{peft_name: tensor}`` as in ``adapter_model.safetensors``.
            config: the ``adapter_config.json`` dict.

        Raises:
            ValueError: ``name`` is already loaded or contains a ``.``.
            RefitMismatchError: a bad config, a target module the model lacks, a
                tensor name the adapter does not have, a missing tensor, or a shape
                that differs from the injected layer's.
        """
        from peft import get_peft_model, set_peft_model_state_dict

        if not name or "." in name:
            raise ValueError(f"adapter names must be non-empty and contain no '.', got {name!r}")
        if name in self.names:
            raise ValueError(f"adapter {name!r} is already loaded")
        lora_config = lora_config_from_dict(config)
        try:
            if self._peft is None:
                self._peft = get_peft_model(
                    self.model, lora_config, adapter_name=name, autocast_adapter_dtype=False
                )
            else:
                self._peft.add_adapter(name, lora_config, autocast_adapter_dtype=False)
            result: Any = set_peft_model_state_dict(self._peft, dict(tensors), adapter_name=name)
            missing = [k for k in result.missing_keys if f".{name}." in k]
            if result.unexpected_keys or missing:
                raise RefitMismatchError(
                    f"adapter {name!r}: tensors the model's adapter layers do not have: "
                    f"{sorted(result.unexpected_keys)[:4]}; missing: {sorted(missing)[:4]}"
                )
        except Exception as exc:
            self.remove(name)
            if isinstance(exc, RefitMismatchError):
                raise
            raise RefitMismatchError(f"adapter {name!r}: {type(exc).__name__}: {exc}") from exc
        self.model.eval()

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """Copies of adapter ``name``'s tensors as the model holds them, under PEFT's
        saved names (``adapter_model.safetensors``: ``...lora_A.weight``
        ``[r, in_features]``, ``...lora_B.weight`` ``[out_features, r]``), in the
        model's dtype: what the forward pass applies.

        Raises:
            KeyError: ``name`` is not loaded.
        """
        from peft import get_peft_model_state_dict

        if self._peft is None or name not in self._peft.peft_config:
            raise KeyError(f"LoRA adapter {name!r} is not loaded (loaded: {self.names})")
        state = get_peft_model_state_dict(self._peft, adapter_name=name)
        return {key: tensor.detach().clone() for key, tensor in state.items()}

    def remove(self, name: str) -> None:
        """Remove adapter ``name`` (no error if absent); the last one restores the
        model's plain ``nn.Linear`` layers (``PeftModel.unload``, nothing merged)."""
        if self._peft is None or name not in self._peft.peft_config:
            return
        if len(self._peft.peft_config) == 1:
            self._peft.unload()
            self._peft = None
        else:
            self._peft.delete_adapter(name)

    def clear(self) -> None:
        """Remove every adapter."""
        for name in self.names:
            self.remove(name)

    @contextlib.contextmanager
    def using(self, name: str | None) -> Iterator[None]:
        """Within the block the model's forward applies adapter ``name`` only, or
        none (``None``: the base model).

        Raises:
            KeyError: ``name`` is not loaded.
        """
        if name is None:
            if self._peft is None:
                yield
                return
            with self._peft.disable_adapter():
                yield
            return
        if self._peft is None or name not in self._peft.peft_config:
            raise KeyError(f"LoRA adapter {name!r} is not loaded (loaded: {self.names})")
        self._peft.set_adapter(name)
        yield
