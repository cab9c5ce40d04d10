"""SGLang: the HTTP generation backend and a contract-true test server.

- :mod:`.backend` — :class:`SGLangHTTPBackend`, the server by URL (satisfies
  :class:`aiosync.transports.http.SGLangServer`).
- :mod:`.contract_server` — ``python -m aiosync.testing.sglang_server`` (its public name):
  SGLang's HTTP contract on the embedded engine, for CPU tests.
"""

from .backend import SGLangGeneration, SGLangHTTPBackend

__all__ = ["SGLangGeneration", "SGLangHTTPBackend"]
