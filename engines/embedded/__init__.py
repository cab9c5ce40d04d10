"""The embedded engine: a transformers-based reference engine for CPU and tests.

It mirrors vLLM's worker contract (``worker.model_runner.model.load_weights``,
``collective_rpc``, sleep/wake) closely enough for every aiosync transport to
run against it without a GPU. It is **not** a vLLM replacement: no batching
scheduler, no paged KV cache, no CUDA graphs.

- :mod:`aiosync.engines.embedded.model` — :class:`HFModelRunner` (checkpoint-named
  ``load_weights``).
- :mod:`aiosync.engines.embedded.engine` — :class:`EmbeddedEngine` (the facade); its
  worker processes and their RPC are ``_pool.WorkerPool``'s.
- ``_tp.py`` — tensor parallelism (``EmbeddedEngine(tensor_parallel_size=N)``): the
  Megatron layout of each checkpoint tensor, the sharded layers, a replica's gloo
  group and its lockstep decode.
"""
