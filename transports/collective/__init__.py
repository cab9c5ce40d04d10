"""Non-colocated refit: one torch.distributed broadcast group (NCCL on GPU, gloo on CPU).

- :mod:`.synchronizer` — the trainer side, :class:`CollectiveWeightSynchronizer`.
- :mod:`.worker` — the engine side, :class:`CollectiveWorkerMixin`.
- ``_group`` (the process group over its own ``TCPStore``), ``_loops`` (the
  pipelined send/receive loops), ``_votes`` (the trainer ranks' agreement) and
  ``_wire`` (bucket header and trailer) are private.
"""

from .synchronizer import CollectiveWeightSynchronizer, default_bucket_bytes, kv_scale_entries
from .worker import CollectiveWorkerMixin

__all__ = [
    "CollectiveWeightSynchronizer",
    "CollectiveWorkerMixin",
    "default_bucket_bytes",
    "kv_scale_entries",
]
