"""This server's own test-only routes (``/_aiosync/...``): fault injection and inspection."""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch
from safetensors.torch import save as safetensors_save

from aiosync.engines.sglang.contract_server._base import _Routes
from aiosync.engines.sglang.contract_server._state import _Fault
from aiosync.engines.sglang.contract_server._wire import (
    _FAULT_MODES,
    _error,
    _HTTPError,
    _is_int,
    _object,
)
from aiosync.transports._verify import arm_transit_fault, disarm_transit_faults


class _FaultRoutes(_Routes):
    """The test-only routes under :data:`AIOSYNC_ROUTE_PREFIX`."""

    def _admin(self, method: str, path: str, data: Any) -> Any:
        state = self.server.state
        if path == "/_aiosync/load" and method == "GET":
            # What tests wait on: SGLang's /v1/loads has no count of generated tokens.
            running, waiting, tokens = state.scheduler.load()
            return {"running": running, "waiting": waiting, "generated_tokens": tokens}
        if path == "/_aiosync/log" and method == "GET":
            with state.lock:
                return list(state.log)
        if path == "/_aiosync/manifest" and method == "GET":
            return [
                [name, list(shape), str(dtype).removeprefix("torch.")]
                for name, (shape, dtype) in state.runner.expected_manifest().items()
            ]
        if path == "/_aiosync/lora_adapters" and method == "GET":
            with state.lock:
                return {name: lora_path for name, (_id, lora_path) in state.lora_adapters.items()}
        if path == "/_aiosync/kv_scales" and method == "GET":
            with state.model_lock:
                return [dict(runner.kv_scales) for runner in state.ranks]
        if path == "/_aiosync/state_dict" and method == "GET":
            query = parse_qs(urlsplit(self.path).query)
            rank_text = query.get("rank", ["0"])[0]
            if not rank_text.isdigit() or int(rank_text) >= len(state.ranks):
                raise _error(f"rank must be one of 0..{len(state.ranks) - 1}, got {rank_text!r}")
            with state.model_lock:
                return safetensors_save(state.ranks[int(rank_text)].hf_state_dict())
        if path == "/_aiosync/faults" and method == "POST":
            spec = _object(data)
            mode, target, count = spec.get("mode"), spec.get("path"), spec.get("count")
            if mode not in _FAULT_MODES or not isinstance(target, str):
                raise _error(f"fault needs a path and a mode in {_FAULT_MODES}")
            if count is not None and (not isinstance(count, int) or count < 1):
                raise _error("count must be a positive int or null")
            with state.lock:
                state.faults[target] = _Fault(mode, count)
            return {"ok": True}
        if path == "/_aiosync/arm_transit_fault" and method == "POST":
            # Test-only: flip (XOR ``mask``, default 0xFF: every bit) byte ``byte`` of the
            # bucket of index ``bucket`` (ServerState.update_index) when TP rank 0 next
            # receives it, before its load.
            spec = _object(data)
            bucket, byte, mask = spec.get("bucket"), spec.get("byte"), spec.get("mask", 0xFF)
            if not (
                isinstance(bucket, int)
                and isinstance(byte, int)
                and isinstance(mask, int)
                and _is_int(bucket)
                and _is_int(byte)
                and _is_int(mask)
                and bucket >= 0
                and byte >= 0
                and 0 < mask < 256
            ):
                raise _error(
                    "arm_transit_fault needs a bucket and a byte, ints >= 0, and an optional "
                    "mask of 1 to 255"
                )
            arm_transit_fault(bucket, byte, mask)
            return {"ok": True}
        if path == "/_aiosync/corrupt" and method == "POST":
            # Test-only: a live weight changed behind every transport's back: element
            # ``index`` of TP rank ``rank``'s tensor ``name`` (HF name) gets ``delta`` added.
            spec = _object(data)
            name, index = spec.get("name"), spec.get("index", 0)
            rank, delta = spec.get("rank", 0), spec.get("delta", 1.0)
            if not (
                isinstance(name, str)
                and _is_int(index)
                and _is_int(rank)
                and 0 <= rank < len(state.ranks)
                and isinstance(delta, (int, float))
            ):
                raise _error("corrupt needs a name, an index >= 0 and a rank of this server")
            with state.model_lock:
                try:
                    weight = state.ranks[rank].model.get_parameter(name)
                except AttributeError as exc:
                    raise _error(f"no parameter {name!r}") from exc
                with torch.no_grad():
                    weight.view(-1)[index] += delta
            return {"ok": True}
        if path == "/_aiosync/reset" and method == "POST":
            with state.lock:
                state.faults.clear()
                state.log.clear()
                state.session_open = False
                state.pending_version = None
                state.update_index = 0
                disarm_transit_faults()
                state.unhang.set()
                state.unhang = threading.Event()
            return {"ok": True}
        raise _HTTPError(404, {"detail": "Not Found"})
