"""Options as typed objects: what every transport shares, and one frozen class per transport.

``create_weight_synchronizer(..., sync=SyncOptions(...), transport=IPCOptions(...),
timeouts=Timeouts(...))``: the shared options (:class:`SyncOptions`) apply to every
transport that declares the capability (:class:`TransportCapabilities`); a transport's
options class names the transport, so giving one *chooses* it (checked against the
topology and the engine kind), and an option the chosen transport cannot honour is an
:class:`~aiosync.errors.UnsupportedOptionError` at construction, never a silent switch
of transport. A field left None takes the transport's default.

Each options field is, by name, a keyword of the transport's constructor
(``IPCWeightSynchronizer(source, engine, bucket_bytes=...)``): the classes stay
usable directly, and ``tests/core/test_options.py`` checks that every constructor
keyword is reachable through these objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .capabilities import DRAFT_REFITS, IN_FLIGHT_POLICIES, DraftRefit, InFlightPolicy

if TYPE_CHECKING:
    import torch

__all__ = [
    "ON_FAILURE",
    "CollectiveOptions",
    "HTTPOptions",
    "IPCOptions",
    "LoRAOptions",
    "OnFailure",
    "SGLangCollectiveOptions",
    "ShardedOptions",
    "SyncOptions",
    "TransportCapabilities",
    "TransportOptions",
    "check_keywords",
]

#: What ``verify=`` may be: ``True`` (every byte), ``"sample"``, ``False``.
VerifyMode = bool | Literal["sample"]

#: What the engines serve after a sync failed or was cancelled before its commit:
#: nothing until a sync succeeds (``"refuse"``), or the version they served before,
#: bit for bit and labelled as it (``"serve_previous"``; each worker keeps a host copy
#: of its weights, see :mod:`aiosync.transports.previous`).
OnFailure = Literal["refuse", "serve_previous"]
ON_FAILURE: tuple[OnFailure, ...] = ("refuse", "serve_previous")


@dataclass(frozen=True, kw_only=True)
class TransportCapabilities:
    """What a transport can do, as data (each synchronizer class's ``capabilities``).

    The factory refuses a :class:`SyncOptions` field the chosen transport does not
    declare; the conformance kit (:mod:`aiosync.testing.conformance`) runs the cells a
    transport declares and the docs' capability table is generated from these.

    Attributes:
        verify: the ``verify=`` modes it honours (``False`` always among them).
        delta: delta refits (``delta=True``: only changed elements travel).
        kv_scales: moves FP8 KV-cache scales (``sync_weights(kv_scales=...)``).
        trace: records ``last_trace`` per sync (``trace=True``).
        elastic: sets failed engines of a quarantining fleet aside and commits to
            the rest (``EngineFleet(on_engine_failure="quarantine")``).
        sharded_trainer: a trainer of several ranks (each sends or gathers its part).
        verify_engine: ``verify_engine()`` checks a live engine's weights.
        serve_previous: ``on_failure="serve_previous"``: its workers keep the last good
            version and put it back when a sync fails (:mod:`aiosync.transports.previous`).
    """

    verify: frozenset[VerifyMode] = frozenset({False})
    delta: bool = False
    kv_scales: bool = True
    trace: bool = False
    elastic: bool = False
    sharded_trainer: bool = False
    verify_engine: bool = False
    serve_previous: bool = False

    def refusal(self, name: str, value: object) -> str | None:
        """Why :class:`SyncOptions`' ``name`` = ``value`` cannot be honoured; None: it can."""
        if name == "verify" and value not in self.verify:
            honoured = ", ".join(sorted(repr(mode) for mode in self.verify))
            return f"verify={value!r} (it honours {honoured})"
        if name in ("delta", "trace") and value and not getattr(self, name):
            return f"{name}={value!r}"
        if name == "on_failure" and value == "serve_previous" and not self.serve_previous:
            return f"on_failure={value!r}"
        return None


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """What every transport shares; None: the transport's default.

    Attributes:
        verify: what each receiver checks of what arrived: ``True`` (every byte, a
            digest computed while the bytes move), ``"sample"`` (a digest of a sample
            of every bucket), ``False``. Default: ``True`` on IPC and the collective,
            ``"sample"`` on HTTP and LoRA, ``False`` where nothing else is declared.
        delta: send only the elements whose bits changed since the last committed
            version (:mod:`aiosync.delta`).
        in_flight: the default in-flight policy of ``sync_weights`` (``"abort"``,
            ``"wait"``, ``"keep"``).
        initial_version: where both versions start (a trainer resumed from its
            step-N checkpoint passes N), an int >= 0.
        event_backlog: default ``max_backlog`` of ``subscribe()``, events.
        trace: record ``last_trace`` per sync.
        draft: what a sync does with the engine's speculative-decoding draft model
            (:data:`~aiosync.capabilities.DraftRefit`, ``docs/draft.md``):
            ``"with_target"`` refits the draft's tensors (the source names them:
            :func:`~aiosync.sources.with_draft`, :func:`~aiosync.sources.draft_under`)
            with the target's, under one version; ``"frozen"`` sends no draft tensor
            and leaves the engine's draft bit for bit as it was. None: the engine's
            default (an embedded engine with a draft: ``"with_target"``).
        on_failure: :data:`OnFailure`: after a sync failed or was cancelled before its
            commit, the engines refuse to generate until a sync succeeds
            (``"refuse"``, the default) or serve the version they served before, bit
            for bit and labelled as it (``"serve_previous"``: IPC and the collective
            into embedded engines; one host copy of each worker's weights).

    Raises:
        ValueError: a value of the wrong kind (before any transport is chosen).
    """

    verify: VerifyMode | None = None
    delta: bool | None = None
    in_flight: InFlightPolicy | None = None
    initial_version: int | None = None
    event_backlog: int | None = None
    trace: bool | None = None
    draft: DraftRefit | None = None
    on_failure: OnFailure | None = None

    def __post_init__(self) -> None:
        if self.on_failure is not None and self.on_failure not in ON_FAILURE:
            raise ValueError(
                f"on_failure must be one of {', '.join(map(repr, ON_FAILURE))}, "
                f"got {self.on_failure!r}"
            )
        if self.draft is not None and self.draft not in DRAFT_REFITS:
            raise ValueError(
                f"draft must be one of {', '.join(map(repr, DRAFT_REFITS))}, got {self.draft!r}"
            )
        if self.verify is not None and self.verify not in (True, False, "sample"):
            raise ValueError(f"verify must be True, False or 'sample', got {self.verify!r}")
        if self.in_flight is not None and self.in_flight not in IN_FLIGHT_POLICIES:
            raise ValueError(
                f"in_flight must be one of {', '.join(IN_FLIGHT_POLICIES)}, got {self.in_flight!r}"
            )
        if self.initial_version is not None and (
            isinstance(self.initial_version, bool)
            or not isinstance(self.initial_version, int)
            or self.initial_version < 0
        ):
            raise ValueError(f"initial_version must be an int >= 0, got {self.initial_version!r}")

    def given(self) -> dict[str, Any]:
        """The fields set (not None), by name."""
        return _given(self)


@dataclass(frozen=True, kw_only=True)
class TransportOptions:
    """Base of the per-transport options: the class names its transport.

    Class attributes:
        transport: ``(module, class)`` of the synchronizer, imported lazily.
        colocated: the topology it serves (True: shares the engine's devices).
        kinds: the engine kinds it drives (``"vllm"``, ``"sglang"``, ``"embedded"``).
    """

    transport: ClassVar[tuple[str, str]]
    colocated: ClassVar[bool | None]
    kinds: ClassVar[tuple[str, ...]]

    def given(self) -> dict[str, Any]:
        """The fields set (not None), by name: keywords of the transport's constructor."""
        return _given(self)


@dataclass(frozen=True, kw_only=True)
class IPCOptions(TransportOptions):
    """Colocated vLLM or embedded engine: buckets through shared memory (CUDA IPC on GPU).

    Attributes:
        bucket_bytes: bucket size, bytes.
        device: where the trainer's tensors are packed.
        device_label: the trainer device's label for the engine.
        buffer_memory_fraction: share of device memory the buffers may take, (0, 1].
        process_group: a sharded trainer's ``torch.distributed`` group.
        direct: let workers read the trainer's tensors in place (one copy).
    """

    transport: ClassVar[tuple[str, str]] = ("aiosync.transports.ipc", "IPCWeightSynchronizer")
    colocated: ClassVar[bool | None] = True
    kinds: ClassVar[tuple[str, ...]] = ("vllm", "embedded")

    bucket_bytes: int | None = None
    device: str | torch.device | None = None
    device_label: str | None = None
    buffer_memory_fraction: float | None = None
    process_group: Any = None
    direct: bool | None = None


@dataclass(frozen=True, kw_only=True)
class _GroupOptions(TransportOptions):
    """Non-colocated vLLM or embedded engine, over a torch.distributed group."""

    colocated: ClassVar[bool | None] = False
    kinds: ClassVar[tuple[str, ...]] = ("vllm", "embedded")

    dist_backend: Literal["nccl", "gloo"] | None = None
    bucket_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class CollectiveOptions(_GroupOptions):
    """Non-colocated vLLM or embedded engine: trainer rank 0 broadcasts every bucket.

    Attributes:
        dist_backend: the data group's torch.distributed backend, ``"nccl"`` or
            ``"gloo"`` (default: nccl when CUDA is available).
        bucket_bytes: bucket size, bytes.
        overlap: ``"inplace"`` (receive into the live weights) or ``"staged"``
            (beside them, swapped at commit).
    """

    transport: ClassVar[tuple[str, str]] = (
        "aiosync.transports.collective",
        "CollectiveWeightSynchronizer",
    )

    overlap: Literal["inplace", "staged"] | None = None


@dataclass(frozen=True, kw_only=True)
class ShardedOptions(_GroupOptions):
    """Non-colocated, shard-aware: every trainer rank sends its shards, each worker
    receives only its tensor-parallel slices (engines that report their layout).

    Attributes:
        dist_backend: as :class:`CollectiveOptions`.
        bucket_bytes: bucket size, bytes.
        data_plane: what carries the slices (the transport's names).
    """

    transport: ClassVar[tuple[str, str]] = (
        "aiosync.transports.sharded",
        "ShardedWeightSynchronizer",
    )

    data_plane: Any = None


@dataclass(frozen=True, kw_only=True)
class HTTPOptions(TransportOptions):
    """Colocated SGLang: buckets through the server's HTTP weight-update routes.

    Attributes:
        bucket_bytes: bucket size, bytes.
        device: where the trainer's tensors are packed.
        abort_all_requests: abort in-flight requests around a refit.
        record_checksums: record SGLang's ``/weights_checker`` checksums at each
            commit, for ``verify_engine()``.
    """

    transport: ClassVar[tuple[str, str]] = ("aiosync.transports.http", "HTTPWeightSynchronizer")
    colocated: ClassVar[bool | None] = True
    kinds: ClassVar[tuple[str, ...]] = ("sglang",)

    bucket_bytes: int | None = None
    device: str | torch.device | None = None
    abort_all_requests: bool | None = None
    record_checksums: bool | None = None


@dataclass(frozen=True, kw_only=True)
class SGLangCollectiveOptions(TransportOptions):
    """Non-colocated SGLang: SGLang's own broadcast group
    (``/init_weights_update_group``, ``/update_weights_from_distributed``).

    Attributes:
        dist_backend: as :class:`CollectiveOptions`.
        bucket_bytes: bucket size, bytes.
        group_name: the servers' name of the group.
        abort_all_requests: abort in-flight requests around a refit.
        record_checksums: as :class:`HTTPOptions`.
    """

    transport: ClassVar[tuple[str, str]] = (
        "aiosync.transports.collective",
        "SGLangCollectiveWeightSynchronizer",
    )
    colocated: ClassVar[bool | None] = False
    kinds: ClassVar[tuple[str, ...]] = ("sglang",)

    dist_backend: Literal["nccl", "gloo"] | None = None
    bucket_bytes: int | None = None
    group_name: str | None = None
    abort_all_requests: bool | None = None
    record_checksums: bool | None = None


@dataclass(frozen=True, kw_only=True)
class LoRAOptions(TransportOptions):
    """An adapter-only refit through the engine's LoRA API, on every backend and topology
    (chosen by the source: a :class:`~aiosync.LoRAAdapterSource`).

    Attributes:
        process_group: a sharded trainer's ``torch.distributed`` group.
    """

    transport: ClassVar[tuple[str, str]] = (
        "aiosync.transports.lora",
        "LoRAAdapterSynchronizer",
    )
    colocated: ClassVar[bool | None] = None
    kinds: ClassVar[tuple[str, ...]] = ("vllm", "sglang", "embedded")

    process_group: Any = None


#: Every per-transport options class, in the order of the docs' table.
TRANSPORT_OPTIONS: tuple[type[TransportOptions], ...] = (
    IPCOptions,
    CollectiveOptions,
    ShardedOptions,
    HTTPOptions,
    SGLangCollectiveOptions,
    LoRAOptions,
)


def _given(options: Any) -> dict[str, Any]:
    values = {f.name: getattr(options, f.name) for f in fields(options)}
    return {name: value for name, value in values.items() if value is not None}


def check_keywords(schema: Any, given: Mapping[str, object], call: str) -> None:
    """``**given``, typed by the TypedDict ``schema`` (``Unpack[schema]``), as a signature
    would check it at run time.

    Raises:
        TypeError: a keyword ``schema`` does not name, or a required one missing.
    """
    unknown = sorted(set(given) - schema.__required_keys__ - schema.__optional_keys__)
    missing = sorted(schema.__required_keys__ - set(given))
    if unknown or missing:
        what = f"unexpected keyword(s) {unknown}" if unknown else f"missing keyword(s) {missing}"
        raise TypeError(f"{call}(): {what}")
