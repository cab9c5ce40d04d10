"""LoRA adapters as a refit: what travels in an adapter-only refit, and who sends it.

Two ways serve a PEFT (LoRA) trainer:

* **Merged refit**: the trainer's source yields the base model's HF checkpoint
  with ``W + scale · B @ A`` merged in on the fly; every transport and engine
  works unchanged.
* **Adapter-only refit** (verl, prime-rl): only the adapter's tensors travel
  (megabytes instead of gigabytes) and the engine loads them as a LoRA adapter
  named after the weight version. A :class:`LoRAAdapterSource` is the trainer's
  side; an engine that serves it is a :class:`LoRAEngine` (see :class:`LoRAAdapter`),
  and may also be a :class:`LoRAChecking` engine.

This module is part of the core: it imports neither torch nor a transport at
import time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from .sources import RefitSource

if TYPE_CHECKING:
    import torch

__all__ = [
    "LoRAAdapter",
    "LoRAAdapterSource",
    "LoRAChecking",
    "LoRAEngine",
    "lora_adapter_name",
]

#: File names of a PEFT adapter directory (what ``save_pretrained`` writes and
#: what vLLM's ``LoRARequest(lora_path=...)`` and SGLang's ``/load_lora_adapter`` read).
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def lora_adapter_name(version: int) -> str:
    """The engine-side id of the adapter carrying weight ``version``: ``"aiosync-v{version}"``."""
    return f"aiosync-v{version}"


@runtime_checkable
class LoRAAdapterSource(RefitSource, Protocol):
    """A refit source whose tensors are a LoRA adapter, not the full model.

    :meth:`prepare_refit_info` and :meth:`iter_weights` give the adapter's
    tensors under PEFT's saved names (``adapter_model.safetensors``: e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
    ``[r, in_features]`` and ``...lora_B.weight`` ``[out_features, r]``).
    """

    def lora_adapter_config(self) -> dict[str, Any]:
        """The adapter's ``adapter_config.json`` (PEFT ``LoraConfig``, JSON-able):
        at least ``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``,
        ``peft_type`` (``"LORA"``) and ``base_model_name_or_path``."""
        ...


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter-only refit, as handed to an engine's ``load_lora_adapter``.

    An engine's ``async def load_lora_adapter(self, adapter: LoRAAdapter) -> None``
    loads it under :attr:`name`, makes it the adapter every later ``generate``
    uses, and unloads the adapter it replaces. If the load fails the engine
    refuses to generate until a load succeeds: it never serves a half-loaded
    adapter, nor silently falls back to the previous one.

    Unless :attr:`verify` is False the engine checks the tensors it received
    against :attr:`digests` before the adapter is made live
    (:func:`aiosync.transports.lora.check_adapter_tensors`; an engine handed the
    adapter as a folder checks the folder it wrote,
    :func:`aiosync.transports.lora.check_saved_adapter`) and raises
    :class:`~aiosync.errors.RefitVerificationError` naming the first tensor
    that differs.

    Attributes:
        name: the engine-side adapter id, :func:`lora_adapter_name` of ``version``.
        version: the weight version the adapter carries (>= 1); vLLM's
            ``lora_int_id``.
        tensors: ``{peft_name: tensor}`` on the CPU, contiguous, in the
            manifest's order and dtypes (names as in ``adapter_model.safetensors``).
        config: the adapter's ``adapter_config.json`` (JSON-able).
        verify: how :attr:`digests` were computed (``"sample"``, ``True`` every
            byte; see :mod:`aiosync.transports._verify`), or ``False``: nothing
            to check.
        digests: ``{peft_name: signed int64}``, the trainer's digest of each
            tensor's bytes (tensor ``i`` of :attr:`tensors` sampled with
            ``sample_key(version, i)``); empty with ``verify=False``.
    """

    name: str
    version: int
    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any] = field(default_factory=dict)
    verify: bool | Literal["sample"] = False
    digests: Mapping[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the adapter holds."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def save(self, directory: str | Path) -> Path:
        """Write the adapter as a PEFT adapter directory (``adapter_model.safetensors``
        and ``adapter_config.json``) into ``directory`` (created); returns it.

        This is the layout ``PeftModel.from_pretrained``, vLLM's ``LoRARequest``
        and SGLang's ``/load_lora_adapter`` read.
        """
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        save_file(dict(self.tensors), str(path / ADAPTER_WEIGHTS_FILE))
        (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(dict(self.config), indent=2))
        return path


@runtime_checkable
class LoRAEngine(Protocol):
    """An engine that serves adapter-only refits (the embedded, SGLang and vLLM
    backends, an :class:`~aiosync.EngineFleet` of them)."""

    async def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Load ``adapter`` and make it the one every later generation applies
        (see :class:`LoRAAdapter` for what a failed load leaves)."""
        ...


@runtime_checkable
class LoRAChecking(Protocol):
    """An engine that can say, before any byte moves, whether it is configured
    for an adapter of this shape (vLLM's ``enable_lora``/``max_lora_rank``,
    SGLang's ``--enable-lora``/``--max-lora-rank``/``--lora-target-modules``)."""

    async def check_lora_adapter(
        self, config: Mapping[str, Any], target_modules: Sequence[str], max_rank: int
    ) -> None:
        """Raise ValueError when the engine cannot load an adapter with ``config``
        (``adapter_config.json``) on ``target_modules`` (e.g. ``["q_proj"]``) of
        rank up to ``max_rank``."""
        ...
