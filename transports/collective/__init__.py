"""Non-colocated refit: one torch.distributed broadcast group (NCCL on GPU, gloo on CPU).

- :mod:`.synchronizer` — the trainer side, :class:`CollectiveWeightSynchronizer`.
- :mod:`.worker` — the engine side, :class:`CollectiveWorkerMixin`.
- :mod:`.sglang` — disaggregated SGLang servers, :class:`SGLangCollectiveWeightSynchronizer`
  (SGLang's own weight-update group and ``/update_weights_from_distributed``).
- ``_group`` (the process group over its own ``TCPStore``), ``_loops`` (the
  pipelined send/receive loops), ``_votes`` (the trainer ranks' agreement) and
  ``_wire`` (bucket header and trailer) are private.
"""

from .sglang import SGLangCollectiveWeightSynchronizer
from .synchronizer import CollectiveWeightSynchronizer, default_bucket_bytes, kv_scale_entries
from .worker import CollectiveWorkerMixin

__all__ = [
    "CollectiveWeightSynchronizer",
    "CollectiveWorkerMixin",
    "SGLangCollectiveWeightSynchronizer",
    "default_bucket_bytes",
    "kv_scale_entries",
]
