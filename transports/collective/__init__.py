"""Non-colocated refit: one torch.distributed broadcast group (NCCL on GPU, gloo on CPU).

- :mod:`.synchronizer` — the trainer side, :class:`CollectiveWeightSynchronizer`.
- :mod:`.worker` — the engine side, :class:`CollectiveWorkerMixin`.
- :mod:`.sglang` — disaggregated SGLang servers, :class:`SGLangCollectiveWeightSynchronizer`
  (SGLang's own weight-update group and ``/update_weights_from_distributed``).
- ``_group`` (forming the process group over its own ``TCPStore``), ``_sync_group``
  (the formed group: its collectives, votes and teardown), ``_member`` (an engine
  worker's side of a group, shared with the shard-aware worker), ``_loops`` (the
  pipelined send/receive loops), ``_votes`` (the trainer ranks' agreement),
  ``_sglang_groups`` (who holds an SGLang server's weight-update group) and ``_wire``
  (bucket header and trailer) are private.
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
