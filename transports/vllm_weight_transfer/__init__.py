"""vLLM's own weight-transfer API (init/start/update/finish) under aiosync's versions and events.

The engine side is vLLM's (``weight_transfer_config``); only the trainer side
lives here, in :mod:`.synchronizer`. See ``docs/vllm.md``.
"""

from . import synchronizer
from .synchronizer import LLMWeightSyncClient as LLMWeightSyncClient
from .synchronizer import ReleasingClient as ReleasingClient
from .synchronizer import VersionRecordingClient as VersionRecordingClient
from .synchronizer import VLLMWeightTransferSynchronizer as VLLMWeightTransferSynchronizer
from .synchronizer import refit_weight_source as refit_weight_source
from .synchronizer import vllm_weight_transfer_available as vllm_weight_transfer_available

__all__ = list(synchronizer.__all__)
