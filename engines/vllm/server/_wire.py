"""What the backend sends: :data:`ROUTES` (every route, method, body field and query
parameter), :data:`OPTIONAL_ROUTES`, :class:`RouteMissingError` and the translation of an
answer's status into aiosync's errors."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from aiosync.engines._routes import Route
from aiosync.errors import (
    TransportError,
)

if TYPE_CHECKING:
    pass


# The logger of every part of the backend (one name, as before the package split).
_log = logging.getLogger("aiosync.engines.vllm.server")

#: Limit for one ``/v1/completions`` call (all its prompts, streamed), seconds:
#: rollouts are long, and a request kept frozen by a ``"keep"`` sync waits for it.
DEFAULT_GENERATE_TIMEOUT_S: float = 600.0
#: The environment variable the server needs for every route but the completions.
SERVER_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# What vLLM's engine core appends to a worker's message
# (``Worker failed with error '<message>', please check the stack trace ...``).
_VLLM_WORKER_SUFFIX = re.compile(r"', please check the stack trace above for the root cause\.?$")
#: The tags ``/wake_up`` accepts (vLLM's ``wake_up(tags)``).
_WAKE_TAGS = frozenset({"weights", "kv_cache", "scheduling"})


def _route(method: str, body: tuple[str, ...] = (), query: tuple[str, ...] = ()) -> Route:
    return Route(method, frozenset(body), frozenset(query))


#: Every route this backend calls: the method, the body fields and the query parameters
#: it sends (vLLM 0.32.0 and 0.34.0 serve them alike). :meth:`VLLMServerBackend._request`
#: refuses anything else; ``tests/contracts/`` checks the table against vLLM 0.34.0's
#: routers and ``tests/vllm/`` against a live server's ``/openapi.json``.
ROUTES: dict[str, Route] = {
    "/health": _route("GET"),
    "/v1/completions": _route(
        "POST",
        (
            "model",
            "prompt",
            "max_tokens",
            "temperature",
            "top_p",
            "seed",
            "logprobs",
            "ignore_eos",
            "return_token_ids",
            "stream",
        ),
    ),
    "/collective_rpc": _route("POST", ("method", "args", "kwargs")),
    "/pause": _route("POST", query=("mode", "clear_cache")),
    "/resume": _route("POST"),
    "/is_paused": _route("GET"),
    "/reset_prefix_cache": _route("POST", query=("reset_running_requests",)),
    "/sleep": _route("POST", query=("level",)),
    "/wake_up": _route("POST", query=("tags",)),
    "/is_sleeping": _route("GET"),
    "/server_info": _route("GET", query=("config_format",)),
    "/update_weight_version": _route("POST", ("new_version",)),
    "/weight_info": _route("GET"),
    "/get_world_size": _route("GET", query=("include_dp",)),
    "/init_weight_transfer_engine": _route("POST", ("init_info",)),
    "/start_weight_update": _route("POST"),
    # The same session for the speculative draft model (vLLM's own transfer engine only).
    "/start_draft_weight_update": _route("POST"),
    "/update_weights": _route("POST", ("update_info",)),
    "/finish_weight_update": _route("POST", ("weight_version",)),
    "/shutdown_weight_transfer_engine": _route("POST"),
    # Aborts every request the server tracks (no request_ids), without pausing.
    "/abort_requests": _route("POST", ("request_ids",)),
    # Only the "checksum" action: the comparison is done here, naming each change.
    "/weight_checker": _route("POST", ("action",)),
    # FastAPI's schema of every route (absent with --disable-fastapi-docs).
    "/openapi.json": _route("GET"),
}
# The routes served only with VLLM_SERVER_DEV_MODE=1: a 404 there names the missing flag.
_DEV_ROUTES = frozenset(ROUTES) - {"/health", "/v1/completions", "/openapi.json"}

#: The routes of :data:`ROUTES` that not every vLLM serves, and which releases do:
#: the backend reads ``/openapi.json`` before calling one (:meth:`VLLMServerBackend.served_routes`).
OPTIONAL_ROUTES: dict[str, str] = {
    "/abort_requests": "vLLM 0.32.0 and 0.34.0 serve it (the RL router)",
    "/weight_checker": "vLLM 0.32.0 and 0.34.0 serve it (the RL router)",
    "/shutdown_weight_transfer_engine": (
        "vLLM 0.32.0 to 0.34.0 serve it; vLLM's main after 0.34 has no such route"
    ),
}


class RouteMissingError(TransportError):
    """The server does not serve a route the call needs (its ``/openapi.json`` lacks
    it, or it answered 404), raised before anything else is sent for the call.

    Attributes:
        route: the path, e.g. ``"/weight_checker"``.
        need: which vLLM releases serve it.
    """

    def __init__(self, base_url: str, route: str, need: str) -> None:
        super().__init__(
            f"the vLLM server at {base_url} does not serve {route}: {need}, with "
            f"{SERVER_DEV_MODE_ENV}=1"
        )
        self.route = route
        self.need = need


def _raise_for_status(response: httpx.Response, where: str, path: str, keyed: bool) -> None:
    """Raise :class:`TransportError` for a non-2xx answer (``http_status`` and
    ``server_message`` set on it), naming the missing server flag for a 404 on a
    dev-mode route and the API key for a 401."""
    if response.is_success:
        return
    if response.status_code == 401:
        raise TransportError(
            f"{where}: 401 Unauthorized: the server rejected the API key "
            f"({'wrong key' if keyed else 'none sent'})"
        )
    message = _server_message(response)
    hint = ""
    if response.status_code == 404 and path in _DEV_ROUTES:
        hint = (
            f" (the server has no {path}: start vllm serve with {SERVER_DEV_MODE_ENV}=1 "
            "in its environment)"
        )
    error = TransportError(f"{where}: HTTP {response.status_code}: {message}{hint}")
    vars(error)["http_status"] = response.status_code
    vars(error)["server_message"] = message
    raise error


def _server_message(response: httpx.Response) -> str:
    """The server's own words: ``error.message`` (vLLM's ``ErrorResponse``),
    ``error`` (the RL routes), ``detail`` (FastAPI), or the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    return _message_of(data)


def _message_of(data: Any) -> str:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if error is not None:
            return str(error)
        if "detail" in data:
            return str(data["detail"])
        if "message" in data:
            return str(data["message"])
    return str(data)[:500]


def _int_field(answer: Any, key: str, path: str) -> int:
    value = answer.get(key) if isinstance(answer, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TransportError(f"{path} answered {str(answer)[:200]}")
    return value


def _bool_field(answer: Any, key: str, path: str) -> bool:
    value = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(value, bool):
        raise TransportError(f"{path} answered {str(answer)[:200]}")
    return value


def _query(
    params: Mapping[str, Any] | None,
) -> list[tuple[str, str | int | float | bool | None]] | None:
    """Query parameters as vLLM's FastAPI routes read them: booleans as
    ``true``/``false``, a list as the key repeated (``tags=a&tags=b``)."""
    if params is None:
        return None
    out: list[tuple[str, str | int | float | bool | None]] = []
    for key, value in params.items():
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            out.append((key, str(item).lower() if isinstance(item, bool) else str(item)))
    return out
