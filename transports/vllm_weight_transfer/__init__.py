"""vLLM's own weight-transfer API (init/start/update/finish) under aiosync's versions and events.

The engine side is vLLM's (``weight_transfer_config``); only the trainer side
lives here, in :mod:`.synchronizer`. See ``docs/vllm.md``.
"""

from .synchronizer import (
    LLMWeightSyncClient,
    ReleasingClient,
    VersionRecordingClient,
    VLLMWeightTransferSynchronizer,
    refit_weight_source,
    vllm_weight_transfer_available,
)

__all__ = [
    "LLMWeightSyncClient",
    "ReleasingClient",
    "VLLMWeightTransferSynchronizer",
    "VersionRecordingClient",
    "refit_weight_source",
    "vllm_weight_transfer_available",
]
