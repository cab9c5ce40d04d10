"""Transports: each implements ``aiosync.WeightSynchronizer._transfer`` in one module.

- :mod:`transports.collective` — non-colocated, torch.distributed broadcast (NCCL / gloo).
- :mod:`transports.ipc` — colocated, ZMQ + shared-memory / CUDA-IPC handles.
- :mod:`transports.http` — colocated SGLang over its HTTP API.
- :mod:`transports.packing` — the bucket layout all of them share.
"""
