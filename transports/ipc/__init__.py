"""Colocated refit: buckets in shared memory (CPU) or CUDA-IPC handles, control over ZMQ.

- :mod:`.synchronizer` — the trainer side, :class:`IPCWeightSynchronizer`.
- :mod:`.worker` — the engine side, :class:`IPCWorkerMixin`.
- ``_sender`` (one sync's buckets, lane by lane, to the workers), ``_packer`` (the
  staging buffers and what is read and packed into them), ``_router`` (the trainer's
  ROUTER socket and the messages over it), ``_receive`` (the worker's loop) and
  ``_shm`` (named POSIX shared memory between independent processes) are private.
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
