"""A real vLLM engine as aiosync's generation backend and engine workers.

:class:`VLLMGenerationBackend` wraps a ``vllm.LLM`` (synchronous; its calls run
in a worker thread through ``anyio.to_thread``) or a ``vllm.v1.engine.async_llm.AsyncLLM``
(awaited directly) and gives the training loop and the transports what they
expect of any engine:

* :class:`aiosync.EngineWorkers` — ``collective_rpc(method, args, kwargs, timeout_s)``
  calls the worker extension's ``aiosync_*`` methods by name through vLLM's own
  ``collective_rpc`` (the engine must be built with
  ``worker_extension_cls=`` :data:`WORKER_EXTENSION`).
* :class:`aiosync.GenerationBackend` — ``prepare_for_generation(tags)`` wakes
  the engine (``wake_up(tags)``) and drops the prefix cache (KV computed with old
  weights must not survive a refit); ``finish_generation()`` puts it to sleep
  (``sleep(level)``).
* ``generate(prompts)`` — greedy (or sampled) token ids for token-id prompts.
* ``load_lora_adapter(adapter)`` — an adapter-only refit (:class:`aiosync.LoRAAdapter`):
  vLLM loads the adapter as ``LoRARequest(adapter.name, adapter.version, path)``
  and every later ``generate`` uses it (the engine must be built with
  ``enable_lora=True`` and ``max_lora_rank >= r``).
* ``pause_generation(mode, clear_cache)`` / ``resume_generation()`` — the
  synchronizer's in-flight policy around a sync: ``AsyncLLM``'s own
  ``pause_generation(mode=..., clear_cache=...)`` (``"abort"``, ``"wait"``,
  ``"keep"``); on ``vllm.LLM`` only ``"wait"`` (see :meth:`VLLMGenerationBackend.pause_generation`).

Sleep mode exists only where vLLM supports it (CUDA, ROCm, XPU) and the engine
was built with ``enable_sleep_mode=True``. vLLM's CPU worker rejects
``enable_sleep_mode`` and turns ``sleep``/``wake_up`` into no-ops; there this
backend logs once that no memory is released and does nothing, rather than
pretend (see ``docs/vllm.md``).

Data parallelism (``data_parallel_size`` N > 1): aiosync must reach every
worker of every replica, or a sync would update some replicas and report
success. The first :meth:`VLLMGenerationBackend.collective_rpc` asks every
worker it reaches who it is (``aiosync_worker_identity``: vLLM's
``data_parallel_index``, rank in its replica) and compares the answers with the
engine's N × (TP × PP) workers (see :class:`DataParallelScope`):

* **One client over every replica** (vLLM's internal load balancer:
  ``AsyncLLM`` / ``vllm serve --data-parallel-size N``). vLLM's own
  ``collective_rpc`` runs the call on every engine but returns the first
  engine's replies only (``DPLBAsyncMPClient.call_utility_async``); this
  backend collects every engine's (``call_utility_all_async``), so the engine
  is one fleet of N replicas: one sync updates all of them, worker ranks are
  global (``data_parallel_index * world_size + rank``, as vLLM's NCCL weight
  transfer numbers them) and a non-colocated sync passes
  ``inference_world_size = N * TP * PP``.
* **A client of some replicas only** (``--data-parallel-external-lb`` /
  ``--data-parallel-rank d``: one ``AsyncLLM`` per DP rank, as vLLM 0.32 allows
  for MoE models; ``--data-parallel-hybrid-lb``: one per node). Its RPCs reach
  those replicas alone, so on its own it refuses the weight transports' set-up
  and receive RPCs (``aiosync_ipc_init``, ``aiosync_collective_init``, ...) with
  a :class:`~aiosync.errors.TransportError` naming the replicas, before any
  byte moves. Put one backend per client in an :class:`aiosync.EngineFleet` (any
  order): the fleet numbers their workers (each backend's replicas from its
  first one) and one sync updates every replica. What aiosync cannot see from
  one client is whether the fleet holds all N replicas; LoRA adapter loads
  (``load_lora_adapter``, vLLM's ``add_lora``) are not checked either.
* Anything else (a replica's workers missing, a client that reaches replicas
  whose replies it drops) is a ``TransportError`` before any byte moves.

Errors: a worker's exception reaches the client of a multiprocess vLLM engine
as a plain ``Exception`` carrying only its message; the worker extension
(:mod:`aiosync.engines.vllm.worker`) tags aiosync's own errors in that message and
this module re-raises them with their type (``RefitMismatchError``,
``TransportError``, ``SyncTimeoutError``); anything else becomes a
``TransportError``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError
from aiosync.generation import Generation, parse_version
from aiosync.lora import LoRAAdapter
from aiosync.transports._leftovers import dir_prefix

__all__ = ["IN_FLIGHT_MODES", "WORKER_EXTENSION", "DataParallelScope", "VLLMGenerationBackend"]

_log = logging.getLogger(__name__)

#: The class to pass as vLLM's ``worker_extension_cls``.
WORKER_EXTENSION = "aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension"

#: The tags ``wake_up`` accepts (vLLM's ``LLM.wake_up``).
_WAKE_TAGS = frozenset({"weights", "kv_cache", "scheduling"})

#: The in-flight policies :meth:`VLLMGenerationBackend.pause_generation` knows
#: (aiosync's ``InFlightPolicy``; vLLM's ``PauseMode`` has the same three values).
IN_FLIGHT_MODES = ("abort", "wait", "keep")

_LLM_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()

# ``[aiosync:TypeName] message``, written by aiosync.engines.vllm.worker.
_TAGGED_ERROR = re.compile(r"\[aiosync:(\w+)\] (.*)", re.DOTALL)

#: Worker RPCs of the weight transports that set up or write a refit: refused by
#: a backend that reaches only some of vLLM's data-parallel replicas, unless it
#: is part of an EngineFleet (releases and status calls pass).
_WEIGHT_RPCS = frozenset(
    {
        "aiosync_ipc_init",
        "aiosync_ipc_receive",
        "aiosync_collective_init",
        "aiosync_collective_receive",
        "aiosync_collective_stage",
        "aiosync_collective_commit",
    }
)


@dataclass(frozen=True)
class DataParallelScope:
    """The vLLM data-parallel replicas a backend's ``collective_rpc`` reaches.

    Attributes:
        size: the engine's ``data_parallel_size`` (1: no data parallelism).
        ranks: the ``data_parallel_index`` of every replica whose workers
            answer, ascending and contiguous.
        replica_world_size: workers per replica (TP × PP).
        fan_out: replies are collected from each engine the client manages
            (vLLM's internal load balancer returns only the first engine's).
    """

    size: int
    ranks: tuple[int, ...]
    replica_world_size: int
    fan_out: bool = False

    @property
    def whole(self) -> bool:
        """True when every replica answers (a sync reaches the whole engine)."""
        return len(self.ranks) == self.size

    @classmethod
    def from_identities(
        cls,
        identities: Sequence[Mapping[str, Any]],
        size: int,
        replica_world_size: int,
        managed: int,
        fan_out: bool = False,
    ) -> DataParallelScope:
        """Check the workers' ``aiosync_worker_identity`` replies against the engine.

        Args:
            identities: one reply per answering worker.
            size: the engine's ``data_parallel_size`` (from the client's config).
            replica_world_size: workers per replica (TP × PP).
            managed: engines the client sends an RPC to (its ``core_engines``).
            fan_out: see the attribute.

        Raises:
            TransportError: a replica answered with fewer or more workers than
                ``replica_world_size`` (or a worker twice), an index outside
                ``0..size-1``, replicas not contiguous, or fewer replicas
                answered than the client reaches (their replies are dropped:
                vLLM's internal load balancer without ``call_utility_all_async``).
        """
        workers = [(int(i["dp_index"]), int(i["replica_rank"])) for i in identities]
        ranks = tuple(sorted({d for d, _ in workers}))
        complete = sorted(workers) == [(d, r) for d in ranks for r in range(replica_world_size)]
        contiguous = bool(ranks) and list(ranks) == list(range(ranks[0], ranks[-1] + 1))
        if not complete or not contiguous or ranks[-1] >= size:
            raise TransportError(
                f"vLLM engine with data_parallel_size={size} and {replica_world_size} "
                f"worker(s) per replica answered collective_rpc from workers "
                f"(dp_index, rank) {sorted(workers)}: not whole replicas; aiosync cannot "
                "tell which workers a sync would reach"
            )
        if len(ranks) < managed:
            raise TransportError(
                f"this vLLM client sends RPCs to {managed} data-parallel engines but "
                f"only replica(s) {list(ranks)} answered (vLLM's internal load balancer "
                "returns the first engine's replies): a sync would reach replicas whose "
                "failures go unseen. Use a vLLM whose AsyncMPClient has "
                "call_utility_all_async, or one AsyncLLM per DP rank "
                "(--data-parallel-external-lb) in an aiosync.EngineFleet"
            )
        return cls(size, ranks, replica_world_size, fan_out)


#: Where :meth:`VLLMGenerationBackend.load_lora_adapter` writes the adapter's PEFT
#: directory for vLLM to read (RAM-backed; the temp dir where it does not exist).
#: Each directory is ``aiosync-lora-<pid>-<8 chars>`` and is removed once vLLM
#: has read it.
LORA_DIR_PARENT = "/dev/shm"

#: PEFT's saved names of a LoRA pair: ``<prefix>.<module>.lora_A.weight`` ``[r, in]``,
#: ``...lora_B.weight`` ``[out, r]`` (embedding LoRA, ``lora_embedding_A/B``, is not matched).
LORA_PAIR_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<kind>[AB])\.weight")


class VLLMGenerationBackend:
    """aiosync's engine interface over a live vLLM engine.

    Args:
        engine: a ``vllm.LLM`` or an ``AsyncLLM``, built with
            ``worker_extension_cls=WORKER_EXTENSION``.
        sleep_level: ``sleep(level)`` used by :meth:`finish_generation`: 1 offloads
            weights to host memory and drops the KV cache; 2 discards the weights
            too (the next wake needs a refit: the transports are told, see
            :meth:`add_weights_discarded_listener`).
        rpc_timeout_s: default limit of one :meth:`collective_rpc`, seconds.

    Raises:
        ValueError: ``sleep_level`` is not 1 or 2.
        TypeError: ``engine`` is neither kind of vLLM engine.
    """

    def __init__(
        self,
        engine: Any,
        *,
        sleep_level: int = 1,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    ) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        if not callable(getattr(engine, "collective_rpc", None)):
            raise TypeError(f"{type(engine).__name__} is not a vLLM LLM/AsyncLLM engine")
        self.engine = engine
        self.sleep_level = sleep_level
        self.rpc_timeout_s = rpc_timeout_s
        self._is_async = inspect.iscoroutinefunction(engine.collective_rpc)
        self._sleep_mode = _sleep_mode_enabled(engine)
        self._asleep = False
        self._discard_listeners: list[Callable[[], None]] = []
        # vllm.LLM is not thread-safe: one call at a time per engine, whichever
        # backend wraps it. The lock is taken inside the worker thread, so a call
        # abandoned on timeout keeps it until vLLM returns and the next call waits
        # for that (within its own timeout).
        self._llm_lock = _LLM_LOCKS.setdefault(engine, threading.Lock())
        self._warned_no_sleep = False
        self._request_ids = 0
        # LoRA: the request every generate() passes (None: the base model), why
        # generate() refuses after a failed load, and the ids of aiosync adapters
        # this backend added to vLLM and has not removed.
        self._lora: Any = None
        self._lora_error: str | None = None
        self._lora_ids: set[int] = set()
        self._gate = _GenerationGate()
        # The data-parallel replicas collective_rpc reaches (None: not asked yet),
        # and whether an EngineFleet numbers this engine's workers.
        self._dp: DataParallelScope | None = None
        self._in_fleet = False

    @classmethod
    def from_model(
        cls,
        model: str,
        *,
        sleep_level: int = 1,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        **llm_kwargs: Any,
    ) -> VLLMGenerationBackend:
        """Build a ``vllm.LLM`` with aiosync's worker extension, then wrap it.

        Args:
            model: the model folder (an HF checkpoint: config.json, safetensors,
                tokenizer files) or hub name.
            **llm_kwargs: passed to ``vllm.LLM`` (``enforce_eager``, ``dtype``,
                ``enable_sleep_mode``, ...). ``worker_extension_cls`` defaults
                to :data:`WORKER_EXTENSION`.

        Raises:
            ImportError: vLLM is not installed.
        """
        from vllm import LLM

        llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        return cls(
            LLM(model=model, **llm_kwargs), sleep_level=sleep_level, rpc_timeout_s=rpc_timeout_s
        )

    # -- EngineWorkers -----------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every vLLM worker; results in rank order.

        Args and results must be msgpack-safe (str, int, float, bool, None, bytes,
        list, dict): vLLM serializes them between its processes. With vLLM data
        parallelism, every worker of every replica the client reaches answers,
        replica by replica (see the module docs); the first call checks which.

        Raises:
            SyncTimeoutError: no answer within ``timeout_s`` (default
                ``rpc_timeout_s``) seconds. The engine keeps running the call
                (aiosync's worker methods end on their own timeouts); later
                calls wait behind it.
            RefitMismatchError, TransportError, SyncTimeoutError: re-raised from
                a worker that raised one; any other worker error is a
                ``TransportError`` with its message.
            TransportError: the engine's data-parallel replicas cannot all be
                reached (:meth:`DataParallelScope.from_identities`), or a weight
                transport RPC through a backend of some replicas only, outside
                an :class:`~aiosync.EngineFleet` (before it reaches any worker).
        """
        timeout = self.rpc_timeout_s if timeout_s is None else timeout_s
        call_kwargs = dict(kwargs or {})
        scope = self._dp or await self._data_parallel_scope(timeout)
        if method == "aiosync_set_rank_offset":
            # Only EngineFleet numbers engines: this backend is one of several.
            self._in_fleet = True
            if scope.ranks[0]:
                call_kwargs["dp_base"] = scope.ranks[0]
        elif not scope.whole and not self._in_fleet and method in _WEIGHT_RPCS:
            raise TransportError(
                f"this vLLM engine reaches data-parallel replica(s) {list(scope.ranks)} of "
                f"{scope.size} only (--data-parallel-external-lb / --data-parallel-hybrid-lb: "
                "its client talks to those engines alone), so a sync through it would update "
                f"{len(scope.ranks)} of {scope.size} replicas: wrap one VLLMGenerationBackend "
                "per vLLM client in an aiosync.EngineFleet and pass the fleet as generation"
            )
        return await self._rpc(method, args, call_kwargs, timeout, scope.fan_out)

    @property
    def data_parallel(self) -> DataParallelScope | None:
        """The vLLM data-parallel replicas this backend reaches; None before the
        first :meth:`collective_rpc`."""
        return self._dp

    async def _data_parallel_scope(self, timeout: float) -> DataParallelScope:
        """Ask the workers who they are when the engine is data parallel (once)."""
        parallel = getattr(_vllm_config(self.engine), "parallel_config", None)
        size = int(getattr(parallel, "data_parallel_size", 1) or 1)
        per_replica = int(getattr(parallel, "world_size", 1) or 1)
        if size <= 1:
            self._dp = DataParallelScope(1, (0,), per_replica)
            return self._dp
        core = getattr(self.engine, "engine_core", None)
        if core is None:  # vllm.LLM
            core = getattr(getattr(self.engine, "llm_engine", None), "engine_core", None)
        managed = len(getattr(core, "core_engines", None) or [None])
        fan_out = (
            self._is_async
            and managed > 1
            and callable(getattr(core, "call_utility_all_async", None))
        )
        identities = await self._rpc("aiosync_worker_identity", (), {}, timeout, fan_out)
        self._dp = DataParallelScope.from_identities(
            identities, size, per_replica, managed, fan_out
        )
        return self._dp

    async def _rpc(
        self,
        method: str,
        args: tuple[Any, ...],
        call_kwargs: dict[str, Any],
        timeout: float,
        fan_out: bool,
    ) -> list[Any]:
        try:
            with anyio.fail_after(timeout):
                if fan_out:
                    # vLLM's collective_rpc utility on each engine the client
                    # manages, in data-parallel order (its own call returns the
                    # first engine's replies only).
                    per_engine = await self.engine.engine_core.call_utility_all_async(
                        "collective_rpc", method, None, tuple(args), call_kwargs
                    )
                    result = [reply for replies in per_engine for reply in replies]
                elif self._is_async:
                    result = await self.engine.collective_rpc(
                        method, timeout=None, args=tuple(args), kwargs=call_kwargs
                    )
                else:
                    result = await self._in_thread(
                        functools.partial(
                            self.engine.collective_rpc,
                            method,
                            # Never vLLM's own timeout: its executor then raises but
                            # leaves the late reply queued for the next call.
                            timeout=None,
                            args=tuple(args),
                            kwargs=call_kwargs,
                        )
                    )
        except TimeoutError as exc:
            if isinstance(exc, SyncError):
                raise
            raise SyncTimeoutError(
                f"vLLM collective_rpc {method!r} did not return within {timeout} s"
            ) from exc
        except SyncError:
            raise
        except Exception as exc:
            raise _rebuild_worker_error(method, exc) from exc
        return list(result)

    # -- GenerationBackend -------------------------------------------------------

    @property
    def sleep_mode(self) -> bool:
        """True when ``sleep``/``wake_up`` really release and restore device memory."""
        return self._sleep_mode

    def add_weights_discarded_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the engine discards its weights (``sleep_level=2``).

        The transports register their synchronizer's invalidation here (the
        embedded engine has the same hook), so after such a sleep ``is_stale``
        is true and the loop refits before generating again (case C6).
        """
        self._discard_listeners.append(callback)

    async def on_weights_committed(self, version: int) -> None:
        """Set vLLM's weight version to ``str(version)`` (``LLM.llm_engine.set_weight_version``,
        ``AsyncLLM.update_weight_version``): outputs from now on carry it. Called by the
        synchronizer after a sync landed on every worker; a vLLM without weight
        versions is left as is."""
        if self._is_async:
            update = getattr(self.engine, "update_weight_version", None)
            if update is not None:
                await update(str(version))
            return
        setter = getattr(getattr(self.engine, "llm_engine", None), "set_weight_version", None)
        if setter is not None:
            await self._in_thread(functools.partial(setter, str(version)))

    async def weight_version(self) -> str | None:
        """The weight version vLLM reports (None: this vLLM has none)."""
        if self._is_async:
            get = getattr(self.engine, "get_weight_version", None)
            return None if get is None else str(await get())
        getter = getattr(getattr(self.engine, "llm_engine", None), "get_weight_version", None)
        return None if getter is None else str(await self._in_thread(getter))

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine (``tags``: ``"weights"``, ``"kv_cache"``; None: all).

        Waking the KV cache (``"kv_cache"`` or None) also drops vLLM's prefix
        cache, so no KV computed with the previous weights is reused after a
        refit. vLLM refuses that while requests hold KV blocks (it returns
        False); those requests are then preempted (``reset_running_requests``)
        and recompute their KV with the new weights. Call it with
        ``["weights"]`` before a colocated refit and with ``["kv_cache"]`` after
        it to keep peak memory low.

        Raises:
            ValueError: an unknown tag.
            TransportError: vLLM refused to drop its prefix cache even with the
                running requests preempted.
        """
        wake = None if tags is None else list(tags)
        if wake is not None:
            unknown = sorted(set(wake) - _WAKE_TAGS)
            if unknown:
                raise ValueError(f"unknown wake-up tags {unknown}; known: {sorted(_WAKE_TAGS)}")
        if self._sleep_mode and self._asleep:
            await self._call("wake_up", wake)
            if wake is None or "kv_cache" in wake:
                self._asleep = False
        elif not self._sleep_mode:
            self._warn_no_sleep()
        if wake is None or "kv_cache" in wake:
            await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        if await self._call("reset_prefix_cache") is not False:
            return  # done (None: a vLLM that does not say)
        # Requests hold KV blocks computed with the previous weights: preempt them.
        try:
            done = await self._call("reset_prefix_cache", reset_running_requests=True)
        except TypeError:  # a vLLM without reset_running_requests
            done = False
        if done is False:
            raise TransportError(
                "vLLM refused to reset its prefix cache while requests hold KV blocks: "
                "KV computed with the previous weights would be reused"
            )

    async def finish_generation(self) -> None:
        """Sleep at ``sleep_level`` so the trainer gets the device memory back.

        A no-op, logged once, where vLLM has no sleep mode (its CPU worker) or
        the engine was built without ``enable_sleep_mode=True``.
        """
        if not self._sleep_mode:
            self._warn_no_sleep()
            return
        if self._asleep:
            return
        await self._call("sleep", self.sleep_level)
        self._asleep = True
        if self.sleep_level >= 2:
            for callback in self._discard_listeners:
                callback()

    # -- generation --------------------------------------------------------------

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = True,
        timeout_s: float | None = None,
    ) -> list[list[int]]:
        """Generate from token-id prompts; returns the new token ids per prompt.

        After a :meth:`load_lora_adapter` every prompt runs with that adapter
        (``lora_request=`` of ``LLM.generate`` / ``AsyncLLM.generate``); before
        any, with the base model alone. A call waits while an adapter loads and
        while generation is paused (:meth:`pause_generation`), then runs.
        A call already running when an ``AsyncLLM`` is paused in ``"abort"``
        mode returns the tokens generated so far (fewer than ``max_new_tokens``).

        Args:
            prompts: one list of token ids per prompt.
            max_new_tokens: tokens to generate per prompt.
            temperature: 0.0 is greedy.
            top_p: nucleus sampling, in ``(0, 1]`` (1.0: off).
            seed: vLLM's per-request sampling seed (None: the engine's).
            ignore_eos: keep going past an end-of-sequence token, so every
                output has ``max_new_tokens`` tokens. (The default here is True;
                :meth:`generate_with_meta` defaults to False, as every engine.)
            timeout_s: how long to wait for a pause or an adapter load to end
                before generating, seconds (None: ``rpc_timeout_s``). Generation
                itself is not bounded.

        Raises:
            SyncTimeoutError: still paused (or loading an adapter) after ``timeout_s``.
            SyncError: a worker holds half-updated weights (a refit failed
                part-way); the last :meth:`load_lora_adapter` failed; or vLLM no
                longer holds the loaded adapter (a full-weight refit removes
                every adapter; so does vLLM's LRU cache when other adapters
                crowd it out). Refit (load an adapter) before generating.
        """
        outputs = await self._completions(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
            logprobs=False,
            timeout_s=timeout_s,
        )
        return [list(o.token_ids) for o in outputs]

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: bool = False,
        timeout_s: float | None = None,
    ) -> list[Generation]:
        """:meth:`generate`, with each result's standing: one :class:`aiosync.Generation`
        per prompt, in prompt order.

        The keywords are those of :class:`aiosync.GenerationBackend`'s
        ``generate_with_meta`` (the same on the embedded engine and SGLang), plus
        ``timeout_s`` (as :meth:`generate`). ``logprobs=True`` asks vLLM for
        ``SamplingParams(logprobs=0)``: the sampled token's log-probability, in
        the engine's ``logprobs_mode`` (vLLM's default ``"raw_logprobs"``:
        ``log_softmax`` of the raw logits, before temperature and top-p, the
        convention of :class:`aiosync.Generation`).

        Versions come from the engine: vLLM labels the tokens it samples with
        its weight version (``CompletionOutput.weight_versions``, spans of
        output-token indexes; the label is the synchronizer's
        ``str(weight_version)`` once :meth:`on_weights_committed` ran, vLLM's
        ``"default"`` before: None). ``finish_reason`` is vLLM's (``"stop"``,
        ``"length"``, ``"abort"``); ``aborted`` is ``finish_reason == "abort"``.

        Raises:
            ValueError: ``max_new_tokens < 1``, ``temperature < 0`` or ``top_p``
                outside ``(0, 1]`` (before anything reaches vLLM).
            SyncTimeoutError, SyncError: as :meth:`generate`.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        outputs = await self._completions(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            timeout_s=timeout_s,
        )
        return [_generation(o, logprobs) for o in outputs]

    async def _completions(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        ignore_eos: bool,
        logprobs: bool,
        timeout_s: float | None,
    ) -> list[Any]:
        """vLLM's ``CompletionOutput`` of each prompt, in prompt order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        wait_s = self.rpc_timeout_s if timeout_s is None else timeout_s
        async with self._gate.shared(wait_s):
            if self._lora_error is not None:
                raise SyncError(f"{self._lora_error}; load a LoRA adapter before generating")
            lora = self._lora
            statuses = await self.collective_rpc("aiosync_vllm_status")
            invalid = [s["rank"] for s in statuses if not s["weights_valid"]]
            if invalid:
                raise SyncError(
                    f"vLLM worker(s) {invalid} hold partially updated weights; "
                    "sync before generating"
                )
            if lora is not None and lora.lora_int_id not in await self.list_loras():
                # Its directory is gone: vLLM would try to read it again and its
                # engine core would die (LoRAAdapterNotFoundError in a step).
                raise SyncError(
                    f"vLLM no longer holds LoRA adapter {lora.lora_name!r} (a full-weight "
                    "refit or vLLM's adapter cache removed it); load it again before generating"
                )
            params = SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                seed=seed,
                ignore_eos=ignore_eos,
                logprobs=0 if logprobs else None,
            )
            inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
            if self._is_async:
                results: list[Any] = [None for _ in inputs]
                async with anyio.create_task_group() as tg:
                    for i, prompt in enumerate(inputs):
                        tg.start_soon(self._generate_async, prompt, params, lora, results, i)
                return results
            outputs = await self._call(
                "generate", inputs, params, use_tqdm=False, lora_request=lora
            )
            return [o.outputs[0] for o in outputs]

    # -- in-flight policy ----------------------------------------------------------

    async def pause_generation(self, mode: str, clear_cache: bool = True) -> None:
        """Stop admitting generation for a sync; ``mode`` says what happens to running requests.

        Every :meth:`generate` call that arrives while paused waits (up to its
        ``timeout_s``) and runs after :meth:`resume_generation`. The synchronizer
        calls this before the first byte of a sync reaches the engine.

        On an ``AsyncLLM`` this is vLLM's ``pause_generation(mode=mode,
        clear_cache=clear_cache)`` (the engine core's scheduler pause; the same as
        ``POST /pause?mode=...``):

        * ``"abort"``: running requests end now with the tokens they have (vLLM's
          finish reason ``"abort"``); a running :meth:`generate` returns them.
        * ``"wait"``: returns once running requests have finished (with the
          weights they started with); requests added meanwhile stay queued.
        * ``"keep"``: running requests are frozen in place and continue after
          :meth:`resume_generation`; their remaining tokens come from the
          weights the engine holds then.

        For ``"abort"`` and ``"wait"`` it also waits until every running
        :meth:`generate` of this backend that vLLM had started answering has
        returned. ``clear_cache=True`` makes vLLM drop its prefix cache (and
        preempt the frozen requests of ``"keep"``, which recompute their KV on
        resume) once the pause is complete.

        On a ``vllm.LLM`` (synchronous; vLLM 0.32 gives it no pause and its engine
        client is not thread-safe, so nothing may reach it while a ``generate``
        runs in its worker thread) only ``"wait"`` exists: it waits for this
        backend's running :meth:`generate` calls to return and holds new ones.
        ``clear_cache=True`` then drops the prefix cache (preempting requests
        that hold KV blocks, as :meth:`prepare_for_generation` does).

        Args:
            mode: ``"abort"``, ``"wait"`` or ``"keep"`` (:data:`IN_FLIGHT_MODES`).
            clear_cache: drop the prefix cache while paused, so no KV computed
                with the old weights is reused.

        Raises:
            ValueError: an unknown ``mode``.
            NotImplementedError: ``"abort"`` or ``"keep"`` on a ``vllm.LLM``;
                raised before anything changes, so before any byte of a sync moves.
            TransportError: vLLM failed the pause, or refused to drop its prefix
                cache; generation is resumed before it is raised.
            SyncTimeoutError: running requests did not finish within
                ``rpc_timeout_s`` (``"abort"``, ``"wait"``); generation is resumed
                before it is raised.
        """
        if mode not in IN_FLIGHT_MODES:
            raise ValueError(f"unknown in-flight mode {mode!r}; known: {list(IN_FLIGHT_MODES)}")
        if not self._is_async and mode != "wait":
            raise NotImplementedError(
                f"in-flight mode {mode!r} is not supported on a synchronous vllm.LLM: "
                "vLLM 0.32 gives LLM no pause, and nothing may reach its engine while "
                "generate() runs in another thread; use 'wait', or an AsyncLLM "
                "(vllm.v1.engine.async_llm.AsyncLLM), whose pause_generation supports "
                "'abort', 'wait' and 'keep'"
            )
        self._gate.pause()
        try:
            with anyio.fail_after(self.rpc_timeout_s):
                if self._is_async:
                    await self._pause_async(mode, clear_cache)
                else:
                    await self._gate.idle()
                    if clear_cache:
                        await self._reset_prefix_cache()
        except BaseException as exc:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.rpc_timeout_s):
                await self.resume_generation()
            if isinstance(exc, TimeoutError) and not isinstance(exc, SyncError):
                raise SyncTimeoutError(
                    f"vLLM's running requests did not end within {self.rpc_timeout_s} s "
                    f"of pause_generation({mode!r})"
                ) from exc
            raise

    async def _pause_async(self, mode: str, clear_cache: bool) -> None:
        try:
            await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        except Exception as exc:
            raise TransportError(f"vLLM pause_generation(mode={mode!r}) failed: {exc}") from exc
        if mode != "keep":
            await self._gate.drained()

    async def resume_generation(self) -> None:
        """End :meth:`pause_generation`: vLLM schedules again (``AsyncLLM.resume_generation``;
        frozen ``"keep"`` requests continue, queued ones start) and held
        :meth:`generate` calls run. Idempotent: vLLM is told to resume even when
        this backend did not pause it (a pause cut short may have reached vLLM).

        Raises:
            TransportError: vLLM failed the resume (held :meth:`generate` calls
                are let through all the same).
        """
        self._gate.resume()
        if not self._is_async:
            return
        try:
            await self.engine.resume_generation()
        except Exception as exc:
            raise TransportError(f"vLLM resume_generation failed: {exc}") from exc

    @property
    def generation_paused(self) -> bool:
        """True between :meth:`pause_generation` and :meth:`resume_generation`."""
        return self._gate.paused

    # -- LoRA adapters -------------------------------------------------------------

    @property
    def lora_adapter(self) -> str | None:
        """The name of the adapter :meth:`generate` uses (``"aiosync-v{version}"``);
        None: the base model, or the last load failed."""
        return None if self._lora is None else str(self._lora.lora_name)

    async def expected_manifest(self) -> dict[str, tuple[tuple[int, ...], Any]] | None:
        """``{hf_name: (shape, torch.dtype)}`` of the checkpoint vLLM loaded, or None if unknown.

        Read from the safetensors headers of the local checkpoint folder
        (``model_config.model``) by worker 0, in the engine's dtype. The LoRA
        synchronizer checks an adapter's layers against it before any byte moves
        (``lora_A`` ``[r, in_features]``, ``lora_B`` ``[out_features, r]`` against
        ``[out_features, in_features]``). The full-weight transports do not
        consult it: their checkpoint check is opt-in
        (``collective_rpc("aiosync_vllm_check_manifest", (True,))``), because
        checkpoints can hold tensors a trainer never sends.

        Returns:
            The manifest (file by file, each in its header's order); None when
            the model is not a local, unquantized safetensors folder (a hub id,
            a quantized model).

        Raises:
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        from aiosync.transports.packing import dtype_from_name

        reply = (await self.collective_rpc("aiosync_vllm_checkpoint_manifest"))[0]
        if reply["manifest"] is None:
            _log.debug("no checkpoint manifest for this vLLM engine: %s", reply["reason"])
            return None
        return {
            name: (tuple(int(d) for d in shape), dtype_from_name(dtype))
            for name, shape, dtype in reply["manifest"]
        }

    async def check_lora_adapter(
        self, config: Mapping[str, Any], target_modules: Sequence[str], max_rank: int
    ) -> None:
        """Check that the engine can load an adapter of this shape (before any byte moves;
        ``LoRAAdapterSynchronizer.init_communicator`` asks).

        Args:
            config: the adapter's ``adapter_config.json`` dict.
            target_modules: the adapted layers' names (``q_proj``, ``down_proj``, ...).
            max_rank: the adapter's largest rank ``r``.

        Raises:
            ValueError: the engine was built without ``enable_lora=True``, or
                ``max_rank`` (or a ``config["rank_pattern"]`` rank) exceeds its
                ``max_lora_rank``.
            RefitMismatchError: a target module outside the engine's
                ``lora_target_modules`` (vLLM would not apply LoRA there).
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        lora_config = _lora_config(self.engine)
        pattern = dict(config.get("rank_pattern") or {})
        _check_rank(
            max([int(max_rank), *(int(r) for r in pattern.values())]),
            lora_config,
            "the LoRA adapter",
        )
        reports = await self.collective_rpc(
            "aiosync_vllm_check_lora", kwargs={"targets": list(target_modules)}
        )
        _raise_lora_problems("the LoRA adapter", reports)

    async def list_loras(self) -> set[int]:
        """The ``lora_int_id`` of every adapter vLLM holds (``list_loras()``; aiosync's
        adapters have their weight version as id)."""
        return {int(i) for i in await self._lora_call("list_loras")}

    async def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Load ``adapter`` into vLLM as ``LoRARequest(adapter.name, adapter.version, path)``,
        make it the adapter every later :meth:`generate` uses, then remove the
        aiosync adapter it replaces (``remove_lora``).

        vLLM 0.32 reads adapters from a PEFT directory only (``LoRARequest.lora_path``;
        no in-memory path without patching its worker): the adapter is written
        with :meth:`LoRAAdapter.save` to ``LORA_DIR_PARENT/aiosync-lora-<pid>-<8 chars>``
        (``/dev/shm``), loaded with ``add_lora`` (vLLM reads every tensor then)
        and the directory removed, on every path. vLLM therefore must keep the
        adapter in its CPU cache (``max_cpu_loras``) for as long as it is used:
        :meth:`generate` refuses once it is gone.

        Waits for running :meth:`generate` calls to finish (none may use the
        adapter being removed) and holds new ones until the load ends. If the
        load fails, in whatever way, :meth:`generate` refuses (``SyncError``)
        until a later load succeeds: it never generates with a half-loaded
        adapter, nor with the previous one or none in its place. Every error
        but ``TransportError`` and ``SyncTimeoutError`` is raised before anything
        reaches vLLM.

        Args:
            adapter: ``tensors`` ``{PEFT saved name: CPU tensor}``:
                ``<module>.lora_A.weight`` ``[r, in_features]`` and
                ``<module>.lora_B.weight`` ``[out_features, r]`` for each target
                module, any float dtype (vLLM casts to its ``lora_dtype``, by
                default the model's); ``config`` the ``adapter_config.json``
                (``r``, ``lora_alpha``, ``target_modules``, ...); ``version`` >= 1
                is vLLM's ``lora_int_id``.

        Raises:
            TypeError: ``adapter`` is not a :class:`~aiosync.LoRAAdapter`, or its
                ``config["r"]`` is not an int.
            ValueError: the engine was built without ``enable_lora=True``; the
                adapter's rank exceeds the engine's ``max_lora_rank``;
                ``version`` < 1; no LoRA tensors.
            RefitMismatchError: a tensor's shape does not fit: a lora_A without
                its lora_B (or the reverse), ranks of a pair that differ or
                differ from ``config["r"]``, or (checked by the workers against
                the safetensors headers of a local, unquantized checkpoint) an
                ``in_features``/``out_features`` other than the base weight's;
                or a module outside the engine's ``lora_target_modules``.
            TransportError, SyncTimeoutError: vLLM refused or failed the load
                (its message), or did not answer within ``rpc_timeout_s``.
        """
        async with self._gate.exclusive():
            try:
                await self._load_lora(adapter)
            except BaseException as exc:  # cancelled too: vLLM may hold part of it
                self._lora = None
                name = getattr(adapter, "name", adapter)
                self._lora_error = (
                    f"loading LoRA adapter {name!r} failed ({type(exc).__name__}: {exc})"
                )
                raise

    async def _load_lora(self, adapter: LoRAAdapter) -> None:
        from vllm.lora.request import LoRARequest

        shapes = _check_lora_adapter(adapter, _lora_config(self.engine))
        reports = await self.collective_rpc("aiosync_vllm_check_lora", (shapes,))
        _raise_lora_problems(f"LoRA adapter {adapter.name!r}", reports)
        replaced = adapter.version in await self.list_loras()
        folder = tempfile.mkdtemp(prefix=dir_prefix("lora"), dir=_lora_dir_parent())
        try:
            await anyio.to_thread.run_sync(adapter.save, folder)
            # load_inplace: reload even if an adapter with this id is held (a retry
            # of the same version); generate() passes a request without it, or
            # vLLM would re-read the (removed) directory at every step.
            await self._add_lora(
                LoRARequest(adapter.name, adapter.version, folder, load_inplace=True)
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._lora = LoRARequest(adapter.name, adapter.version, folder)
        self._lora_error = None
        for stale in sorted(self._lora_ids - {adapter.version}):
            await self._lora_call("remove_lora", stale)
            self._lora_ids.discard(stale)
        if replaced:  # same name, new tensors: KV cached under that name is stale
            await self._reset_prefix_cache()

    async def _add_lora(self, request: Any) -> None:
        self._lora_ids.add(request.lora_int_id)  # vLLM may hold part of it, even on failure
        try:
            with anyio.fail_after(self.rpc_timeout_s):
                added = await self._lora_call("add_lora", request)
        except TimeoutError as exc:
            raise SyncTimeoutError(
                f"vLLM add_lora({request.lora_name!r}) did not return within {self.rpc_timeout_s} s"
            ) from exc
        except TransportError as exc:
            # A failed add can leave the adapter registered, half-copied into its
            # slot (vLLM 0.32 registers it before activating it): drop it.
            with suppress(Exception):
                await self._lora_call("remove_lora", request.lora_int_id)
                self._lora_ids.discard(request.lora_int_id)
            raise TransportError(
                f"vLLM could not load LoRA adapter {request.lora_name!r}: {exc.__cause__ or exc}"
            ) from exc
        if not added:
            raise TransportError(f"vLLM did not load LoRA adapter {request.lora_name!r}")

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
        if self._is_async:
            self.engine.shutdown()
            return
        await self._in_thread(functools.partial(_shutdown_llm, self.engine))

    # -- helpers -----------------------------------------------------------------

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.engine, name)
        if self._is_async:
            return await fn(*args, **kwargs)
        return await self._in_thread(functools.partial(fn, *args, **kwargs))

    async def _lora_call(self, name: str, *args: Any) -> Any:
        # AsyncLLM has add_lora/remove_lora/list_loras; vllm.LLM only through llm_engine.
        try:
            if self._is_async:
                return await getattr(self.engine, name)(*args)
            call = getattr(self.engine.llm_engine, name)
            return await self._in_thread(functools.partial(call, *args))
        except Exception as exc:
            raise TransportError(f"vLLM {name} failed: {exc}") from exc

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        def locked() -> Any:
            with self._llm_lock:
                return fn()

        return await anyio.to_thread.run_sync(locked, abandon_on_cancel=True)

    async def _generate_async(
        self, prompt: Any, params: Any, lora: Any, results: list[Any], index: int
    ) -> None:
        self._request_ids += 1
        final = None
        try:
            async for out in self.engine.generate(
                prompt, params, f"aiosync-{self._request_ids}", lora_request=lora
            ):
                if final is None:
                    self._gate.streaming += 1
                final = out
        finally:
            if final is not None:
                self._gate.streaming -= 1
                self._gate.notify()
        assert final is not None
        results[index] = final.outputs[0]

    def _warn_no_sleep(self) -> None:
        if not self._warned_no_sleep:
            self._warned_no_sleep = True
            _log.warning(
                "vLLM sleep mode is off on this engine (vLLM supports it only on CUDA/ROCm/XPU "
                "with enable_sleep_mode=True; its CPU worker ignores sleep/wake_up): "
                "finish_generation() releases no memory and prepare_for_generation() "
                "only resets the prefix cache"
            )


def _generation(output: Any, logprobs: bool) -> Generation:
    """A :class:`~aiosync.Generation` from vLLM's ``CompletionOutput``.

    ``output.logprobs`` (asked with ``SamplingParams(logprobs=0)``) holds, per
    token, a mapping ``{token_id: Logprob}`` with at least the sampled token;
    ``output.weight_versions`` spans ``[start, end)`` of output-token indexes,
    each with the weight-version label that sampled them (None: no label).

    Raises:
        TransportError: asked for logprobs and vLLM answered none for a token.
    """
    token_ids = [int(t) for t in output.token_ids]
    values: list[float] | None = None
    if logprobs:
        positions = output.logprobs
        if positions is None or len(positions) != len(token_ids):
            raise TransportError(
                f"vLLM answered {0 if positions is None else len(positions)} logprob "
                f"positions for {len(token_ids)} tokens"
            )
        values = []
        for token, position in zip(token_ids, positions, strict=True):
            entry = None if position is None else position.get(token)
            if entry is None:
                raise TransportError(f"vLLM answered no logprob for sampled token {token}")
            values.append(float(entry.logprob))
    spans = [s for s in (getattr(output, "weight_versions", None) or []) if s.end > s.start]
    first = last = change = None
    if spans and token_ids:
        first, last = parse_version(spans[0].version), parse_version(spans[-1].version)
        change = next((s.start for s in spans if parse_version(s.version) != first), None)
    finish = output.finish_reason
    return Generation(
        token_ids=token_ids,
        logprobs=values,
        first_version=first,
        last_version=last,
        version_change_at=change,
        aborted=finish == "abort",
        finish_reason=None if finish is None else str(finish),
    )


def _vllm_config(engine: Any) -> Any:
    config = getattr(engine, "vllm_config", None)
    if config is None:
        config = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    return config


def _sleep_mode_enabled(engine: Any) -> bool:
    model_config = getattr(_vllm_config(engine), "model_config", None)
    return bool(getattr(model_config, "enable_sleep_mode", False))


def _lora_config(engine: Any) -> Any:
    """The engine's ``LoRAConfig``.

    Raises:
        ValueError: the engine was built without ``enable_lora=True``.
    """
    lora_config = getattr(_vllm_config(engine), "lora_config", None)
    if lora_config is None:
        raise ValueError(
            "this vLLM engine was built without LoRA support: build it with "
            "enable_lora=True (vllm serve --enable-lora) and max_lora_rank >= the adapter's "
            "rank to load LoRA adapters"
        )
    return lora_config


def _check_lora_adapter(adapter: Any, lora_config: Any) -> dict[str, list[int]]:
    """Check ``adapter`` against itself and the engine's ``LoRAConfig``; returns the
    shapes of its LoRA pairs ``{peft_name: [rows, cols]}`` for the workers' check.

    Raises:
        TypeError, ValueError, RefitMismatchError: see ``load_lora_adapter``.
    """
    if not isinstance(adapter, LoRAAdapter):
        raise TypeError(f"expected an aiosync.LoRAAdapter, got {type(adapter).__name__}")
    if isinstance(adapter.version, bool) or not isinstance(adapter.version, int):
        raise TypeError(f"LoRA adapter version must be an int, got {adapter.version!r}")
    if adapter.version < 1:
        raise ValueError(
            f"LoRA adapter version must be >= 1 (vLLM's lora_int_id), got {adapter.version}"
        )
    rank = adapter.config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"LoRA adapter config['r'] must be an int, got {rank!r}")
    pattern = dict(adapter.config.get("rank_pattern") or {})
    _check_rank(
        max([rank, *(int(r) for r in pattern.values())]),
        lora_config,
        f"LoRA adapter {adapter.name!r}",
    )
    pairs: dict[str, dict[str, Sequence[int]]] = {}
    shapes: dict[str, list[int]] = {}
    for name, tensor in adapter.tensors.items():
        match = LORA_PAIR_NAME.fullmatch(name)
        if match is None:
            continue  # embedding LoRA, modules_to_save: vLLM checks them
        shape = list(tensor.shape)
        if len(shape) != 2:
            raise RefitMismatchError(f"LoRA tensor {name} must be 2-D, has shape {shape}")
        pairs.setdefault(match["module"], {})[match["kind"]] = shape
        shapes[name] = shape
    if not pairs:
        raise ValueError(f"LoRA adapter {adapter.name!r} holds no lora_A/lora_B tensors")
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise RefitMismatchError(f"LoRA adapter has no {module}.{missing}.weight")
        a_rank, b_rank = pair["A"][0], pair["B"][1]
        if a_rank != b_rank or (not pattern and a_rank != rank):
            raise RefitMismatchError(
                f"LoRA ranks of {module} do not agree: lora_A {list(pair['A'])} "
                f"([r, in_features]), lora_B {list(pair['B'])} ([out_features, r]), "
                f"config r={rank}"
            )
        _check_rank(a_rank, lora_config, f"LoRA adapter {adapter.name!r} at {module}")
    return shapes


def _check_rank(rank: int, lora_config: Any, what: str) -> None:
    if rank > lora_config.max_lora_rank:
        raise ValueError(
            f"{what} has rank {rank}, above the engine's "
            f"max_lora_rank={lora_config.max_lora_rank}: build the engine with a larger "
            "max_lora_rank (vllm serve --max-lora-rank)"
        )


def _raise_lora_problems(what: str, reports: Sequence[Mapping[str, Any]]) -> None:
    """Raise the workers' ``aiosync_vllm_check_lora`` problems as one RefitMismatchError."""
    for report in reports:
        if not report["checked"]:
            _log.debug("LoRA shapes not checked against the model: %s", report["reason"])
    problems = list(dict.fromkeys(p for report in reports for p in report["problems"]))
    if problems:
        raise RefitMismatchError(
            f"{what} does not fit the engine's model: "
            + "; ".join(problems[:5])
            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        )


def _lora_dir_parent() -> str:
    return LORA_DIR_PARENT if os.path.isdir(LORA_DIR_PARENT) else tempfile.gettempdir()


class _GenerationGate:
    """``generate()`` calls share it; a LoRA load holds it alone (waiting for the
    running calls; calls that arrive meanwhile wait for the load); a pause keeps
    new calls out until the resume. One event loop.

    ``streaming`` counts the running calls' requests that vLLM has started
    answering (an ``AsyncLLM`` output came) and not finished: after vLLM's own
    "abort"/"wait" pause, those end on their own and :meth:`drained` waits for them.
    """

    def __init__(self) -> None:
        self._running = 0
        self._loading = False
        self.paused = False
        self.streaming = 0
        self._changed: anyio.Event | None = None

    async def _wait(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def notify(self) -> None:
        self._notify()

    @asynccontextmanager
    async def shared(self, timeout_s: float) -> AsyncIterator[None]:
        try:
            with anyio.fail_after(timeout_s):
                while self._loading or self.paused:
                    await self._wait()
        except TimeoutError as exc:
            what = "paused for a sync" if self.paused else "loading a LoRA adapter"
            raise SyncTimeoutError(
                f"generate() waited {timeout_s} s for the vLLM engine, still {what}"
            ) from exc
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._notify()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        while self._loading:
            await self._wait()
        self._loading = True
        try:
            while self._running:
                await self._wait()
            yield
        finally:
            self._loading = False
            self._notify()

    def pause(self) -> None:
        """Hold every later ``generate()`` call until :meth:`resume`."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._notify()

    async def idle(self) -> None:
        """Wait until no ``generate()`` call runs."""
        while self._running:
            await self._wait()

    async def drained(self) -> None:
        """Wait until no request that vLLM had started answering is still streaming."""
        while self.streaming:
            await self._wait()


def _rebuild_worker_error(method: str, exc: Exception) -> Exception:
    from aiosync.transports._wire import rebuild_error

    match = _TAGGED_ERROR.search(str(exc))
    if match is None:
        return TransportError(f"vLLM collective_rpc {method!r} failed: {exc}")
    return rebuild_error(
        {"type": match.group(1), "message": match.group(2)}, f"vLLM worker ({method})"
    )


def _shutdown_llm(llm: Any) -> None:
    # vllm.LLM has no public close(); its engine core client owns the processes.
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()
