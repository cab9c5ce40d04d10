"""Engine adapters: *what* aiosync synchronizes into, apart from *how* (``aiosync.transports``).

- :mod:`aiosync.engines.vllm` — ``VLLMGenerationBackend`` and the vLLM worker
  extension (``aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension``).
- :mod:`aiosync.engines.sglang` — ``SGLangHTTPBackend`` and the SGLang-contract
  test server (``python -m aiosync.testing.sglang_server``).
- :mod:`aiosync.engines.embedded` — ``EmbeddedEngine``, the CPU reference engine.
- :mod:`aiosync.engines.colocation` — the scheduler's GPU share of a colocated engine
  worker (``scheduler_gpu_share``; a placement figure, not a memory fraction).
"""
