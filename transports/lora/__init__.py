"""Adapter-only refits: a LoRA trainer's adapter, loaded by the engine's own LoRA API.

- :mod:`.synchronizer` — the trainer side, :class:`LoRAAdapterSynchronizer`.
- ``_layout`` — PEFT's saved adapter layout and its checks against the base model.
- The engine side is each engine's ``load_lora_adapter(adapter)`` (see
  :class:`aiosync.LoRAAdapter` for the contract): the embedded engine applies
  it with PEFT in its workers, SGLang loads it with ``/load_lora_adapter``.
  Before the adapter goes live the engine checks the trainer's per-tensor
  digests (``verify=``) with :func:`check_adapter_tensors` where it receives
  the tensors, or :func:`check_saved_adapter` on the folder it hands over.
"""

from ._digests import adapter_digests, check_adapter_tensors, check_saved_adapter
from .synchronizer import LoRAAdapterSynchronizer

__all__ = [
    "LoRAAdapterSynchronizer",
    "adapter_digests",
    "check_adapter_tensors",
    "check_saved_adapter",
]
