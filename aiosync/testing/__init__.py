"""Test doubles users need too: a dict-backed refit source and the SGLang contract server.

- :class:`StateDictSource`: a ``RefitSource`` over an ordered ``{hf_name: tensor}`` dict.
- :mod:`aiosync.testing.sglang_server`: a stand-in for SGLang's HTTP server on the embedded
  engine, ``python -m aiosync.testing.sglang_server --model-config qwen3-tiny``
  (``docs/sglang-test-server.md``; it lives in ``aiosync/engines/sglang/contract_server/``).
  Not imported here: it loads transformers.

A source over an ``nn.Module`` (vLLM calls it ``ModuleSource``) is
:class:`aiosync.refit.DTensorRefitSource`: it already streams a plain module's weights
in checkpoint names, one tensor at a time.
"""

from __future__ import annotations

from .sources import StateDictSource

__all__ = ["StateDictSource"]
