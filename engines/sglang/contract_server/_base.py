"""The HTTP server and the request handler's base, which each group of routes extends."""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from aiosync.engines.sglang.contract_server._state import ServerState


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: ServerState

    def server_close(self) -> None:
        """Stop listening and close every weight-update group (no gloo thread or
        socket outlives the server)."""
        super().server_close()
        state = getattr(self, "state", None)
        if state is not None:
            state.close_weight_groups()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (timeout, dropped fault) is not a server error.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _Routes(BaseHTTPRequestHandler):
    """What every group of routes reads: the server (its :class:`ServerState`) and this
    request's stamps (``times`` of its log entry)."""

    server: _Server
    _times: dict[str, float]
