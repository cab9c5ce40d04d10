"""A contract-true stand-in for SGLang's HTTP server, on the embedded transformers engine.

Run it as ``python -m aiosync.testing.sglang_server --port 0 --port-file F --model-config
config.json`` (or a preset name such as ``qwen3-tiny``); it binds 127.0.0.1 only. Endpoints,
test-only routes (``/_aiosync/...``) and fault injection: ``docs/sglang-test-server.md``.
It lives with the SGLang engine (it runs the embedded engine behind SGLang's routes and
the HTTP transport's wire format); :mod:`aiosync.testing.sglang_server` is its public name.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import anyio
import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file as safetensors_load_file
from safetensors.torch import save as safetensors_save

from aiosync._model_shapes import MODEL_CONFIGS
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import SyncError, TransportError
from aiosync.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from aiosync.transports._leftovers import dir_prefix, sweep_leftovers
from aiosync.transports._verify import arm_transit_fault, disarm_transit_faults, transit_fault
from aiosync.transports.collective._custom_group import CustomGroup, join_custom_group
from aiosync.transports.http import (
    FLATTENED_BUCKET,
    decode_flattened_bucket,
    use_file_system_sharing,
)

__all__ = ["ServerState", "main", "make_server", "serve_in_subprocess"]

_ALL_TAGS = ("weights", "kv_cache", "cuda_graph")
_LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# SGLang's names for the layers it adapts (q/k/v and gate/up are fused there).
_SGLANG_MODULE = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
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
# A hung request gives up on its own after this long (seconds), so a test
# that forgot to reset never leaves a thread behind for good.
_HANG_LIMIT_S = 600.0


@dataclass
class _Fault:
    mode: str
    remaining: int | None  # None: forever


_PAUSE_MODES = ("abort", "in_place", "retract")


@dataclass(eq=False)
class _Ticket:
    """One ``/generate`` request at the :class:`_Scheduler`; compared by identity
    (two requests at the same point look alike field for field)."""

    id: int = 0
    aborted: bool = False
    retracted: bool = False
    in_step: bool = False
    tokens: int = 0
    #: The :attr:`_Scheduler.weights_epoch` of the KV its retraction left in the tree.
    kv_epoch: int | None = None


class _Scheduler:
    """SGLang's pause contract (``PauseGenerationReqInput``) at decode-step granularity.

    While paused, new requests wait before admission (SGLang's ``is_pause_cond``)
    and the admitted ones, per mode: ``"abort"`` ends them before their next
    token (``finish_reason`` ``abort``), the pause returning once all ended;
    ``"in_place"`` freezes them between two tokens with their KV cache (they stay
    in the running batch: ``/flush_cache`` refuses); ``"retract"`` moves them
    back to the waiting queue, their KV cache dropped (``/flush_cache`` may run),
    recomputed from prompt and tokens so far after ``/continue_generation``.

    The radix tree, as far as a retract touches it: SGLang's retract frees a
    request's KV beyond the tree-owned prefix and only unlocks that prefix
    (sgl-project/sglang PR #33784), so a retracted request re-admitted without a
    flush in between recomputes on top of the old weights' prefix KV. The tree
    remembers each retracted request and the :attr:`weights_epoch` its KV came
    from; :meth:`flush` empties it, and :meth:`readmit` reports a stale reuse.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.mode: str | None = None
        self.epoch = 0
        self.tickets: list[_Ticket] = []
        #: Bumped whenever weights change (each loaded bucket).
        self.weights_epoch = 0
        # Retracted requests whose prefix KV the tree still holds.
        self.tree: set[int] = set()
        self._ids = 0

    def admit(self) -> _Ticket:
        with self.cond:
            while self.mode is not None:
                self.cond.wait()
            self._ids += 1
            ticket = _Ticket(id=self._ids)
            self.tickets.append(ticket)
            return ticket

    def readmit(self, ticket: _Ticket) -> bool:
        """A retracted request waits in the queue until generation continues; True
        when its recompute then reuses prefix KV of other weights than the live ones."""
        with self.cond:
            while self.mode is not None and not ticket.aborted:
                self.cond.wait()
            ticket.retracted = False
            stale = ticket.id in self.tree and ticket.kv_epoch != self.weights_epoch
            self.tree.discard(ticket.id)
            return stale and not ticket.aborted

    def finish(self, ticket: _Ticket) -> None:
        with self.cond:
            # By identity: list.remove would take the first *equal* ticket.
            self.tickets = [t for t in self.tickets if t is not ticket]
            self.tree.discard(ticket.id)
            self.cond.notify_all()

    def weights_changed(self) -> None:
        with self.cond:
            self.weights_epoch += 1

    def flush(self) -> bool:
        """SGLang 0.5.23's ``flush_cache``: only when ``is_fully_idle()``, no request
        running *or waiting* (the retracted ones wait: issue #33783); then the tree
        is empty. False: refused, nothing flushed."""
        with self.cond:
            if self.tickets:
                return False
            self.tree.clear()
            return True

    def drop_tree(self) -> None:
        with self.cond:
            self.tree.clear()

    def step(self, ticket: _Ticket) -> bool:
        """Before each token: False ends this decode (aborted, or retracted)."""
        with self.cond:
            if ticket.in_step:
                ticket.in_step = False
                ticket.tokens += 1
                self.cond.notify_all()
            while not ticket.aborted and self.mode == "in_place":
                self.cond.wait()
            if self.mode == "retract" and not ticket.aborted and not ticket.retracted:
                ticket.retracted = True
                ticket.kv_epoch = self.weights_epoch
                self.tree.add(ticket.id)
                self.cond.notify_all()
            if ticket.aborted or ticket.retracted:
                return False
            ticket.in_step = True
            return True

    def pause(self, mode: str) -> None:
        with self.cond:
            self.mode = mode
            self.epoch += 1
            epoch = self.epoch
            if mode == "abort":
                for ticket in self.tickets:
                    ticket.aborted = True
            self.cond.notify_all()

            def settled() -> bool:
                if mode == "abort":
                    return not self.tickets
                if mode == "in_place":
                    return not any(t.in_step for t in self.tickets)
                return all(t.retracted for t in self.tickets)

            while not settled() and self.epoch == epoch:
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.mode = None
            self.epoch += 1
            self.cond.notify_all()

    def abort_all(self) -> None:
        with self.cond:
            for ticket in self.tickets:
                ticket.aborted = True
            self.cond.notify_all()

    def load(self) -> tuple[int, int, int]:
        """``(requests in the running batch, retracted ones waiting, tokens generated)``."""
        with self.cond:
            waiting = sum(t.retracted for t in self.tickets)
            return len(self.tickets) - waiting, waiting, sum(t.tokens for t in self.tickets)


#: Request-log entries a server keeps (:attr:`ServerState.log_limit`): ~400 refits.
LOG_LIMIT = 10_000


class _RankLoadError(Exception):
    """A TP rank's load failed (:meth:`ServerState.load_selected`)."""

    def __init__(self, rank: int, error: SyncError) -> None:
        super().__init__(f"TP rank {rank}: {error}")
        self.rank = rank
        self.error = error


@dataclass
class ServerState:
    """Everything the handlers share; guarded by ``lock`` (the model by ``model_lock``)."""

    runner: HFModelRunner
    tp_size: int = 1
    api_key: str | None = None
    enable_memory_saver: bool = False
    weights_cpu_backup: bool = False
    model_path: str = ""
    weight_version: str | None = "default"
    #: SGLang's ``tokenizer_manager.startup_time`` (``time.time()`` when the server
    #: started), reported by ``/server_info``: a server restarted on the same URL
    #: reports another one.
    startup_time: float = field(default_factory=time.time)
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    #: SGLang's weight-update session (0.5.23; PRs #28710, #28001): every
    #: ``update_weights_from_tensor`` must run between ``/begin_weight_update`` and
    #: ``/end_weight_update``. False: an older server, without those routes (404).
    weight_update_session: bool = True
    #: A session is open (``/begin_weight_update`` answered, no ``/end`` yet).
    session_open: bool = False
    #: The ``weight_version`` an update sent inside the open session; the session's
    #: end records it (SGLang's ``_WeightUpdateSession.pending_version``).
    pending_version: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    model_lock: threading.Lock = field(default_factory=threading.Lock)
    released: set[str] = field(default_factory=set)
    #: The ``/generate`` requests admitted, and the pause in force.
    scheduler: _Scheduler = field(default_factory=_Scheduler)
    #: Loaded LoRA adapters, ``{lora_name: (lora_id, lora_path)}``, in load order;
    #: each TP rank's model holds the adapter under ``lora_id``.
    lora_adapters: dict[str, tuple[str, str]] = field(default_factory=dict)
    cache: dict[tuple[tuple[int, ...], int, str | None, bool], tuple[list[int], list[float]]] = (
        field(default_factory=dict)
    )
    #: The request log (``GET /_aiosync/log``), oldest first: the last ``log_limit``
    #: entries (a refit adds ~24), so a long run against the server stays bounded.
    log: collections.deque[dict[str, Any]] = field(init=False)
    log_limit: int = LOG_LIMIT
    faults: dict[str, _Fault] = field(default_factory=dict)
    unhang: threading.Event = field(default_factory=threading.Event)
    #: Tensor-parallel ranks 1.. (rank 0 is ``runner``), copies of ``runner`` unless
    #: given. Each holds the whole model (no sharding) and loads only its own
    #: ``serialized_named_tensors`` entry, so that every rank's weights can be
    #: read back; generation runs on rank 0.
    other_ranks: list[HFModelRunner] = field(default_factory=list)
    #: ``/init_weights_update_group``'s groups, ``{group_name: [member of TP rank r, ...]}``
    #: (each SGLang TP worker's ``_model_update_group``): every simulated TP rank is a
    #: real gloo member of the group, rank ``rank_offset + r``.
    weight_groups: dict[str, list[CustomGroup]] = field(default_factory=dict)
    #: The limit of a group's formation and of each of its broadcasts, seconds
    #: (``--weights-update-timeout-s``).
    weights_update_timeout_s: float = 120.0
    #: The bucket index the next update request gets (``/update_weights_from_tensor``,
    #: ``/update_weights_from_distributed``): its order in the current refit, from 0
    #: at ``/begin_weight_update``, ``/flush_cache`` and ``/update_weight_version``
    #: (a refit's start and end); the index the test fault
    #: (``/_aiosync/arm_transit_fault``) names.
    update_index: int = 0
    #: Taken by the three group routes for their whole run: SGLang's scheduler serves
    #: one request at a time, so a formation or a broadcast holds back the next group
    #: request (a destroy waits for a hung update) until it ends or times out.
    group_lock: threading.Lock = field(default_factory=threading.Lock)
    #: ``/weights_checker``'s snapshots, ``{TP rank: {name: copy}}`` (``"snapshot"``
    #: takes one, ``"compare"`` drops it).
    weight_snapshots: dict[int | tuple[str, int], dict[str, torch.Tensor]] = field(
        default_factory=dict
    )
    #: The speculative-decoding draft model of each TP rank (SGLang's draft worker,
    #: ``--speculative-draft-model-path``), copies of the first unless given; empty: no
    #: draft. Each update's ``selector`` says which runners load it (SGLang 0.5.23's
    #: ``SchedulerWeightUpdaterManager._select_runners``): both get the same tensors,
    #: and, as Qwen3-Next's loaders do (``is_mtp``), the target skips the names under
    #: :attr:`draft_prefix` while the draft loads only those (the prefix removed).
    draft_ranks: list[HFModelRunner] = field(default_factory=list)
    #: What the draft's tensors are named under in an update (``"mtp."``).
    draft_prefix: str = "mtp."
    #: ``/get_server_info``'s ``speculative_draft_model_path`` (the draft's config).
    draft_model_path: str | None = None
    #: The ``selector`` of the open session (``/begin_weight_update``).
    session_selector: str = "all"

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.log_limit < 1:
            raise ValueError(f"log_limit must be >= 1, got {self.log_limit}")
        self.log = collections.deque(maxlen=self.log_limit)
        if self.weights_update_timeout_s <= 0:
            raise ValueError(
                f"weights_update_timeout_s must be > 0, got {self.weights_update_timeout_s}"
            )
        while len(self.other_ranks) < self.tp_size - 1:
            self.other_ranks.append(HFModelRunner(copy.deepcopy(self.runner.model)))
        while self.draft_ranks and len(self.draft_ranks) < self.tp_size:
            self.draft_ranks.append(HFModelRunner(copy.deepcopy(self.draft_ranks[0].model)))

    @property
    def running(self) -> int:
        """Requests in the running batch (frozen in place ones included; retracted
        ones wait in the queue and hold no KV cache)."""
        return self.scheduler.load()[0]

    @property
    def ranks(self) -> list[HFModelRunner]:
        """Every TP rank's model, rank order (rank 0 is ``runner``)."""
        return [self.runner, *self.other_ranks]

    def load_selected(
        self, per_rank: Sequence[Sequence[tuple[str, torch.Tensor]]], selector: str
    ) -> None:
        """Load each TP rank's tensors into the runners ``selector`` picks (``"target"``,
        ``"draft"``, ``"all"``), as SGLang 0.5.23 fans an update out to them; without a
        draft every tensor goes to the target (an unknown name fails there).

        Raises:
            _RankLoadError: a rank's load failed (the rank and its SyncError).
        """
        prefix = self.draft_prefix
        for rank, tensors in enumerate(per_rank):
            loads: list[tuple[HFModelRunner, list[tuple[str, torch.Tensor]]]] = []
            if not self.draft_ranks:
                loads.append((self.ranks[rank], list(tensors)))
            else:
                if selector in ("target", "all"):
                    own = [(n, t) for n, t in tensors if not n.startswith(prefix)]
                    loads.append((self.ranks[rank], own))
                if selector in ("draft", "all"):
                    drafted = [(n[len(prefix) :], t) for n, t in tensors if n.startswith(prefix)]
                    loads.append((self.draft_ranks[rank], drafted))
            for runner, items in loads:
                try:
                    runner.load_weights(items)
                except SyncError as exc:
                    raise _RankLoadError(rank, exc) from exc

    def close_weight_groups(self) -> None:
        """Close and forget every weight-update group (the server stops). Never raises;
        a member whose broadcast is in flight closes once that broadcast ended (gloo's
        teardown waits for it: at most :attr:`weights_update_timeout_s`)."""
        with self.lock:
            groups, self.weight_groups = list(self.weight_groups.values()), {}
        for members in groups:
            for member in members:
                member.close()

    def take_update_index(self) -> int:
        """The index of the update request now receiving, and count it."""
        with self.lock:
            index, self.update_index = self.update_index, self.update_index + 1
        return index

    def take_fault(self, path: str) -> str | None:
        with self.lock:
            fault = self.faults.get(path)
            if fault is None:
                return None
            if fault.remaining is not None:
                fault.remaining -= 1
                if fault.remaining <= 0:
                    del self.faults[path]
            return fault.mode


class _HTTPError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def _error(message: str, status: int = 400) -> _HTTPError:
    # SGLang's _create_error_response: {"error": {"message": ...}}, 400.
    return _HTTPError(status, {"error": {"message": message}})


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # This request's stamps (``times`` of its log entry).
    _times: dict[str, float]
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

    def _generate(self, data: dict[str, Any]) -> Any:
        state = self.server.state
        input_ids = data.get("input_ids")
        single = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], int)
        prompts = [input_ids] if single else input_ids
        if not isinstance(prompts, list) or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
        ):
            raise _error("input_ids must be a non-empty list of token ids or a list of them")
        params = data.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        temperature = float(params.get("temperature", 1.0))
        ignore_eos = bool(params.get("ignore_eos", False))
        top_p = float(params.get("top_p", 1.0))
        seed = params.get("sampling_seed")
        return_logprob = bool(data.get("return_logprob", False))
        names = _lora_names(data.get("lora_path"), len(prompts))
        with state.lock:
            if state.released:
                raise _error(f"memory released ({sorted(state.released)}); resume it first")
            unknown = sorted({n for n in names if n is not None} - set(state.lora_adapters))
            if unknown:
                # SGLang's TokenizerManager: a ValueError, answered 400.
                raise _error(
                    f"The following requested LoRA adapters are not loaded: {set(unknown)}\n"
                    f"Loaded adapters: {set(state.lora_adapters)}."
                )
            lora_ids = [None if n is None else state.lora_adapters[n][0] for n in names]
        results = []
        for prompt, lora_id in zip(prompts, lora_ids, strict=True):
            key = (tuple(prompt), max_new, lora_id, ignore_eos)
            with state.lock:
                cached = state.cache.get(key) if temperature == 0 else None
            aborted = stale = False
            versions: list[str | None] = []
            if cached is None:
                out, logprobs, aborted, versions, stale = self._decode(
                    prompt, max_new, temperature, ignore_eos, lora_id, top_p, seed
                )
                if temperature == 0 and not aborted and len(set(versions)) == 1:
                    with state.lock:
                        state.cache[key] = (out, logprobs)
            else:
                out, logprobs = cached
            finish: dict[str, Any] = {"type": "length", "length": max_new}
            if aborted:
                finish = {"type": "abort", "message": "Abort in waiting queue"}
            elif out and not ignore_eos and out[-1] in state.runner.eos_ids():
                # SGLang's FINISH_MATCHED_TOKEN.
                finish = {"type": "stop", "matched": out[-1]}
            # A cached answer was computed by the weights now live (a flush clears it).
            labels = versions if cached is None else [state.weight_version] * len(out)
            spans = _weight_version_spans(labels, state.weight_version)
            meta_info: dict[str, Any] = {
                "id": uuid.uuid4().hex,
                "finish_reason": finish,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "cached_tokens": len(prompt) if cached is not None else 0,
                # SGLang 0.5.23 (utils/weight_versions.py): the label of each run of
                # output tokens, and the answer's label is the last run's.
                "weight_versions": spans,
                "weight_version": spans[-1]["version"],
                # Test-server only: a retracted request was recomputed on top of
                # prefix KV of other weights (no flush between retract and resume).
                "aiosync_stale_kv": stale,
            }
            if return_logprob:
                # SGLang's shape: one [logprob, token_id, text] per output token
                # (text None unless return_text_in_logprobs); with the default
                # logprob_start_len (-1) no prompt position is scored.
                meta_info["output_token_logprobs"] = [
                    [lp, tok, None] for lp, tok in zip(logprobs, out, strict=True)
                ]
                meta_info["input_token_logprobs"] = []
            results.append({"text": "", "output_ids": out, "meta_info": meta_info})
        return results[0] if single else results

    def _decode(
        self,
        prompt: list[int],
        max_new: int,
        temperature: float,
        ignore_eos: bool,
        lora_id: str | None,
        top_p: float = 1.0,
        seed: Any = None,
    ) -> tuple[list[int], list[float], bool, list[str | None], bool]:
        """One request, token by token, at the scheduler: ``(ids, logprobs, aborted,
        versions, stale)`` (``stale``: see :meth:`_Scheduler.readmit`); ``logprobs``:
        each token's ``log_softmax(logits)[token]`` before temperature and top-p
        (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB`` convention, and what SGLang
        reports for greedy requests)."""
        state = self.server.state
        ticket = state.scheduler.admit()
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[str | None] = []
        stale = False
        generator = state.runner.make_generator(None if seed is None else int(seed))

        def before_forward() -> str | None:
            with state.lock:
                versions.append(state.weight_version)
            return lora_id

        def gate(_step: int) -> bool:
            return state.scheduler.step(ticket)

        try:
            while True:
                result = state.runner.decode(
                    prompt + out,
                    max_new_tokens=max_new - len(out),
                    temperature=temperature,
                    ignore_eos=ignore_eos,
                    before_forward=before_forward,
                    gate=gate,
                    top_p=top_p,
                    generator=generator,
                )
                out += result.token_ids
                logprobs += result.logprobs
                ended = bool(out) and not ignore_eos and out[-1] in state.runner.eos_ids()
                if not result.aborted or ticket.aborted or ended or len(out) >= max_new:
                    return out, logprobs, ticket.aborted, versions, stale
                # Retracted: back in the queue, KV cache dropped; recomputed from the
                # prompt and the tokens so far once generation continues.
                stale |= state.scheduler.readmit(ticket)
                if ticket.aborted:
                    return out, logprobs, True, versions, stale
        finally:
            state.scheduler.finish(ticket)

    def _pause_generation(self, data: Any) -> Any:
        """SGLang's ``PauseGenerationReqInput``: ``mode`` ``"abort"`` (default),
        ``"in_place"`` or ``"retract"`` (see :class:`_Scheduler`)."""
        mode = (data or {}).get("mode", "abort") if isinstance(data, dict) else "abort"
        if mode not in _PAUSE_MODES:
            raise _error(f"Invalid mode: {mode!r}. Expected one of {list(_PAUSE_MODES)}.")
        self.server.state.scheduler.pause(mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def _update_weights_from_tensor(self, data: dict[str, Any]) -> Any:
        state = self.server.state
        entries = data.get("serialized_named_tensors")
        load_format = data.get("load_format")
        if load_format != FLATTENED_BUCKET:
            raise _HTTPError(
                400, {"success": False, "message": f"unsupported load_format {load_format!r}"}
            )
        if not isinstance(entries, list) or len(entries) != state.tp_size:
            raise _HTTPError(
                400,
                {
                    "success": False,
                    "message": f"serialized_named_tensors needs {state.tp_size} entries "
                    f"(one per TP rank), got {_count(entries)}",
                },
            )
        selector = _selector(data)
        self._require_weights()
        self._require_session("update_weights_from_tensor")
        try:
            # Rank r decodes entry r and loads it into its own model, as SGLang's
            # TP workers do (each deserializes only its own rank's entry).
            per_rank = [decode_flattened_bucket(e) for e in entries]
        except TransportError as exc:
            raise _HTTPError(400, {"success": False, "message": str(exc)}) from exc
        self._times["decoded"] = time.monotonic()
        # The test fault lands in what TP rank 0 received (its own private mapping),
        # before the load copies it into the model: what SGLang's read-back reads.
        _fault_in_transit(per_rank[0], state.take_update_index())
        try:
            with state.model_lock:
                try:
                    state.load_selected(per_rank, selector)
                except _RankLoadError as failed:
                    rank, error = failed.rank, failed.error
                    message = f"TP rank {rank}: {error}" if rank else str(error)
                    raise _HTTPError(400, {"success": False, "message": message}) from error
        finally:
            # Drop every view so the sender's shared segments can be released.
            del per_rank
        self._times["loaded"] = time.monotonic()
        return self._after_update(data, "Success")

    def _require_weights(self) -> None:
        """400 while the weights are released (nothing to load them into)."""
        if "weights" in self.server.state.released:
            raise _HTTPError(
                400, {"success": False, "message": "weights are released; resume them first"}
            )

    def _require_session(self, route: str) -> None:
        """400 outside a weight-update session, on a server that has them (SGLang 0.5.23's
        ``SchedulerWeightUpdaterManager.update_weights_from_tensor`` and
        ``..._from_distributed``, each naming itself)."""
        state = self.server.state
        with state.lock:
            outside = state.weight_update_session and not state.session_open
        if outside:
            raise _HTTPError(400, {"success": False, "message": _outside_session(route)})

    def _after_update(self, data: dict[str, Any], message: str) -> dict[str, Any]:
        """What follows a successful load on every rank, the same for each update route:
        the scheduler learns the weights changed, the cache is flushed (``flush_cache``,
        default true) and ``weight_version`` recorded (pending until the session's end
        when one is open). Returns the answer, ``{"success": true, "message": message}``
        (``" Weight version updated to {v}."`` appended when a version came).

        Raises:
            _HTTPError: 500 when the flush is refused (requests still run): SGLang
                asserts there and its scheduler dies.
        """
        state = self.server.state
        state.scheduler.weights_changed()
        if data.get("flush_cache", True):
            with state.lock:
                if not state.scheduler.flush():
                    raise _error("Cache flush failed after updating weights", 500)
                state.cache.clear()
        version = data.get("weight_version")
        if version is not None:
            with state.lock:
                if state.session_open:
                    state.pending_version = str(version)
                else:
                    state.weight_version = str(version)
            message += f" Weight version updated to {version}."
        return {"success": True, "message": message}

    def _init_weights_update_group(self, data: dict[str, Any]) -> Any:
        """SGLang's ``InitWeightsUpdateGroupReqInput``: ``master_address`` (str),
        ``master_port``, ``rank_offset``, ``world_size`` (int), ``group_name`` (default
        ``"weight_update_group"``), ``backend`` (default ``"nccl"``).

        Every TP rank ``r`` joins group ``group_name`` as rank ``rank_offset + r`` of
        ``world_size``, all at once (the backend forms only once every rank, the
        trainer's rank 0 included, joined), each over its own client of the trainer's
        ``TCPStore`` at ``master_address:master_port``, as SGLang's TP workers do
        (``init_custom_process_group``, ``tcp://`` rendezvous). Blocks until formed, at
        most :attr:`ServerState.weights_update_timeout_s`.

        Answers ``{"success": true, "message": "Succeeded to initialize custom process
        group."}``; 400 ``{"success": false, "message": "Failed to initialize custom
        process group: {reason}."}`` for backend ``"nccl"`` (no CUDA here), a name
        already formed (torch's text), a rank outside ``world_size`` or a formation that
        failed or timed out (then no rank keeps a member); 422 for a malformed body.
        """
        state = self.server.state
        address, port = data.get("master_address"), data.get("master_port")
        offset, world = data.get("rank_offset"), data.get("world_size")
        name = data.get("group_name", _DEFAULT_GROUP)
        backend = data.get("backend", "nccl")
        if not (
            isinstance(address, str)
            and isinstance(port, int)
            and isinstance(offset, int)
            and isinstance(world, int)
            and not any(isinstance(v, bool) for v in (port, offset, world))
            and isinstance(name, str)
            and isinstance(backend, str)
        ):
            raise _HTTPError(
                422,
                {
                    "detail": "master_address (str), master_port, rank_offset and world_size "
                    "(int) are required; group_name and backend are strings"
                },
            )
        if not name:
            # SGLang asserts this in every TP worker.
            raise _HTTPError(400, {"success": False, "message": "Group name cannot be empty"})
        if backend == "nccl":
            raise _init_failure(
                "backend 'nccl' needs CUDA, and this test server runs on CPU only; "
                "use backend='gloo'"
            )
        if backend != "gloo":
            raise _init_failure(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        outside = [r for r in range(offset, offset + state.tp_size) if not 0 <= r < world]
        if outside:
            # Refused before any rank joins: the others would wait out the timeout.
            raise _init_failure(f"rank {outside[0]} is outside a group of {world} ranks")
        timeout_s = state.weights_update_timeout_s

        def join(tp_rank: int) -> CustomGroup:
            # One store client per TP rank, as SGLang's tcp:// rendezvous makes in each
            # TP worker process.
            store = dist.TCPStore(
                address,
                port,
                None,
                False,
                datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
            return join_custom_group(
                store,
                group_name=name,
                rank=offset + tp_rank,
                world_size=world,
                backend=backend,
                timeout_s=timeout_s,
            )

        with state.group_lock:
            with state.lock:
                taken = name in state.weight_groups
            if taken:
                # What torch's _new_process_group_helper raises in each TP worker.
                raise _init_failure(
                    "The specified group name has already been created, "
                    "please use a different group name"
                )
            results = _on_every_rank(state.tp_size, join)
            members = [m for m in results if isinstance(m, CustomGroup)]
            if len(members) < len(results):
                for member in members:
                    member.close()
                rank, exc = next(
                    (r, e) for r, e in enumerate(results) if isinstance(e, BaseException)
                )
                raise _init_failure(_on_rank(rank, exc))
            with state.lock:
                state.weight_groups[name] = members
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def _update_weights_from_distributed(self, data: dict[str, Any]) -> Any:
        """SGLang's ``UpdateWeightsFromDistributedReqInput``: ``names``, ``dtypes`` (torch
        attribute names: ``"bfloat16"``), ``shapes`` (one each per tensor), ``group_name``
        (default ``"weight_update_group"``), ``flush_cache`` (default true),
        ``abort_all_requests`` (default false), ``weight_version``, ``load_format``.

        Every TP rank receives the tensors from rank 0 over its own member of the group,
        all ranks at once: with ``load_format="flattened_bucket"`` ONE broadcast of a
        uint8 tensor, the tensors' bytes concatenated in ``names`` order, no padding
        (SGLang's ``FlattenedTensorBucket``); otherwise one broadcast per tensor, in
        ``names`` order. Each rank then loads them into its own model.

        Answers ``{"success": true, "message": "Succeeded to update parameter online."}``
        (``" Weight version updated to {v}."`` appended when ``weight_version`` came);
        400 ``{"success": false, ...}`` outside a session, for an unknown group, released
        weights, or a failed receive or load (SGLang's "Failed to update parameter
        online: ..." text; a failed broadcast leaves the group broken); 422 for a
        malformed body; 500 when the flush after the load is refused.
        """
        state = self.server.state
        names, dtypes, shapes = data.get("names"), data.get("dtypes"), data.get("shapes")
        name = data.get("group_name", _DEFAULT_GROUP)
        if not (
            isinstance(names, list)
            and all(isinstance(n, str) for n in names)
            and isinstance(dtypes, list)
            and all(isinstance(d, str) for d in dtypes)
            and isinstance(shapes, list)
            and all(
                isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)
                for shape in shapes
            )
            and isinstance(name, str)
        ):
            raise _HTTPError(
                422,
                {
                    "detail": "names and dtypes must be lists of strings, shapes a list of "
                    "lists of sizes, group_name a string"
                },
            )
        if not len(names) == len(dtypes) == len(shapes):
            # SGLang zips them and drops the extra entries silently; a bug to surface here.
            raise _HTTPError(
                422,
                {
                    "detail": "names, dtypes and shapes need one entry each per tensor, got "
                    f"{len(names)}, {len(dtypes)}, {len(shapes)}"
                },
            )
        bucketed = data.get("load_format") == FLATTENED_BUCKET
        selector = _selector(data)
        if data.get("abort_all_requests", False):
            # SGLang's TokenizerManager aborts before it hands the update on.
            state.scheduler.abort_all()
        self._require_session("update_weights_from_distributed")
        with state.group_lock:
            with state.lock:
                members = state.weight_groups.get(name)
                known = list(state.weight_groups)
            if members is None:
                raise _HTTPError(
                    400,
                    {
                        "success": False,
                        "message": f"Group {name} not in {known}. "
                        "Please call `init_weights_update_group` first.",
                    },
                )
            self._require_weights()
            try:
                specs = [
                    (n, _torch_dtype(d), tuple(shape))
                    for n, d, shape in zip(names, dtypes, shapes, strict=True)
                ]
            except ValueError as exc:
                raise _update_failure(str(exc)) from exc
            group = members
            index = state.take_update_index()

            def receive(tp_rank: int) -> list[tuple[str, torch.Tensor]]:
                return _receive_tensors(group[tp_rank], specs, bucketed)

            results = _on_every_rank(state.tp_size, receive)
            self._times["received"] = time.monotonic()
            per_rank: list[list[tuple[str, torch.Tensor]]] = []
            for rank, result in enumerate(results):
                if isinstance(result, BaseException):
                    raise _update_failure(_on_rank(rank, result))
                per_rank.append(result)
            # The test fault lands in what TP rank 0 received, before its load.
            _fault_in_transit(per_rank[0], index)
            with state.model_lock:
                try:
                    state.load_selected(per_rank, selector)
                except _RankLoadError as failed:
                    raise _update_failure(_on_rank(failed.rank, failed.error)) from failed.error
            self._times["loaded"] = time.monotonic()
        return self._after_update(data, "Succeeded to update parameter online.")

    def _destroy_weights_update_group(self, data: dict[str, Any]) -> Any:
        """SGLang's ``DestroyWeightsUpdateGroupReqInput``: ``group_name`` (default
        ``"weight_update_group"``). Closes every TP rank's member and forgets the group.

        Answers ``{"success": true, "message": "Succeeded to destroy custom process
        group."}``; 400 ``{"success": false, "message": "The group to be destroyed does
        not exist."}`` for a name not formed.
        """
        state = self.server.state
        name = data.get("group_name", _DEFAULT_GROUP)
        if not isinstance(name, str):
            raise _HTTPError(422, {"detail": "group_name must be a string"})
        with state.group_lock:
            with state.lock:
                members = state.weight_groups.pop(name, None)
            if members is None:
                raise _HTTPError(
                    400,
                    {"success": False, "message": "The group to be destroyed does not exist."},
                )
            for member in members:
                member.close()
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _begin_weight_update(self, data: dict[str, Any]) -> Any:
        """SGLang 0.5.23's ``BeginWeightUpdateReqInput`` (``selector``: ``"target" | "draft" |
        "all"``, its only field; another value is SGLang's validation error, 400): opens the
        session; a second ``begin`` is refused (400), as SGLang's ``begin_weight_update``."""
        selector = _selector(data)
        state = self.server.state
        with state.lock:
            if state.session_open:
                raise _HTTPError(400, {"success": False, "message": _SESSION_OPEN})
            state.session_open = True
            state.session_selector = selector
            state.pending_version = None
            state.update_index = 0
        return {"success": True, "message": "Success"}

    def _end_weight_update(self, data: dict[str, Any]) -> Any:
        """SGLang's ``EndWeightUpdateReqInput``: closes the session (the loader's
        post-processing is a no-op here), recording the version its updates carried."""
        state = self.server.state
        with state.lock:
            if not state.session_open:
                raise _HTTPError(400, {"success": False, "message": _NO_SESSION})
            state.session_open = False
            if state.pending_version is not None:
                state.weight_version, state.pending_version = state.pending_version, None
        return {"success": True, "message": "Success"}

    def _update_weight_version(self, data: dict[str, Any]) -> Any:
        """SGLang's ``UpdateWeightVersionReqInput``: ``new_version`` (str), ``abort_all_requests``
        (default True). Only the label changes, never the weights; ``abort_all_requests``
        ends the running requests before their next token (``finish_reason`` abort)."""
        version = data.get("new_version")
        if not isinstance(version, str):
            raise _error(f"new_version must be a string, got {version!r}")
        abort = data.get("abort_all_requests", True)
        if not isinstance(abort, bool):
            raise _error(f"abort_all_requests must be a bool, got {abort!r}")
        if abort:
            self.server.state.scheduler.abort_all()
        with self.server.state.lock:
            self.server.state.weight_version = version
            self.server.state.update_index = 0
        return {
            "success": True,
            "message": f"Weight version updated to {version}",
            "new_version": version,
        }

    def _get_weights_by_name(self, data: Any) -> Any:
        """SGLang's ``GetWeightsByNameReqInput``: ``name`` (str), ``truncate_size``
        (default 100). GET or POST, as SGLang's route.

        Answers 200 with TP rank 0's tensor as SGLang 0.5.23's
        ``LlamaForCausalLM.get_weights_by_name`` gives it (:func:`_sglang_weight`):
        ``.to(torch.float32).tolist()[:truncate_size]`` (the first ``truncate_size``
        entries of the first dimension; NaN and infinities ``null``, as ``orjson``
        writes them); 400 ``{"error": {"message": "Get parameter by name failed"}}``
        where SGLang's method returns None (no such parameter, a 0-d tensor); 422 for
        a malformed body.
        """
        state = self.server.state
        body = data if isinstance(data, dict) else {}
        name, truncate_size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not _is_int(truncate_size):
            raise _HTTPError(
                422, {"detail": "name (str) is required; truncate_size must be an int"}
            )
        with state.model_lock:
            rows = _sglang_weight(state.ranks, name, truncate_size)
        if rows is None:
            raise _error("Get parameter by name failed")
        return rows

    def _weights_checker(self, data: Any) -> Any:
        """SGLang 0.5.23's ``CheckWeightsReqInput`` (GET or POST, body optional):
        ``action`` (default ``"checksum"``; ``"snapshot"``, ``"reset_tensors"``,
        ``"compare"``), ``allow_quant_error`` (bool), ``skip_tensor_list`` (substrings of
        names left out), ``selector`` (``"target"``, ``"draft"``, ``"all"``: the draft's
        checksums are keyed ``"draft." + name``, its own names, as SGLang's
        ``_merge_checksum_payloads``; no draft: ``"draft"`` checks nothing). SGLang's
        ``WeightChecker`` over each TP rank's ``named_parameters()`` and ``named_buffers()``
        (this server's: the HF names; SGLang's: its own, the fused
        ``qkv_proj``/``gate_up_proj``), the rotary caches skipped.

        * ``snapshot``: each rank copies its tensors (SGLang: into host memory);
        * ``compare``: each rank compares its tensors with its snapshot, bit for bit,
          then drops the snapshot; a rank without one fails (an ``assert``: message
          ``""``). Only TP rank 0 answers an SGLang scheduler request, so only its
          outcome comes back;
        * ``reset_tensors``: each rank overwrites its tensors with random values;
        * ``checksum``: each rank hashes each tensor (``tensor_hash``: on CPU the first
          8 bytes of its bytes' SHA-256, big-endian, as 16 hex digits; on GPU a Triton
          hash), all ranks gathered.

        Answers 200 ``{"success": true, "message": "Success."}`` plus, for
        ``checksum``, ``"ranks"`` (one ``ChecksumInfo`` per TP rank: ``checksums``
        ``{name: hex}``, ``per_gpu_checksum``, ``parallelism_info``) and
        ``"per_engine_checksum"``; 400 ``{"success": false, "message": ...}`` on
        failure (a compare's names each differing tensor: ``"check tensor equality
        failed:\\nname=N max_abs_err=... "``); 422 for a malformed body.
        """
        state = self.server.state
        body = {} if data is None else data
        action = body.get("action", "checksum") if isinstance(body, dict) else None
        skip = body.get("skip_tensor_list") if isinstance(body, dict) else None
        if not (
            isinstance(body, dict)
            and isinstance(action, str)
            and isinstance(body.get("allow_quant_error", False), bool)
            and (skip is None or (isinstance(skip, list) and all(isinstance(x, str) for x in skip)))
            and body.get("selector", "all") in ("target", "draft", "all")
        ):
            raise _HTTPError(
                422,
                {
                    "detail": "action (str), allow_quant_error (bool), skip_tensor_list "
                    "(list of str), selector ('target', 'draft' or 'all')"
                },
            )
        selector = body.get("selector", "all")
        roles = [
            (role, runners)
            for role, runners in (("target", state.ranks), ("draft", state.draft_ranks))
            if selector in (role, "all") and runners
        ]
        if not roles:
            # No draft runner: SGLang's check_weights merges nothing and succeeds.
            return {"success": True, "message": "Success."}
        with state.model_lock:
            try:
                ranks = [
                    _merge_checksums(
                        [
                            (
                                role,
                                _check_weights(
                                    state, rank, runners[rank], action, skip or [], role
                                ),
                            )
                            for role, runners in roles
                        ]
                    )
                    for rank in range(state.tp_size)
                ]
            except _CheckFailed as exc:
                raise _HTTPError(400, {"success": False, "message": str(exc)}) from exc
        answer: dict[str, Any] = {"success": True, "message": "Success."}
        if action == "checksum":
            answer["ranks"] = ranks
            engine = hashlib.sha256()
            for info in ranks:
                engine.update(str((info or {}).get("per_gpu_checksum")).encode())
            answer["per_engine_checksum"] = engine.hexdigest()
        return answer

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

    def _release(self, tags: list[str]) -> None:
        state = self.server.state
        if not state.enable_memory_saver:
            raise _error("release_memory_occupation needs --enable-memory-saver")
        with state.lock:
            if state.running:
                raise _error(
                    "release_memory_occupation should be called only when no ongoing request."
                )
            state.released.update(tags)
            if "kv_cache" in tags:
                state.cache.clear()
                state.scheduler.drop_tree()
        return None

    def _resume(self, tags: list[str]) -> None:
        state = self.server.state
        with state.lock:
            missing = [t for t in tags if t not in state.released]
            if missing:
                raise _error(f"resume_memory_occupation: {missing} not released")
            state.released.difference_update(tags)
        if "weights" in tags and not state.weights_cpu_backup:
            # The memory saver hands back fresh pages: the old weights are gone.
            with state.model_lock:
                for runner in state.ranks:
                    runner.fill_(float("nan"))
        return None

    # -- test-only ------------------------------------------------------------------

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


#: SGLang's default ``group_name`` of the three weight-update group routes (io_struct).
_DEFAULT_GROUP = "weight_update_group"
_T = TypeVar("_T")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reason(exc: BaseException) -> str:
    """An exception's first line (torch's store errors run over many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _on_rank(rank: int, exc: BaseException) -> str:
    """``exc``'s reason, naming the TP rank when it is not rank 0 (as the tensor route)."""
    return f"TP rank {rank}: {_reason(exc)}" if rank else _reason(exc)


def _init_failure(reason: str) -> _HTTPError:
    # SGLang's init_weights_update_group wraps every formation error so.
    return _HTTPError(
        400,
        {"success": False, "message": f"Failed to initialize custom process group: {reason}."},
    )


def _update_failure(reason: str) -> _HTTPError:
    # SGLang's update_weights_from_distributed wraps every receive or load error so.
    return _HTTPError(
        400,
        {
            "success": False,
            "message": f"Failed to update parameter online: {reason}. The full weights of the "
            "ModelRunner are partially updated. Please discard the whole weights.",
        },
    )


def _torch_dtype(name: str) -> torch.dtype:
    """``getattr(torch, name)`` as SGLang resolves ``dtypes`` entries; ValueError when
    that is no dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def _on_every_rank(count: int, work: Callable[[int], _T]) -> list[_T | BaseException]:
    """``work(r)`` for every TP rank ``r < count`` at once, each in its own thread: the
    ranks take part in one collective together (SGLang's TP workers are processes),
    so one at a time would wait for the others forever. Returns each rank's result or
    exception, rank order; every thread has ended by then."""
    if count == 1:
        try:
            return [work(0)]
        except Exception as exc:
            return [exc]
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="aiosync-sglang-tp") as pool:
        futures = [pool.submit(work, rank) for rank in range(count)]
    out: list[_T | BaseException] = []
    for future in futures:
        error = future.exception()
        out.append(future.result() if error is None else error)
    return out


def _receive_tensors(
    member: CustomGroup,
    specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    bucketed: bool,
) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's receive of ``/update_weights_from_distributed``.

    Args:
        member: this rank's member of the group (rank 0, the trainer, sends).
        specs: ``(name, dtype, shape)`` per tensor, ``names`` order.
        bucketed: ONE broadcast of a uint8 tensor of ``sum(numel * element_size)``
            bytes, each tensor's bytes in ``specs`` order with no padding (SGLang's
            ``FlattenedTensorBucket``); False: one broadcast per tensor, in order.

    Returns:
        ``(name, tensor)`` per spec, of its dtype and shape: views of the received
        bucket where its offset is aligned for its dtype, else copies.

    Raises:
        TransportError, SyncTimeoutError: a broadcast failed (the member is broken).
    """
    if not bucketed:
        tensors = [(name, torch.empty(shape, dtype=dtype)) for name, dtype, shape in specs]
        # SGLang issues every broadcast async and then waits for all: on one
        # connection the same order, received one after the other here.
        for name, tensor in tensors:
            member.broadcast(tensor, what=f"receiving {name!r}")
        return tensors
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    member.broadcast(flat, what=f"receiving a bucket of {len(specs)} tensors, {flat.numel()} bytes")
    out: list[tuple[str, torch.Tensor]] = []
    start = 0
    for (name, dtype, shape), size in zip(specs, sizes, strict=True):
        piece = flat[start : start + size]
        if start % dtype.itemsize == 0:
            # A view of the bucket, as SGLang's FlattenedTensorBucket.reconstruct_tensors.
            out.append((name, piece.view(dtype).view(shape)))
        else:
            # A dtype view needs an aligned offset: a copy (mixed-dtype buckets only).
            tensor = torch.empty(shape, dtype=dtype)
            tensor.view(-1).view(torch.uint8).copy_(piece)
            out.append((name, tensor))
        start += size
    return out


def _fault_in_transit(tensors: Sequence[tuple[str, torch.Tensor]], bucket: int) -> None:
    """Apply the test fault armed for ``bucket`` (:func:`transit_fault`, a no-op unless a
    test armed one) to the bytes one TP rank received, before its load.

    The received tensors are views of one buffer, back to back (a flattened bucket):
    the fault is applied to those bytes in place. Otherwise (one broadcast per tensor)
    to a copy of their bytes in order, copied back.
    """
    views = [tensor for _, tensor in tensors]
    if not views:
        return
    span = _span(views)
    if span is not None:
        transit_fault(span, bucket)
        return
    raw = torch.cat([v.reshape(-1).view(torch.uint8) for v in views])
    transit_fault(raw, bucket)
    start = 0
    for view in views:
        size = view.numel() * view.element_size()
        view.reshape(-1).view(torch.uint8).copy_(raw[start : start + size])
        start += size


def _span(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A ``uint8`` view of the bytes ``views`` cover when they lie back to back, in order,
    contiguous, in one storage; else None."""
    storage = views[0].untyped_storage()
    start = end = views[0].storage_offset() * views[0].element_size()
    for view in views:
        offset = view.storage_offset() * view.element_size()
        if (
            view.untyped_storage().data_ptr() != storage.data_ptr()
            or not view.is_contiguous()
            or offset != end
        ):
            return None
        end = offset + view.numel() * view.element_size()
    span = torch.empty(0, dtype=torch.uint8, device=views[0].device)
    return span.set_(storage, start, (end - start,), (1,))


# SGLang's LlamaForCausalLM.stacked_params_mapping: (checkpoint name part, shard id),
# cut out of its fused qkv_proj / gate_up_proj.
_STACKED = (
    (".q_proj", "q"),
    (".k_proj", "k"),
    (".v_proj", "v"),
    (".gate_proj", 0),
    (".up_proj", 1),
)
# The dense layers LlamaForCausalLM fuses: its params_dict has no other stacked name.
_FUSED_NAME = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$"
)
#: SGLang's vocabulary padding (``DEFAULT_VOCAB_PADDING_SIZE``) of the embedding and head.
_VOCAB_PADDING = 64


def _sglang_weight(ranks: Sequence[HFModelRunner], name: str, truncate_size: int) -> Any:
    """What SGLang 0.5.23's ``/get_weights_by_name`` answers for ``name``; None where its
    model's method returns None (a name it has no parameter for, a 0-d tensor).

    ``LlamaForCausalLM.get_weights_by_name`` (``python/sglang/srt/models/llama.py``), on
    the TP rank 0 of ``len(ranks)`` ranks, applied to whichever model this server
    serves (SGLang's ``Qwen3ForCausalLM`` has no such method: a real Qwen3 server
    answers 400 for every name):

    * ``q_proj``/``k_proj``/``v_proj``: rank 0's fused ``qkv_proj`` (its rows of q, k
      and v, laid out with the attention's ``head_dim``), narrowed at offsets computed
      with ``hidden_size // num_attention_heads`` as the head size, as SGLang does (for
      a model whose ``head_dim`` differs, k and v come back as other rows);
    * ``gate_proj``/``up_proj``: rank 0's ``gate_up_proj`` halves,
      ``intermediate_size // tp`` rows each;
    * ``o_proj``/``down_proj``: every rank's columns gathered (whole);
    * ``embed_tokens``/``lm_head``: rank 0's vocabulary shard, padded with zero rows to
      a multiple of 64 (a tied ``lm_head`` is the embedding);
    * anything else: the tensor as rank 0 holds it (the whole tensor).

    Then ``.to(torch.float32).tolist()[:truncate_size]``, non-finite values ``None``.
    """
    try:
        weight = _rank0_view(ranks, name)
        rows = weight[:truncate_size].to(torch.float32)
    except (AttributeError, KeyError, IndexError, RuntimeError, TypeError, ValueError):
        return None
    if bool(torch.isfinite(rows).all()):
        return rows.tolist()
    values = rows.numpy().astype(object)
    values[~np.isfinite(rows.numpy())] = None
    return values.tolist()


def _rank0_view(ranks: Sequence[HFModelRunner], name: str) -> torch.Tensor:
    """:func:`_sglang_weight`'s tensor before the truncation (raises where SGLang's does)."""
    tp = len(ranks)
    config = ranks[0].model.config
    for shard, shard_id in _STACKED:
        if shard not in name:
            continue
        if not _FUSED_NAME.match(name):
            raise KeyError(name)  # no such entry in LlamaForCausalLM's params_dict
        if shard_id in ("q", "k", "v"):
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            # Rank 0's shard of the fused layer: its heads of q, k and v (a kv head
            # replicated when there are fewer kv heads than ranks).
            q, k, v = (_hf_tensor(ranks[0], name.replace(shard, p)) for p in _QKV_PARTS)
            local_kv = max(1, kv_heads // tp) * head_dim
            fused = torch.cat([q[: heads // tp * head_dim], k[:local_kv], v[:local_kv]])
            size_of = config.hidden_size // heads  # SGLang's get_weights_by_name
            offset, size = {
                "q": (0, heads // tp * size_of),
                "k": (heads // tp * size_of, kv_heads // tp * size_of),
                "v": ((heads // tp + kv_heads // tp) * size_of, kv_heads // tp * size_of),
            }[str(shard_id)]
            return fused.narrow(0, offset, size)
        half = config.intermediate_size // tp
        gate = _hf_tensor(ranks[0], name.replace(shard, ".gate_proj"))
        up = _hf_tensor(ranks[0], name.replace(shard, ".up_proj"))
        return torch.cat([gate[:half], up[:half]]).narrow(0, 0 if shard_id == 0 else half, half)
    weight = _hf_tensor(ranks[0], name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        vocab = weight.shape[0]
        per_rank = -(-vocab // _VOCAB_PADDING) * _VOCAB_PADDING // tp
        if per_rank > vocab:
            weight = torch.cat([weight, weight.new_zeros((per_rank - vocab, *weight.shape[1:]))])
        return weight[:per_rank]
    if tp > 1 and ("o_proj" in name or "down_proj" in name):
        # Row-parallel: rank r holds columns r; SGLang all-gathers them (dim 1; a 1-D
        # bias fails there, as in SGLang).
        columns = weight.shape[1] // tp
        parts = [_hf_tensor(ranks[r], name).narrow(1, r * columns, columns) for r in range(tp)]
        return torch.cat(parts, dim=1)
    return weight


_QKV_PARTS = (".q_proj", ".k_proj", ".v_proj")


def _hf_tensor(runner: HFModelRunner, name: str) -> torch.Tensor:
    """Checkpoint tensor ``name`` of ``runner``'s model (KeyError: it has none)."""
    try:
        return runner.model.get_parameter(name).detach()
    except AttributeError:
        # Not a module path of the model (PEFT-wrapped layers, FP8 scales): the
        # checkpoint view, a copy of every tensor (rare).
        return runner.hf_state_dict()[name]


class _CheckFailed(Exception):
    """A ``/weights_checker`` action failed on a rank (SGLang's message)."""


#: SGLang 0.5.23's ``_NON_PERSISTENT_BUFFER_PATTERNS`` (``utils/weight_checker.py``):
#: never reset, compared or hashed.
_UNCHECKED = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")


def _check_weights(
    state: ServerState,
    rank: int,
    runner: HFModelRunner,
    action: str,
    skip: Sequence[str],
    role: str = "target",
) -> dict[str, Any] | None:
    """One TP rank's ``WeightChecker.handle`` (SGLang 0.5.23) on its ``role``'s runner
    (``"target"``, ``"draft"``): returns its ``ChecksumInfo`` for ``checksum``, else
    None; raises :class:`_CheckFailed`."""
    key: int | tuple[str, int] = rank if role == "target" else (role, rank)
    model = runner.model
    tensors = {
        name: t.data
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if not any(p in name for p in (*_UNCHECKED, *skip))
    }
    if action == "snapshot":
        state.weight_snapshots[key] = {name: t.detach().clone() for name, t in tensors.items()}
        return None
    if action == "reset_tensors":
        with torch.no_grad():
            for t in tensors.values():
                t.copy_(torch.rand(t.shape, dtype=torch.float32).to(t.dtype))
        return None
    if action == "compare":
        snapshot = state.weight_snapshots.get(key)
        if snapshot is None:
            raise _CheckFailed("")  # SGLang's bare ``assert self._snapshot_tensors is not None``
        errors = []
        for name, actual in tensors.items():
            expect = snapshot[name]
            if torch.equal(expect.view(torch.uint8), actual.view(torch.uint8)):
                continue
            diff = (expect.float() - actual.float()).abs()
            errors.append(
                f"name={name} max_abs_err={float(diff.max())} mean_abs_err={float(diff.mean())} "
                f"num_exceed={int((diff > 0).sum())} expect={_raw(expect)} actual={_raw(actual)} "
            )
        del state.weight_snapshots[key]
        # Only TP rank 0 answers SGLang's scheduler requests: another rank's outcome is lost.
        if errors and rank == 0:
            raise _CheckFailed("check tensor equality failed:\n" + "\n".join(errors))
        return None
    if action == "checksum":
        checksums = {name: _tensor_hash(t) for name, t in tensors.items()}
        placement = {"tp_rank": rank, "tp_size": state.tp_size, "dp_rank": 0, "dp_size": 1}
        return {
            "checksums": checksums,
            "per_gpu_checksum": _overall_checksum(checksums),
            "parallelism_info": [
                {"role": role, **placement, "pp_rank": 0, "pp_size": 1}
                | {"rank": rank, "size": state.tp_size}
            ],
        }
    raise _CheckFailed(f"Unsupported action={action!r}")


def _overall_checksum(checksums: Mapping[str, str]) -> str:
    overall = hashlib.sha256()
    for name in sorted(checksums):
        overall.update(name.encode())
        overall.update(checksums[name].encode())
    return overall.hexdigest()


def _merge_checksums(
    payloads: Sequence[tuple[str, dict[str, Any] | None]],
) -> dict[str, Any] | None:
    """One TP rank's ``ChecksumInfo`` over its runners (SGLang 0.5.23's
    ``_merge_checksum_payloads``): a draft's names prefixed by its role, the target's
    as they are; None when no runner answered one (an action other than ``checksum``)."""
    answered = [(role, p) for role, p in payloads if p is not None]
    if not answered:
        return None
    if len(answered) == 1 and answered[0][0] == "target":
        return answered[0][1]
    merged: dict[str, str] = {}
    infos: list[Any] = []
    for role, payload in answered:
        for name, checksum in payload["checksums"].items():
            merged[name if role == "target" else f"{role}.{name}"] = checksum
        infos.extend(payload["parallelism_info"])
    return {
        "checksums": merged,
        "per_gpu_checksum": _overall_checksum(merged),
        "parallelism_info": infos,
    }


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


def _tensor_hash(tensor: torch.Tensor) -> str:
    """SGLang's ``f"{tensor_hash(t):016x}"`` on a CPU tensor (``mm_utils.tensor_hash``)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{int.from_bytes(hashlib.sha256(raw).digest()[:8], 'big'):016x}"


def _raw(tensor: torch.Tensor) -> str:
    """SGLang's ``repr(RawComparable)``."""
    return f"raw(shape={tuple(tensor.shape)} dtype={tensor.dtype})"


def _weight_version_spans(
    labels: Sequence[str | None], current: str | None
) -> list[dict[str, Any]]:
    """SGLang 0.5.23's ``meta_info["weight_versions"]`` for output tokens computed under
    ``labels`` (one each): ``{"version", "start", "end"}`` per run of one label, token
    positions ``[start, end)``; no token: one empty span of the ``current`` label."""
    spans: list[dict[str, Any]] = []
    for index, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": label, "start": index, "end": index + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: ServerState

    def server_close(self) -> None:
        """Stop listening and close every weight-update group (no gloo thread or
        socket outlives the server)."""
        super().server_close()
        state = getattr(self, "state", None)
        if state is not None:
            state.close_weight_groups()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (timeout, dropped fault) is not a server error.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def make_server(state: ServerState, port: int = 0) -> _Server:
    """Bind a server for ``state`` on 127.0.0.1:``port`` (0: any free port)."""
    server = _Server(("127.0.0.1", port), _Handler)
    server.state = state
    return server


@contextlib.asynccontextmanager
async def serve_in_subprocess(
    model_config: Mapping[str, Any],
    *,
    seed: int = 0,
    dtype: str = "float32",
    args: Sequence[str] = (),
    start_timeout_s: float = 300.0,
) -> AsyncIterator[str]:
    """Run this server in its own process on 127.0.0.1; yield its base URL.

    Args:
        model_config: an HF config dict with ``model_type`` (random init, ``seed``).
        seed: the server model's init seed.
        dtype: the server model's dtype name (``"float32"``, ``"bfloat16"``).
        args: more command-line flags (``["--api-key", "k", "--enable-memory-saver"]``).
        start_timeout_s: limit for the model build and bind, seconds.

    The server exits with this process, however it ends (even SIGKILL): it holds
    the read end of a pipe whose write end only this process has (``--parent-fd``);
    the kernel closes that on death and the server reads EOF. A child this process
    forks (not spawns) inherits the write end and keeps the server up while it lives.
    Leftovers of dead aiosync processes are removed first
    (:mod:`aiosync.transports._leftovers`).

    Raises:
        TransportError: the server exited before it was ready.
        TimeoutError: it was not ready within ``start_timeout_s``.
    """
    sweep_leftovers()
    with tempfile.TemporaryDirectory(prefix=dir_prefix("sglang")) as tmp:
        config_path, port_file = Path(tmp) / "config.json", Path(tmp) / "port"
        config_path.write_text(json.dumps(dict(model_config)))
        # os.pipe() is close-on-exec: only the server (pass_fds) gets the read end.
        parent_r, parent_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "aiosync.testing.sglang_server", "--port", "0",
                 "--port-file", str(port_file), "--model-config", str(config_path),
                 "--seed", str(seed), "--dtype", dtype, "--parent-fd", str(parent_r), *args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(parent_r,),
            )  # fmt: skip
        except BaseException:
            os.close(parent_w)
            raise
        finally:
            os.close(parent_r)
        try:
            with anyio.fail_after(start_timeout_s):
                while not port_file.exists():
                    if proc.poll() is not None:
                        raise TransportError(f"SGLang test server exited with {proc.returncode}")
                    await anyio.sleep(0.1)
            yield f"http://127.0.0.1:{port_file.read_text()}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            os.close(parent_w)


def _model_config(parser: argparse.ArgumentParser, value: str) -> str | dict[str, Any]:
    """``--model-config``: a path on disk wins; otherwise a preset name of ``aiosync bench``."""
    if Path(value).exists():
        return value
    if value in MODEL_CONFIGS:
        return dict(MODEL_CONFIGS[value])
    parser.error(
        f"--model-config {value!r} is neither a config.json or folder on disk nor a preset; "
        f"presets: {', '.join(MODEL_CONFIGS)}"
    )


def main(argv: list[str] | None = None) -> None:
    """Command line: build the model, bind, write the port, serve until killed."""
    parser = argparse.ArgumentParser(
        prog="python -m aiosync.testing.sglang_server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, default=0, help="0: a free port (default)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here when ready")
    parser.add_argument(
        "--model-config",
        required=True,
        help="config.json, a folder holding one (with *.safetensors: loaded, else random "
        f"weights), or a preset of `aiosync bench --model`: {', '.join(MODEL_CONFIGS)} "
        "(qwen3-tiny builds in seconds; the others are full-size, random weights)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for generation and load_weights (default 1: test machines are "
        "shared, and more threads than free cores make OpenMP spin)",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--lora-target-modules", nargs="*", default=None)
    parser.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="a draft model beside the target (as --model-config; built with seed + 1), its "
        "tensors named --speculative-draft-prefix + its own names in updates, loaded by the "
        "updates whose selector is 'draft' or 'all' (docs/draft.md)",
    )
    parser.add_argument("--speculative-draft-prefix", default="mtp.")
    parser.add_argument(
        "--no-weight-update-session",
        action="store_true",
        help="act as an SGLang before the weight-update session (PRs #28710, #28001): no "
        "/begin_weight_update, /end_weight_update (404), updates accepted without one",
    )
    parser.add_argument(
        "--weights-update-timeout-s",
        type=float,
        default=120.0,
        help="limit of a weight-update group's formation (/init_weights_update_group) and of "
        "each of its broadcasts (/update_weights_from_distributed), seconds (default 120)",
    )
    parser.add_argument(
        "--parent-fd",
        type=int,
        default=None,
        help="read end of a pipe from the parent: EOF (the parent died or closed it) stops "
        "the server",
    )
    args = parser.parse_args(argv)
    folders: list[str] = []  # removed however the server stops

    def stop(*_: object) -> None:
        # Stopped with SIGTERM (as serve_in_subprocess does) or orphaned: remove the
        # preset's config folder, then leave at once (an unwinding exit races torch's
        # native threads). The weight-update groups are not closed first: gloo's
        # teardown waits out a broadcast in flight; the kernel closes their sockets.
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if args.parent_fd is not None:
        # Watching from the start: a parent that dies during the model build counts too.
        _stop_on_eof(args.parent_fd, stop)
    # Resolved before the model build so that a typo fails at once, with the presets listed.
    model_config = _model_config(parser, args.model_config)
    # Bound before the model build too: a busy port fails at once, and leaves nothing.
    try:
        server = _Server(("127.0.0.1", args.port), _Handler)
    except OSError as exc:
        print(
            f"aiosync SGLang test server: cannot listen on 127.0.0.1:{args.port}: "
            f"{exc.strerror or exc} (another process holds the port? pass --port 0 for a "
            "free one)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)
    use_file_system_sharing()
    torch.set_num_threads(args.threads)
    runner = HFModelRunner.from_config(model_config, seed=args.seed, dtype=args.dtype)
    model_path = str(args.model_config)
    config_dir = None
    if isinstance(model_config, dict):
        # A preset has no folder: write its config so that /get_server_info's model_path
        # lets a trainer check its manifest against this model, as with real SGLang.
        config_dir = tempfile.mkdtemp(prefix=dir_prefix("sglang-config"))
        folders.append(config_dir)
        runner.model.config.save_pretrained(config_dir)
        model_path = config_dir
    draft_ranks: list[HFModelRunner] = []
    draft_path = None
    if args.speculative_draft_model_path is not None:
        draft_config = _model_config(parser, args.speculative_draft_model_path)
        draft = HFModelRunner.from_config(draft_config, seed=args.seed + 1, dtype=args.dtype)
        draft_ranks.append(draft)
        draft_path = str(args.speculative_draft_model_path)
        if isinstance(draft_config, dict):
            draft_dir = tempfile.mkdtemp(prefix=dir_prefix("sglang-config"))
            folders.append(draft_dir)
            draft.model.config.save_pretrained(draft_dir)
            draft_path = draft_dir
    state = ServerState(
        runner=runner,
        draft_ranks=draft_ranks,
        draft_prefix=args.speculative_draft_prefix,
        draft_model_path=draft_path,
        tp_size=args.tp_size,
        api_key=args.api_key,
        enable_memory_saver=args.enable_memory_saver,
        weights_cpu_backup=args.enable_weights_cpu_backup,
        model_path=model_path,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
        weight_update_session=not args.no_weight_update_session,
        weights_update_timeout_s=args.weights_update_timeout_s,
    )
    server.state = state
    port = server.server_address[1]
    if args.port_file is not None:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    print(f"aiosync SGLang test server on http://127.0.0.1:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        if config_dir is not None:
            shutil.rmtree(config_dir, ignore_errors=True)


def _stop_on_eof(fd: int, stop: Callable[[], None]) -> None:
    """Call ``stop`` when pipe ``fd`` reads EOF: every write end closed (the parent died).

    A daemon thread blocks in ``read``; nothing polls. The parent never writes, so
    any bytes that arrive are read and ignored.
    """

    def watch() -> None:
        with contextlib.suppress(OSError):  # a broken fd means no parent to wait for either
            while os.read(fd, 64):
                pass
        stop()

    threading.Thread(target=watch, name="aiosync-parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
