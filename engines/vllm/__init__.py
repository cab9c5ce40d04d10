"""vLLM: the generation backend and the worker extension every aiosync receiver lives in.

- :mod:`.backend` — :class:`VLLMGenerationBackend` (``LLM`` / ``AsyncLLM``).
- :mod:`.server` — :class:`VLLMServerBackend`, a remote ``vllm serve`` by URL
  (``docs/vllm-server.md``).
- :mod:`.worker` — :class:`VLLMWorkerMixin`: refits inside vLLM's layerwise reload.
- :mod:`.worker_extension` — :class:`AiosyncWorkerExtension`, the class named in
  ``worker_extension_cls="aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension"``.
"""

from .backend import WORKER_EXTENSION, VLLMGenerationBackend
from .server import VLLMServerBackend

__all__ = ["WORKER_EXTENSION", "VLLMGenerationBackend", "VLLMServerBackend"]
