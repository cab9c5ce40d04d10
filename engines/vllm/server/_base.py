"""The backend's HTTP plumbing: one ``_request`` for every error, the routes a server
serves (``/openapi.json``), ``/collective_rpc`` and the server's state."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import httpx

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.engines._gate import AdmissionGate
from aiosync.engines._generate import GenerateFromMeta
from aiosync.engines._http import (
    answer_body,
    http_client,
    http_errors,
    http_status,
    request_timeout,
)
from aiosync.engines._routes import check_request
from aiosync.engines.vllm._checksums import RecordedChecksums
from aiosync.engines.vllm._dp import WEIGHT_RPCS
from aiosync.engines.vllm._drivers import rebuild_worker_error
from aiosync.errors import (
    ExceptionMapping,
    SyncTimeoutError,
    TransportError,
    map_exceptions,
)

if TYPE_CHECKING:
    pass

from aiosync.engines.vllm.server._wire import (
    _VLLM_WORKER_SUFFIX,
    DEFAULT_GENERATE_TIMEOUT_S,
    OPTIONAL_ROUTES,
    ROUTES,
    RouteMissingError,
    _int_field,
    _log,
    _query,
    _raise_for_status,
)


class _ServerBase(GenerateFromMeta):
    """The HTTP client of one server and what every part of the backend reads
    (:class:`VLLMServerBackend` documents the arguments)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        model: str | None = None,
        sleep_level: int = 1,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        generate_timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
        record_checksums: bool = False,
        draft_prefix: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if draft_prefix is not None and (not isinstance(draft_prefix, str) or not draft_prefix):
            raise ValueError(f"draft_prefix must be a non-empty string, got {draft_prefix!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        for label, value in (
            ("rpc_timeout_s", rpc_timeout_s),
            ("generate_timeout_s", generate_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        if urlsplit(base_url).scheme not in ("http", "https"):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.sleep_level = sleep_level
        self.rpc_timeout_s = rpc_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.record_checksums = record_checksums
        self._draft_prefix = draft_prefix
        self._client = http_client(self.base_url, api_key, rpc_timeout_s, transport)
        self._gate = AdmissionGate(f"the vLLM server at {self.base_url}")
        self._discard_listeners: list[Callable[[], None]] = []
        self._server_info: dict[str, Any] | None = None
        self._warned_no_sleep = False
        self._asleep = False
        # Workers per replica, and with every data-parallel replica (None: not asked).
        self._world: tuple[int, int] | None = None
        # The version label of the weights the server computes with, as far as this
        # backend changed it (None: not changed by it yet), and how often it changed:
        # a token that streams in after a change was computed by the new weights.
        self._computing: int | None = None
        self._version_epoch = 0
        # The version committed while generation was paused: computing from the resume.
        self._committed_in_pause: int | None = None
        self._streamed_tokens = 0
        # The paths /openapi.json lists (None: not read yet); _schema_hidden: it answered
        # 404 (--disable-fastapi-docs), so the routes are unknown for good.
        self._routes: frozenset[str] | None = None
        self._schema_hidden = False
        # /weight_checker's checksums at the last commit (record_checksums).
        self._checksums: RecordedChecksums | None = None
        self._warned_no_checker = False

    # -- the HTTP plumbing: one place for every error -------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        fresh_connection: bool = False,
    ) -> Any:
        """One request; the answer's JSON (its text if not JSON, None if empty).

        ``fresh_connection``: on a connection of its own, closed after the answer
        (``Connection: close``). For the routes where a server-side exception
        becomes the 500 answer: Starlette's ``ServerErrorMiddleware`` sends it and
        re-raises, and the server drops that connection, which a pooled request
        would otherwise reuse and fail on (``ReadError``).

        Raises:
            SyncTimeoutError: no answer within ``timeout_s`` (default ``rpc_timeout_s``).
            TransportError: a connection error, a 401 or another non-2xx answer
                (``http_status`` set on the error for the latter).
            RuntimeError: a route, method, body field or query parameter outside
                :data:`ROUTES` (an aiosync defect), before anything is sent.
        """
        check_request(ROUTES, method, path, body, params)
        limit = self.rpc_timeout_s if timeout_s is None else timeout_s
        where = f"{method} {self.base_url}{path}"
        errors: ExceptionMapping = {
            TimeoutError: lambda _: SyncTimeoutError(f"{where}: no answer within {limit} s"),
            **http_errors(where, lambda exc: f"{where}: no answer within {limit} s ({exc!r})"),
        }
        with map_exceptions(errors), anyio.fail_after(limit if math.isfinite(limit) else None):
            response = await self._client.request(
                method,
                path,
                json=body,
                params=_query(params),
                headers={"Connection": "close"} if fresh_connection else None,
                timeout=request_timeout(limit),
            )
        try:
            _raise_for_status(response, where, path, "Authorization" in self._client.headers)
        except TransportError as exc:
            if http_status(exc) == 404 and path in OPTIONAL_ROUTES:
                raise RouteMissingError(self.base_url, path, OPTIONAL_ROUTES[path]) from exc
            raise
        return answer_body(response)

    # -- which routes the server has: /openapi.json, once ---------------------------

    async def served_routes(self) -> frozenset[str] | None:
        """The paths the server serves, from its ``GET /openapi.json`` (read once, cached).

        vLLM's app publishes every route it registered there (FastAPI's schema),
        unless started with ``--disable-fastapi-docs``: then (a 404) None, for good,
        and each optional route is simply tried (a 404 on it is a
        :class:`RouteMissingError`). Another error answer is None too, and the
        schema is asked for again next time.

        Raises:
            TransportError, SyncTimeoutError: the server is unreachable or gave no
                answer in time; it answered a schema without ``paths``.
        """
        if self._routes is None and not self._schema_hidden:
            try:
                spec = await self._request("GET", "/openapi.json")
            except TransportError as exc:
                status = http_status(exc)
                if status is None:
                    raise  # unreachable: the call that wanted the route would fail too
                self._schema_hidden = status == 404
                _log.info("%s: no route list (%s); optional routes are tried", self.base_url, exc)
                return None
            paths = spec.get("paths") if isinstance(spec, dict) else None
            if not isinstance(paths, dict):
                raise TransportError(f"{self.base_url}/openapi.json answered no paths")
            self._routes = frozenset(str(p) for p in paths)
        return self._routes

    async def _serves(self, path: str) -> bool | None:
        """Whether the server serves ``path``; None: unknown (no ``/openapi.json``)."""
        routes = await self.served_routes()
        return None if routes is None else path in routes

    async def _require_route(self, path: str) -> None:
        """Refuse a call whose route the server's ``/openapi.json`` does not list.

        Raises:
            RouteMissingError: it is not listed (which releases serve it named).
        """
        if await self._serves(path) is False:
            raise RouteMissingError(self.base_url, path, OPTIONAL_ROUTES[path])

    # -- EngineWorkers: /collective_rpc -------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every worker through ``POST /collective_rpc``;
        one result per worker, rank order.

        Arguments and results travel as JSON (vLLM's route: ``{"method", "args",
        "kwargs"}`` in, ``{"results": [...]}`` out, a result that is not a
        dict, list or None turned into its ``str``), so bytes cannot travel:
        every aiosync set-up and receive RPC is JSON-safe, the diagnostic
        ``aiosync_vllm_read_weights`` (raw bytes) is not. vLLM's own RPC timeout
        is never sent (its executor hands a late reply to the next call).

        Raises:
            SyncTimeoutError: no answer within ``timeout_s`` (default
                ``rpc_timeout_s``) seconds. The server keeps running the call
                (aiosync's worker methods end on their own timeouts).
            RefitMismatchError, TransportError, SyncTimeoutError: re-raised from
                a worker that raised one; any other worker error is a
                ``TransportError`` with its message.
            TransportError: the server failed or is unreachable; it answered a
                result that is not JSON (``bytes``); or it serves several vLLM
                data-parallel replicas (``--data-parallel-size`` > 1), whose
                route answers the first replica's workers only, for a weight
                transport RPC (before it reaches any worker).
            TypeError: an argument that is not JSON-serializable (before any request).
        """
        if method in WEIGHT_RPCS:
            await self._check_whole_engine()
        body = {"method": method, "args": list(args), "kwargs": dict(kwargs or {})}
        try:
            json.dumps(body)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"collective_rpc({method!r}) over HTTP takes JSON-safe arguments: {exc}"
            ) from exc
        timeout = self.rpc_timeout_s if timeout_s is None else timeout_s
        try:
            answer = await self._request(
                "POST", "/collective_rpc", body=body, timeout_s=timeout, fresh_connection=True
            )
        except SyncTimeoutError as exc:
            raise SyncTimeoutError(
                f"vLLM collective_rpc {method!r} did not return within {timeout} s "
                f"({self.base_url})"
            ) from exc
        except TransportError as exc:
            status = http_status(exc)
            message = str(vars(exc).get("server_message", ""))
            if status == 400 and "JSON serializable" in message:
                raise TransportError(
                    f"vLLM collective_rpc {method!r}: the server could not send its result "
                    f"as JSON ({message}); results must be JSON-safe over HTTP"
                ) from exc
            if status == 500 or "[aiosync:" in message:
                # A worker's error: vLLM passes its message only (typed by the tag).
                message = _VLLM_WORKER_SUFFIX.sub("", message)
                raise rebuild_worker_error(method, Exception(message)) from exc
            raise
        if answer is None:
            return []
        if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
            raise TransportError(
                f"vLLM collective_rpc {method!r} answered {str(answer)[:200]}, not "
                '{"results": [...]}'
            )
        return list(answer["results"])

    async def world_size(self, include_dp: bool = True) -> int:
        """``GET /get_world_size``: workers of one replica (TP × PP), or with every
        data-parallel replica (``include_dp``; what a non-colocated sync passes as
        ``inference_world_size``). Cached.

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        if self._world is None:
            sizes = []
            for dp in (False, True):
                answer = await self._request("GET", "/get_world_size", params={"include_dp": dp})
                sizes.append(_int_field(answer, "world_size", "/get_world_size"))
            self._world = (sizes[0], sizes[1])
        return self._world[1] if include_dp else self._world[0]

    async def _check_whole_engine(self) -> None:
        """Refuse a weight RPC where ``/collective_rpc`` answers for part of the engine."""
        replica = await self.world_size(include_dp=False)
        total = await self.world_size(include_dp=True)
        if total != replica:
            raise TransportError(
                f"the vLLM server at {self.base_url} serves {total // replica} data-parallel "
                f"replicas, and its /collective_rpc answers the first one's {replica} "
                "worker(s) only: a sync through it would update some replicas and report "
                "success; run one server per replica (--data-parallel-size 1) and put "
                "one VLLMServerBackend per server in an aiosync.EngineFleet"
            )

    # -- the server's state ----------------------------------------------------------

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info?config_format=json``: the server's ``VllmConfig`` as JSON
        (``vllm_config.model_config``, ``parallel_config``, ...), cached.

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        if self._server_info is None:
            info = await self._request("GET", "/server_info", params={"config_format": "json"})
            if not isinstance(info, dict) or not isinstance(info.get("vllm_config"), dict):
                raise TransportError(f"/server_info answered {str(info)[:200]}")
            self._server_info = info
        return self._server_info

    async def sleep_mode(self) -> bool:
        """True when the server's ``/sleep`` releases memory (``--enable-sleep-mode``;
        vLLM's CPU build has none).

        Raises:
            TransportError, SyncTimeoutError: ``/server_info`` failed.
        """
        model = (await self.server_info())["vllm_config"].get("model_config") or {}
        return bool(model.get("enable_sleep_mode", False))

    async def check_health(self) -> None:
        """``GET /health``: return if the server answers 200 (its engine alive).

        Raises:
            TransportError: the server is unreachable or unhealthy (its answer quoted).
            SyncTimeoutError: no answer within ``rpc_timeout_s``.
        """
        await self._request("GET", "/health")

    @property
    def same_host(self) -> bool:
        """Whether ``base_url`` names this machine (a loopback address, or an address
        of one of its interfaces): the IPC transport reaches the workers only there."""
        host = urlsplit(self.base_url).hostname or ""
        try:
            addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except OSError:
            return False
        local = {"127.0.0.1", "::1"}
        with contextlib.suppress(OSError):
            local |= {str(i[4][0]) for i in socket.getaddrinfo(socket.gethostname(), None)}
        return any(ipaddress.ip_address(a).is_loopback or a in local for a in addresses)

    @property
    def streamed_tokens(self) -> int:
        """Tokens this backend's :meth:`generate_with_meta` calls have received so far
        (a count that only grows; tests and progress displays watch it)."""
        return self._streamed_tokens
