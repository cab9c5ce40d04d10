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
* :class:`aiosync.capabilities.LayoutReporting` — ``weight_layouts()`` (what each
  worker holds of each HF tensor, :mod:`._layout`) and ``tensor_parallel_size``:
  with tensor parallelism the factory picks the shard-aware transport, which
  sends each worker only its slices.
* ``load_lora_adapter(adapter)`` — an adapter-only refit (:class:`aiosync.LoRAAdapter`):
  vLLM loads the adapter as ``LoRARequest(adapter.name, adapter.version, path)``
  and every later ``generate`` uses it (the engine must be built with
  ``enable_lora=True`` and ``max_lora_rank >= r``).
* :class:`aiosync.capabilities.ChecksumVerifying` (``record_checksums=True``) — at
  each commit the workers' own checksums of every parameter
  (``Worker.compute_weight_checksums``, what ``vllm serve``'s ``/weight_checker``
  answers) are recorded; :meth:`~VLLMGenerationBackend.verify_recorded_checksums`
  (``verify_engine()`` asks it) names each parameter changed since.
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

This module is the facade; the ``LLM``/``AsyncLLM`` difference lives in
:mod:`._drivers`, data parallelism in :mod:`._dp`, LoRA in :mod:`._lora`, the
admission of ``generate`` calls in :class:`aiosync.engines._gate.AdmissionGate`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.capabilities import IN_FLIGHT_POLICIES, EngineKind, InFlightPolicy
from aiosync.errors import SyncError, SyncTimeoutError, TransportError
from aiosync.generation import Generation, SamplingParams, parse_version, sampling_params
from aiosync.lora import LoRAAdapter

from .._gate import AdmissionGate
from .._generate import GenerateFromMeta
from ._checksums import RecordedChecksums, merge_worker_checksums
from ._dp import WEIGHT_RPCS, DataParallelScope, discover_scope
from ._drivers import driver_for, rebuild_worker_error
from ._lora import (
    LORA_DIR_PARENT,
    LORA_PAIR_NAME,
    AdapterSlot,
    check_rank,
    lora_config_of,
    raise_lora_problems,
)

if TYPE_CHECKING:
    from aiosync.capabilities import (
        ChecksumVerifying,
        ConfigReporting,
        DiscardNotifier,
        Engine,
        EngineWorkers,
        Generating,
        LayoutReporting,
        ManifestReporting,
        PausableEngine,
        VersionedEngine,
    )
    from aiosync.layout import Layout

__all__ = [
    "IN_FLIGHT_MODES",
    "LORA_DIR_PARENT",
    "LORA_PAIR_NAME",
    "WORKER_EXTENSION",
    "DataParallelScope",
    "VLLMGenerationBackend",
]

_log = logging.getLogger(__name__)

#: The class to pass as vLLM's ``worker_extension_cls``.
WORKER_EXTENSION = "aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension"

#: The tags ``wake_up`` accepts (vLLM's ``LLM.wake_up``).
_WAKE_TAGS = frozenset({"weights", "kv_cache", "scheduling"})

#: The in-flight policies :meth:`VLLMGenerationBackend.pause_generation` knows
#: (aiosync's ``InFlightPolicy``; vLLM's ``PauseMode`` has the same three values).
IN_FLIGHT_MODES = IN_FLIGHT_POLICIES


