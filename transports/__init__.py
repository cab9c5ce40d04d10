"""Transports: how weights move. Each is one subpackage holding both halves of it.

- :mod:`aiosync.transports.collective` — non-colocated: torch.distributed broadcast
  (NCCL / gloo); trainer side ``CollectiveWeightSynchronizer``, engine side
  ``CollectiveWorkerMixin``.
- :mod:`aiosync.transports.ipc` — colocated: ZMQ + shared-memory / CUDA-IPC handles;
  ``IPCWeightSynchronizer`` and ``IPCWorkerMixin``.
- :mod:`aiosync.transports.http` — colocated SGLang over its HTTP API;
  ``HTTPWeightSynchronizer`` and the ``SGLangServer`` contract it drives.
- :mod:`aiosync.transports.vllm_weight_transfer` — vLLM's own weight-transfer API
  driven with aiosync's versions and events.
- :mod:`aiosync.transports.lora` — adapter-only refits of a LoRA trainer through
  the engine's own ``load_lora_adapter``; ``LoRAAdapterSynchronizer``.

Shared by all of them, and nothing else: :mod:`aiosync.transports.packing` (the
bucket layout and manifest checks) and ``_wire`` (the msgpack frames and the
errors re-built from a worker). Transports know the engine *contract*
(``collective_rpc``, the worker mixins, SGLang's HTTP API), never an adapter
class from :mod:`aiosync.engines`.
"""
