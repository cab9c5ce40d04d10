"""The worker extension users hand to the engine: every aiosync receiver in one class.

vLLM: ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` with
``WORKER_EXTENSION = "aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension"``;
the trainer then drives the ``aiosync_*`` methods with ``collective_rpc``. The
embedded engine mixes this class into its workers by default.
"""

from __future__ import annotations

from aiosync.transports.collective.worker import CollectiveWorkerMixin
from aiosync.transports.ipc.worker import IPCWorkerMixin
from aiosync.transports.sharded.worker import ShardedWorkerMixin

from .worker import VLLMWorkerMixin

__all__ = ["AiosyncWorkerExtension"]


class AiosyncWorkerExtension(
    VLLMWorkerMixin, IPCWorkerMixin, CollectiveWorkerMixin, ShardedWorkerMixin
):
    """All engine-side receivers: IPC (colocated), the broadcast and the shard-aware
    transfer (non-colocated; the latter where the model reports its layout)."""
