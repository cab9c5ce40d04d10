"""``VLLMServerBackend``: a remote ``vllm serve``, reached by URL, as a full aiosync engine.

The server's HTTP API as the training loop and the transports use it (contracts
read from vLLM 0.32.0's sources and checked against 0.34.0's, ``docs/vllm-server.md``;
every route, body field and query parameter in :data:`ROUTES`):

* generation: ``POST /v1/completions`` with token-id prompts, streamed
  (``vllm/entrypoints/openai/completion/protocol.py``: ``prompt`` as lists of
  ids, ``return_token_ids``, ``logprobs``, ``stream``);
* the in-flight policy: ``POST /pause?mode=...``, ``POST /resume``,
  ``GET /is_paused`` and the weight-version label ``POST /update_weight_version``,
  ``GET /weight_info`` (``vllm/entrypoints/rl/online/api_router.py``);
* the workers: ``POST /collective_rpc`` into aiosync's worker extension
  (``vllm/entrypoints/serve/dev/rpc/api_router.py``), so that the IPC (same
  host) and collective transports drive it as they drive an in-process engine;
* ``POST /reset_prefix_cache``, ``POST /sleep``, ``POST /wake_up``,
  ``GET /is_sleeping``, ``GET /server_info`` (``vllm/entrypoints/serve/dev/``);
* vLLM's own weight-transfer phases (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``);
* ``POST /abort_requests`` (the ``"abort"`` in-flight policy) and ``POST
  /weight_checker`` (``record_checksums``: :meth:`VLLMServerBackend.verify_recorded_checksums`)
  where the server has them.

The routes a server serves are read once from its ``GET /openapi.json``
(:meth:`VLLMServerBackend.served_routes`): a route of :data:`OPTIONAL_ROUTES` the
server lacks is either done without (``/abort_requests``: ``/pause?mode=abort``) or
refused with a :class:`RouteMissingError` naming it and the vLLM releases that serve it.

Every route but the completions is registered only with ``VLLM_SERVER_DEV_MODE=1``;
the server needs ``--worker-extension-cls
aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension`` for the transports.

Every HTTP error is translated once, in :meth:`VLLMServerBackend._request`: no
answer in time is a :class:`~aiosync.SyncTimeoutError`; a refused or dropped
connection, a non-2xx answer (the server's own message quoted) or a 401 is a
:class:`~aiosync.TransportError`; a worker's aiosync error (``[aiosync:Type]``
in vLLM's message, as :mod:`aiosync.engines.vllm.worker` tags it) keeps its
type. Only httpx and anyio are imported here: no vLLM, no torch.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import re
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

import anyio
import httpx

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.capabilities import (
    DRAFT_REFITS,
    IN_FLIGHT_POLICIES,
    DraftRefit,
    EngineKind,
    InFlightPolicy,
)
from aiosync.errors import (
    ExceptionMapping,
    SyncError,
    SyncTimeoutError,
    TransportError,
    UnsupportedOptionError,
    map_exceptions,
)
from aiosync.generation import Generation, SamplingParams, parse_version, sampling_params

from .._gate import AdmissionGate
from .._generate import GenerateFromMeta
from .._http import http_errors
from .._routes import Route, check_request
from ._checksums import RecordedChecksums
from ._dp import WEIGHT_RPCS
from ._drivers import rebuild_worker_error

if TYPE_CHECKING:
    import torch

    from aiosync.capabilities import (
        ChecksumVerifying,
        DiscardNotifier,
        DraftHolding,
        Engine,
        EngineWorkers,
        Generating,
        HealthReporting,
        ManifestReporting,
        PausableEngine,
        VersionedEngine,
    )

__all__ = [
    "DEFAULT_GENERATE_TIMEOUT_S",
    "OPTIONAL_ROUTES",
    "ROUTES",
    "SERVER_DEV_MODE_ENV",
    "RouteMissingError",
    "VLLMServerBackend",
]

_log = logging.getLogger(__name__)

#: Limit for one ``/v1/completions`` call (all its prompts, streamed), seconds:
#: rollouts are long, and a request kept frozen by a ``"keep"`` sync waits for it.
DEFAULT_GENERATE_TIMEOUT_S: float = 600.0
#: The environment variable the server needs for every route but the completions.
SERVER_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# Connecting to a server never legitimately takes long.
_CONNECT_TIMEOUT_S = 10.0
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


@dataclass
class _Choice:
    """One prompt's answer as it streams in: tokens, their logprobs and versions."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    finish_reason: str | None = None


