"""Adapter-only refits: a LoRA trainer's adapter, loaded by the engine's own LoRA API.

- :mod:`.synchronizer` — the trainer side, :class:`LoRAAdapterSynchronizer`.
- ``_layout`` — PEFT's saved adapter layout and its checks against the base model.
- The engine side is each engine's ``load_lora_adapter(adapter)`` (see
  :class:`aiosync.LoRAAdapter` for the contract): the embedded engine applies
  it with PEFT in its workers, SGLang loads it with ``/load_lora_adapter``.
"""

from .synchronizer import LoRAAdapterSynchronizer

__all__ = ["LoRAAdapterSynchronizer"]
