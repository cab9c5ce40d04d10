"""What the handlers share: the request scheduler (pause modes, retraction, the radix
tree's flush) and :class:`ServerState`."""

from __future__ import annotations

import collections
import copy
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import SyncError
from aiosync.transports.collective._custom_group import CustomGroup

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
