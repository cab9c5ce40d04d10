"""The embedded engine: transformers models in worker processes, driven like vLLM.

A reference engine for CPU machines and tests — **not a vLLM replacement** (no
scheduler, no paged KV cache, one prompt at a time, one token per step, with a
pause gate between steps: :meth:`EmbeddedEngine.pause_generation`). It gives every aiosync
transport a real engine to talk to: separate processes (``spawn``), a worker
object per process with ``model_runner.model.load_weights`` and the worker
extension mixins, ``collective_rpc`` by method name, sleep/wake, and
data-parallel generation, each replica optionally split over
``tensor_parallel_size`` processes (Megatron-style, ``_tp.py``). The processes
and their RPC are :class:`~aiosync.engines.embedded._pool.WorkerPool`'s; this
module is the facade.

Requires an asyncio event loop (pyzmq's asyncio sockets).

Example::

    async with EmbeddedEngine(config_dict, num_workers=2) as engine:
        await engine.prepare_for_generation()
        outs = await engine.generate([[1, 2, 3]], max_new_tokens=8)

    # 2 replicas x 2 tensor-parallel ranks: 4 worker processes.
    async with EmbeddedEngine(config_dict, num_workers=2, tensor_parallel_size=2) as engine:
        layouts = await engine.weight_layouts()  # one per worker
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Literal, Self

import anyio.to_thread
import torch

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.capabilities import (
    DRAFT_REFITS,
    IN_FLIGHT_POLICIES,
    DraftRefit,
    EngineKind,
    InFlightPolicy,
)
from aiosync.errors import SyncError, TransportError, UnsupportedOptionError
from aiosync.generation import Generation, SamplingParams, sampling_params, version_span
from aiosync.layout import Layout, Part
from aiosync.lora import LoRAAdapter
from aiosync.transports.packing import dtype_from_name

from .._gate import AdmissionGate
from .._generate import GenerateFromMeta
from ._args import _build_config, _check_draft, _check_dtype, _check_quantization, _model_spec
from ._pool import RESPAWN_HINT, WorkerPool
from ._serve import run_worker
from ._tp import TPSpec, check_tensor_parallel, endpoints_for, open_tp_store
from ._worker import WorkerSpec, tensor_from_wire, tensor_to_wire

if TYPE_CHECKING:
    import torch.distributed as dist
    from transformers import PretrainedConfig

    from aiosync.capabilities import (
        ConfigReporting,
        DiscardNotifier,
        DraftHolding,
        Engine,
        EngineWorkers,
        Generating,
        HealthReporting,
        LayoutReporting,
        ManifestReporting,
        PausableEngine,
        SleepReporting,
        VersionedEngine,
    )

__all__ = ["DEFAULT_WORKER_EXTENSION", "EmbeddedEngine", "EmbeddedGeneration"]

#: The worker extension mixed into every worker unless told otherwise.
DEFAULT_WORKER_EXTENSION = "aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension"

#: Time allowed for the workers to import torch and build their models, seconds.
DEFAULT_START_TIMEOUT_S: float = 600.0


class EmbeddedEngine(GenerateFromMeta):
    """Data-parallel replicas of one transformers model, each in one worker process
    or split over ``tensor_parallel_size`` of them.

    An :class:`~aiosync.capabilities.Engine` that is also a
    :class:`~aiosync.capabilities.PausableEngine`, ``VersionedEngine``,
    ``DiscardNotifier``, ``SleepReporting``, ``EngineWorkers``, ``Generating``
    ``ManifestReporting``, ``ConfigReporting``, ``LayoutReporting`` and ``DraftHolding``
    (checked by mypy at the end of this module).

    Args:
        model: an HF config (a transformers ``PretrainedConfig`` such as
            ``Qwen3Config(...)``, or its dict with ``model_type``), a config.json
            path, or a local model folder (loaded with ``from_pretrained`` when it holds
            safetensors); see :meth:`HFModelRunner.from_config`.
        num_workers: data-parallel replicas, >= 1 (worker processes when
            ``tensor_parallel_size`` is 1).
        tensor_parallel_size: worker processes per replica, >= 1, each holding a
            Megatron-style slice of the model (``_tp.py``: column-parallel
            q/k/v/gate/up, row-parallel o/down with a gloo all-reduce over the
            replica's ranks, vocab-parallel embedding and ``lm_head``, the rest
            replicated; dense Qwen3 and Qwen3-MoE). Worker ``replica * N + r`` is
            rank ``r`` of replica ``replica`` (as vLLM numbers them); every
            worker still takes FULL checkpoint tensors from the transports and
            keeps its slice (:meth:`weight_layouts`). Rank 0 of each replica
            drives its generation, the others run the same steps in lockstep.
            Not with a ``runner_factory``, nor with LoRA adapters.
        expert_parallel_size: expert-parallel groups of each replica's ranks (``M``,
            dividing ``tensor_parallel_size``; Qwen3-MoE only): each group holds
            ``num_experts / M`` whole experts, each cut over the group's
            ``tensor_parallel_size / M`` ranks (``M == tensor_parallel_size``: every
            rank holds whole experts, as vLLM's ``--enable-expert-parallel``
            places them); attention, dense MLPs and embeddings stay Megatron-cut
            over the replica. A worker's :meth:`weight_layouts` lacks the other
            groups' experts, so the shard-aware transport sends it only its own.
            1 (the default): every rank holds a slice of every expert.
        seed: seed for random initialisation (the same on every worker).
        dtype: parameter dtype name (``"float32"``, ``"bfloat16"``).
        worker_extension_cls: dotted path of the mixin class added to each
            worker (vLLM's ``worker_extension_cls``); None for none.
        sleep_level: what :meth:`finish_generation` does: 1 keeps the weights,
            2 discards them (zeroes them: a sync is then required).
        rpc_timeout_s: default timeout of :meth:`collective_rpc`, seconds.
        start_timeout_s: time allowed for the workers to start, seconds.
        threads_per_worker: torch intra-op threads per worker.
        runner_factory: dotted path of ``f(model, seed=, dtype=)`` building the
            object that becomes ``worker.model_runner.model`` (it needs
            ``load_weights`` and ``device``; ``generate``/``hf_state_dict`` for
            those RPCs); default :meth:`HFModelRunner.from_config`. Benchmarks
            use it for weights-only models.
        device_labels: one label per worker process (:attr:`world_size` of
            them, global worker order) naming the device it stands for, so
            that a sharded trainer's ranks pair with "their" workers as on GPUs
            (see :class:`~aiosync.IPCWeightSynchronizer`'s ``process_group``);
            default ``"cpu"`` for every worker.
        quantization: ``"fp8"``: the workers serve the model's block-wise FP8
            checkpoint, the layout of the Qwen3-FP8 and DeepSeek-V3 checkpoints
            (what :class:`~aiosync.refit.FP8RefitSource` streams): each linear
            weight as ``<module>.weight`` ``float8_e4m3fn`` plus
            ``<module>.weight_scale_inv`` ``float32 [ceil(out/128), ceil(in/128)]``,
            everything else in ``dtype``. :meth:`expected_manifest` lists those
            names and dtypes (so a transport refuses an unquantized trainer at
            init, naming a tensor); each worker keeps the FP8 tensors and
            dequantizes them into its ``dtype`` weights before generating
            (``_fp8._FP8Weights``). A model folder holding an FP8 checkpoint is
            read as it is on disk. None: the checkpoint as the model holds it.
        draft: a speculative-decoding draft model held beside the target on every
            worker (an MTP module, an EAGLE head; ``docs/draft.md``), as ``model``
            (an HF config of a causal LM, built with seed ``seed + 1``). Its
            checkpoint tensors are named ``draft_prefix + name`` and load in the
            same sync as the target's, under one version, while :attr:`draft_refit`
            is ``"with_target"`` (the default; :meth:`expected_manifest` lists
            them), or are left as they are when it is ``"frozen"``
            (:meth:`select_draft_refit`, ``SyncOptions(draft=...)``). Generation
            uses the target alone. Not with ``tensor_parallel_size > 1``,
            ``quantization`` or a ``runner_factory``.
        draft_prefix: the prefix of the draft's names (``"mtp."``: Qwen3-Next's MTP
            layers' in its checkpoint); no target name may start with it.

    Raises:
        TypeError: ``model`` is none of the above, or ``num_workers``,
            ``tensor_parallel_size`` or ``expert_parallel_size`` is not an int (before
            any process starts).
        ImportError: transformers is not installed (``pip install 'aiosync[embedded]'``).
        ValueError: ``num_workers < 1``, ``tensor_parallel_size < 1``, an unknown
            ``dtype`` or ``sleep_level``, ``device_labels`` not one string per
            worker, or ``tensor_parallel_size > 1`` with a ``runner_factory`` or
            a config dict that does not split over it (a model type other than
            Qwen3/Qwen3-MoE, heads or sizes not divisible); an unknown
            ``quantization``, or ``"fp8"`` with ``tensor_parallel_size > 1`` or a
            ``runner_factory``; a ``draft`` with any of those, or an empty
            ``draft_prefix`` (a target name that starts with it: at start);
            ``expert_parallel_size < 1`` or not dividing ``tensor_parallel_size``, or
            a config dict without experts that split over it (``_tp.check_expert_parallel``).
    """

    #: Which engine this is (:class:`~aiosync.capabilities.KindReporting`): the factory
    #: picks the transport by it.
    engine_kind: EngineKind = "embedded"

    def __init__(
        self,
        model: object,
        *,
        num_workers: int = 1,
        seed: int = 0,
        dtype: str = "float32",
        worker_extension_cls: str | None = DEFAULT_WORKER_EXTENSION,
        sleep_level: int = 1,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        threads_per_worker: int = 1,
        runner_factory: str | None = None,
        device_labels: Sequence[str] | None = None,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        quantization: Literal["fp8"] | None = None,
        draft: object = None,
        draft_prefix: str = "mtp.",
    ) -> None:
        for what, value in (
            ("num_workers", num_workers),
            ("tensor_parallel_size", tensor_parallel_size),
            ("expert_parallel_size", expert_parallel_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{what} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{what} must be >= 1, got {value}")
        if tensor_parallel_size > 1 and runner_factory is not None:
            raise ValueError("tensor_parallel_size > 1 does not work with a runner_factory")
        _check_quantization(quantization, tensor_parallel_size, runner_factory)
        if draft is not None:
            _check_draft(draft_prefix, tensor_parallel_size, runner_factory, quantization)
        world_size = num_workers * tensor_parallel_size
        _check_dtype(dtype)
        # The workers build transformers models; say so here rather than in a dead worker's log.
        if importlib.util.find_spec("transformers") is None:
            raise ImportError(
                "the embedded engine runs transformers models: pip install 'aiosync[embedded]'"
            )
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        if device_labels is not None and (
            len(device_labels) != world_size
            or not all(isinstance(x, str) and x for x in device_labels)
        ):
            raise ValueError(
                f"device_labels must be {world_size} non-empty strings, got {device_labels!r}"
            )
        self._model = _model_spec(model)
        # The draft model's spec (None: no draft), the prefix of its names, the
        # draft_refit later syncs load by, and the one the running workers hold.
        self._draft = None if draft is None else _model_spec(draft)
        self._draft_prefix = draft_prefix
        self._draft_refit: DraftRefit = "with_target"
        self._draft_told: DraftRefit = "with_target"
        if tensor_parallel_size % expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size={expert_parallel_size} must divide "
                f"tensor_parallel_size={tensor_parallel_size}"
            )
        if tensor_parallel_size > 1 and isinstance(self._model, dict):
            # What the dict says can be checked here, before minutes of spawning; the
            # workers check the full config (transformers' defaults filled in) again.
            check_tensor_parallel(self._model, tensor_parallel_size, expert_parallel_size)
        self.device_labels = None if device_labels is None else list(device_labels)
        #: Data-parallel replicas (what generate splits prompts over).
        self.num_workers = num_workers
        #: Worker processes per replica.
        self.tensor_parallel_size = tensor_parallel_size
        #: Expert-parallel groups of each replica's ranks (1: none).
        self.expert_parallel_size = expert_parallel_size
        self.seed = seed
        self.dtype = dtype
        self.worker_extension_cls = worker_extension_cls
        self.sleep_level = sleep_level
        self.start_timeout_s = start_timeout_s
        self.threads_per_worker = threads_per_worker
        self.runner_factory = runner_factory
        #: ``"fp8"``: the workers serve the FP8 checkpoint; None: the model's own.
        self.quantization: Literal["fp8"] | None = quantization
        self._pool = WorkerPool(world_size, run_worker, self._worker_args, rpc_timeout_s)
        # The replicas' tensor-parallel groups meet over this store (started by
        # start()); each replica's group is formed anew, under a new prefix,
        # whenever the replica is respawned.
        self._tp_store: dist.TCPStore | None = None
        self._tp_formations = [0] * num_workers
        # The workers' model config, built on the first expected_config().
        self._config: PretrainedConfig | None = None
        self._discard_listeners: list[Callable[[], None]] = []
        #: The synchronizer's ``weight_version`` of the weights every worker holds;
        #: None before the first sync (the engine's own initial weights).
        self.weight_version: int | None = None
        # How many commits labelled the workers' weights: the workers order labels
        # by it, since a new owner's versions may be lower than the last (case C27).
        self._commits = 0
        #: The LoRA adapter every generation applies (:meth:`load_lora_adapter`);
        #: None: the base model.
        self.lora_adapter: str | None = None
        #: What sleeps on the workers, known here without asking them (this object
        #: alone sleeps and wakes them): a colocated synchronizer skips the wake of
        #: anything not in it. Every tag from :meth:`finish_generation` until
        #: :meth:`prepare_for_generation` wakes it.
        self.asleep_tags: frozenset[str] = frozenset()
        # Why generate() refuses on account of an adapter load (in flight or
        # failed); None when it does not.
        self._lora_refusal: str | None = None
        # The in-flight policy, kept here first: this object alone sends the
        # workers requests, so while none of its generate calls runs a pause
        # needs no worker RPC (admission closes here), and the weight version
        # travels with the next request instead of an RPC of its own.
        self._gate = AdmissionGate("the embedded engine")
        # The workers' gates were paused too (requests were running): resume them.
        self._workers_paused = False
        # A generate call was given up (cancelled, timed out) after its request
        # was sent: the workers may still run it, so pauses ask them until a
        # "wait" or "abort" pause has ended every request there.
        self._abandoned = False

    # -- the draft model (DraftHolding) ------------------------------------------

    @property
    def draft_prefix(self) -> str | None:
        """The prefix of the draft model's checkpoint names (``"mtp."``); None: no draft."""
        return None if self._draft is None else self._draft_prefix

    @property
    def draft_refit(self) -> DraftRefit | None:
        """What later syncs do with the draft model (:data:`~aiosync.capabilities.DraftRefit`);
        None: no draft."""
        return None if self._draft is None else self._draft_refit

    def select_draft_refit(self, mode: DraftRefit) -> None:
        """Whether later syncs load the draft with the target (``"with_target"``) or
        leave it bit for bit as it is (``"frozen"``). The workers learn it before
        the engine's next RPC (their manifest, which a transport checks at init,
        lists the draft's tensors or leaves them out).

        Raises:
            ValueError: an unknown ``mode``.
            UnsupportedOptionError: ``"with_target"`` on an engine without a draft.
        """
        if mode not in DRAFT_REFITS:
            raise ValueError(f"mode must be one of {DRAFT_REFITS}, got {mode!r}")
        if self._draft is None:
            if mode == "with_target":
                raise UnsupportedOptionError(
                    "draft='with_target': this EmbeddedEngine holds no draft model "
                    "(EmbeddedEngine(..., draft=config))"
                )
            return
        self._draft_refit = mode

    async def _tell_draft_refit(self) -> None:
        """Tell the running workers :attr:`draft_refit` if it changed since they were."""
        if self._draft is None or self._draft_told == self._draft_refit or not self._pool.started:
            return
        mode = self._draft_refit
        calls: list[tuple[int, list[Any], dict[str, Any]]] = [
            (rank, [mode], {}) for rank in range(self.world_size)
        ]
        await self._pool.call("embedded_select_draft_refit", calls, None)
        self._draft_told = mode

    @property
    def layout_refusal(self) -> str | None:
        """None: every worker reports its layout (:meth:`weight_layouts`)."""
        return None

    @property
    def world_size(self) -> int:
        """Worker processes: ``num_workers * tensor_parallel_size``. :meth:`collective_rpc`
        answers one result per worker, and a collective synchronizer's
        ``inference_world_size`` is this."""
        return self.num_workers * self.tensor_parallel_size

    @property
    def rpc_timeout_s(self) -> float:
        """Default limit of one :meth:`collective_rpc` (and of ``generate``'s wait), seconds."""
        return self._pool.rpc_timeout_s

    @rpc_timeout_s.setter
    def rpc_timeout_s(self, value: float) -> None:
        self._pool.rpc_timeout_s = value

    def _worker_args(self, rank: int, weights_valid: bool) -> tuple[Any, ...]:
        """``run_worker``'s arguments for worker ``rank``."""
        spec = WorkerSpec(
            rank,
            self.world_size,
            self._model,
            self.seed,
            self.dtype,
            self.worker_extension_cls,
            runner_factory=self.runner_factory,
            weights_valid=weights_valid,
            device_label=None if self.device_labels is None else self.device_labels[rank],
            tensor_parallel=self._tp_spec(rank),
            quantization=self.quantization,
            draft=None
            if self._draft is None
            else {"model": self._draft, "prefix": self._draft_prefix, "refit": self._draft_refit},
        )
        return (self._pool.endpoint, self.threads_per_worker, spec)

    def _tp_spec(self, rank: int) -> TPSpec | None:
        """Worker ``rank``'s place in its replica's tensor-parallel group (None: TP=1)."""
        size = self.tensor_parallel_size
        if size == 1:
            return None
        assert self._tp_store is not None and self._pool.dir is not None
        replica = rank // size
        return TPSpec(
            rank=rank % size,
            size=size,
            replica=replica,
            store_port=int(self._tp_store.port),
            prefix=f"tp/{replica}/{self._tp_formations[replica]}",
            endpoints=endpoints_for(self._pool.dir, range(replica * size, (replica + 1) * size)),
            timeout_s=self.start_timeout_s,
            expert_parallel=self.expert_parallel_size,
        )

    # -- lifecycle ------------------------------------------------------------

    @classmethod
    async def start_engine(cls, model: object, **options: Any) -> Self:
        """Construct and :meth:`start` an engine."""
        engine = cls(model, **options)
        await engine.start()
        return engine

    async def start(self) -> Self:
        """Spawn the workers and wait until every model is built.

        Idempotent while running; an engine that was shut down does not start again.

        Raises:
            SyncError: the engine was shut down (:meth:`shutdown`, or the exit of
                ``async with``): build a new one.
            TransportError: a worker failed to build its model or exited.
            SyncTimeoutError: the workers were not ready within ``start_timeout_s``.
        """
        if self._pool.closed:
            # A closed pool's socket directory is gone and its workers reaped:
            # returning self here would hand out an engine whose every call fails.
            raise SyncError(
                "EmbeddedEngine.start() after shutdown(): a shut-down engine does not "
                "start again; build a new EmbeddedEngine"
            )
        if self._pool.started:
            return self
        try:
            if self.tensor_parallel_size > 1:
                self._tp_store = await anyio.to_thread.run_sync(open_tp_store, self.start_timeout_s)
            await self._pool.start(self.start_timeout_s)
            self._draft_told = self._draft_refit  # the workers were built with it
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def respawn_dead_workers(self) -> list[int]:
        """Start a fresh process for every worker that died; returns their ranks.

        A respawned worker holds the initial weights (``seed`` or the model
        folder), not the last synced version, so it starts with its weights
        marked invalid (:meth:`generate` raises :class:`~aiosync.errors.SyncError`)
        and the weights-discarded listeners are called (a registered
        synchronizer becomes stale). Run ``init_communicator()`` and a sync
        before generating.

        With ``tensor_parallel_size > 1`` a replica is respawned whole: its
        surviving ranks are stopped first (a gloo group takes no new member),
        then every rank of it starts afresh in a new group; all their ranks
        are returned.

        Raises:
            TransportError, SyncTimeoutError: a new worker failed to start.
        """
        self._pool.check_running()
        dead = self._pool.dead
        if not dead:
            return []
        # The dead workers' weights are gone whatever happens next.
        self._notify_weights_discarded()
        size = self.tensor_parallel_size
        if size > 1:
            replicas = sorted({rank // size for rank in dead})
            await self._pool.stop(
                [replica * size + r for replica in replicas for r in range(size)],
                "stopped: a tensor-parallel peer in its replica died",
            )
            for replica in replicas:
                self._tp_formations[replica] += 1
        return await self._pool.respawn_dead(self.start_timeout_s)

    async def check_health(self) -> None:
        """Return when every worker runs (:class:`~aiosync.capabilities.HealthReporting`).

        Raises:
            TransportError: a worker died (named, with its exit code), or the
                engine is not running.
        """
        self._pool.check_running()
        dead = self._pool.dead
        if dead:
            reasons = "; ".join(f"worker {r}: {self._pool.why_dead(r)}" for r in dead)
            raise TransportError(f"engine worker(s) {dead} died ({reasons}); {RESPAWN_HINT}")

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    @property
    def socket_dir(self) -> str | None:
        """The private (0700) directory of the RPC socket; None before start."""
        return self._pool.dir

    @property
    def pids(self) -> list[int]:
        """Worker process ids, rank order (:attr:`world_size` of them)."""
        return [p.pid or 0 for p in self._pool.procs]

    @property
    def processes(self) -> list[BaseProcess]:
        """The worker processes, rank order (for tests and tools)."""
        return list(self._pool.procs)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (killing any that do not exit in ``timeout_s``), remove sockets.

        Idempotent.
        """
        if self._pool.closed:
            return
        # Waiting generate calls fail fast: the engine is shut down.
        self._gate.resume()
        await self._pool.close(timeout_s)
        self._tp_store = None  # the server goes with the last reference

    # -- RPC ------------------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``worker.method(*args, **kwargs)`` on every worker (all :attr:`world_size`
        of them, every tensor-parallel rank); results in rank order.

        Arguments and results must be msgpack-safe (str, int, float, bool, None,
        bytes, list, dict); tuples arrive as lists.

        Raises:
            SyncTimeoutError: not every worker answered within ``timeout_s``
                (default ``rpc_timeout_s``) seconds.
            TransportError: a worker is dead or died during the call, or raised
                an exception of a type aiosync does not re-raise as itself.
            SyncError (and subclasses), ValueError, TypeError, KeyError,
            AttributeError, NotImplementedError: re-raised from a worker.
        """
        await self._tell_draft_refit()
        calls = [(rank, list(args), dict(kwargs or {})) for rank in range(self.world_size)]
        return await self._pool.call(method, calls, timeout_s)

    # -- GenerationBackend ----------------------------------------------------

    async def on_weights_committed(self, version: int) -> None:
        """Record ``version`` as the engine's :attr:`weight_version` (called by the
        synchronizer once a sync landed on every worker); the workers label the
        tokens they compute from now on with it (:meth:`generate_with_meta`).

        ``version`` is the committing synchronizer's, whether or not it is higher
        than the last: a restarted trainer (versions from 0) that committed owns
        the labels from then on (case C27).

        While a pause is in force (a sync's) no RPC is made: the label reaches the
        workers with :meth:`resume_generation` if requests are frozen there, else
        with the next request (:meth:`generate_with_meta`, :meth:`status`), before
        any token is computed under it.

        Raises:
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        self.weight_version = version
        self._commits += 1
        if not self._gate.paused:
            await self.collective_rpc("embedded_set_weight_version", (self._label(),))

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        """Pause generation on every worker (the in-flight policy, decode-step granularity).

        From the call on no new request starts (a :meth:`generate` waits until
        :meth:`resume_generation`); the running ones, per ``mode``:

        * ``"abort"``: end before their next token, keeping the tokens they have,
          marked aborted (:meth:`generate_with_meta`); returns once all ended.
        * ``"wait"``: run to their end; returns then.
        * ``"keep"``: stop before their next token and stay there with their KV
          cache; returns once no forward pass runs. After :meth:`resume_generation`
          they continue, their remaining tokens computed by the weights live then,
          attending to the KV cache the earlier weights computed (as vLLM's
          ``keep`` and SGLang's ``in_place``).

        Only this object sends the workers requests, so with none of its
        :meth:`generate` calls running the pause is kept here and costs no RPC
        (a sync's fixed cost, ``benchmarks/fixed_cost.py``).

        ``clear_cache``: accepted for the contract; this engine keeps no KV cache
        between requests (no prefix cache), so there is nothing to clear.

        Raises:
            ValueError: an unknown ``mode`` (before any worker is told).
            TransportError: as :meth:`collective_rpc` (no time limit of its own:
                ``"wait"`` lasts as long as the longest request; bound it with a
                cancel scope, as the synchronizer does).
        """
        _check_mode(mode)
        self._pool.check_running()
        self._gate.pause()
        if self._gate.running or self._workers_paused or self._abandoned:
            # Set before the call: a pause that fails half-way is resumed all the same.
            self._workers_paused = True
            await self.collective_rpc("embedded_pause_generation", (mode,), timeout_s=math.inf)
            if mode != "keep":
                self._abandoned = False  # every request there has ended

    async def resume_generation(self) -> None:
        """Undo :meth:`pause_generation` on every worker. Idempotent.

        Raises:
            TransportError, SyncTimeoutError: as :meth:`collective_rpc` (the
                engine then stays paused; call it again).
        """
        if self._workers_paused:
            await self.collective_rpc("embedded_resume_generation", (self._label(),))
            self._workers_paused = False
        self._gate.resume()

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake ``tags`` (``"weights"``, ``"kv_cache"``; None: all) on every worker.

        After a level-2 sleep the weights wake zeroed and stay invalid until a
        sync succeeds; :meth:`generate` refuses until then.
        """
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown tags {sorted(unknown)}; known: weights, kv_cache")
        await self.collective_rpc("embedded_wake", (list(tags) if tags is not None else None,))
        self.asleep_tags = self.asleep_tags - set(tags) if tags is not None else frozenset()

    async def finish_generation(self) -> None:
        """Sleep every worker at ``sleep_level`` (2 discards the weights and the
        LoRA adapter)."""
        # Before the call: a sleep that fails half-way leaves workers asleep.
        self.asleep_tags = frozenset({"weights", "kv_cache"})
        discarded = await self.collective_rpc("embedded_sleep", (self.sleep_level,))
        if any(discarded):
            self.lora_adapter = None
            self._notify_weights_discarded()

    async def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Make ``adapter`` the LoRA adapter every later :meth:`generate` applies, on every worker.

        The tensors (``{peft_name: tensor}``, PEFT's saved names and layout:
        ``lora_A`` ``[r, in_features]``, ``lora_B`` ``[out_features, r]``; megabytes)
        travel to each worker in the RPC itself, which applies them with PEFT,
        unmerged, cast to the engine's dtype: the base weights are not touched.
        The adapter replaces the previous one (unloaded first; adapters never
        stack). From the call until it returns, and after it failed, :meth:`generate`
        refuses (:class:`~aiosync.errors.SyncError`) until a load succeeds: a
        half-loaded adapter is never served, nor the previous one silently.
        Unless ``adapter.verify`` is False each worker checks the tensors it
        decoded against ``adapter.digests`` before loading them
        (:func:`aiosync.transports.lora.check_adapter_tensors`).

        Raises:
            RefitVerificationError: a worker received a tensor otherwise than the
                trainer sent it (names the worker, the adapter and the tensor);
                no adapter is loaded.
            SyncError: a worker's base weights are not valid (a level-2 sleep, a
                failed full refit, a respawned worker): an adapter cannot restore them.
            RefitMismatchError: the adapter does not fit the model (a target
                module it lacks, a shape, a bad ``adapter_config.json``).
            NotImplementedError: ``tensor_parallel_size > 1`` (before any worker
                is touched: the engine keeps serving its base model).
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        if self.tensor_parallel_size > 1:
            raise NotImplementedError(
                "LoRA adapters are not supported with tensor_parallel_size > 1 (the adapter "
                "layers would need the same Megatron slicing as the base layers)"
            )
        wire = {name: tensor_to_wire(tensor) for name, tensor in adapter.tensors.items()}
        # What each worker checks what it decodes against (None: nothing to check).
        check = (
            None
            if adapter.verify is False
            else {
                "version": adapter.version,
                "verify": adapter.verify,
                "digests": dict(adapter.digests),
            }
        )
        self._lora_refusal = f"loading LoRA adapter {adapter.name!r} did not complete"
        self.lora_adapter = None
        await self.collective_rpc(
            "embedded_load_lora_adapter", (adapter.name, wire, dict(adapter.config), check)
        )
        self.lora_adapter = adapter.name
        self._lora_refusal = None

    async def expected_manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{hf_name: (shape, dtype)}`` of the base model's checkpoint, in
        ``save_pretrained`` order (worker 0's :meth:`HFModelRunner.expected_manifest`);
        with a draft model whose :attr:`draft_refit` is ``"with_target"``, the draft's
        tensors follow under :attr:`draft_prefix`.

        Raises:
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        await self._tell_draft_refit()
        (reply,) = await self._pool.call("embedded_expected_manifest", [(0, [], {})], None)
        return {name: (tuple(shape), dtype_from_name(dtype)) for name, shape, dtype in reply}

    async def expected_config(self) -> PretrainedConfig | None:
        """The HF config the workers built their model from (a transformers
        ``PretrainedConfig``), for the transports' config check at init.

        Built here as :meth:`HFModelRunner.from_config` builds it (a dict through
        ``AutoConfig.for_model``, a folder through ``AutoConfig.from_pretrained``),
        so transformers' defaults are filled in as on the workers; in a worker
        thread (it imports transformers), once. None with a ``runner_factory``:
        such a runner need not compute what the config says.

        Raises:
            ValueError: the config has no ``model_type``.
            OSError: the config path cannot be read.
        """
        if self.runner_factory is not None:
            return None
        if self._config is None:
            self._config = await anyio.to_thread.run_sync(_build_config, self._model)
        return self._config

    def _notify_weights_discarded(self) -> None:
        for listener in list(self._discard_listeners):
            listener()

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever workers lose their synced weights (a level-2
        sleep, or a dead worker replaced by :meth:`respawn_dead_workers`).

        A synchronizer registers ``_invalidate_engine_weights`` here so that it
        knows a sync is needed before the engine may generate (case C6).
        """
        self._discard_listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener` (no error if absent)."""
        if listener in self._discard_listeners:
            self._discard_listeners.remove(listener)

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        **keywords: Any,
    ) -> list[Generation]:
        """Generate for each prompt (token ids), split over the workers: one
        :class:`EmbeddedGeneration` (an :class:`aiosync.Generation`) per prompt, in
        prompt order, holding only the new ids. :meth:`generate` returns their
        ``token_ids``.

        Prompts are split into contiguous chunks, one per replica (data parallel;
        a tensor-parallel replica's rank 0 drives it).
        Each prompt advances one token per step; while the engine is paused
        (:meth:`pause_generation`) a call waits for :meth:`resume_generation`. A
        request aborted by a pause returns the tokens it had (``aborted``). With a
        LoRA adapter loaded (:meth:`load_lora_adapter`) every prompt is generated
        with it.

        Args:
            prompts: one list of token ids per prompt (non-empty).
            params: how to sample (:class:`aiosync.SamplingParams`), or its fields
                as keywords (``max_new_tokens=``, ``temperature=``, ``top_p=``,
                ``seed=`` seeding each worker's sampler, ``ignore_eos=``,
                ``logprobs=``); see :func:`aiosync.generation.sampling_params`.
            timeout_s: limit for the call, seconds (None: ``rpc_timeout_s``).

        Each result's versions are the engine's own: the synchronizer's
        ``weight_version`` live on the worker when each token was computed
        (:meth:`on_weights_committed`), None before the first sync;
        ``finish_reason`` is ``"stop"`` (EOS), ``"length"`` or ``"abort"``.

        Raises:
            ValueError: bad sampling parameters (:class:`~aiosync.SamplingParams`),
                or an empty prompt (raised by the worker).
            TypeError: an unknown keyword, or no token limit.
            SyncError: a worker's weights are invalid (after a failed refit or a
                level-2 sleep) or asleep, or a LoRA adapter load is in flight or failed.
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        sampling = sampling_params(params, keywords)
        if self._lora_refusal is not None:
            raise SyncError(
                f"the embedded engine refuses to generate: {self._lora_refusal}; a sync must "
                "succeed first"
            )
        timeout = self.rpc_timeout_s if timeout_s is None else timeout_s
        async with self._admitted(timeout) as remaining_s:
            return await self._generate(prompts, sampling, remaining_s)

    @contextlib.asynccontextmanager
    async def _admitted(self, timeout_s: float) -> AsyncIterator[float]:
        """Admit one generate call: wait while paused, then count it as running
        until the block ends. Yields what is left of ``timeout_s``, seconds.

        A dead worker is refused before the wait (:meth:`check_health`): a pause
        whose resume failed on it would never be lifted."""
        await self.check_health()
        async with self._gate.shared(timeout_s) as remaining_s:
            self._pool.check_running()
            try:
                yield remaining_s
            except BaseException:
                self._abandoned = True
                raise

    async def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, timeout_s: float
    ) -> list[Generation]:
        batch = [list(p) for p in prompts]
        chunk = -(-len(batch) // self.num_workers) if batch else 0
        kwargs = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "seed": sampling.seed,
            "ignore_eos": sampling.ignore_eos,
            "top_p": sampling.top_p,
            "logprobs": sampling.logprobs,
            "weight_label": self._label(),
        }
        calls = []
        for replica in range(self.num_workers):
            part = batch[replica * chunk : (replica + 1) * chunk]
            if part:
                # The replica's driver: its other ranks follow it step by step.
                calls.append((replica * self.tensor_parallel_size, [part], dict(kwargs)))
        results = await self._pool.call("embedded_generate_with_meta", calls, timeout_s)
        return [EmbeddedGeneration.from_reply(out) for part in results for out in part]

    # -- tests and tools ------------------------------------------------------

    async def status(self) -> list[dict[str, Any]]:
        """Each worker's ``{"rank", "pid", "weights_valid", "asleep", "kv_scales",
        "lora_adapter", "lora_loaded", "lora_valid", "paused", "requests",
        "weight_version"}`` (``lora_adapter``: the adapter generations apply, None
        for the base model; ``lora_loaded``: every adapter its model holds;
        ``paused``: the pause mode in force, None when running; ``requests``: the
        decode steps each running request has started)."""
        return await self.collective_rpc("embedded_status", (self._label(),))

    def _label(self) -> list[int] | None:
        """``[commit, version]`` the workers label tokens with (None: never synced)."""
        return None if self.weight_version is None else [self._commits, self.weight_version]

    async def weight_layouts(self) -> list[Layout]:
        """What each worker holds of each checkpoint tensor, one
        :data:`~aiosync.layout.Layout` (``{hf_name: Part}``, checkpoint order) per
        worker in rank order (:attr:`world_size` of them).

        Each :class:`~aiosync.layout.Part` names the FULL tensor's shape (as
        :meth:`expected_manifest`) and the range kept: :meth:`Part.whole` for
        every tensor with ``tensor_parallel_size=1``, else the Megatron slice
        of the worker's tensor-parallel rank (with ``expert_parallel_size > 1``
        only the experts of the worker's EP group: the others' names are absent).

        Raises:
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        replies = await self.collective_rpc("embedded_weight_layout")
        return [{name: Part.from_wire(part) for name, part in reply.items()} for reply in replies]

    async def hf_state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """Every worker's weights in HF checkpoint names (copies; for tests); a
        tensor-parallel worker's are its slices (:meth:`weight_layouts`)."""
        replies = await self.collective_rpc("embedded_state_dict")
        return [
            {name: tensor_from_wire(fields) for name, fields in reply.items()} for reply in replies
        ]


@dataclass(frozen=True, slots=True)
class EmbeddedGeneration(Generation):
    """One prompt's result from :meth:`EmbeddedEngine.generate_with_meta`: an
    :class:`aiosync.Generation` that also keeps every token's version.

    Attributes:
        versions: per token, the engine's ``weight_version`` when the token was
            computed (None: before the first sync); ``len(versions) == len(token_ids)``.
            ``first_version`` and ``last_version`` are derived from it;
            ``version_change_at`` from the commits that labelled the tokens, so
            that two owners' weights under one version number still count as a
            change (a restarted trainer's version 1 is not the first run's).
    """

    versions: list[int | None] = field(default_factory=list)

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> EmbeddedGeneration:
        """From a worker's ``{"token_ids", "aborted", "versions", "commits",
        "logprobs", "finish_reason"}`` (``embedded_generate_with_meta``)."""
        versions = [None if v is None else int(v) for v in reply["versions"]]
        first, last, _ = version_span(versions)
        _, _, change = version_span([int(c) for c in reply["commits"]])
        logprobs = reply.get("logprobs")
        return cls(
            token_ids=[int(t) for t in reply["token_ids"]],
            logprobs=None if logprobs is None else [float(x) for x in logprobs],
            first_version=first,
            last_version=last,
            version_change_at=change,
            aborted=bool(reply["aborted"]),
            finish_reason=reply.get("finish_reason"),
            versions=versions,
        )


def _check_mode(mode: object) -> None:
    if mode not in IN_FLIGHT_POLICIES:
        raise ValueError(f"mode must be one of {IN_FLIGHT_POLICIES}, got {mode!r}")


if TYPE_CHECKING:
    # mypy checks the capabilities this engine claims (aiosync.capabilities).
    def _claims(
        e: EmbeddedEngine,
    ) -> tuple[
        Engine,
        PausableEngine,
        VersionedEngine,
        DiscardNotifier,
        SleepReporting,
        EngineWorkers,
        Generating,
        ManifestReporting,
        ConfigReporting,
        LayoutReporting,
        HealthReporting,
        DraftHolding,
    ]:
        return (e, e, e, e, e, e, e, e, e, e, e, e)
