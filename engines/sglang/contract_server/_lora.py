"""``/load_lora_adapter`` and ``/unload_lora_adapter``: PEFT adapters under SGLang's
names and answers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file as safetensors_load_file

from aiosync.engines.sglang._lora import _SGLANG_MODULE
from aiosync.engines.sglang.contract_server._base import _Routes
from aiosync.engines.sglang.contract_server._state import ServerState
from aiosync.engines.sglang.contract_server._wire import (
    _LORA_DISABLED,
    _error,
    _HTTPError,
)
from aiosync.errors import SyncError
from aiosync.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE


class _LoRARoutes(_Routes):
    """SGLang's LoRA adapter routes."""

    def _load_lora_adapter(self, data: dict[str, Any]) -> Any:
        """SGLang's ``LoadLoRAAdapterReqInput``: ``lora_name``, ``lora_path`` (a PEFT
        adapter folder, read now), ``pinned``. Answers ``LoRAUpdateOutput``."""
        state = self.server.state
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise _HTTPError(422, {"detail": "lora_name and lora_path must be strings"})
        if not state.enable_lora:
            raise _lora_failure(state, _LORA_DISABLED)
        with state.lock:
            duplicate = name in state.lora_adapters
        if duplicate:
            raise _lora_failure(
                state, f"Failed to load LoRA adapter {name} because it is already loaded"
            )
        try:
            config = json.loads((Path(path) / ADAPTER_CONFIG_FILE).read_text())
            tensors = safetensors_load_file(str(Path(path) / ADAPTER_WEIGHTS_FILE))
        except (OSError, ValueError) as exc:
            raise _lora_failure(state, f"{type(exc).__name__}: {exc}") from exc
        rank = int(config.get("r", 0))
        targets = config.get("target_modules") or []
        allowed = state.lora_target_modules
        outside = (
            allowed is not None
            and "all" not in allowed
            and isinstance(targets, list)
            and bool(_sglang_modules(targets) - _sglang_modules(allowed))
        )
        if (state.max_lora_rank is not None and rank > state.max_lora_rank) or outside:
            raise _lora_failure(
                state,
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA "
                "memory pool configuration. Please ensure that the LoRA adapter's rank is within "
                "the configured `--max-lora-rank` and that the target modules are included in "
                "`--lora-target-modules`.",
            )
        lora_id = uuid.uuid4().hex
        with state.model_lock:
            try:
                for runner in state.ranks:
                    runner.load_lora_adapter(lora_id, tensors, config)
            except (SyncError, ValueError) as exc:
                for runner in state.ranks:
                    runner.unload_lora_adapter(lora_id)
                raise _lora_failure(state, str(exc)) from exc
            with state.lock:
                state.lora_adapters[name] = (lora_id, path)
        return _lora_result(state, True)

    def _unload_lora_adapter(self, data: dict[str, Any]) -> Any:
        """SGLang's ``UnloadLoRAAdapterReqInput``: ``lora_name``. Answers ``LoRAUpdateOutput``."""
        state = self.server.state
        name = data.get("lora_name")
        if not isinstance(name, str):
            raise _HTTPError(422, {"detail": "lora_name must be a string"})
        if not state.enable_lora:
            raise _lora_failure(state, _LORA_DISABLED)
        with state.model_lock:
            with state.lock:
                entry = state.lora_adapters.pop(name, None)
                loaded = state.lora_adapters.keys()
                missing = f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}"
            if entry is None:
                raise _lora_failure(state, missing)
            for runner in state.ranks:
                runner.unload_lora_adapter(entry[0])
        return _lora_result(state, True)


def _lora_result(state: ServerState, success: bool, error: str | None = None) -> dict[str, Any]:
    """SGLang's ``LoRAUpdateOutput``: ``loaded_adapters`` maps each name to its path.
    Takes ``state.lock``: never call it holding that lock."""
    with state.lock:
        loaded = {name: lora_path for name, (_id, lora_path) in state.lora_adapters.items()}
    return {"success": success, "error_message": error, "loaded_adapters": loaded}


def _lora_failure(state: ServerState, message: str) -> _HTTPError:
    return _HTTPError(400, _lora_result(state, False, message))


def _sglang_modules(names: Sequence[str]) -> set[str]:
    return {_SGLANG_MODULE.get(str(n), str(n)) for n in names}


def _lora_names(lora_path: Any, count: int) -> list[str | None]:
    """``/generate``'s ``lora_path``: one adapter name (or None) per prompt."""
    if lora_path is None or isinstance(lora_path, str):
        return [lora_path] * count
    if (
        isinstance(lora_path, list)
        and len(lora_path) == count
        and all(n is None or isinstance(n, str) for n in lora_path)
    ):
        return list(lora_path)
    raise _error(f"lora_path must be a name, null, or one per prompt ({count}), got {lora_path!r}")
