"""Shard-aware refit: many trainer ranks send their own shards straight to the workers.

- :mod:`._source_layout` — what each trainer rank holds (:func:`dtensor_layouts`,
  :func:`single_rank_layouts`, :func:`replicated_layouts`) and a sender's local
  tensors (:func:`local_tensor_fn`); :func:`shard_refusal` says what it cannot send.
- :mod:`._plan` — :func:`make_plan`: the deterministic many-senders plan (boxes,
  replicas balanced over senders, per-pair buckets, a digest every rank compares).
- :mod:`._p2p` — :func:`run_plan`: its point-to-point executor over a
  ``torch.distributed`` group (``batch_isend_irecv``, two buckets in flight per pair).
- :mod:`._delta` — delta syncs on the same plan: each sender's baseline of what it
  sends (``ShardBaseline``) and the per-pair header + patches wire (``run_delta_plan``).

The layout vocabulary (:class:`aiosync.layout.Part`, ``Layout``) lives in the core.
:mod:`.synchronizer` drives them (:class:`ShardedWeightSynchronizer`, the trainer
side); :mod:`.worker` is the engine side (:class:`ShardedWorkerMixin`).
"""

from ._p2p import P2PResult, SinkFn, SourceFn, run_plan
from ._plan import (
    Box,
    Plan,
    Transfer,
    TransferBucket,
    box_numel,
    box_shape,
    box_within,
    make_plan,
)
from ._source_layout import (
    dtensor_layout,
    dtensor_layouts,
    iter_local_tensors,
    local_tensor_fn,
    manifest_dtypes,
    replicated_layouts,
    shard_refusal,
    single_rank_layouts,
)
from .synchronizer import ShardedWeightSynchronizer
from .worker import ShardedWorkerMixin

__all__ = [
    "Box",
    "P2PResult",
    "Plan",
    "ShardedWeightSynchronizer",
    "ShardedWorkerMixin",
    "SinkFn",
    "SourceFn",
    "Transfer",
    "TransferBucket",
    "box_numel",
    "box_shape",
    "box_within",
    "dtensor_layout",
    "dtensor_layouts",
    "iter_local_tensors",
    "local_tensor_fn",
    "make_plan",
    "manifest_dtypes",
    "replicated_layouts",
    "run_plan",
    "shard_refusal",
    "single_rank_layouts",
]
