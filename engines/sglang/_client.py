"""SGLang's native HTTP API as typed calls: one ``httpx`` client, SGLang's errors as aiosync's.

The endpoints a refit makes (``/get_server_info``, ``/begin_weight_update``,
``/update_weights_from_tensor``, ``/end_weight_update``, ``/flush_cache``,
``/update_weight_version``, ``/model_info`` (the label), ``/get_weights_by_name`` (the
``verify`` read-back), ``/weights_checker`` (``verify_engine()``'s checksums); disaggregated:
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``) live here;
the engine's behaviour (memory saver, validity, generation) lives in
:mod:`.backend`. Endpoint bodies and answers: ``docs/sglang.md``; the contracts as
read in SGLang's sources (version, paths): ``docs/sglang-contract.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import httpx

from aiosync.errors import SyncTimeoutError, TransportError, map_exceptions

from .._http import answer_body, http_client, http_errors, http_status, request_timeout
from .._routes import Route, check_request

__all__ = [
    "DEFAULT_FLUSH_TIMEOUT_S",
    "FLUSH_BACKOFF_INITIAL_S",
    "FLUSH_BACKOFF_MAX_S",
    "ROUTES",
    "SESSION_SELECTOR",
    "SGLangClient",
    "http_status",
]

#: Total time ``flush_cache`` keeps retrying a busy server, seconds.
DEFAULT_FLUSH_TIMEOUT_S: float = 60.0
#: First wait between ``/flush_cache`` attempts, seconds; doubles each retry.
FLUSH_BACKOFF_INITIAL_S: float = 0.05
#: Longest wait between ``/flush_cache`` attempts, seconds.
FLUSH_BACKOFF_MAX_S: float = 2.0
#: The ``selector`` of the weight-update session (SGLang 0.5.23's
#: ``BeginWeightUpdateReqInput``: ``"target" | "draft" | "all"``, its only field):
#: ``"all"``, as the ``selector`` every ``update_weights_from_*`` loads with (SGLang's
#: default), so ``/end_weight_update`` finalizes every runner (the target model and a
#: speculative draft model) the updates loaded. :attr:`SGLangClient.selector` replaces
#: it for a client whose draft is frozen (``"target"``, ``docs/draft.md``).
SESSION_SELECTOR = "all"


def _route(method: str, *body: str) -> Route:
    return Route(method, frozenset(body))


#: Every route this client (and :class:`~aiosync.SGLangHTTPBackend`, its LoRA
#: adapters, the disaggregated synchronizer through it) calls: the method and the
#: body fields it sends, each a field of the route's request class in SGLang 0.5.23's
#: ``io_struct.py``. :meth:`SGLangClient._request` refuses anything else;
#: ``tests/contracts/`` checks the table against the released wheel's sources.
ROUTES: dict[str, Route] = {
    "/health": _route("GET"),
    "/get_server_info": _route("GET"),
    "/model_info": _route("GET"),
    "/v1/loads": _route("GET"),
    "/generate": _route("POST", "input_ids", "sampling_params", "return_logprob", "lora_path"),
    "/pause_generation": _route("POST", "mode"),
    "/continue_generation": _route("POST"),
    "/flush_cache": _route("POST"),
    "/begin_weight_update": _route("POST", "selector"),
    "/end_weight_update": _route("POST"),
    "/update_weights_from_tensor": _route(
        "POST",
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "selector",
    ),
    "/init_weights_update_group": _route(
        "POST",
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    ),
    "/update_weights_from_distributed": _route(
        "POST",
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "selector",
    ),
    "/destroy_weights_update_group": _route("POST", "group_name"),
    "/update_weight_version": _route("POST", "new_version", "abort_all_requests"),
    "/get_weights_by_name": _route("POST", "name", "truncate_size"),
    "/weights_checker": _route("POST", "action", "selector", "skip_tensor_list"),
    "/release_memory_occupation": _route("POST", "tags"),
    "/resume_memory_occupation": _route("POST", "tags"),
    "/load_lora_adapter": _route("POST", "lora_name", "lora_path", "pinned"),
    "/unload_lora_adapter": _route("POST", "lora_name"),
}


class SGLangClient:
    """The HTTP side of an SGLang server: requests, their limits and error translation.

    Every request error is translated here, once: no answer within the limit is
    a :class:`~aiosync.SyncTimeoutError`; a connection error, a non-2xx answer
    (the server's own message quoted) or a 401 (the API key named) is a
    :class:`~aiosync.TransportError`.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:30000"``.
        api_key: the server's ``--api-key``; sent as ``Authorization: Bearer``.
        tp_size: entries per ``update_weights_from_tensor`` call; None: unknown.
        request_timeout_s: limit for one request other than ``/generate``, seconds.
        flush_timeout_s: how long :meth:`flush_cache` retries a busy server, seconds.
        transport: an ``httpx.AsyncBaseTransport`` to use (tests, proxies).

    Raises:
        ValueError: a timeout not > 0, or ``tp_size < 1``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        tp_size: int | None,
        request_timeout_s: float,
        flush_timeout_s: float,
        transport: httpx.AsyncBaseTransport | None,
    ) -> None:
        for label, value in (
            ("request_timeout_s", request_timeout_s),
            ("flush_timeout_s", flush_timeout_s),
        ):
            if value <= 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        if tp_size is not None and tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.base_url = base_url.rstrip("/")
        self.tp_size = tp_size
        self.request_timeout_s = request_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self._client = http_client(self.base_url, api_key, request_timeout_s, transport)
        # The weight-version label this client last set on the server (None: none yet).
        self._version_label: str | None = None
        # How many times this client set a label (a commit of a sync): a request
        # whose answer comes after a change lived through a refit.
        self._label_epoch = 0
        # Whether the server has SGLang's weight-update session routes: None until
        # the first begin_weight_update() asked (a 404 there means an older server).
        self._session_routes: bool | None = None
        # A session this client opened and has not ended yet.
        self._session_open = False
        #: The runners this client's weight updates load (SGLang 0.5.23's ``selector``:
        #: ``"all"``, the target and a speculative draft model; ``"target"``, the
        #: target alone, the draft frozen). Sent with ``/begin_weight_update`` and,
        #: when not SGLang's default ``"all"``, with every ``update_weights_from_*``.
        self.selector: str = SESSION_SELECTOR

    # -- the calls a refit makes ----------------------------------------------------

    async def server_info(self) -> dict[str, Any]:
        """``/get_server_info``: the server's arguments and state.

        Raises:
            TransportError: the request failed, or the answer is not an object.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        info = await self._request("GET", "/get_server_info")
        if not isinstance(info, dict):
            raise TransportError(f"/get_server_info answered {str(info)[:200]}")
        return info

    async def resolve_tp_size(self) -> int:
        """``tp_size`` as given, or as the server reports it (cached).

        Raises:
            TransportError: the server reports no valid ``tp_size``, or the request failed.
        """
        if self.tp_size is None:
            info = await self.server_info()
            tp = info.get("tp_size", 1)
            if not isinstance(tp, int) or tp < 1:
                raise TransportError(f"/get_server_info reports tp_size={tp!r}")
            self.tp_size = tp
        return self.tp_size

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None,
        flush_cache: bool = False,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> str:
        """POST ``/update_weights_from_tensor`` (not retried: not idempotent); returns the message.

        ``flush_cache=True`` makes SGLang *assert* the flush inside the update
        and crash its scheduler when requests are running, so the synchronizer
        always sends False and flushes with :meth:`flush_cache` afterwards.

        Raises:
            TransportError: non-2xx, ``success: false``, or a connection error.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if self.selector != SESSION_SELECTOR:
            body["selector"] = self.selector
        answer = await self._post("/update_weights_from_tensor", body)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise TransportError(f"/update_weights_from_tensor failed: {answer.get('message')}")
        if weight_version is not None:
            self._version_label = weight_version
            self._label_epoch += 1
        return str(answer.get("message", "")) if isinstance(answer, dict) else ""

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any] | None:
        """POST ``/get_weights_by_name`` (SGLang's ``GetWeightsByNameReqInput``): what the
        server holds of checkpoint tensor ``name``.

        SGLang answers ``param.cpu().to(torch.float32).numpy().tolist()[:truncate_size]``
        of its TP rank 0: the first ``truncate_size`` entries of the FIRST dimension
        (rows of a matrix, elements of a vector), float32 values as JSON numbers (NaN
        and infinities as ``null``); ``q_proj``/``k_proj``/``v_proj`` and
        ``gate_proj``/``up_proj`` are its rows of the fused ``qkv_proj``/``gate_up_proj``;
        with ``dp_size > 1`` one such list per DP rank. A read for tests and checks,
        not a fast path (``docs/sglang-contract.md``).

        Args:
            name: HF checkpoint name, e.g. ``"model.embed_tokens.weight"``.
            truncate_size: rows (first-dimension entries) to return; the tensor's
                ``numel()`` returns all of them.

        Returns:
            The nested lists; None when the server cannot read the tensor: 400
            (SGLang's ``"Get parameter by name failed"``: no such parameter, or a model
            class without ``get_weights_by_name``, as Qwen3's) or 404 (a server, or a
            router in front of it, without the route).

        Raises:
            TransportError: another non-2xx answer, a connection error, or an answer
                that is not a list.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        body = {"name": name, "truncate_size": truncate_size}
        try:
            answer = await self._post("/get_weights_by_name", body)
        except TransportError as exc:
            if http_status(exc) in (400, 404):
                return None
            raise
        if not isinstance(answer, list):
            raise TransportError(f"/get_weights_by_name {name!r} answered {str(answer)[:200]}")
        return answer

    async def check_weights(
        self,
        action: str,
        *,
        skip_tensor_list: Sequence[str] | None = None,
        timeout_s: float | None = None,
        selector: str = "target",
    ) -> dict[str, Any] | None:
        """POST ``/weights_checker`` (SGLang 0.5.23's ``CheckWeightsReqInput``; ``selector``
        ``"target"`` by default, ``"draft"`` or ``"all"`` for a speculative draft model's
        tensors, keyed ``"draft." + name``): ``action`` is ``"checksum"`` (every TP rank
        hashes each of its tensors: SGLang's parameter names, fused
        ``qkv_proj``/``gate_up_proj``; a GPU Triton hash on GPU), ``"snapshot"``,
        ``"compare"`` or ``"reset_tensors"``.

        Returns:
            The answer, ``{"success": bool, "message": str}`` plus, for ``checksum``,
            ``"ranks"`` (one ``{"checksums": {name: hex}, "per_gpu_checksum",
            "parallelism_info": [...]}`` per TP rank and DP rank) and
            ``"per_engine_checksum"``; a refusal (SGLang's 400: a failed compare names
            each differing tensor in ``message``) is returned with ``success`` false.
            None: the server has no ``/weights_checker`` (404: before SGLang 0.5.23).

        Raises:
            TransportError: another non-2xx answer, a connection error, or not an object.
            SyncTimeoutError: no answer within ``timeout_s`` (default ``request_timeout_s``).
        """
        body: dict[str, Any] = {"action": action, "selector": selector}
        if skip_tensor_list is not None:
            body["skip_tensor_list"] = list(skip_tensor_list)
        try:
            answer = await self._post("/weights_checker", body, timeout_s=timeout_s)
        except TransportError as exc:
            if http_status(exc) == 404:
                return None
            if http_status(exc) == 400:
                return {"success": False, "message": vars(exc).get("server_message", str(exc))}
            raise
        if not isinstance(answer, dict):
            raise TransportError(f"/weights_checker {action!r} answered {str(answer)[:200]}")
        return answer

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float | None = None,
    ) -> None:
        """POST ``/init_weights_update_group``: every TP rank ``r`` of the server joins
        the trainer's group as rank ``rank_offset + r`` (SGLang answers once all
        of them, the trainer included, joined: call it while the trainer joins).

        Raises:
            TransportError: non-2xx or ``success: false`` (the server's message).
            SyncTimeoutError: no answer within ``timeout_s`` (default ``request_timeout_s``).
        """
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        answer = await self._post("/init_weights_update_group", body, timeout_s=timeout_s)
        _check_success("/init_weights_update_group", answer)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        load_format: str | None,
        flush_cache: bool = False,
        abort_all_requests: bool = False,
    ) -> None:
        """POST ``/update_weights_from_distributed`` (not retried): every TP rank receives
        the trainer's broadcast of these tensors (``load_format="flattened_bucket"``:
        one uint8 broadcast of their bytes, back to back in ``names`` order) and
        loads them. ``dtypes`` are torch's names without ``torch.`` (``"bfloat16"``).
        ``flush_cache=False`` for the reason :meth:`update_weights_from_tensor` gives.

        Raises:
            TransportError: non-2xx or ``success: false`` (the server's message).
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(shape) for shape in shapes],
            "group_name": group_name,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if self.selector != SESSION_SELECTOR:
            body["selector"] = self.selector
        answer = await self._post("/update_weights_from_distributed", body)
        _check_success("/update_weights_from_distributed", answer)

    async def destroy_weights_update_group(
        self, group_name: str, timeout_s: float | None = None
    ) -> None:
        """POST ``/destroy_weights_update_group {group_name}``: the server's ranks leave it.

        Raises:
            TransportError: non-2xx or ``success: false`` (e.g. no such group).
            SyncTimeoutError: no answer within ``timeout_s``.
        """
        answer = await self._post(
            "/destroy_weights_update_group", {"group_name": group_name}, timeout_s=timeout_s
        )
        _check_success("/destroy_weights_update_group", answer)

    @property
    def weight_update_session(self) -> bool | None:
        """Whether the server has SGLang's weight-update session (``/begin_weight_update``,
        ``/end_weight_update``; SGLang PRs #28710, #28001): None until
        :meth:`begin_weight_update` first asked, False on an older server (404)."""
        return self._session_routes

    async def begin_weight_update(self) -> bool:
        """POST ``/begin_weight_update {"selector": ...}`` (:attr:`selector`, ``"all"`` unless
        the draft is frozen; the request's only field in SGLang 0.5.23): open the session every
        ``update_weights_from_*`` asserts.

        Returns:
            True when a session is now open; False on a server without the
            route (404, an SGLang before the session): learned once, never asked again.

        A server that says a session is already open (``{"success": false, "message":
        "a weight-update session is already open; ..."}``, 400) that this client did
        not open (a trainer that died inside one) gets ``/end_weight_update`` for
        that stale session first, then a new ``/begin_weight_update``.

        Raises:
            TransportError: the server refused (its message quoted), a connection
                error, or this client's own session is open (a concurrent sync).
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        if self._session_routes is False:
            return False
        if self._session_open:
            # Another sync through this client is inside its session: never end it.
            raise TransportError(
                f"POST {self.base_url}/begin_weight_update: this client's weight-update "
                "session is open (another sync through it is in flight)"
            )
        try:
            answer = await self._post("/begin_weight_update", {"selector": self.selector})
        except TransportError as exc:
            if self._session_routes is None and http_status(exc) == 404:
                self._session_routes = False
                return False
            if http_status(exc) != 400 or "already open" not in str(exc):
                raise
            await self._post("/end_weight_update", {})
            answer = await self._post("/begin_weight_update", {"selector": self.selector})
        self._session_routes = True
        _check_success("/begin_weight_update", answer)
        self._session_open = True
        return True

    async def end_weight_update(self) -> None:
        """POST ``/end_weight_update`` (body ``{}``) if this client opened a session: SGLang
        runs its loader's post-processing (quantization finalize, ``post_load_weights``
        when no ``load_weights`` ran) and closes it. Nothing when no session is open.

        Raises:
            TransportError: the server refused (its message quoted), or a connection error.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        if not self._session_open:
            return
        # Whatever the answer, the session is the server's to close now: never twice.
        self._session_open = False
        answer = await self._post("/end_weight_update", {})
        _check_success("/end_weight_update", answer)

    async def flush_cache(self, timeout_s: float | None = None) -> int:
        """POST ``/flush_cache`` until it answers 200; returns the attempts made.

        Retry policy: SGLang answers 400 while requests are running or waiting,
        so a non-2xx answer, a connection error or a per-request timeout is
        retried (flushing is idempotent) after 0.05 s, doubling to at most 2 s
        (:data:`FLUSH_BACKOFF_INITIAL_S`, :data:`FLUSH_BACKOFF_MAX_S`), for at
        most ``timeout_s`` (default ``flush_timeout_s``) seconds in total.

        Raises:
            TransportError: still failing after ``timeout_s``; names the last answer.
        """
        budget = self.flush_timeout_s if timeout_s is None else timeout_s
        delay = FLUSH_BACKOFF_INITIAL_S
        attempts = 0
        last = "no attempt"
        per_try = min(budget, self.request_timeout_s)
        with anyio.move_on_after(budget):
            while True:
                attempts += 1
                try:
                    await self._post("/flush_cache", None, timeout_s=per_try)
                    return attempts
                except (TransportError, SyncTimeoutError) as exc:
                    last = str(exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, FLUSH_BACKOFF_MAX_S)
        raise TransportError(
            f"/flush_cache did not succeed within {budget} s ({attempts} attempts); last: {last}"
        )

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = False
    ) -> None:
        """POST ``/update_weight_version``: the server reports ``new_version`` from now on
        (``/model_info``, ``meta_info.weight_version``); the weights are untouched.

        Args:
            new_version: the label, e.g. ``str(sync.weight_version)``.
            abort_all_requests: abort running requests first (SGLang's default is
                True; the synchronizer sends False: it flushed an idle cache already).

        Raises:
            TransportError: non-2xx, ``success: false``, or a connection error.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        answer = await self._post("/update_weight_version", body)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise TransportError(f"/update_weight_version failed: {answer.get('message')}")
        self._version_label = new_version
        self._label_epoch += 1

    async def check_health(self) -> None:
        """``GET /health``: return when the server answers 200
        (:class:`~aiosync.capabilities.HealthReporting`, for elastic fleets).

        Raises:
            TransportError: non-2xx or a connection error (a dead server).
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        await self._request("GET", "/health")

    async def get_weight_version(self) -> str | None:
        """``GET /model_info``'s ``weight_version``: the label of the last completed update
        (SGLang's ``"default"``, or its ``--weight-version``, before any). SGLang 0.5.23
        has no ``/get_weight_version``: the label is reported by ``/model_info``.

        Raises:
            TransportError: the request failed, or the answer has no ``weight_version``.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        answer = await self._request("GET", "/model_info")
        if not isinstance(answer, dict) or "weight_version" not in answer:
            raise TransportError(f"/model_info answered {str(answer)[:200]}")
        version = answer["weight_version"]
        return None if version is None else str(version)

    async def aclose(self) -> None:
        """Close the HTTP connection pool. Idempotent."""
        await self._client.aclose()

    # -- plumbing ---------------------------------------------------------------

    async def _post(self, path: str, body: Any, *, timeout_s: float | None = None) -> Any:
        return await self._request("POST", path, body, timeout_s=timeout_s)

    async def _request(
        self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None
    ) -> Any:
        """One request; the answer's JSON (its text if not JSON, None if empty).

        Raises:
            SyncTimeoutError: no answer within ``timeout_s`` (default ``request_timeout_s``).
            TransportError: a connection error, a 401 or another non-2xx answer.
            RuntimeError: a route, method or body field outside :data:`ROUTES`
                (an aiosync defect), before anything is sent.
        """
        check_request(ROUTES, method, path, body)
        limit = self.request_timeout_s if timeout_s is None else timeout_s
        timeout = request_timeout(limit)
        where = f"{method} {self.base_url}{path}"
        with map_exceptions(
            http_errors(where, lambda exc: f"{where}: no answer within {limit} s ({exc!r})")
        ):
            if body is None:
                response = await self._client.request(method, path, timeout=timeout)
            else:
                response = await self._client.request(method, path, json=body, timeout=timeout)
        if response.status_code == 401:
            raise TransportError(
                f"{where}: 401 Unauthorized: the server rejected the API key "
                f"({'none sent' if 'Authorization' not in self._client.headers else 'wrong key'})"
            )
        if not response.is_success:
            error = TransportError(
                f"{where}: HTTP {response.status_code}: {_server_message(response)}"
            )
            vars(error)["http_status"] = response.status_code
            vars(error)["server_message"] = _server_message(response)
            raise error
        return answer_body(response)


def _check_success(path: str, answer: Any) -> None:
    if isinstance(answer, dict) and answer.get("success") is False:
        raise TransportError(f"{path} failed: {answer.get('message')}")


def _server_message(response: httpx.Response) -> str:
    """The server's own words: ``error.message``, ``message``, ``error_message``
    (``LoRAUpdateOutput``), ``error``, or the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
        if data.get("error_message"):
            return str(data["error_message"])
        if error is not None:
            return str(error)
    return str(data)[:500]
