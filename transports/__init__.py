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

What every transport shares lives in the core (:class:`aiosync.WeightSynchronizer`,
:mod:`aiosync.capabilities`); what several share on the wire lives here:
:mod:`aiosync.transports.packing` (bucket layout, manifest checks), ``_wire`` (msgpack
frames, errors re-built from a worker), ``_ranks`` (a sharded trainer's ranks and their
agreement), ``_identity`` (device pairing), ``_leftovers`` (what dead processes left);
CUDA memory another process can map is the core's (``aiosync/_cuda_ipc.py``). Transports
know the engine *contract* (the capability Protocols, the worker mixins, SGLang's HTTP
API), never an adapter class from :mod:`aiosync.engines`.
"""
