"""What an engine can do, as small typed Protocols.

The core and the transports ask ``isinstance(engine, PausableEngine)``, never
``getattr(engine, "pause_generation", None)``: a capability is a name here, with
its signature, and mypy checks every engine class against the Protocols it claims
(each engine module ends with a static assertion). Every Protocol is
``runtime_checkable``, so ``isinstance`` tests that the methods exist (not their
signatures: mypy does that).

An engine is an :class:`Engine` (wake and sleep); everything else is optional:
:class:`PausableEngine` (the in-flight policy of every sync),
:class:`VersionedEngine` (the version label, after every committed sync),
:class:`DiscardNotifier` (every synchronizer listens), :class:`SleepReporting`
(the colocated bracket wakes only what slept), :class:`EngineWorkers` (IPC and
collective drive the workers), :class:`Generating` (the rollout loop) and
:class:`ValidityReporting`, :class:`ManifestReporting` and
:class:`ConfigReporting` (checks before a sync), :class:`LayoutReporting` (the
shard-aware transport) and :class:`EngineSet` (a fleet), :class:`ElasticEngines`
(a fleet that sets failed engines aside) and :class:`HealthReporting` (how it
tells them), :class:`RollingEngines` (a fleet refit in waves),
:class:`RestartReporting` (a server restarted behind its URL),
:class:`KindReporting` (which engine it is: the factory picks the transport by it),
:class:`ChecksumVerifying` (``verify_engine()`` asks the engine to compare its own
weight checksums with those it recorded at the last commit),
:class:`DraftHolding` (a speculative-decoding draft model a sync refits with the
target or leaves frozen: ``docs/draft.md``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    Protocol,
    cast,
    get_args,
    runtime_checkable,
)

if TYPE_CHECKING:
    from .generation import Generation, SamplingParams
    from .layout import Layout

__all__ = [
    "DRAFT_REFITS",
    "IN_FLIGHT_POLICIES",
    "ChecksumVerifying",
    "ConfigReporting",
    "DiscardNotifier",
    "DraftHolding",
    "DraftRefit",
    "ElasticEngines",
    "Engine",
    "EngineKind",
    "EngineSet",
    "EngineWorkers",
    "Generating",
    "HealthReporting",
    "InFlightPolicy",
    "KindReporting",
    "LayoutReporting",
    "ManifestReporting",
    "PausableEngine",
    "PeerWaves",
    "RestartReporting",
    "RollingEngines",
    "SleepReporting",
    "ValidityReporting",
    "VersionedEngine",
    "WorkerDescribing",
    "engines_of",
    "implements",
]

#: What a sync does with the requests the engine is generating when it starts
#: (see :class:`PausableEngine`): ``"abort"`` ends them now, ``"wait"`` lets them
#: finish first, ``"keep"`` freezes them and lets the new weights compute their
#: remaining tokens.
InFlightPolicy = Literal["abort", "wait", "keep"]

#: The values of :data:`InFlightPolicy`, in that order.
IN_FLIGHT_POLICIES: tuple[InFlightPolicy, ...] = get_args(InFlightPolicy)

#: Which engine an engine object is: the engines' own API it speaks.
EngineKind = Literal["vllm", "sglang", "embedded"]

#: What a sync does with an engine's speculative-decoding draft model (an MTP module,
#: an EAGLE head; see :class:`DraftHolding` and ``docs/draft.md``): ``"with_target"``
#: loads the draft's tensors in the same sync as the target's, under one version
#: (SGLang's ``selector="all"``; vLLM's ``/start_draft_weight_update`` session beside
#: the target's), ``"frozen"`` sends the target's alone and leaves the draft bit for
#: bit as it is (SGLang's ``selector="target"``; what miles does when it does not
#: train the MTP layers).
DraftRefit = Literal["with_target", "frozen"]

#: The values of :data:`DraftRefit`, in that order.
DRAFT_REFITS: tuple[DraftRefit, ...] = get_args(DraftRefit)


@runtime_checkable
class Engine(Protocol):
    """The inference engine as the training loop sees it (vLLM, SGLang, embedded, a fleet)."""

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine: ``tags`` selects ``"weights"`` and/or ``"kv_cache"`` (None: all)."""
        ...

    async def finish_generation(self) -> None:
        """Let the engine release device memory while the trainer runs (sleep)."""
        ...


