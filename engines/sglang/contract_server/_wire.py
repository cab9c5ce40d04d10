"""The SGLang 0.5.23 contract as this server serves it: the route table, the errors it
answers with, SGLang's texts and the request-body checks every handler shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_ALL_TAGS = ("weights", "kv_cache", "cuda_graph")
_LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
_FAULT_MODES = ("error", "hang", "drop", "busy")
#: The prefix of this server's own routes (fault injection, inspection): not SGLang's.
AIOSYNC_ROUTE_PREFIX = "/_aiosync/"


@dataclass(frozen=True)
class ServedRoute:
    """One of SGLang's routes as this server serves it: the methods it answers
    (SGLang 0.5.23's, ``http_server.py``) and the body fields its handler reads
    (fields of the route's request class in SGLang's ``io_struct.py``)."""

    methods: frozenset[str]
    fields: frozenset[str] = frozenset()


def _served(methods: str, *fields: str) -> ServedRoute:
    return ServedRoute(frozenset(methods.split()), frozenset(fields))


#: Every SGLang route this server serves; any other path but :data:`AIOSYNC_ROUTE_PREFIX`'s
#: answers 404 (another method 405), and a handler reading a body field not named here
#: fails (500). ``tests/contracts/`` checks the table against SGLang 0.5.23's sources.
SGLANG_ROUTES: dict[str, ServedRoute] = {
    "/health": _served("GET"),
    "/health_generate": _served("GET"),
    "/model_info": _served("GET"),
    "/get_model_info": _served("GET"),
    "/server_info": _served("GET"),
    "/get_server_info": _served("GET"),
    "/v1/loads": _served("GET"),
    "/generate": _served("POST", "input_ids", "sampling_params", "return_logprob", "lora_path"),
    "/pause_generation": _served("POST", "mode"),
    "/continue_generation": _served("POST"),
    "/flush_cache": _served("GET POST"),
    "/begin_weight_update": _served("POST", "selector"),
    "/end_weight_update": _served("POST"),
    "/update_weights_from_tensor": _served(
        "POST",
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "selector",
    ),
    "/init_weights_update_group": _served(
        "POST",
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    ),
    "/update_weights_from_distributed": _served(
        "POST",
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "selector",
    ),
    "/destroy_weights_update_group": _served("POST", "group_name"),
    "/update_weight_version": _served("POST", "new_version", "abort_all_requests"),
    "/get_weights_by_name": _served("GET POST", "name", "truncate_size"),
    "/weights_checker": _served(
        "GET POST", "action", "selector", "skip_tensor_list", "allow_quant_error"
    ),
    "/release_memory_occupation": _served("GET POST", "tags"),
    "/resume_memory_occupation": _served("GET POST", "tags"),
    "/load_lora_adapter": _served("POST", "lora_name", "lora_path", "pinned"),
    "/unload_lora_adapter": _served("POST", "lora_name"),
}


class _HTTPError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def _error(message: str, status: int = 400) -> _HTTPError:
    # SGLang's _create_error_response: {"error": {"message": ...}}, 400.
    return _HTTPError(status, {"error": {"message": message}})


# SGLang 0.5.23, python/sglang/srt/managers/scheduler_components/weight_updater.py.
def _outside_session(route: str) -> str:
    """SGLang's refusal of ``route`` (``"update_weights_from_tensor"``,
    ``"update_weights_from_distributed"``) outside a weight-update session."""
    return f"{route} must run between begin_weight_update() and end_weight_update()"


_SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
_NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
# SGLang's http_server.py flush_cache: this text, 200 when flushed, 400 when refused.
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _selector(data: Mapping[str, Any]) -> str:
    """An update's or a session's ``selector`` (SGLang 0.5.23: ``"target" | "draft" |
    "all"``, default ``"all"``); another value is SGLang's validation error, 400."""
    selector = data.get("selector", "all")
    if selector not in ("target", "draft", "all"):
        # SGLang's RequestValidationError handler: an ErrorResponse, 400.
        message = f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}"
        raise _HTTPError(
            400, {"object": "error", "message": message, "type": "Bad Request", "code": 400}
        )
    return str(selector)


class _DeclaredBody(dict[str, Any]):
    """A request body whose handler may read only the fields its route declares
    (:data:`SGLANG_ROUTES`): reading another is this server's defect (an
    ``AssertionError``, answered 500), so the table is what the handlers read."""

    def __init__(self, data: dict[str, Any], path: str, fields: frozenset[str]) -> None:
        super().__init__(data)
        self._path, self._fields = path, fields

    def _declared(self, key: object) -> None:
        if key not in self._fields:
            raise AssertionError(f"the test server reads {key!r} of {self._path}, undeclared")

    def __getitem__(self, key: str) -> Any:
        self._declared(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._declared(key)
        return super().__contains__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._declared(key)
        return super().get(key, default)


def _object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _error("the request body must be a JSON object")
    return data


def _count(entries: Any) -> str:
    return str(len(entries)) if isinstance(entries, list) else repr(entries)


def _tags(data: Any) -> list[str]:
    tags = data.get("tags") if isinstance(data, dict) else None
    if tags is None or tags == []:
        return list(_ALL_TAGS)
    if not isinstance(tags, list) or any(t not in _ALL_TAGS for t in tags):
        raise _error(f"tags must be a subset of {list(_ALL_TAGS)}, got {tags!r}")
    return list(tags)


def _summary(data: Any) -> dict[str, Any]:
    """What the request log keeps of a body (never the payloads)."""
    if not isinstance(data, dict):
        return {}
    out: dict[str, Any] = {}
    keys = (
        "tags",
        "weight_version",
        "new_version",
        "load_format",
        "flush_cache",
        "lora_name",
        "lora_path",
        "selector",
        "name",
        "truncate_size",
    )
    for key in (*keys, "abort_all_requests", "group_name", "backend", "rank_offset", "world_size"):
        if key in data:
            out[key] = data[key]
    if isinstance(data.get("serialized_named_tensors"), list):
        out["entries"] = len(data["serialized_named_tensors"])
    if isinstance(data.get("names"), list):
        out["tensors"] = len(data["names"])
    return out
