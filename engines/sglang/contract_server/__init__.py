"""A contract-true stand-in for SGLang's HTTP server, on the embedded transformers engine.

Run it as ``python -m aiosync.testing.sglang_server --port 0 --port-file F --model-config
config.json`` (or a preset name such as ``qwen3-tiny``); it binds 127.0.0.1 only. Endpoints,
test-only routes (``/_aiosync/...``) and fault injection: ``docs/sglang-test-server.md``.
It lives with the SGLang engine (it runs the embedded engine behind SGLang's routes and
the HTTP transport's wire format); :mod:`aiosync.testing.sglang_server` is its public name.
"""

from __future__ import annotations

from aiosync.engines.sglang.contract_server._cli import (
    main,
    make_server,
    serve_in_subprocess,
    stop_server,
)
from aiosync.engines.sglang.contract_server._state import ServerState
from aiosync.engines.sglang.contract_server._wire import (
    AIOSYNC_ROUTE_PREFIX,
    SGLANG_ROUTES,
    ServedRoute,
)

__all__ = [
    "AIOSYNC_ROUTE_PREFIX",
    "SGLANG_ROUTES",
    "ServedRoute",
    "ServerState",
    "main",
    "make_server",
    "serve_in_subprocess",
    "stop_server",
]
