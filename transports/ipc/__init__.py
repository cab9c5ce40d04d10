"""Colocated refit: buckets in shared memory (CPU) or CUDA-IPC handles, control over ZMQ.

- :mod:`.synchronizer` — the trainer side, :class:`IPCWeightSynchronizer`.
- :mod:`.worker` — the engine side, :class:`IPCWorkerMixin`.
- ``_shm`` (named POSIX shared memory between independent processes) is private.
"""

from .synchronizer import (
    DEFAULT_BUFFER_MEMORY_FRACTION,
    DEFAULT_PIPELINE_BUCKETS,
    IPCWeightSynchronizer,
    default_bucket_bytes,
)
from .worker import IPCWorkerMixin

__all__ = [
    "DEFAULT_BUFFER_MEMORY_FRACTION",
    "DEFAULT_PIPELINE_BUCKETS",
    "IPCWeightSynchronizer",
    "IPCWorkerMixin",
    "default_bucket_bytes",
]