class VLLMGenerationBackend(GenerateFromMeta):
    """aiosync's engine interface over a live vLLM engine.

    Args:
        engine: a ``vllm.LLM`` or an ``AsyncLLM``, built with
            ``worker_extension_cls=WORKER_EXTENSION``.
        sleep_level: ``sleep(level)`` used by :meth:`finish_generation`: 1 offloads
            weights to host memory and drops the KV cache; 2 discards the weights
            too (the next wake needs a refit: the transports are told, see
            :meth:`add_weights_discarded_listener`).
        rpc_timeout_s: default limit of one :meth:`collective_rpc`, seconds.
        record_checksums: at each commit (:meth:`on_weights_committed`) ask every
            worker for vLLM's SHA-256 of each parameter of its model
            (``compute_weight_checksums``, vLLM 0.32.0 and later) and keep them:
            :meth:`verify_recorded_checksums` then names any parameter changed
            since. Costs one host copy and hash of the whole model per sync.

    An :class:`~aiosync.capabilities.Engine` that is also a ``PausableEngine``,
    ``VersionedEngine``, ``DiscardNotifier``, ``EngineWorkers``, ``Generating``,
    ``ManifestReporting``, ``ConfigReporting``, ``LayoutReporting`` and
    ``ChecksumVerifying`` (checked by mypy at the end of this module).

    Raises:
        ValueError: ``sleep_level`` is not 1 or 2.
        TypeError: ``engine`` is neither kind of vLLM engine.
    """

    #: Which engine this is (:class:`~aiosync.capabilities.KindReporting`): the factory
    #: picks the transport by it.
    engine_kind: EngineKind = "vllm"

    #: ``generate()`` without ``params`` starts from these: 16 tokens, past any
    #: EOS (``generate_with_meta`` has no defaults and stops at EOS, as every engine).
    generate_defaults: ClassVar[SamplingParams | None] = SamplingParams(
        max_tokens=16, ignore_eos=True
    )

    def __init__(
        self,
        engine: Any,
        *,
        sleep_level: int = 1,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        record_checksums: bool = False,
    ) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self._driver = driver_for(engine)
        self.engine = engine
        self.sleep_level = sleep_level
        self.rpc_timeout_s = rpc_timeout_s
        self.record_checksums = record_checksums
        # The workers' checksums at the last commit (record_checksums; None: none yet).
        self._checksums: RecordedChecksums | None = None
        self._sleep_mode = _sleep_mode_enabled(self._driver.vllm_config)
        self._asleep = False
        self._discard_listeners: list[Callable[[], None]] = []
        self._warned_no_sleep = False
        self._lora = AdapterSlot(
            self._driver, self.collective_rpc, self._reset_prefix_cache, lambda: self.rpc_timeout_s
        )
        self._gate = AdmissionGate("the vLLM engine")
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
        elif not scope.whole and not self._in_fleet and method in WEIGHT_RPCS:
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

        async def identities(fan_out: bool) -> list[Any]:
            return await self._rpc("aiosync_worker_identity", (), {}, timeout, fan_out)

        self._dp = await discover_scope(self._driver, identities)
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
                return await self._driver.collective_rpc(method, args, call_kwargs, fan_out)
        except TimeoutError as exc:
            if isinstance(exc, SyncError):
                raise
            raise SyncTimeoutError(
                f"vLLM collective_rpc {method!r} did not return within {timeout} s"
            ) from exc
        except SyncError:
            raise
        except Exception as exc:
            raise rebuild_worker_error(method, exc) from exc

    # -- GenerationBackend -------------------------------------------------------

    @property
    def sleep_mode(self) -> bool:
        """True when ``sleep``/``wake_up`` really release and restore device memory."""
        return self._sleep_mode

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the engine discards its weights (``sleep_level=2``).

        Every synchronizer registers its invalidation here, so after such a sleep
        ``is_stale`` is true and the loop refits before generating again.
        """
        self._discard_listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener` (no error if absent)."""
        if listener in self._discard_listeners:
            self._discard_listeners.remove(listener)

    async def on_weights_committed(self, version: int) -> None:
        """Set vLLM's weight version to ``str(version)`` (``LLM.llm_engine.set_weight_version``,
        ``AsyncLLM.update_weight_version``): outputs from now on carry it. Called by the
        synchronizer after a sync landed on every worker; a vLLM without weight
        versions is left as is. With ``record_checksums``, the workers' checksums
        are recorded as ``version``'s.

        Raises:
            TransportError, SyncTimeoutError: a worker failed or did not answer the
                checksums within ``rpc_timeout_s``.
        """
        await self._driver.set_weight_version(str(version))
        if self.record_checksums:
            self._checksums = None  # a failed recording must not leave the last one
            self._checksums = RecordedChecksums(version, await self.weight_checksums())

    async def weight_checksums(self) -> dict[str, str]:
        """Every worker's SHA-256 (hex) of each parameter of its model, as it holds it now
        (``Worker.compute_weight_checksums`` through ``collective_rpc``).

        Keys are ``"dp{d}:pp{p}:pcp{c}:tp{t}:{name}"`` (the worker's ranks, vLLM's own
        parameter name: fused, sharded, post-processed); on vLLM's CPU build a linear
        layer's ``weight`` is an empty tensor (its bytes live in the kernel's packed
        copy), so its checksum is of no bytes. The target model only: a speculative
        draft model is not hashed.

        Raises:
            TransportError: a worker failed, answered something else than
                ``{str: str}``, or two workers answered the same key.
            SyncTimeoutError: no answer within ``rpc_timeout_s``.
        """
        replies = await self.collective_rpc("compute_weight_checksums")
        return merge_worker_checksums(replies, "vLLM compute_weight_checksums")

    async def verify_recorded_checksums(self) -> int | None:
        """Compare the workers' checksums now with those recorded at the last commit
        (``record_checksums=True``); :class:`~aiosync.capabilities.ChecksumVerifying`.

        Says which parameters changed since the commit (each named with its
        worker's ranks), not that the commit held the trainer's tensors
        (``verify_engine()``'s read-back digests compare those).

        Returns:
            How many parameters (summed over workers) matched; None: nothing
            recorded (``record_checksums=False``, or no commit yet).

        Raises:
            RefitVerificationError: a parameter's checksum differs, is gone or is new
                (up to five named, and how many in all).
            TransportError, SyncTimeoutError: as :meth:`weight_checksums`.
        """
        if self._checksums is None:
            return None
        return self._checksums.compare(
            await self.weight_checksums(), "the vLLM engine", "compute_weight_checksums"
        )

    async def weight_version(self) -> int | None:
        """The synchronizer's ``weight_version`` that vLLM reports (its label
        ``str(version)`` as an int); None: vLLM's ``"default"`` before any sync,
        or a vLLM without weight versions."""
        return parse_version(await self._driver.get_weight_version())

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
            await self._driver.call("wake_up", wake)
            if wake is None or "kv_cache" in wake:
                self._asleep = False
        elif not self._sleep_mode:
            self._warn_no_sleep()
        if wake is None or "kv_cache" in wake:
            await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        if await self._driver.call("reset_prefix_cache") is not False:
            return  # done (None: a vLLM that does not say)
        # Requests hold KV blocks computed with the previous weights: preempt them.
        try:
            done = await self._driver.call("reset_prefix_cache", reset_running_requests=True)
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
        await self._driver.call("sleep", self.sleep_level)
        self._asleep = True
        if self.sleep_level >= 2:
            self._checksums = None  # the weights are gone: nothing to compare with
            for listener in list(self._discard_listeners):
                listener()

    # -- generation --------------------------------------------------------------

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        **keywords: Any,
    ) -> list[Generation]:
        """Generate from token-id prompts: one :class:`aiosync.Generation` per prompt,
        in prompt order, holding only the new ids. :meth:`generate` returns their
        ``token_ids`` (and starts from :attr:`generate_defaults`).

        After a :meth:`load_lora_adapter` every prompt runs with that adapter
        (``lora_request=`` of ``LLM.generate`` / ``AsyncLLM.generate``); before
        any, with the base model alone. A call waits while an adapter loads and
        while generation is paused (:meth:`pause_generation`), then runs.
        A call already running when an ``AsyncLLM`` is paused in ``"abort"``
        mode returns the tokens generated so far (fewer than ``max_tokens``).

        Args:
            prompts: one list of token ids per prompt.
            params: how to sample (:class:`aiosync.SamplingParams`), or its fields
                as keywords (``max_new_tokens=``, ``temperature=``, ``top_p=``,
                ``seed=`` vLLM's per-request seed, ``ignore_eos=``, ``logprobs=``);
                see :func:`aiosync.generation.sampling_params`. ``logprobs=True``
                asks vLLM for ``SamplingParams(logprobs=0)``: the sampled token's
                log-probability in the engine's ``logprobs_mode`` (vLLM's default
                ``"raw_logprobs"``: ``log_softmax`` of the raw logits, before
                temperature and top-p, the convention of :class:`aiosync.Generation`).
            timeout_s: how long to wait for a pause or an adapter load to end
                before generating, seconds (None: ``rpc_timeout_s``). Generation
                itself is not bounded.

        Versions come from the engine: vLLM labels the tokens it samples with
        its weight version (``CompletionOutput.weight_versions``, spans of
        output-token indexes; the label is the synchronizer's
        ``str(weight_version)`` once :meth:`on_weights_committed` ran, vLLM's
        ``"default"`` before: None). ``finish_reason`` is vLLM's (``"stop"``,
        ``"length"``, ``"abort"``); ``aborted`` is ``finish_reason == "abort"``.

        Raises:
            ValueError: bad sampling parameters (:class:`~aiosync.SamplingParams`;
                before anything reaches vLLM).
            TypeError: an unknown keyword, or no token limit.
            SyncTimeoutError: still paused (or loading an adapter) after ``timeout_s``.
            SyncError: a worker holds half-updated weights (a refit failed
                part-way); the last :meth:`load_lora_adapter` failed; or vLLM no
                longer holds the loaded adapter (a full-weight refit removes
                every adapter; so does vLLM's LRU cache when other adapters
                crowd it out). Refit (load an adapter) before generating.
        """
        sampling = sampling_params(params, keywords)
        outputs = await self._completions(prompts, sampling, timeout_s)
        return [_generation(o, sampling.logprobs) for o in outputs]

    async def _completions(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, timeout_s: float | None
    ) -> list[Any]:
        """vLLM's ``CompletionOutput`` of each prompt, in prompt order."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        wait_s = self.rpc_timeout_s if timeout_s is None else timeout_s
        async with self._gate.shared(wait_s):
            lora = await self._lora.usable_before_status()
            statuses = await self.collective_rpc("aiosync_vllm_status")
            invalid = [s["rank"] for s in statuses if not s["weights_valid"]]
            if invalid:
                raise SyncError(
                    f"vLLM worker(s) {invalid} hold partially updated weights; "
                    "sync before generating"
                )
            await self._lora.check_held(lora)
            params = VLLMSamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                seed=sampling.seed,
                ignore_eos=sampling.ignore_eos,
                logprobs=0 if sampling.logprobs else None,
            )
            inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
            return await self._driver.generate(inputs, params, lora, self._gate)

    # -- in-flight policy ----------------------------------------------------------

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
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
        if mode not in self._driver.pause_modes:
            raise NotImplementedError(
                f"in-flight mode {mode!r} is not supported on a synchronous vllm.LLM: "
                "vLLM 0.32 gives LLM no pause, and nothing may reach its engine while "
                "generate() runs in another thread; use 'wait', or an AsyncLLM "
                "(vllm.v1.engine.async_llm.AsyncLLM), whose pause_generation supports "
                "'abort', 'wait' and 'keep'"
            )
        async with self._gate.pausing(
            self.rpc_timeout_s,
            self.resume_generation,
            timeout_message=f"vLLM's running requests did not end within {self.rpc_timeout_s} "
            f"s of pause_generation({mode!r})",
            where="the vLLM engine",
            log=_log,
        ):
            cleared = await self._driver.pause(mode, clear_cache, self._gate)
            if clear_cache and not cleared:
                await self._reset_prefix_cache()

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
        await self._driver.resume()

    @property
    def generation_paused(self) -> bool:
        """True between :meth:`pause_generation` and :meth:`resume_generation`."""
        return self._gate.paused

    # -- LoRA adapters -------------------------------------------------------------

    @property
    def lora_adapter(self) -> str | None:
        """The name of the adapter :meth:`generate` uses (``"aiosync-v{version}"``);
        None: the base model, or the last load failed."""
        request = self._lora.request
        return None if request is None else str(request.lora_name)

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

    async def expected_config(self) -> Any | None:
        """vLLM's ``model_config.hf_config``: the HF config the engine computes with
        (its ``hf_overrides`` applied), for the transports' config check at init.

        Read from the engine object in this process (no RPC); None when this
        vLLM does not expose it.
        """
        return self._driver.hf_config

    @property
    def tensor_parallel_size(self) -> int:
        """Workers that share one replica's weights, each holding its slices
        (vLLM's ``parallel_config.tensor_parallel_size``; 1 when the config has none)."""
        parallel = getattr(self._driver.vllm_config, "parallel_config", None)
        return int(getattr(parallel, "tensor_parallel_size", 1) or 1)

    @property
    def layout_refusal(self) -> str | None:
        """Why the workers cannot report a layout, from the engine's config alone
        (quantized, LoRA-enabled; None: their layers say): the factory then keeps
        the broadcast."""
        from ._layout import config_refusal

        return config_refusal(self._driver.vllm_config)

    async def weight_layouts(self) -> list[Layout]:
        """What each worker holds of each HF checkpoint tensor: one
        :data:`~aiosync.layout.Layout` (``{hf_name: Part}``, full HF shapes) per
        worker, in rank order.

        Derived by each worker from its own layers, as vLLM's loaders narrow the
        checkpoint (:mod:`aiosync.engines.vllm._layout`): column-parallel rows,
        the q/k/v and gate/up parts of packed layers, row-parallel columns, the
        real vocabulary rows of embeddings, replicated tensors whole.

        Raises:
            TransportError: a worker's model cannot be described exactly
                (quantized, LoRA-enabled, a layer type aiosync does not know);
                as :meth:`collective_rpc` otherwise.
        """
        from aiosync.layout import Part

        replies = await self.collective_rpc("aiosync_sharded_layout")
        return [{name: Part.from_wire(part) for name, part in reply.items()} for reply in replies]

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
        lora_config = lora_config_of(self._driver.vllm_config)
        pattern = dict(config.get("rank_pattern") or {})
        check_rank(
            max([int(max_rank), *(int(r) for r in pattern.values())]),
            lora_config,
            "the LoRA adapter",
        )
        reports = await self.collective_rpc(
            "aiosync_vllm_check_lora", kwargs={"targets": list(target_modules)}
        )
        raise_lora_problems("the LoRA adapter", reports)

    async def list_loras(self) -> set[int]:
        """The ``lora_int_id`` of every adapter vLLM holds (``list_loras()``; aiosync's
        adapters have their weight version as id)."""
        return await self._lora.held()

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
            await self._lora.load(adapter)

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
        await self._driver.shutdown()

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
    # weight_versions: a CompletionOutput field of newer vLLMs only.
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


def _sleep_mode_enabled(vllm_config: Any) -> bool:
    # enable_sleep_mode is a ModelConfig field of the vLLMs aiosync supports.
    return bool(getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False))


if TYPE_CHECKING:
    # mypy checks the capabilities this backend claims (aiosync.capabilities).
    def _claims(
        b: VLLMGenerationBackend,
    ) -> tuple[
        Engine,
        PausableEngine,
        VersionedEngine,
        DiscardNotifier,
        EngineWorkers,
        Generating,
        ManifestReporting,
        ConfigReporting,
        LayoutReporting,
        ChecksumVerifying,
    ]:
        return (b, b, b, b, b, b, b, b, b, b)
