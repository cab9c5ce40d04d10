"""The request handler: dispatch (authentication, injected faults, the log) and the
route table's dispatch to each group of routes."""

from __future__ import annotations

import datetime
import json
import socket
import time
from typing import Any

from aiosync.engines.sglang.contract_server._checker import _CheckerRoutes
from aiosync.engines.sglang.contract_server._faults import _FaultRoutes
from aiosync.engines.sglang.contract_server._generation import _GenerationRoutes
from aiosync.engines.sglang.contract_server._lora import _LoRARoutes
from aiosync.engines.sglang.contract_server._memory import _MemoryRoutes
from aiosync.engines.sglang.contract_server._state import _HANG_LIMIT_S
from aiosync.engines.sglang.contract_server._weights import _WeightRoutes
from aiosync.engines.sglang.contract_server._wire import (
    _FLUSH_TEXT,
    SGLANG_ROUTES,
    _DeclaredBody,
    _error,
    _HTTPError,
    _object,
    _summary,
    _tags,
)


class _Handler(
    _GenerationRoutes, _WeightRoutes, _CheckerRoutes, _LoRARoutes, _MemoryRoutes, _FaultRoutes
):
    """One request: authentication, injected faults, the log, then :data:`SGLANG_ROUTES`'s
    dispatch to the group of routes that serves it."""

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    # Headers and body go out in two writes: without this, Nagle's algorithm and
    # the client's delayed ACK add ~40 ms to every answer.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        return None

    # -- dispatch ---------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        state = self.server.state
        times = {"start": time.monotonic()}
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        entry: dict[str, Any] = {"method": method, "path": path}
        self._times = times
        status, body = 500, None
        try:
            data = json.loads(raw) if raw else None
            times["body"] = time.monotonic()
            entry.update(_summary(data))
            if path.startswith("/_aiosync/"):
                status, body = 200, self._admin(method, path, data)
            else:
                self._check_auth(path)
                fault = state.take_fault(path)
                if fault == "drop":
                    entry["status"] = "dropped"
                    self._record(entry)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "hang":
                    entry["status"] = "hung"
                    self._record(entry)
                    state.unhang.wait(_HANG_LIMIT_S)
                    raise _error("hung request released", 503)
                if fault == "error":
                    raise _error(f"injected fault on {path}", 500)
                if fault == "busy":
                    raise _HTTPError(
                        400,
                        _FLUSH_TEXT
                        if path == "/flush_cache"
                        else {"error": {"message": "server busy (injected)"}},
                    )
                status, body = 200, self._route(method, path, data)
        except _HTTPError as exc:
            status, body = exc.status, exc.body
        except json.JSONDecodeError as exc:
            status, body = 400, {"error": {"message": f"invalid JSON body: {exc}"}}
        except Exception as exc:
            status, body = 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
        if not path.startswith("/_aiosync/"):
            entry["status"] = status
            entry["times"] = times
            self._record(entry)
        self._send(status, body)
        times["answered"] = time.monotonic()

    def _record(self, entry: dict[str, Any]) -> None:
        with self.server.state.lock:
            self.server.state.log.append(entry)

    def _send(self, status: int, body: Any) -> None:
        if isinstance(body, bytes):
            payload, ctype = body, "application/octet-stream"
        elif isinstance(body, str):
            payload, ctype = body.encode(), "text/plain; charset=utf-8"
        else:
            payload, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _check_auth(self, path: str) -> None:
        key = self.server.state.api_key
        if key is None or path.startswith("/health"):
            return
        if self.headers.get("Authorization") != f"Bearer {key}":
            raise _HTTPError(401, {"error": "Unauthorized"})

    # -- SGLang's endpoints -------------------------------------------------------

    def _route(self, method: str, path: str, data: Any) -> Any:
        state = self.server.state
        served = SGLANG_ROUTES.get(path)
        if served is None:
            raise _HTTPError(404, {"detail": "Not Found"})
        if method not in served.methods:
            raise _HTTPError(405, {"detail": "Method Not Allowed"})
        if isinstance(data, dict):
            data = _DeclaredBody(data, path, served.fields)
        if path in ("/health", "/health_generate"):
            return None
        if path in ("/model_info", "/get_model_info") and method == "GET":
            # SGLang 0.5.23: /model_info (/get_model_info its deprecated alias) is where
            # the label lives; there is no /get_weight_version.
            return {
                "model_path": state.model_path,
                "tokenizer_path": None,
                "is_generation": True,
                "weight_version": state.weight_version,
            }
        if path in ("/server_info", "/get_server_info") and method == "GET":
            return {
                "model_path": state.model_path,
                "startup_time": state.startup_time,
                # SGLang reports its --dtype; this server's is the model's own.
                "dtype": str(next(state.runner.model.parameters()).dtype).removeprefix("torch."),
                "revision": None,
                "json_model_override_args": "{}",
                "tp_size": state.tp_size,
                "dp_size": 1,
                "enable_memory_saver": state.enable_memory_saver,
                "enable_weights_cpu_backup": state.weights_cpu_backup,
                "enable_lora": state.enable_lora,
                "lora_paths": None,
                "max_lora_rank": state.max_lora_rank,
                "lora_target_modules": state.lora_target_modules,
                "max_loaded_loras": None,
                "weight_version": state.weight_version,
                "version": "aiosync-test-server",
                # SGLang's ServerArgs: a draft worker runs beside the target ("NEXTN": MTP).
                "speculative_algorithm": "NEXTN" if state.draft_ranks else None,
                "speculative_draft_model_path": state.draft_model_path,
            }
        if path == "/generate" and method == "POST":
            return self._generate(_object(data))
        if path == "/pause_generation" and method == "POST":
            return self._pause_generation(data)
        if path == "/continue_generation" and method == "POST":
            state.scheduler.resume()
            return {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/v1/loads" and method == "GET":
            # SGLang 0.5.23's /v1/loads (entrypoints/v1_loads.py; it has no /get_load):
            # one LoadSnapshot per DP rank under "loads", its core fields flat.
            running, waiting, _ = state.scheduler.load()
            return {
                "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
                "version": "aiosync-test-server",
                "accelerator": "cpu",
                "num_accelerators": 1,
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": running,
                        "num_waiting_reqs": waiting,
                    }
                ],
            }
        if path == "/update_weights_from_tensor" and method == "POST":
            return self._update_weights_from_tensor(_object(data))
        if path == "/get_weights_by_name":
            return self._get_weights_by_name(data)
        if path == "/init_weights_update_group" and method == "POST":
            return self._init_weights_update_group(_object(data))
        if path == "/update_weights_from_distributed" and method == "POST":
            return self._update_weights_from_distributed(_object(data))
        if path == "/destroy_weights_update_group" and method == "POST":
            return self._destroy_weights_update_group(_object(data or {}))
        if state.weight_update_session and method == "POST":
            if path == "/begin_weight_update":
                return self._begin_weight_update(_object(data or {}))
            if path == "/end_weight_update":
                return self._end_weight_update(_object(data or {}))
        if path == "/update_weight_version" and method == "POST":
            return self._update_weight_version(_object(data))
        if path == "/load_lora_adapter" and method == "POST":
            return self._load_lora_adapter(_object(data))
        if path == "/unload_lora_adapter" and method == "POST":
            return self._unload_lora_adapter(_object(data))
        if path == "/flush_cache":
            # SGLang 0.5.23 (issue #33783): refused while requests run or wait, the
            # retracted ones included; answered 400 with the same text.
            with state.lock:
                if not state.scheduler.flush():
                    raise _HTTPError(400, _FLUSH_TEXT)
                state.cache.clear()
                state.update_index = 0
            return _FLUSH_TEXT
        if path == "/weights_checker":
            return self._weights_checker(data)
        if path == "/release_memory_occupation":
            return self._release(_tags(data))
        if path == "/resume_memory_occupation":
            return self._resume(_tags(data))
        raise _HTTPError(404, {"detail": "Not Found"})