class VLLMServerBackend(GenerateFromMeta):
    """A ``vllm serve`` process, reached by URL, as an aiosync engine.

    An :class:`~aiosync.capabilities.Engine` that is also a ``PausableEngine``,
    ``VersionedEngine``, ``DiscardNotifier``, ``EngineWorkers``, ``Generating``
    and ``ManifestReporting`` (checked by mypy at the end of this module), so
    :class:`~aiosync.IPCWeightSynchronizer` (trainer on the server's host) and
    :class:`~aiosync.CollectiveWeightSynchronizer` (anywhere the workers can
    reach the trainer's store) drive it as they drive an in-process
    :class:`~aiosync.VLLMGenerationBackend`. ``generate()`` is
    :meth:`generate_with_meta`'s token ids.

    The server must run with ``VLLM_SERVER_DEV_MODE=1`` and
    ``--worker-extension-cls aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension``,
    with aiosync importable in its Python (``docs/vllm-server.md``).

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        api_key: the server's ``--api-key``; sent as ``Authorization: Bearer``.
        model: the ``model`` field of completions requests (a served model
            name); None: the server's default model.
        sleep_level: the ``/sleep?level=`` of :meth:`finish_generation`: 1
            offloads the weights, 2 discards them (the transports are told:
            :meth:`add_weights_discarded_listener`).
        rpc_timeout_s: default limit of one request other than generation
            (a :meth:`collective_rpc`, a pause), seconds.
        generate_timeout_s: limit of one :meth:`generate_with_meta` call, seconds.
        record_checksums: at each commit (:meth:`on_weights_committed`) ask the
            server's ``/weight_checker`` for the SHA-256 of every parameter of every
            worker and keep them: :meth:`verify_recorded_checksums` (the
            :class:`~aiosync.capabilities.ChecksumVerifying` capability) then names any
            parameter changed since. Costs one hash of the whole model per sync, on
            the server.
        draft_prefix: the server runs speculative decoding with a draft model whose
            tensors the checkpoint names under this prefix (Qwen3-Next's MTP layers:
            ``"mtp."``). The backend is then a
            :class:`~aiosync.capabilities.DraftHolding`: ``SyncOptions(draft="frozen")``
            works (:meth:`expected_manifest` leaves those names out: the transports
            load into the target model alone, so the draft stays as it is), and
            ``"with_target"`` is refused (:meth:`select_draft_refit` says why). None:
            no draft; ``"with_target"`` is refused as for any engine without one.
        transport: an ``httpx.AsyncBaseTransport`` to use (proxies, tests).

    Raises:
        ValueError: ``sleep_level`` not 1 or 2, a timeout not > 0, a
            ``base_url`` without ``http(s)://``, or an empty ``draft_prefix``.
    """

    #: Which engine this is (:class:`~aiosync.capabilities.KindReporting`): the factory
    #: picks the transport by it.
    engine_kind: EngineKind = "vllm"

    #: ``generate()`` without ``params`` starts from these: 16 tokens, past any
    #: EOS (``generate_with_meta`` has no defaults and stops at EOS, as every engine).
    generate_defaults: ClassVar[SamplingParams | None] = SamplingParams(
        max_tokens=16, ignore_eos=True
    )

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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(rpc_timeout_s, connect=_CONNECT_TIMEOUT_S),
            transport=transport,
        )
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
                timeout=_httpx_timeout(limit),
            )
        try:
            _raise_for_status(response, where, path, "Authorization" in self._client.headers)
        except TransportError as exc:
            if _http_status(exc) == 404 and path in OPTIONAL_ROUTES:
                raise RouteMissingError(self.base_url, path, OPTIONAL_ROUTES[path]) from exc
            raise
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

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
                status = _http_status(exc)
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
            status = _http_status(exc)
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

    # -- the in-flight policy ----------------------------------------------------------

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        """Stop generation for a sync: ``POST /pause?mode=...``, then drop the prefix cache.

        New :meth:`generate_with_meta` calls of this backend wait (up to their
        ``timeout_s``) until :meth:`resume_generation`; the server queues every
        client's new requests. Running requests:

        * ``"abort"``: end now with their tokens (finish reason ``"abort"``);
          returns once this backend's running calls have their last chunk.
          Where the server has ``/abort_requests`` (vLLM 0.32.0, 0.34.0): ``POST
          /pause?mode=keep``, then ``POST /abort_requests {}``. The scheduler stops
          first, then every request the server holds ends (any client's, and any
          that arrived between the two calls); requests sent after that are
          queued until the resume, on every release. (``/pause?mode=abort`` also
          pauses, but vLLM 0.34 answers requests sent during that pause with 503
          ``RetryableRequestError``; a sync should delay the other clients'
          rollouts, not fail them.) Without ``/abort_requests``, or when the
          server publishes no ``/openapi.json``: ``POST /pause?mode=abort``.
        * ``"wait"``: the server answers once they finished on the old weights;
          returns once this backend's calls have their last chunk.
        * ``"keep"``: frozen between two tokens; they continue after the resume,
          their remaining tokens computed by the weights the server then holds.

        ``clear_cache``: the prefix cache is reset explicitly with
        ``POST /reset_prefix_cache`` once the pause is complete (for ``"keep"``
        with ``reset_running_requests=true``: the frozen requests give up their
        KV blocks and recompute them with the new weights on resume). The
        route's own ``clear_cache`` query is deprecated and ignored with
        ``mode=keep`` (``vllm/entrypoints/rl/online/api_router.py``, 0.32), so
        it is always sent ``false`` and never relied on.

        Raises:
            ValueError: an unknown ``mode`` (before any request).
            TransportError: the server failed the pause or refused to drop its
                prefix cache; generation is resumed before it is raised.
            SyncTimeoutError: not done within ``rpc_timeout_s``; generation is
                resumed before it is raised.
        """
        if mode not in IN_FLIGHT_POLICIES:
            raise ValueError(f"unknown in-flight mode {mode!r}; known: {list(IN_FLIGHT_POLICIES)}")
        abort_route = mode == "abort" and await self._serves("/abort_requests") is True
        self._gate.pause()
        self._committed_in_pause = None
        try:
            with anyio.fail_after(self.rpc_timeout_s):
                if abort_route:
                    # Frozen first, so that nothing is computed between the two calls;
                    # then everything the server holds ends with finish reason "abort".
                    await self._request(
                        "POST", "/pause", params={"mode": "keep", "clear_cache": False}
                    )
                    await self._request("POST", "/abort_requests", body={})
                else:
                    await self._request(
                        "POST", "/pause", params={"mode": mode, "clear_cache": False}
                    )
                if mode != "keep":
                    await self._gate.drained()
                if clear_cache:
                    await self._reset_prefix_cache(preempt=mode == "keep")
        except BaseException as exc:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.rpc_timeout_s):
                try:
                    await self.resume_generation()
                except SyncError as resume_exc:  # secondary: the pause's error has the traceback
                    _log.error(
                        "resuming %s after a failed pause: %s: %s",
                        self.base_url,
                        type(resume_exc).__name__,
                        resume_exc,
                    )
            if isinstance(exc, TimeoutError) and not isinstance(exc, SyncError):
                raise SyncTimeoutError(
                    f"pause_generation({mode!r}) of {self.base_url} did not complete within "
                    f"{self.rpc_timeout_s} s"
                ) from exc
            raise

    async def resume_generation(self) -> None:
        """``POST /resume``: the server schedules again (frozen ``"keep"`` requests
        continue) and this backend's held calls run. Idempotent.

        Raises:
            TransportError, SyncTimeoutError: the server failed the resume (held
                calls are let through all the same).
        """
        if self._committed_in_pause is not None:
            # From here the server computes with the committed weights.
            self._set_computing(self._committed_in_pause)
            self._committed_in_pause = None
        self._gate.resume()
        await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        """``GET /is_paused``: whether the server's scheduler is paused (by any client).

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        answer = await self._request("GET", "/is_paused")
        if not isinstance(answer, dict) or not isinstance(answer.get("is_paused"), bool):
            raise TransportError(f"/is_paused answered {str(answer)[:200]}")
        return answer["is_paused"]

    @property
    def generation_paused(self) -> bool:
        """True between this backend's :meth:`pause_generation` and :meth:`resume_generation`."""
        return self._gate.paused

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """``POST /reset_prefix_cache``: drop the server's prefix cache; whether it did.

        Args:
            reset_running_requests: preempt running (or frozen) requests first,
                so that their KV blocks go too (they recompute them).

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        answer = await self._request(
            "POST",
            "/reset_prefix_cache",
            params={"reset_running_requests": reset_running_requests},
        )
        if not isinstance(answer, dict) or not isinstance(answer.get("success"), bool):
            raise TransportError(f"/reset_prefix_cache answered {str(answer)[:200]}")
        return answer["success"]

    async def _reset_prefix_cache(self, *, preempt: bool) -> None:
        if not preempt and await self.reset_prefix_cache():
            return
        # Requests hold KV blocks computed with the previous weights: preempt them.
        if not await self.reset_prefix_cache(reset_running_requests=True):
            raise TransportError(
                f"the vLLM server at {self.base_url} refused to reset its prefix cache "
                "even with the running requests preempted: KV computed with the previous "
                "weights would be reused"
            )

    # -- versions ----------------------------------------------------------------------

    async def on_weights_committed(self, version: int) -> None:
        """``POST /update_weight_version`` with ``str(version)``: ``/weight_info`` reports
        it from now on, and tokens this backend receives once the server computes
        with the new weights (after the resume, when the sync paused it) are
        labelled ``version``.

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        await self._request("POST", "/update_weight_version", body={"new_version": str(version)})
        if self._gate.paused:
            self._committed_in_pause = version
        else:
            self._set_computing(version)
        if self.record_checksums:
            await self._record_checksums(version)

    # -- the server's own weight checksums: /weight_checker ------------------------------

    async def weight_checksums(self) -> dict[str, str]:
        """``POST /weight_checker {"action": "checksum"}``: the SHA-256 (hex) of every
        parameter of every worker, as the server holds it now.

        Keys are ``"dp{d}:pp{p}:pcp{c}:tp{t}:{name}"``: the worker's data-, pipeline-,
        context- and tensor-parallel ranks, and vLLM's own parameter name
        (``model.layers.0.self_attn.qkv_proj.weight``: fused, sharded, after
        vLLM's post-processing; a tensor subclass's inner tensors as
        ``{name}.{attr}``). vLLM hashes each parameter's bytes in its dtype
        (``vllm/model_executor/model_loader/weight_checksum.py``), copied to host
        memory: the whole model, on every call.

        Raises:
            RouteMissingError: the server has no ``/weight_checker`` (before the request).
            TransportError, SyncTimeoutError: the request failed, or the answer is not
                ``{"checksums": {str: str}}``.
        """
        await self._require_route("/weight_checker")
        answer = await self._request(
            "POST", "/weight_checker", body={"action": "checksum"}, fresh_connection=True
        )
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if not isinstance(sums, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in sums.items()
        ):
            raise TransportError(f"/weight_checker answered {str(answer)[:200]}")
        return dict(sums)

    async def _record_checksums(self, version: int) -> None:
        """Keep ``/weight_checker``'s checksums as those of ``version``; a server without
        the route records nothing (warned once)."""
        self._checksums = None
        try:
            sums = await self.weight_checksums()
        except RouteMissingError as exc:
            if not self._warned_no_checker:
                self._warned_no_checker = True
                _log.warning("record_checksums: %s; no checksums are recorded", exc)
            return
        self._checksums = RecordedChecksums(version, sums)

    async def verify_recorded_checksums(self) -> int | None:
        """Compare ``/weight_checker``'s checksums now with those recorded at the last
        commit (``record_checksums=True``); :class:`~aiosync.capabilities.ChecksumVerifying`.

        This says which of the server's parameters changed since the commit (each
        named with its worker's ranks), not that the commit held the trainer's
        tensors: the server's parameters are fused, sharded and post-processed, so
        the trainer cannot recompute their hashes (the workers' read-back of
        ``verify_engine()`` compares those with the trainer's).

        Returns:
            How many parameters (summed over workers) matched; None: nothing
            recorded (``record_checksums=False``, no commit yet, or no
            ``/weight_checker`` on the server).

        Raises:
            RefitVerificationError: a parameter's checksum differs, is gone or is new
                (up to five named, and how many in all).
            TransportError, SyncTimeoutError: the request failed.
        """
        if self._checksums is None:
            return None
        now = await self.weight_checksums()
        return self._checksums.compare(
            now, f"the vLLM server at {self.base_url}", "/weight_checker checksums"
        )

    async def weight_version(self) -> int | None:
        """``GET /weight_info``: the server's weight-version label as an int; None:
        vLLM's ``"default"`` before any sync labelled it.

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        answer = await self._request("GET", "/weight_info")
        if not isinstance(answer, dict) or "weight_version" not in answer:
            raise TransportError(f"/weight_info answered {str(answer)[:200]}")
        return parse_version(answer["weight_version"])

    def _set_computing(self, version: int) -> None:
        self._computing = version
        self._version_epoch += 1

    # -- waking and sleeping -----------------------------------------------------------

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the server discards its weights (``sleep_level=2``)."""
        self._discard_listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener` (no error if absent)."""
        if listener in self._discard_listeners:
            self._discard_listeners.remove(listener)

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake the server (``POST /wake_up?tags=...``; None: all) if this backend put it
        to sleep; waking the KV cache (``"kv_cache"`` or None) also drops the prefix
        cache, so no KV computed with the previous weights is reused after a refit.

        Raises:
            ValueError: an unknown tag.
            TransportError, SyncTimeoutError: the server failed, or refused to drop
                its prefix cache even with the running requests preempted.
        """
        wake = None if tags is None else list(tags)
        if wake is not None:
            unknown = sorted(set(wake) - _WAKE_TAGS)
            if unknown:
                raise ValueError(f"unknown wake-up tags {unknown}; known: {sorted(_WAKE_TAGS)}")
        if self._asleep:
            await self._request("POST", "/wake_up", params={"tags": wake or []})
            if wake is None or "kv_cache" in wake:
                self._asleep = False
        if wake is None or "kv_cache" in wake:
            await self._reset_prefix_cache(preempt=False)

    async def finish_generation(self) -> None:
        """``POST /sleep?level=sleep_level`` so the trainer gets the device memory back.

        A no-op, logged once, where the server has no sleep mode (started without
        ``--enable-sleep-mode``, or vLLM's CPU build). Level 2 discards the weights:
        the listeners are told before this returns.

        Raises:
            TransportError, SyncTimeoutError: the server failed.
        """
        if not await self.sleep_mode():
            if not self._warned_no_sleep:
                self._warned_no_sleep = True
                _log.warning(
                    "the vLLM server at %s has no sleep mode (--enable-sleep-mode, CUDA/ROCm/"
                    "XPU only): finish_generation() releases no memory",
                    self.base_url,
                )
            return
        if self._asleep:
            return
        try:
            await self._request("POST", "/sleep", params={"level": self.sleep_level})
        finally:
            # A failed sleep may have released part of it: assume it did.
            self._asleep = True
            if self.sleep_level >= 2:
                self._checksums = None  # the weights are gone: nothing to compare with
                for listener in list(self._discard_listeners):
                    listener()

    async def is_sleeping(self) -> bool:
        """``GET /is_sleeping``.

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        answer = await self._request("GET", "/is_sleeping")
        if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
            raise TransportError(f"/is_sleeping answered {str(answer)[:200]}")
        return answer["is_sleeping"]

    # -- generation ------------------------------------------------------------------

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        **keywords: Any,
    ) -> list[Generation]:
        """Generate from token-id prompts through ``POST /v1/completions``: one
        :class:`aiosync.Generation` per prompt, in prompt order, the new ids only.

        One streamed request for all prompts (``prompt`` a list of id lists,
        ``return_token_ids``, ``stream``; ``logprobs=0`` when asked: the sampled
        token's log-probability in the server's ``--logprobs-mode``, by default
        the raw logits' ``log_softmax``, :class:`aiosync.Generation`'s
        convention). ``finish_reason`` is vLLM's (``"stop"``, ``"length"``,
        ``"abort"``; ``aborted`` for the latter).

        Versions: the completions API carries no weight-version label, so each
        token is labelled with the version the server computed with when it
        arrived: the server's ``/weight_info`` label when the call was admitted,
        then each version this backend committed (:meth:`on_weights_committed`)
        from the resume of the sync that committed it on. A request kept across
        a ``"keep"`` sync thus reports ``version_change_at`` at its first token
        computed by the new weights. (Exact as long as a chunk the server
        computed before a pause does not reach this client after the sync that
        followed: vLLM's ``/pause`` returns once the outputs computed before it
        were handed to their streams. Versions committed by another client of
        the server are seen at the next call only.)

        Args:
            prompts: one list of token ids per prompt (non-empty).
            params: how to sample (:class:`aiosync.SamplingParams`), or its fields
                as keywords (``max_new_tokens=``, ``temperature=``, ``top_p=``,
                ``seed=``, ``ignore_eos=``, ``logprobs=``).
            timeout_s: how long to wait for a pause of this backend to end
                before generating, seconds (None: ``rpc_timeout_s``). The
                generation itself is bounded by ``generate_timeout_s``.

        Raises:
            ValueError, TypeError: bad sampling parameters or an empty prompt
                (before any request).
            SyncTimeoutError: still paused after ``timeout_s``, or no complete
                answer within ``generate_timeout_s``.
            SyncError: a worker holds half-updated weights (a refit failed
                part-way): refit before generating.
            TransportError: the server failed, is unreachable, or answered
                something else than the request asked for.
        """
        sampling = sampling_params(params, keywords)
        token_prompts = [list(p) for p in prompts]
        if any(not p for p in token_prompts):
            raise ValueError("every prompt needs at least one token id")
        if not token_prompts:
            return []
        wait_s = self.rpc_timeout_s if timeout_s is None else timeout_s
        async with self._gate.shared(wait_s):
            statuses = await self.collective_rpc("aiosync_vllm_status")
            invalid = [s.get("rank") for s in statuses if not s.get("weights_valid", True)]
            if invalid:
                raise SyncError(
                    f"vLLM worker(s) {invalid} of {self.base_url} hold partially updated "
                    "weights; sync before generating"
                )
            admitted = await self.weight_version()
            choices = await self._stream_completions(token_prompts, sampling, admitted)
        return [_generation(c, sampling.logprobs) for c in choices]

    async def _stream_completions(
        self, prompts: list[list[int]], sampling: SamplingParams, admitted: int | None
    ) -> list[_Choice]:
        body: dict[str, Any] = {
            "prompt": prompts,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "ignore_eos": sampling.ignore_eos,
            "return_token_ids": True,
            "stream": True,
        }
        if self.model is not None:
            body["model"] = self.model
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.logprobs:
            body["logprobs"] = 0
        choices = [_Choice() for _ in prompts]
        started = [False] * len(prompts)
        epoch = self._version_epoch
        check_request(ROUTES, "POST", "/v1/completions", body)
        where = f"POST {self.base_url}/v1/completions"
        limit = self.generate_timeout_s

        def version_now() -> int | None:
            return admitted if self._version_epoch == epoch else self._computing

        errors: ExceptionMapping = {
            TimeoutError: lambda _: SyncTimeoutError(
                f"{where}: no complete answer within {limit} s"
            ),
            **http_errors(where, lambda _: f"{where}: no complete answer within {limit} s"),
        }
        try:
            with map_exceptions(errors), anyio.fail_after(limit if math.isfinite(limit) else None):
                async with self._client.stream(
                    "POST", "/v1/completions", json=body, timeout=_httpx_timeout(limit)
                ) as response:
                    if not response.is_success:
                        await response.aread()
                    _raise_for_status(
                        response, where, "/v1/completions", "Authorization" in self._client.headers
                    )
                    async for chunk in _server_sent_events(response, where):
                        for entry in chunk.get("choices") or []:
                            index = _choice_index(entry, len(prompts), where)
                            self._add_tokens(choices[index], entry, version_now(), where)
                            if not started[index] and choices[index].token_ids:
                                started[index] = True
                                self._gate.streaming += 1
                            if entry.get("finish_reason") is not None and started[index]:
                                started[index] = False
                                self._gate.streaming -= 1
                                self._gate.notify()
        finally:
            left = sum(started)
            if left:
                self._gate.streaming -= left
                self._gate.notify()
        unfinished = [i for i, c in enumerate(choices) if c.finish_reason is None]
        if unfinished:
            raise TransportError(
                f"{where}: the stream ended without finishing prompts {unfinished}"
            )
        return choices

    def _add_tokens(
        self, choice: _Choice, entry: Mapping[str, Any], version: int | None, where: str
    ) -> None:
        """Append one streamed chunk of one prompt (``token_ids``, ``logprobs.token_logprobs``)."""
        ids = entry.get("token_ids") or []
        if not isinstance(ids, list):
            raise TransportError(f"{where}: token_ids {str(ids)[:80]} is not a list")
        logprobs = entry.get("logprobs")
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if values is not None and len(values) != len(ids):
            raise TransportError(
                f"{where}: {len(values)} token_logprobs for {len(ids)} token ids in one chunk"
            )
        choice.token_ids.extend(int(t) for t in ids)
        choice.logprobs.extend(values if values is not None else [None] * len(ids))
        choice.versions.extend([version] * len(ids))
        self._streamed_tokens += len(ids)
        if entry.get("finish_reason") is not None:
            choice.finish_reason = str(entry["finish_reason"])

    # -- checks before a refit -------------------------------------------------------

    async def expected_manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """``{hf_name: (shape, torch.dtype)}`` of the checkpoint the server loaded, or None.

        Read by worker 0 from the safetensors headers of the server's local
        checkpoint folder (``aiosync_vllm_checkpoint_manifest``), in the server's
        dtype; None when the model is not a local, unquantized safetensors folder.

        Raises:
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        from aiosync.transports.packing import dtype_from_name

        reply = (await self.collective_rpc("aiosync_vllm_checkpoint_manifest"))[0]
        if reply["manifest"] is None:
            _log.debug("no checkpoint manifest for %s: %s", self.base_url, reply["reason"])
            return None
        # The draft's tensors (in the same checkpoint: Qwen3-Next's mtp.*) are never
        # loaded by aiosync's transfers into vLLM (select_draft_refit).
        draft = self._draft_prefix
        return {
            name: (tuple(int(d) for d in shape), dtype_from_name(dtype))
            for name, shape, dtype in reply["manifest"]
            if draft is None or not name.startswith(draft)
        }

    # -- the speculative draft model (DraftHolding) ------------------------------------

    @property
    def draft_prefix(self) -> str | None:
        """The prefix of the draft model's checkpoint names (``"mtp."``); None: no draft."""
        return self._draft_prefix

    def select_draft_refit(self, mode: DraftRefit) -> None:
        """``"frozen"``: later syncs load the target model alone, and
        :meth:`expected_manifest` leaves the draft's names out (what it does whenever
        ``draft_prefix`` is set, so nothing changes). ``"with_target"`` is refused.

        Why it is refused: aiosync's transports load every tensor through the worker
        extension into the target model (``model_runner.get_model()``); vLLM's draft
        model (``get_draft_model()``) is loaded only in vLLM's own weight-transfer
        session, ``POST /start_draft_weight_update`` then ``/update_weights`` and
        ``/finish_weight_update`` (vLLM 0.32.0 and 0.34.0; refused by the server
        unless its ``--weight-transfer-config`` backend supports draft updates and a
        speculative draft model is configured), whose NCCL and IPC backends need
        CUDA and which no aiosync synchronizer drives for a draft yet
        (:meth:`start_draft_weight_update` is the route, for a caller that does).

        Raises:
            ValueError: an unknown ``mode``.
            UnsupportedOptionError: ``"with_target"`` (without a ``draft_prefix``:
                no draft to refit, named so).
        """
        if mode not in DRAFT_REFITS:
            raise ValueError(
                f"draft must be one of {', '.join(map(repr, DRAFT_REFITS))}, got {mode!r}"
            )
        if mode == "with_target" and self._draft_prefix is None:
            raise UnsupportedOptionError(
                f"draft='with_target': VLLMServerBackend({self.base_url}) holds no draft "
                "model (no draft_prefix)"
            )
        if mode == "with_target":
            raise UnsupportedOptionError(
                f"draft='with_target': the vLLM server at {self.base_url} loads aiosync's "
                "transfers into its target model only; its draft model is refit only by "
                "vLLM's own weight-transfer session (POST /start_draft_weight_update, with "
                "a --weight-transfer-config backend that supports draft updates: NCCL or "
                "IPC, CUDA), which aiosync does not drive yet: pass draft='frozen' (the "
                "draft keeps its weights) or leave draft unset (docs/draft.md)"
            )

    # -- vLLM's own weight-transfer routes ---------------------------------------------

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """``POST /init_weight_transfer_engine {"init_info": ...}``: phase 1 of vLLM's own
        weight transfer (the server needs ``--weight-transfer-config``; its NCCL and
        IPC backends need CUDA). Phases 2-4 are :meth:`start_weight_update`,
        :meth:`update_weights`, :meth:`finish_weight_update`.

        Raises:
            TransportError, SyncTimeoutError: the server refused (its message) or failed.
        """
        await self._request(
            "POST",
            "/init_weight_transfer_engine",
            body={"init_info": dict(init_info)},
            fresh_connection=True,
        )

    async def start_weight_update(self) -> None:
        """``POST /start_weight_update``: the workers open vLLM's layerwise reload.

        Raises:
            TransportError, SyncTimeoutError: the server refused or failed.
        """
        await self._request("POST", "/start_weight_update", fresh_connection=True)

    async def start_draft_weight_update(self) -> None:
        """``POST /start_draft_weight_update``: as :meth:`start_weight_update`, the
        session's :meth:`update_weights` loading into the speculative draft model
        (vLLM 0.32.0, 0.34.0: ``set_weight_update_target(draft_model, ...)``); then
        :meth:`finish_weight_update`.

        Raises:
            TransportError: the server refused (its transfer backend cannot update a
                draft, no draft model is configured, a session is open) or failed.
            SyncTimeoutError: no answer within ``rpc_timeout_s``.
        """
        await self._request("POST", "/start_draft_weight_update", fresh_connection=True)

    async def update_weights(self, update_info: Mapping[str, Any]) -> None:
        """``POST /update_weights {"update_info": ...}``: names, dtypes and shapes of the
        tensors the trainer sends next through vLLM's transfer backend.

        Raises:
            TransportError, SyncTimeoutError: the server refused or failed.
        """
        await self._request(
            "POST",
            "/update_weights",
            body={"update_info": dict(update_info)},
            fresh_connection=True,
        )

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update {"weight_version": ...}``: the workers finish the
        reload (``process_weights_after_loading``) and the server takes the label.

        Raises:
            TransportError, SyncTimeoutError: the server refused or failed.
        """
        await self._request(
            "POST",
            "/finish_weight_update",
            body={"weight_version": weight_version},
            fresh_connection=True,
        )

    async def shutdown_weight_transfer_engine(self) -> None:
        """``POST /shutdown_weight_transfer_engine``: the workers leave the transfer group.

        Raises:
            RouteMissingError: the server has no such route (vLLM after 0.34).
            TransportError, SyncTimeoutError: the server refused or failed.
        """
        await self._require_route("/shutdown_weight_transfer_engine")
        await self._request("POST", "/shutdown_weight_transfer_engine", fresh_connection=True)

    # -- lifetime --------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the HTTP connection pool (the server keeps running). Idempotent."""
        await self._client.aclose()

    async def shutdown(self) -> None:
        """As :meth:`aclose`: the server is not this backend's to stop."""
        await self.aclose()

    async def __aenter__(self) -> VLLMServerBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _generation(choice: _Choice, logprobs: bool) -> Generation:
    """A :class:`~aiosync.Generation` from one prompt's streamed answer.

    Raises:
        TransportError: asked for logprobs and the server answered none for a token.
    """
    from aiosync.generation import version_span

    values: list[float] | None = None
    if logprobs:
        if any(v is None for v in choice.logprobs):
            raise TransportError("the vLLM server answered no logprob for a sampled token")
        values = [float(v) for v in choice.logprobs if v is not None]
    first, last, change = version_span(choice.versions)
    return Generation(
        token_ids=list(choice.token_ids),
        logprobs=values,
        first_version=first,
        last_version=last,
        version_change_at=change,
        aborted=choice.finish_reason == "abort",
        finish_reason=choice.finish_reason,
    )


async def _server_sent_events(
    response: httpx.Response, where: str
) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a ``text/event-stream`` answer, up to ``data: [DONE]``.

    Raises:
        TransportError: a chunk that is not a JSON object, or an ``error`` chunk
            (the server's message quoted).
    """
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except ValueError as exc:
            raise TransportError(f"{where}: a chunk is not JSON: {payload[:200]}") from exc
        if not isinstance(chunk, dict):
            raise TransportError(f"{where}: a chunk is not an object: {payload[:200]}")
        if "error" in chunk:
            raise TransportError(f"{where}: {_message_of(chunk)}")
        yield chunk


def _choice_index(entry: Any, count: int, where: str) -> int:
    index = entry.get("index") if isinstance(entry, dict) else None
    if not isinstance(index, int) or not 0 <= index < count:
        raise TransportError(f"{where}: a choice with index {index!r} for {count} prompts")
    return index


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


def _http_status(exc: TransportError) -> int | None:
    status = vars(exc).get("http_status")
    return status if isinstance(status, int) else None


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


def _httpx_timeout(limit: float) -> httpx.Timeout:
    if not math.isfinite(limit):
        return httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S)
    return httpx.Timeout(limit, connect=min(limit, _CONNECT_TIMEOUT_S))


if TYPE_CHECKING:
    # mypy checks the capabilities this backend claims (aiosync.capabilities).
    def _claims(
        b: VLLMServerBackend,
    ) -> tuple[
        Engine,
        PausableEngine,
        VersionedEngine,
        DiscardNotifier,
        EngineWorkers,
        Generating,
        ManifestReporting,
        HealthReporting,
        ChecksumVerifying,
        DraftHolding,
    ]:
        return (b, b, b, b, b, b, b, b, b, b)
