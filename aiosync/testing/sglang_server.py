"""The SGLang contract test server's public name: ``python -m aiosync.testing.sglang_server``.

The server lives in :mod:`aiosync.engines.sglang.contract_server` (``docs/sglang-test-server.md``);
this module hands on its names and runs it as ``__main__``.
"""

from __future__ import annotations

from aiosync.engines.sglang.contract_server import (
    AIOSYNC_ROUTE_PREFIX,
    SGLANG_ROUTES,
    ServerState,
    main,
    make_server,
    serve_in_subprocess,
)

__all__ = [
    "AIOSYNC_ROUTE_PREFIX",
    "SGLANG_ROUTES",
    "ServerState",
    "main",
    "make_server",
    "serve_in_subprocess",
]

if __name__ == "__main__":
    main()
