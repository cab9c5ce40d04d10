"""One embedded-engine worker: the object whose methods its process serves by name,
and how it is built (:class:`WorkerSpec`, :func:`build_worker`).

The worker object mirrors a vLLM worker: ``worker.model_runner.model`` is the
:class:`~aiosync.engines.embedded.model.HFModelRunner`, and the worker-extension
mixins (``AiosyncWorkerExtension`` by default) are among its bases, so their
``aiosync_*`` methods are callable through ``collective_rpc``. The process around
it (its socket, its RPC threads) is :mod:`._serve`'s.

With tensor parallelism (``_tp.py``) the worker is one rank of a replica: rank
0 (the driver) serves generate requests for the replica, the others (followers)
run the driver's steps in a thread of their own; every rank serves every other
RPC (loads, sleeps, status) for its own slice.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from aiosync.errors import SyncError
from aiosync.layout import Part
from aiosync.transports.lora import check_adapter_tensors
from aiosync.transports.packing import dtype_from_name, dtype_name
from aiosync.transports.validity import mark_invalid, mark_valid

from .._gate import GenerationGate, RequestTicket

if TYPE_CHECKING:
    from ._tp import TPSpec
    from .model import HFModelRunner

__all__ = ["EmbeddedWorker", "WorkerSpec", "build_worker", "tensor_from_wire", "tensor_to_wire"]


class EmbeddedWorker:
    """The engine-side worker: model, sleep state and the engine's own RPCs.

    Attributes:
        rank: this worker's index, 0..world_size-1 (``replica * tp_size + tp_rank``,
            as vLLM numbers the workers of its data-parallel replicas).
        world_size: number of workers (every rank of every replica).
        tp_rank: its rank in its tensor-parallel replica (0: the driver; 0
            without tensor parallelism).
        tp_size: ranks per replica (1 without tensor parallelism).
        device: where the model lives (CPU).
        model_runner: ``model_runner.model`` is the :class:`HFModelRunner`.
        aiosync_weights_valid: False while a refit is in flight or after one
            failed, or after the weights were discarded; generation refuses then.
        aiosync_lora_adapter: the LoRA adapter every generation applies (an
            adapter-only refit's ``aiosync-v{version}``), None for the base model.
        aiosync_gate: the :class:`GenerationGate` of its requests (pause/resume).
        aiosync_weight_version: the weight version its tokens are labelled with.
        aiosync_weight_commit: which of the engine's commits that version is
            (its count of ``on_weights_committed`` calls; 0: never synced).
        aiosync_draft_weight_version: the weight version of the draft model's
            weights (None: its initial ones): a commit made while the draft is
            refit with the target (``draft_refit == "with_target"``) labels both.
    """

    def __init__(
        self, rank: int, world_size: int, runner: HFModelRunner, weights_valid: bool = True
    ) -> None:
        self.rank = rank
        self.local_rank = rank
        self.world_size = world_size
        tp = getattr(runner, "tensor_parallel", None)
        self.tp_rank: int = 0 if tp is None else tp.rank
        self.tp_size: int = 1 if tp is None else tp.size
        self.device = runner.device
        self.model_runner = SimpleNamespace(model=runner)
        self.aiosync_weights_valid = weights_valid
        #: The device this worker stands for when pairing with a sharded trainer (None: "cpu").
        self.device_label: str | None = None
        self.aiosync_lora_adapter: str | None = None
        # Why generation is refused on account of the adapter (a load in flight or
        # failed), None when it is not.
        self._lora_refusal: str | None = None
        self._asleep: set[str] = set()
        self._state_lock = threading.Lock()
        #: Admission and per-step gate of generation requests (the in-flight policy).
        self.aiosync_gate = GenerationGate()
        #: The synchronizer's weight version of the weights held (None: never synced).
        self.aiosync_weight_version: int | None = None
        #: The engine's commit that labelled them (0: none): labels are ordered by
        #: it, not by version, since a new owner's versions may be lower (case C27).
        self.aiosync_weight_commit = 0
        self.aiosync_draft_weight_version: int | None = None
        # What a sleep took away and a wake of "weights" gives back, as vLLM does:
        # level 1 offloads the weights (a copy here), level 2 keeps only the
        # buffers the checkpoint does not carry (rotary caches), since a refit
        # restores the rest.
        self._offloaded: dict[str, torch.Tensor] | None = None
        self._saved_buffers: dict[str, torch.Tensor] | None = None
        # Sleeps, wakes and weight loads in order (embedded_lifecycle); every
        # load goes through the runner's load_weights, wrapped to record it.
        self._lifecycle: list[str] = []
        # Its own lock: a load may run under _state_lock (embedded_load_state_dict).
        self._lifecycle_lock = threading.Lock()
        self._load_weights = runner.load_weights
        runner.load_weights = self._logged_load  # type: ignore[method-assign]
        # A runner_factory's runner may not load parts.
        self._load_weight_parts: Callable[[Any], int] | None = getattr(
            runner, "load_weight_parts", None
        )
        if self._load_weight_parts is not None:
            runner.load_weight_parts = self._logged_load_parts  # type: ignore[method-assign]

    def embedded_generate_with_meta(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        top_p: float = 1.0,
        logprobs: bool = False,
        weight_label: list[int] | None = None,
    ) -> list[dict[str, Any]]:
        """Generate for ``prompts``, one token per step; per prompt ``{"token_ids",
        "aborted", "versions", "commits", "logprobs", "finish_reason"}`` (``versions``:
        the engine's weight version each token was computed with, None before the
        first sync; ``commits``: the engine's commit that labelled it, 0 before
        the first, which tells two owners' weights apart under one version number;
        ``logprobs``: with ``logprobs``, each token's
        ``log_softmax(logits)[token]`` before temperature and top-p, else None;
        ``finish_reason``: ``"abort"``, ``"stop"`` (ended on an EOS token) or
        ``"length"``).

        Each prompt is one request at the worker's :class:`GenerationGate`:
        admitted once no pause is in force, then stepped token by token. Before
        every step, under the model's lock, the weights are checked: a refit that
        began loading (without pausing this request), a discard, a sleep or a
        LoRA load in flight stops the request with :class:`SyncError` rather than
        mixing versions.

        ``weight_label``: the engine's ``[commit, version]`` when the call was sent
        (:meth:`embedded_set_weight_version`; the engine sends it with each call
        rather than an RPC of its own after each sync).

        Raises:
            SyncError: the weights are invalid (a refit failed half-way or is
                loading, or the engine discarded them), asleep, or a LoRA adapter
                load is in flight or failed (at admission or before a step).
        """
        self.embedded_set_weight_version(weight_label)
        runner: HFModelRunner = self.model_runner.model
        generator = runner.make_generator(seed)
        results: list[dict[str, Any]] = []
        for prompt in prompts:
            versions: list[int | None] = []
            commits: list[int] = []

            def before_forward(
                versions: list[int | None] = versions, commits: list[int] = commits
            ) -> str | None:
                # Under the model's lock: nothing loads into the weights meanwhile.
                with self._state_lock:
                    self._check_can_generate()
                    versions.append(self.aiosync_weight_version)
                    commits.append(self.aiosync_weight_commit)
                    return self.aiosync_lora_adapter

            with self.aiosync_gate.request() as ticket:

                def gate(_step: int, ticket: RequestTicket = ticket) -> bool:
                    return self.aiosync_gate.step(ticket)

                out = runner.decode(
                    prompt,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    generator=generator,
                    ignore_eos=ignore_eos,
                    before_forward=before_forward,
                    gate=gate,
                    top_p=top_p,
                )
            if out.aborted:
                finish = "abort"
            elif out.token_ids and not ignore_eos and out.token_ids[-1] in runner.eos_ids():
                finish = "stop"
            else:
                finish = "length"
            results.append(
                {
                    "token_ids": out.token_ids,
                    "aborted": out.aborted,
                    "versions": versions,
                    "commits": commits,
                    "logprobs": list(out.logprobs) if logprobs else None,
                    "finish_reason": finish,
                }
            )
        return results

    def _tp_refusal(self) -> int:
        """Why this follower refuses a step: 0 if it may serve it, else a
        ``_tp.REFUSALS`` code (as :meth:`_check_can_generate` decides)."""
        with self._state_lock:
            if not self.aiosync_weights_valid:
                return 1
            if self._lora_refusal is not None:
                return 2
            return 3 if self._asleep else 0

    def _aiosync_weight_modules(self) -> list[torch.nn.Module]:
        """What holds the live weights: the target model and, when held, the draft."""
        runner = self.model_runner.model
        modules: list[torch.nn.Module] = [runner.model]
        if runner.draft is not None:
            modules.append(runner.draft.model)
        return modules

    def _check_can_generate(self) -> None:
        """Raise SyncError unless the weights may serve a step (hold ``_state_lock``)."""
        if not self.aiosync_weights_valid:
            raise SyncError(
                f"worker {self.rank}: weights are not valid (a refit failed or is loading, or "
                "they were discarded while asleep); a sync must succeed before generating"
            )
        if self._lora_refusal is not None:
            raise SyncError(
                f"worker {self.rank}: {self._lora_refusal}; a sync must succeed before generating"
            )
        if self._asleep:
            raise SyncError(f"worker {self.rank}: asleep ({sorted(self._asleep)})")

    def embedded_pause_generation(self, mode: str) -> int:
        """Pause this worker's generation (:class:`GenerationGate`, ``mode`` one of
        ``"abort"``, ``"wait"``, ``"keep"``); returns the requests left frozen.

        Raises:
            ValueError: an unknown ``mode``.
        """
        return self.aiosync_gate.pause(mode)

    def embedded_resume_generation(self, weight_label: list[int] | None = None) -> None:
        """Admit requests again and let frozen ones continue, their next tokens
        labelled ``weight_label`` (:meth:`embedded_set_weight_version`). Idempotent."""
        self.embedded_set_weight_version(weight_label)
        self.aiosync_gate.resume()

    def embedded_set_weight_version(self, label: list[int] | None) -> None:
        """Label the tokens computed from now on with ``label``, the engine's
        ``[commit, version]`` (its count of commits, and the committing
        synchronizer's ``weight_version``).

        The latest commit wins, whatever its version: a restarted trainer's
        versions start again at 0 and must label the weights it committed (case
        C27), while a request sent before a sync but admitted after it carries an
        older commit, which must not relabel newer weights. None (the engine had
        no version yet) changes nothing.
        """
        if label is None:
            return
        commit, version = (int(x) for x in label)
        with self._state_lock:
            if commit > self.aiosync_weight_commit:
                self.aiosync_weight_commit, self.aiosync_weight_version = commit, version
                # The sync that committed loaded the draft too (its manifest listed the
                # draft's tensors): one version for both. A frozen draft keeps its own.
                if getattr(self.model_runner.model, "draft_refit", None) == "with_target" and (
                    getattr(self.model_runner.model, "draft", None) is not None
                ):
                    self.aiosync_draft_weight_version = version

    def embedded_select_draft_refit(self, mode: str) -> None:
        """Whether later syncs load the draft model with the target (``"with_target"``)
        or leave it as it is (``"frozen"``): the runner's manifest lists its tensors
        or leaves them out (``HFModelRunner.draft_refit``).

        Raises:
            ValueError: an unknown ``mode``, or a runner without a draft model.
        """
        if mode not in ("with_target", "frozen"):
            raise ValueError(f"mode must be 'with_target' or 'frozen', got {mode!r}")
        runner = self.model_runner.model
        if getattr(runner, "draft", None) is None:
            raise ValueError("this worker's model runner holds no draft model")
        with self._state_lock:
            runner.draft_refit = mode

    def _logged_load(self, weights: Any) -> int:
        """The runner's ``load_weights``, recorded in :meth:`embedded_lifecycle`."""
        with self._lifecycle_lock:
            if not self._lifecycle or self._lifecycle[-1] != "load":
                self._lifecycle.append("load")
        return int(self._load_weights(weights))

    def _logged_load_parts(self, parts: Any) -> int:
        """The runner's ``load_weight_parts``, recorded as a load in :meth:`embedded_lifecycle`."""
        assert self._load_weight_parts is not None
        with self._lifecycle_lock:
            if not self._lifecycle or self._lifecycle[-1] != "load":
                self._lifecycle.append("load")
        return int(self._load_weight_parts(parts))

    def embedded_lifecycle(self) -> list[str]:
        """This worker's sleeps, wakes and weight loads, in order: ``"sleep(1)"``,
        ``"sleep(2)"``, ``"wake(weights)"``, ``"wake(kv_cache)"``, ``"load"`` (one per
        run of consecutive ``load_weights`` calls, e.g. one refit's buckets)."""
        with self._lifecycle_lock:
            return list(self._lifecycle)

    def embedded_sleep(self, level: int) -> bool:
        """Sleep, as vLLM does: level 1 offloads the weights (restored by the wake of
        ``"weights"``, over anything loaded meanwhile); level 2 discards the weights
        (they are zeroed) and the LoRA adapter, keeping only the model's buffers that
        the checkpoint does not carry (restored on wake). Returns whether the
        weights were discarded."""
        runner: HFModelRunner = self.model_runner.model
        # The model's lock first, as every other path takes them (no lock-order
        # inversion); a weights-only runner (runner_factory) may have none.
        model_lock = getattr(runner, "lock", None) or contextlib.nullcontext()
        with model_lock, self._state_lock:
            with self._lifecycle_lock:
                self._lifecycle.append(f"sleep({level})")
            first = "weights" not in self._asleep
            self._asleep = {"weights", "kv_cache"}
            if level < 2 and first and hasattr(runner, "hf_state_dict"):
                self._offloaded = runner.hf_state_dict()
            if level >= 2:
                self._offloaded = None
                self._saved_buffers = _uncarried_buffers(runner)
                runner.fill_(0.0)
                discard_adapters = getattr(runner, "unload_all_lora_adapters", None)
                if discard_adapters is not None:
                    discard_adapters()
                self.aiosync_lora_adapter = None
                mark_invalid(self)
                self.aiosync_discard_epoch = getattr(self, "aiosync_discard_epoch", 0) + 1
                return True
        return False

    def embedded_load_lora_adapter(
        self,
        name: str,
        tensors: dict[str, list[Any]],
        config: dict[str, Any],
        check: dict[str, Any] | None = None,
    ) -> int:
        """Make LoRA adapter ``name`` the one every generation applies; returns its bytes.

        ``tensors`` is ``{peft_name: [dtype name, shape, raw bytes]}``
        (:func:`tensor_to_wire`), ``config`` the ``adapter_config.json`` dict,
        ``check`` (None: none) ``{"version", "verify", "digests"}``: the
        trainer's per-tensor digests, compared with the decoded tensors before
        they are loaded (:func:`aiosync.transports.lora.check_adapter_tensors`).
        The previous adapter is removed first (adapters replace each other, they
        never stack); the base weights are not touched. From the start of the
        load until it succeeds, generation refuses: after a failure no adapter
        is loaded and it keeps refusing until a load succeeds.

        Raises:
            RefitVerificationError: a decoded tensor's digest differs from the
                trainer's (nothing is loaded).
            SyncError: the base weights are not valid (discarded by a level-2
                sleep, a failed full refit, a respawn): an adapter cannot restore
                them; a full refit must land first (or sleep at level 1).
            RefitMismatchError: the adapter does not fit the model.
        """
        runner: HFModelRunner = self.model_runner.model
        with runner.lock:  # waits for a generation in progress
            with self._state_lock:
                if not self.aiosync_weights_valid:
                    raise SyncError(
                        f"worker {self.rank}: the base weights are not valid (discarded by a "
                        "level-2 sleep, a failed refit or a respawn); an adapter-only refit "
                        "cannot restore them: sync the full model first, or sleep at level 1"
                    )
                self._lora_refusal = f"loading LoRA adapter {name!r} did not complete"
                self.aiosync_lora_adapter = None
            runner.unload_all_lora_adapters()
            decoded = {key: tensor_from_wire(fields) for key, fields in tensors.items()}
            # Before the load: a tensor that arrived otherwise than sent never goes live.
            check_adapter_tensors(
                decoded,
                name=name,
                version=int(check["version"]) if check else 0,
                verify=check["verify"] if check else False,
                digests=check["digests"] if check else {},
            )
            runner.load_lora_adapter(name, decoded, config)
            with self._state_lock:
                self.aiosync_lora_adapter = name
                self._lora_refusal = None
        return sum(t.numel() * t.element_size() for t in decoded.values())

    def embedded_lora_state_dict(self) -> dict[str, list[Any]]:
        """The live LoRA adapter's tensors as the model applies them,
        ``{peft_name: [dtype name, shape, raw bytes]}`` (tests; ``{}`` when no
        adapter is live)."""
        name = self.aiosync_lora_adapter
        if name is None:
            return {}
        state = self.model_runner.model.lora_state_dict(name)
        return {key: tensor_to_wire(tensor) for key, tensor in state.items()}

    def embedded_expected_manifest(self) -> list[list[Any]]:
        """The base model's checkpoint manifest, ``[[hf_name, shape, dtype name], ...]``
        in ``save_pretrained`` order (:meth:`HFModelRunner.expected_manifest`)."""
        manifest = self.model_runner.model.expected_manifest()
        return [[name, list(shape), dtype_name(dtype)] for name, (shape, dtype) in manifest.items()]

    def embedded_weight_layout(self) -> dict[str, list[Any]]:
        """What this worker holds of each checkpoint tensor: ``{hf_name: part}`` with
        each :class:`~aiosync.layout.Part` as :meth:`Part.to_wire` (``[full shape, dim,
        start, length]``), in checkpoint order. Every part is whole without tensor
        parallelism (also for a ``runner_factory`` runner, from its manifest)."""
        runner = self.model_runner.model
        layout = getattr(runner, "weight_layout", None)
        if layout is not None:
            parts: dict[str, Part] = layout()
        else:
            parts = {
                name: Part.whole(shape) for name, (shape, _) in runner.expected_manifest().items()
            }
        return {name: part.to_wire() for name, part in parts.items()}

    def embedded_load_weight_parts(self, items: list[list[Any]]) -> int:
        """Load ``[[hf_name, part as Part.to_wire, tensor as tensor_to_wire], ...]``
        through the runner's ``load_weight_parts``; returns the elements written.

        For tests and tools (a shard-aware transport calls
        ``model_runner.model.load_weight_parts`` itself). The weights' validity is
        not changed: that is the transport's business.

        Raises:
            NotImplementedError: the runner (a ``runner_factory``'s) loads no parts.
            RefitMismatchError, ValueError: as ``HFModelRunner.load_weight_parts``.
        """
        if self._load_weight_parts is None:
            raise NotImplementedError("this worker's model runner has no load_weight_parts")
        parts = [
            (name, Part.from_wire(part), tensor_from_wire(fields)) for name, part, fields in items
        ]
        return int(self.model_runner.model.load_weight_parts(parts))

    def embedded_wake(self, tags: list[str] | None) -> list[str]:
        """Wake ``tags`` (``"weights"``, ``"kv_cache"``; None: all); returns what still sleeps."""
        runner = self.model_runner.model
        model_lock = getattr(runner, "lock", None) or contextlib.nullcontext()
        with model_lock, self._state_lock:
            waking = set(tags) if tags is not None else set(self._asleep)
            with self._lifecycle_lock:
                self._lifecycle.extend(f"wake({tag})" for tag in sorted(waking & self._asleep))
            if "weights" in waking & self._asleep:
                offloaded, self._offloaded = self._offloaded, None
                if offloaded is not None and self.tp_size > 1:
                    # The offloaded copies are this rank's slices (hf_state_dict).
                    assert self._load_weight_parts is not None
                    layout = runner.weight_layout()
                    self._load_weight_parts((n, layout[n], t) for n, t in offloaded.items())
                elif offloaded is not None:
                    self._load_weights(list(offloaded.items()))
                saved, self._saved_buffers = self._saved_buffers, None
                if saved:
                    buffers = dict(runner.model.named_buffers())
                    with torch.no_grad():
                        for name, value in saved.items():
                            buffers[name].copy_(value)
            self._asleep -= waking
            return sorted(self._asleep)

    def embedded_status(self, weight_label: list[int] | None = None) -> dict[str, Any]:
        """``{"rank", "pid", "weights_valid", "asleep", "kv_scales", "lora_adapter",
        "lora_loaded", "lora_valid", "paused", "requests", "weight_version"}``:
        ``lora_adapter`` is the adapter generations apply (None: the base model),
        ``lora_loaded`` every adapter the model holds, ``lora_valid`` False while an
        adapter load is in flight or after one failed; ``paused`` the pause mode in
        force (None: running), ``requests`` the decode steps each running request
        has started, ``weight_version`` the version its tokens are labelled with
        (after taking the engine's label, as :meth:`embedded_generate_with_meta`);
        with a draft model also ``"draft_refit"`` and ``"draft_weight_version"``
        (:attr:`aiosync_draft_weight_version`)."""
        self.embedded_set_weight_version(weight_label)
        runner = self.model_runner.model
        drafted = (
            {}
            if getattr(runner, "draft", None) is None
            else {
                "draft_refit": runner.draft_refit,
                "draft_weight_version": self.aiosync_draft_weight_version,
            }
        )
        return {
            **drafted,
            "rank": self.rank,
            "pid": os.getpid(),
            "weights_valid": self.aiosync_weights_valid,
            "asleep": sorted(self._asleep),
            "kv_scales": dict(self.model_runner.model.kv_scales),
            "lora_adapter": self.aiosync_lora_adapter,
            "lora_loaded": list(getattr(self.model_runner.model, "lora_adapters", [])),
            "lora_valid": self._lora_refusal is None,
            "paused": self.aiosync_gate.mode,
            "requests": self.aiosync_gate.progress(),
            "weight_version": self.aiosync_weight_version,
        }

    def embedded_state_dict(self) -> dict[str, list[Any]]:
        """The weights in checkpoint names: ``{name: [dtype name, shape, raw bytes]}`` (tests);
        a tensor-parallel rank's slices (:meth:`embedded_weight_layout`)."""
        state = self.model_runner.model.hf_state_dict()
        return {name: tensor_to_wire(tensor) for name, tensor in state.items()}

    def embedded_load_state_dict(self, state: dict[str, list[Any]]) -> int:
        """Load ``{name: [dtype name, shape, raw bytes]}`` (the inverse of
        :meth:`embedded_state_dict`) and mark the weights valid; returns the count.

        For tests and tools; trainers use a transport.
        """
        weights = [(name, tensor_from_wire(fields)) for name, fields in state.items()]
        with self._state_lock:
            loaded = int(self.model_runner.model.load_weights(weights))
            mark_valid(self)
        return loaded


def _uncarried_buffers(runner: Any) -> dict[str, torch.Tensor] | None:
    """Copies of the model's buffers that its checkpoint does not carry (non-persistent
    ones: rotary ``inv_freq``...), which no refit restores; None for a runner
    without an ``nn.Module`` model (runner_factory)."""
    model = getattr(runner, "model", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(runner, "expected_manifest"):
        return None
    carried = set(runner.expected_manifest())
    return {
        name: buffer.detach().clone()
        for name, buffer in model.named_buffers()
        if name not in carried
    }


def tensor_to_wire(tensor: torch.Tensor) -> list[Any]:
    """``[dtype name, shape, raw bytes]``: a tensor as msgpack-safe fields (no pickle)."""
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [dtype_name(tensor.dtype), list(tensor.shape), raw]


def tensor_from_wire(fields: list[Any]) -> torch.Tensor:
    """Inverse of :func:`tensor_to_wire` (a new tensor owning its memory)."""
    dtype_str, shape, raw = fields
    dtype = dtype_from_name(dtype_str)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _import(path: str) -> Any:
    module, _, name = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process builds (:func:`build_worker`): the engine makes one per
    rank, and it travels to the process (pickled).

    Attributes:
        rank, world_size: the worker's rank among the engine's ``world_size`` workers.
        model: the model's config (a dict, a path) or checkpoint, as
            :meth:`HFModelRunner.from_config` takes it.
        seed, dtype: :meth:`HFModelRunner.from_config`'s.
        extension: dotted path of a worker extension class (the worker's class
            derives from it too); None: none.
        runner_factory: dotted path of ``f(model, seed=, dtype=)`` replacing
            :meth:`HFModelRunner.from_config`; None: that.
        weights_valid: False for a respawned worker, holding initial rather than
            synced weights: it refuses to generate until a sync succeeds.
        device_label: the "device" this CPU worker stands for
            (``EmbeddedEngine(device_labels=...)``).
        tensor_parallel: its place in a tensor-parallel replica: it joins the
            replica's group (blocking until every rank did), keeps its slice of the
            model, and a follower starts running the driver's steps; None: TP=1.
        quantization: ``"fp8"`` (:meth:`HFModelRunner.from_config`'s) or None.
        draft: ``{"model": the draft's config, "prefix": its names' prefix, "refit":
            "with_target" | "frozen"}``, a draft model held beside the target; None: none.
    """

    rank: int
    world_size: int
    model: Any
    seed: int
    dtype: str
    extension: str | None
    runner_factory: str | None = None
    weights_valid: bool = True
    device_label: str | None = None
    tensor_parallel: TPSpec | None = None
    quantization: str | None = None
    draft: dict[str, Any] | None = None


def build_worker(spec: WorkerSpec) -> EmbeddedWorker:
    """The :class:`EmbeddedWorker` ``spec`` describes, its class also derived from
    ``spec.extension``.

    Raises:
        ValueError: ``tensor_parallel`` with a ``runner_factory``, or a model that
            does not split over the replica's ranks.
        TransportError: the replica's group did not form.
    """
    # transformers is imported here, in the worker, so that the parent can name the missing
    # extra (EmbeddedEngine.__init__) instead of failing on import.
    from .model import HFModelRunner

    if spec.tensor_parallel is None:
        factory = (
            HFModelRunner.from_config
            if spec.runner_factory is None
            else _import(spec.runner_factory)
        )
        # Only when set: a runner_factory need not take it (the engine refuses both).
        options: dict[str, Any] = {}
        if spec.quantization is not None:
            options["quantization"] = spec.quantization
        if spec.draft is not None:
            options.update(draft=spec.draft["model"], draft_prefix=spec.draft["prefix"])
        runner = factory(spec.model, seed=spec.seed, dtype=spec.dtype, **options)
        if spec.draft is not None:
            runner.draft_refit = spec.draft["refit"]
    elif spec.runner_factory is not None:
        raise ValueError("a runner_factory's runner cannot be tensor-parallel")
    else:
        from ._tp import TensorParallel

        tp = TensorParallel.connect(spec.tensor_parallel)
        runner = HFModelRunner.from_config(
            spec.model, seed=spec.seed, dtype=spec.dtype, tensor_parallel=tp
        )
    bases: tuple[type, ...] = (EmbeddedWorker,)
    if spec.extension:
        mixin = _import(spec.extension)
        if not isinstance(mixin, type):
            raise TypeError(f"worker extension {spec.extension} is not a class")
        bases += (mixin,)
    cls = type("EmbeddedWorker", bases, {})
    worker: EmbeddedWorker = cls(spec.rank, spec.world_size, runner, spec.weights_valid)
    worker.device_label = spec.device_label
    parallel = getattr(runner, "tensor_parallel", None)
    if parallel is not None and not parallel.is_driver:
        parallel.start_serving(runner, worker._tp_refusal)
    return worker