@runtime_checkable
class PausableEngine(Protocol):
    """An engine that can hold its requests while a sync runs (vLLM's
    ``pause_generation``/``resume_generation``, SGLang's ``/pause_generation``)."""

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        """Stop admitting new requests (they wait until resumed); then, for running ones:
        ``"abort"`` ends them now (marked aborted), ``"wait"`` lets them finish,
        ``"keep"`` freezes them between two tokens; returns once no forward pass
        runs. ``clear_cache`` also drops the prefix/KV cache of finished requests
        (computed by the old weights).

        Raises:
            ValueError: an unknown ``mode``.
        """
        ...

    async def resume_generation(self) -> None:
        """Admit requests again and let frozen ones continue. Idempotent."""
        ...


@runtime_checkable
class VersionedEngine(Protocol):
    """An engine that labels what it generates with the synchronizer's version."""

    async def on_weights_committed(self, version: int) -> None:
        """``version`` landed on every worker: report it (``weight_version``) from now on."""
        ...


@runtime_checkable
class DiscardNotifier(Protocol):
    """An engine that says when it dropped its weights (woken from a level-2 sleep,
    a worker respawned): the synchronizer then requires a sync before generating."""

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the event loop's thread) whenever the weights are dropped."""
        ...

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener` (no error if absent)."""
        ...


@runtime_checkable
class SleepReporting(Protocol):
    """An engine that knows what it released: the colocated bracket wakes only that."""

    @property
    def asleep_tags(self) -> frozenset[str] | None:
        """The released tags (``"weights"``, ``"kv_cache"``); None: unknown (wake all)."""
        ...


@runtime_checkable
class EngineWorkers(Protocol):
    """An engine whose workers can be driven by name, like vLLM's ``collective_rpc``."""

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every worker; one result per worker, rank order."""
        ...


@runtime_checkable
class WorkerDescribing(Protocol):
    """An engine (a fleet) that can name a worker by its global rank, for error messages."""

    def describe_worker(self, rank: int) -> str:
        """E.g. ``"engine 1 of 3, worker 0"``."""
        ...


@runtime_checkable
class Generating(Protocol):
    """An engine that generates and says which weights did it (every aiosync engine)."""

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        **keywords: Any,
    ) -> Sequence[Generation]:
        """One :class:`~aiosync.Generation` per prompt, in prompt order; ``params``
        (or the same fields as keywords) as :class:`~aiosync.SamplingParams`."""
        ...


@runtime_checkable
class ValidityReporting(Protocol):
    """An engine that knows whether its weights can be trusted (False after a
    failed or partial load, until a sync lands)."""

    @property
    def weights_valid(self) -> bool:
        """False while some worker may hold a mix of two versions or none."""
        ...


@runtime_checkable
class ChecksumVerifying(Protocol):
    """An engine that checksums its own weights (vLLM's ``/weight_checker``) at each
    commit and can say whether any changed since: ``verify_engine()`` asks it."""

    async def verify_recorded_checksums(self) -> int | None:
        """Compare the engine's checksums now with those recorded at the last commit.

        Returns:
            How many checksummed tensors matched (over every worker); None: nothing
            recorded (not asked to record, or no commit yet).

        Raises:
            RefitVerificationError: a tensor changed since the commit (named, with
                the worker's shard).
        """
        ...


@runtime_checkable
class ManifestReporting(Protocol):
    """An engine that can say which checkpoint it loads, so that a transport
    compares the trainer's manifest with it before any byte moves."""

    async def expected_manifest(self) -> Mapping[str, tuple[tuple[int, ...], Any]] | None:
        """``{hf_name: (shape, torch.dtype)}`` the engine's loader takes; None: unknown."""
        ...


@runtime_checkable
class ConfigReporting(Protocol):
    """An engine that can say which model config it computes with, so that a drift
    that keeps the shapes (another ``rope_theta``) is caught before any byte moves."""

    async def expected_config(self) -> Any | None:
        """The engine's HF config (a ``PretrainedConfig`` or its ``config.json``
        dict); None: unknown."""
        ...


@runtime_checkable
class LayoutReporting(Protocol):
    """An engine whose workers say which part of each checkpoint tensor they hold,
    so that the shard-aware transport sends each worker only its slices."""

    @property
    def tensor_parallel_size(self) -> int:
        """Workers that share one replica's weights (1: every worker holds them whole)."""
        ...

    @property
    def layout_refusal(self) -> str | None:
        """Why :meth:`weight_layouts` would refuse, known without asking the workers
        (a quantized or LoRA-enabled vLLM engine); None: the workers say."""
        ...

    async def weight_layouts(self) -> list[Layout]:
        """One :data:`~aiosync.layout.Layout` (``{hf_name: Part}``) per worker, in rank
        order."""
        ...


@runtime_checkable
class EngineSet(Protocol):
    """Several engines driven as one (an :class:`~aiosync.EngineFleet`)."""

    @property
    def engines(self) -> Sequence[Any]:
        """The member engines, in order."""
        ...


@runtime_checkable
class HealthReporting(Protocol):
    """An engine that can tell at once whether it can serve (its workers alive, its
    server answering)."""

    async def check_health(self) -> None:
        """Return if healthy; raise (e.g. :class:`~aiosync.errors.TransportError`
        naming the dead worker) if not."""
        ...


@runtime_checkable
class RestartReporting(Protocol):
    """An engine in a process the synchronizer neither started nor watches (a server
    reached by URL) that can tell whether that process was restarted since it last
    saw it: a restarted server holds fresh weights, whatever label it answers under.
    :func:`~aiosync.refit_if_stale` asks it before reading ``is_stale``."""

    async def check_restarted(self) -> bool:
        """Ask the engine; if it was restarted, run the weights-discarded listeners
        (:class:`DiscardNotifier`: the synchronizer turns stale) and return True.

        Raises:
            TransportError, SyncTimeoutError: the engine did not answer.
        """
        ...


@runtime_checkable
class KindReporting(Protocol):
    """An engine that says which kind it is (:data:`EngineKind`), so that
    ``create_weight_synchronizer`` needs no ``backend=``; a fleet's members and a
    Ray engine's spec say it for them."""

    @property
    def engine_kind(self) -> EngineKind:
        """``"vllm"``, ``"sglang"`` or ``"embedded"``."""
        ...


@runtime_checkable
class ElasticEngines(Protocol):
    """A fleet whose membership changes (an :class:`~aiosync.EngineFleet` with
    ``on_engine_failure="quarantine"``, or one given engines by ``add_engine``): the
    synchronizer re-initializes when :attr:`membership_epoch` moved, and after a
    failed sync retries on the engines left once :meth:`set_aside_failed` set some aside."""

    @property
    def membership_epoch(self) -> int:
        """Incremented by every membership change."""
        ...

    async def set_aside_failed(self, error: BaseException) -> list[tuple[str, str]]:
        """Quarantine the engines that failed; ``[(label, reason)]`` (empty: none)."""
        ...

    def take_joined(self) -> list[str]:
        """The engines that went into service at the last commit (each reported once)."""
        ...


@runtime_checkable
class RollingEngines(Protocol):
    """A fleet refit in waves (an :class:`~aiosync.EngineFleet` with
    ``refit="rolling"``): the synchronizer moves one version to each wave in turn
    while the engines outside it keep serving the version they hold.

    :meth:`begin_wave` narrows the fleet to the wave (its ``engines``, what the
    transport reaches, and its ``membership_epoch`` moves, so the transport re-forms
    over them); the wave's engines take no new requests until :meth:`end_wave`.
    """

    @property
    def rolling(self) -> bool:
        """True when syncs go in waves (``refit="rolling"``)."""
        ...

    def waves(self) -> list[list[Any]]:
        """The next sync's waves, in order: every engine in the sync exactly once."""
        ...

    def begin_wave(self, engines: Sequence[Any]) -> None:
        """Narrow the fleet to ``engines`` (one of :meth:`waves`) for a sync's transfer."""
        ...

    def end_wave(self, *, committed: bool) -> None:
        """Widen the fleet again; ``committed=False``: the wave's engines may hold part
        of a version and serve nothing until a later sync commits them. No wave: no-op."""
        ...


@runtime_checkable
class PeerWaves(Protocol):
    """A rolling fleet whose waves after the first copy the new version from an engine
    that committed it (``EngineFleet(wave_source="peer")``) instead of taking the
    trainer's bytes: the trainer sends one copy per sync whatever the fleet's size."""

    @property
    def peer_waves(self) -> bool:
        """True when waves after the first copy from a peer."""
        ...

    async def copy_wave(self, version: int, *, timeout_s: float = 60.0) -> int | None:
        """Copy ``version`` into the wave in progress from engines outside it; the bytes
        the peers sent, or None when no engine outside the wave serves ``version``."""
        ...


@runtime_checkable
class DraftHolding(Protocol):
    """An engine that holds a speculative-decoding draft model whose weights a sync
    refits with the target's or leaves frozen (:data:`DraftRefit`).

    The draft's tensors are named in the engine's checkpoint by :attr:`draft_prefix`
    (Qwen3-Next's MTP layers: ``"mtp."``); :meth:`select_draft_refit` says which of
    them the next syncs load, so that the engine's manifest (what a transport
    compares the trainer's with at init, before any byte moves) lists the draft's
    tensors or leaves them out. ``SyncOptions(draft=...)`` calls it through
    :func:`aiosync.sources.apply_draft_option`.
    """

    @property
    def draft_prefix(self) -> str | None:
        """The prefix of the draft's checkpoint names (``"mtp."``); None: no draft model."""
        ...

    def select_draft_refit(self, mode: DraftRefit) -> None:
        """What every later sync loads: target and draft (``"with_target"``) or the
        target alone (``"frozen"``: the draft's weights stay as they are). Takes
        effect before the engine is next asked for its manifest.

        Raises:
            ValueError: an unknown ``mode``.
            UnsupportedOptionError: ``"with_target"`` on an engine without a draft.
        """
        ...


def engines_of(generation: object, *, what: str = "engine") -> tuple[Any, ...]:
    """The engines behind ``generation``: a fleet's members, a list's items, or itself.

    Raises:
        ValueError: no engine, or the same engine twice.
    """
    if implements(generation, EngineSet):
        engines = tuple(cast(EngineSet, generation).engines)
    elif isinstance(generation, list | tuple):
        engines = tuple(generation)
    else:
        engines = (generation,)
    if not engines:
        raise ValueError(f"at least one {what} is needed")
    if len({id(engine) for engine in engines}) != len(engines):
        raise ValueError(f"the same {what} appears twice")
    return engines


# What typing keeps on a Protocol class beside its members (Python 3.11's list).
_NOT_MEMBERS = frozenset(
    {
        "__abstractmethods__", "__annotations__", "__dict__", "__doc__", "__init__",
        "__module__", "__new__", "__slots__", "__subclasshook__", "__weakref__",
        "__class_getitem__", "__parameters__", "__orig_bases__", "__qualname__",
        "__protocol_attrs__", "__non_callable_proto_members__", "__type_params__",
        "_is_protocol", "_is_runtime_protocol", "__firstlineno__", "__static_attributes__",
    }
)  # fmt: skip


@functools.cache
def _members(protocol: type) -> tuple[tuple[str, bool], ...]:
    """``(name, callable)`` of each member of a runtime Protocol, bases included."""
    members: dict[str, bool] = {}
    for base in reversed(protocol.__mro__[:-1]):
        if not getattr(base, "_is_protocol", False) or base in (Protocol,):
            continue
        for name in inspect.get_annotations(base):
            members.setdefault(name, False)
        for name, value in base.__dict__.items():
            if name not in _NOT_MEMBERS and not name.startswith("_abc_"):
                members[name] = callable(value)
    return tuple(members.items())


def implements(obj: object, protocol: type) -> bool:
    """``isinstance(obj, protocol)`` for a runtime Protocol of this module, at the cost of
    a few ``getattr``: the sync's hot path asks a dozen of them per sync, and Python
    3.11 recomputes a Protocol's members on every ``isinstance`` (14-25 us each on a
    loaded machine; 3.12 caches them). The same rule: every member present, and a
    method member not None."""
    for name, is_method in _members(protocol):
        value = getattr(obj, name, _MISSING)
        if value is _MISSING or (is_method and value is None):
            return False
    return True


_MISSING = object()
