"""The HTTP routes an engine client calls, as data: method, body fields, query parameters.

Each HTTP client (:class:`~aiosync.engines.sglang._client.SGLangClient`,
:class:`~aiosync.VLLMServerBackend`) keeps one table of every route it calls and
checks each request against it before sending it (:func:`check_request`), so the
table is what the client really does. ``tests/contracts/`` checks the tables
against the engines' released sources (SGLang's ``http_server.py`` and
``io_struct.py``, vLLM's routers): a route, method or field the release does not
have fails there, not on a user's server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Route", "check_request"]


@dataclass(frozen=True, slots=True)
class Route:
    """One route as a client calls it.

    Attributes:
        method: the HTTP method the client sends (``"GET"``, ``"POST"``).
        body: the JSON body fields the client may send (its request class's
            fields on the engine: SGLang's ``io_struct`` classes, vLLM's
            ``Body(embed=True)`` parameters); empty: no body, or ``{}``.
        query: the query parameters the client may send.
    """

    method: str
    body: frozenset[str] = frozenset()
    query: frozenset[str] = frozenset()


def check_request(
    table: Mapping[str, Route],
    method: str,
    path: str,
    body: Any = None,
    params: Mapping[str, Any] | None = None,
) -> None:
    """Refuse a request its client's route table does not declare.

    Args:
        table: the client's routes, ``{path: Route}``.
        method, path: the request's.
        body: its JSON body (a dict's keys are checked; other bodies are not).
        params: its query parameters.

    Raises:
        RuntimeError: ``path`` is not in ``table``, or is called with another
            method, body field or query parameter than declared: a defect of
            aiosync (the table and the client disagree), never of the caller.
    """
    route = table.get(path)
    if route is None or route.method != method:
        raise RuntimeError(
            f"aiosync defect: {method} {path} is not in the client's route table "
            f"({'declared ' + route.method if route else 'undeclared'})"
        )
    fields = set(body) if isinstance(body, Mapping) else set()
    if not fields <= route.body:
        raise RuntimeError(
            f"aiosync defect: {method} {path} sends body fields {sorted(fields - route.body)} "
            "its route table does not declare"
        )
    query = set(params or ())
    if not query <= route.query:
        raise RuntimeError(
            f"aiosync defect: {method} {path} sends query parameters "
            f"{sorted(query - route.query)} its route table does not declare"
        )
