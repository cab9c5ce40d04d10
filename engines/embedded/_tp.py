"""Megatron-style tensor parallelism for the embedded engine's workers.

One data-parallel replica of an ``EmbeddedEngine(..., tensor_parallel_size=N)``
is ``N`` worker processes. Each builds the full transformers model from the
config (same seed, so the same initial weights as an unsharded worker), then
keeps only its slice (:func:`tp_layout` says which, in HF checkpoint names and
:class:`~aiosync.layout.Part` terms, as vLLM shards the same model):

* column-parallel ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``
  (dim-0 rows of ``weight`` and ``bias``; MoE experts too, per expert): their
  outputs stay sharded, heads and the MLP's intermediate features split by rank;
* row-parallel ``o_proj``/``down_proj`` (dim-1 columns; per expert too): each rank's
  partial output is summed over the replica's group (gloo ``allreduce`` SUM), the
  bias added once after the sum;
* vocab-parallel ``embed_tokens`` (dim-0 rows: an id outside the rank's rows
  embeds to zeros, then the SUM) and ``lm_head`` (dim-0 rows: the logits are
  all-gathered); a tied head shares the embedding's rows;
* everything else (norms, ``q_norm``/``k_norm``, the MoE router) replicated.

GQA: the ``K`` key/value heads are split by rank when ``K >= N``; with fewer
(``N % K == 0``) rank ``r`` holds head ``r * K // N``, replicated as vLLM does.

MoE experts are TP-sliced (every rank holds every expert's slice) unless the
replica is also expert-parallel (``expert_parallel=M``, ``M`` dividing ``N``, as
vLLM's ``--enable-expert-parallel`` places them): then rank ``r`` is in EP group
``r // (N / M)`` and holds whole experts ``[g * E / M, (g + 1) * E / M)`` of that
group, each cut over the group's ``N / M`` ranks like a dense MLP (``M == N``:
whole experts, no cut). A name of an expert another rank holds is absent from
the layout. The router stays replicated; each rank runs the routes to its own
experts (the others masked, transformers' expert-parallel sentinel) and the
partial outputs are summed over the replica (transformers' ``AllReduceEP``).

The ranks of a replica meet over a ``TCPStore`` that the engine process serves
on ``127.0.0.1`` (:func:`open_tp_store`), in a ``ProcessGroupGloo`` built
directly (each worker has no default group, and needs none) on the loopback
device. Generation runs in lockstep: rank 0 of the replica (the *driver*)
decodes, and before each forward pass tells the other ranks (*followers*) the
step's input ids over a ZMQ ``PUSH``/``PULL`` socket in the engine's private
directory; every rank then agrees that its weights may serve the step (a gloo
all-gather of refusal codes) and runs the same forward pass, so the collectives
inside it pair up. Only the driver samples. An idle follower waits on its
socket, never inside a collective, so a pause of any length costs nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import zmq
from torch import nn
from torch.nn import functional as F

from aiosync.errors import SyncError, TransportError
from aiosync.layout import Part, even_chunks
from aiosync.transports._wire import decode, encode

from ._targets import _EXPERT_NAME

if TYPE_CHECKING:
    from .model import HFModelRunner

__all__ = [
    "DEFAULT_TP_TIMEOUT_S",
    "REFUSALS",
    "TP_MODEL_TYPES",
    "TPGroup",
    "TPSpec",
    "TensorParallel",
    "check_expert_parallel",
    "check_tensor_parallel",
    "open_tp_store",
    "tp_layout",
]

_log = logging.getLogger(__name__)

#: Model types whose layers :func:`tp_layout` knows (dense Qwen3, Qwen3-MoE).
TP_MODEL_TYPES: frozenset[str] = frozenset({"qwen3", "qwen3_moe"})

#: Limit of one collective of a replica's group, seconds: only ever reached
#: while a step runs (an idle follower waits on its socket), so a stalled peer
#: surfaces within this long.
DEFAULT_TP_TIMEOUT_S: float = 300.0

#: Why a rank refuses a step, by the code it sends in the step's agreement
#: (0: it may serve the step).
REFUSALS: Mapping[int, str] = {
    1: "weights are not valid (a refit failed or is loading, or they were discarded "
    "while asleep); a sync must succeed before generating",
    2: "a LoRA adapter load is in flight or failed; a sync must succeed before generating",
    3: "asleep",
}

# How often an idle follower looks whether it was closed, milliseconds.
_FOLLOWER_POLL_MS = 1000

# HF checkpoint name -> how tensor parallelism cuts it (the first match wins;
# no match: replicated). Per-model knowledge as data: the module surgery
# (:func:`_shard_modules`) slices the in-memory tensors by the parts these give.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(^|\.)embed_tokens\.weight$"), "vocab"),
    (re.compile(r"^lm_head\.(weight|bias)$"), "vocab"),
    (re.compile(r"\.self_attn\.q_proj\.(weight|bias)$"), "column"),
    (re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$"), "kv_heads"),
    # Dense MLPs and every expert of an MoE block (``experts.{e}.gate_proj.weight``).
    (re.compile(r"\.(gate|up)_proj\.(weight|bias)$"), "column"),
    # Row-parallel biases are added once, after the sum: replicated.
    (re.compile(r"\.(o|down)_proj\.weight$"), "row"),
)


@dataclass(frozen=True, slots=True)
class TPSpec:
    """Where one worker sits in its replica's tensor-parallel group (picklable:
    the engine hands it to the worker process).

    Attributes:
        rank: the worker's rank in its replica, ``0..size-1`` (0: the driver).
        size: ranks per replica (``tensor_parallel_size``), >= 2.
        replica: the data-parallel replica's index.
        store_port: port of the engine's ``TCPStore`` on ``127.0.0.1``.
        prefix: the group's key prefix in the store (unique per formation, so a
            respawned replica never reads its predecessor's keys).
        endpoints: the ZMQ endpoint each rank's step socket binds (the driver's,
            entry 0, is unused).
        timeout_s: limit of the group's formation, seconds.
        collective_timeout_s: limit of each collective, seconds.
        expert_parallel: expert-parallel groups the replica's ranks form (``M``,
            dividing ``size``; 1: every rank holds a slice of every expert).
    """

    rank: int
    size: int
    replica: int
    store_port: int
    prefix: str
    endpoints: tuple[str, ...]
    timeout_s: float
    collective_timeout_s: float = DEFAULT_TP_TIMEOUT_S
    expert_parallel: int = 1


def open_tp_store(timeout_s: float) -> dist.TCPStore:
    """The engine's store for its replicas' groups: a server on ``127.0.0.1``, on a
    port the OS picks (its ``port`` attribute; blocking, milliseconds)."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        None,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class TPGroup:
    """One replica's gloo group over loopback: the collectives of a sharded forward pass.

    Every method blocks until all ranks of the replica made the same call, for at
    most the group's timeout.

    Raises (every method):
        TransportError: a peer died, or the collective timed out (the replica's
            peers are then out of step: the engine respawns replicas whole).
    """

    def __init__(self, pg: Any, rank: int, size: int, replica: int) -> None:
        self._pg = pg
        self.rank = rank
        self.size = size
        self.replica = replica

    @classmethod
    def connect(cls, spec: TPSpec) -> TPGroup:
        """Join the replica's group (blocks until every rank joined).

        Raises:
            TransportError: the store is unreachable or a rank did not join
                within ``spec.timeout_s``.
        """
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                spec.store_port,
                None,
                False,
                datetime.timedelta(seconds=spec.timeout_s),
            )
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
            # Loopback only: the ranks of a replica are processes of one machine.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(spec.prefix, store), spec.rank, spec.size, opts
            )
        except Exception as exc:
            raise TransportError(
                f"tensor-parallel group of replica {spec.replica} (rank {spec.rank} of "
                f"{spec.size}) did not form: {exc}"
            ) from exc
        return cls(pg, spec.rank, spec.size, spec.replica)

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            raise TransportError(
                f"tensor-parallel {what} of replica {self.replica} failed on rank "
                f"{self.rank}: {exc}"
            ) from exc

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (any shape and dtype); returns it."""
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        with self._errors("all-reduce"):
            self._pg.allreduce([work]).wait()
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on each) concatenated along ``dim``, rank order."""
        local = tensor.contiguous()
        outs = [torch.empty_like(local) for _ in range(self.size)]
        with self._errors("all-gather"):
            self._pg.allgather([outs], [local]).wait()
        return torch.cat(outs, dim=dim)

    def gather_codes(self, code: int) -> list[int]:
        """Every rank's ``code`` (an int, 0..255), rank order."""
        return [int(x) for x in self.all_gather(torch.tensor([code], dtype=torch.uint8), 0)]


def _get(config: Mapping[str, Any] | object, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def check_tensor_parallel(config: Mapping[str, Any] | object, size: int, ep: int = 1) -> None:
    """Raise ValueError unless ``config`` (an HF config or its dict) splits over ``size``
    ranks, its experts over ``ep`` expert-parallel groups of them.

    A key the config lacks is not checked (a dict may rely on transformers'
    defaults; the worker checks the full config again).

    Raises:
        ValueError: a model type :func:`tp_layout` does not know, or heads,
            key/value heads, (MoE) intermediate size or vocabulary not divisible
            as Megatron TP needs (``K % N == 0`` or ``N % K == 0`` for GQA); or
            as :func:`check_expert_parallel`.
    """
    model_type = _get(config, "model_type")
    if model_type is not None and model_type not in TP_MODEL_TYPES:
        raise ValueError(
            f"tensor_parallel_size > 1 supports model types {sorted(TP_MODEL_TYPES)}, "
            f"got {model_type!r}"
        )
    check_expert_parallel(config, size, ep)
    # The experts' intermediate size is cut over an EP group's ranks only.
    cuts = {"moe_intermediate_size": size // ep}
    for key in ("num_attention_heads", "intermediate_size", "moe_intermediate_size", "vocab_size"):
        value = _get(config, key)
        by = cuts.get(key, size)
        if value is not None and int(value) % by:
            what = "tensor_parallel_size" if by == size else "tensor_parallel_size // ep"
            raise ValueError(f"{key}={value} is not divisible by {what}={by}")
    kv = _get(config, "num_key_value_heads")
    if kv is not None and int(kv) % size and size % int(kv):
        raise ValueError(
            f"num_key_value_heads={kv} and tensor_parallel_size={size}: one must divide the "
            "other (fewer heads than ranks are replicated, as vLLM does)"
        )


def check_expert_parallel(config: Mapping[str, Any] | object, size: int, ep: int) -> None:
    """Raise ValueError unless ``ep`` expert-parallel groups fit ``size`` ranks and the
    config's experts (``ep == 1``: nothing to check).

    Raises:
        ValueError: ``ep < 1``, ``size % ep``, a model without experts
            (``num_experts`` 0 or absent, a ``model_type`` other than ``qwen3_moe``),
            or ``num_experts % ep``.
    """
    if ep == 1:
        return
    if ep < 1 or size % ep:
        raise ValueError(
            f"expert_parallel_size={ep} must divide tensor_parallel_size={size} (the "
            "replica's ranks form the expert-parallel groups)"
        )
    model_type = _get(config, "model_type")
    experts = _get(config, "num_experts")
    if model_type not in (None, "qwen3_moe") or not experts:
        raise ValueError(
            f"expert_parallel_size > 1 needs a Qwen3-MoE model with experts, got model "
            f"type {model_type!r} with num_experts={experts!r}"
        )
    if int(experts) % ep:
        raise ValueError(f"num_experts={experts} is not divisible by expert_parallel_size={ep}")


def _head_dim(config: object) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(_get(config, "hidden_size")) // int(_get(config, "num_attention_heads"))


def tp_layout(
    manifest: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    config: object,
    rank: int,
    size: int,
    ep: int = 1,
) -> dict[str, Part]:
    """The :class:`Part` of each checkpoint tensor that TP rank ``rank`` of ``size`` holds.

    Args:
        manifest: the FULL checkpoint's ``{hf_name: (shape, dtype)}`` (the model's
            ``save_pretrained`` names; a tied ``lm_head`` absent).
        config: the model's HF config (``head_dim``, ``num_key_value_heads``,
            ``num_experts``).
        ep: expert-parallel groups of the ``size`` ranks (see the module); 1: none.

    Returns:
        ``{hf_name: part}`` in ``manifest`` order: column-parallel and
        vocab-parallel tensors cut along dim 0, row-parallel ones along dim 1,
        the rest :meth:`Part.whole`. With ``ep > 1`` only the experts of this
        rank's EP group (``mlp.experts.{e}.*``), each cut over the group's
        ``size // ep`` ranks; the names of other experts are absent.

    Raises:
        ValueError: as :func:`check_tensor_parallel`.
    """
    check_tensor_parallel(config, size, ep)
    head_dim = _head_dim(config)
    experts = int(_get(config, "num_experts") or 0)
    group_size = size // ep
    group, within = divmod(rank, group_size)
    layout: dict[str, Part] = {}
    for name, (shape, _) in manifest.items():
        expert = _EXPERT_NAME.match(name) if ep > 1 else None
        if expert is not None:
            first, count = even_chunks(experts, ep)[group]
            if first <= int(expert["e"]) < first + count:
                # One expert's projection, cut over the EP group's ranks like a dense MLP.
                dim = 1 if expert["proj"] == "down" else 0
                layout[name] = Part(shape, dim, *_even(shape[dim], within, group_size, name))
            continue
        kind = next((kind for pattern, kind in _RULES if pattern.search(name)), None)
        if kind is None or not shape:
            layout[name] = Part.whole(shape)
        elif kind == "row":
            layout[name] = Part(shape, 1, *_even(shape[1], rank, size, name))
        elif kind == "kv_heads" and shape[0] // head_dim < size:
            # Fewer key/value heads than ranks: each rank keeps the one its query heads use.
            head = rank * (shape[0] // head_dim) // size
            layout[name] = Part(shape, 0, head * head_dim, head_dim)
        else:  # column, vocab, kv_heads with K >= N
            layout[name] = Part(shape, 0, *_even(shape[0], rank, size, name))
    return layout


def _even(extent: int, rank: int, size: int, name: str) -> tuple[int, int]:
    if extent % size:
        raise ValueError(f"{name}: {extent} rows do not split evenly over {size} ranks")
    return even_chunks(extent, size)[rank]


# -- the sharded layers ----------------------------------------------------------


class _RowParallelLinear(nn.Linear):
    """``nn.Linear`` holding dim-1 columns of its weight: partial products summed
    over the group, then the (replicated) bias added once."""

    tp_group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp_group.all_reduce_(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class _VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` holding rows ``[vocab_start, vocab_start + num_embeddings)``."""

    tp_group: TPGroup
    vocab_start: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        # Exactly one rank holds each id's row: the others add zeros.
        return self.tp_group.all_reduce_(out.masked_fill(outside.unsqueeze(-1), 0.0))


class _VocabParallelHead(nn.Linear):
    """``nn.Linear`` holding vocabulary rows: local logits all-gathered along the last dim."""

    tp_group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_group.all_gather(F.linear(x, self.weight, self.bias), dim=-1)


def _replace(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    # A fresh, contiguous copy: the full tensor it was cut from is freed.
    setattr(module, attr, nn.Parameter(value.detach().clone(), requires_grad=False))


def _narrow(tensor: torch.Tensor, part: Part, offset: int = 0) -> torch.Tensor:
    """``part``'s slice of ``tensor`` (whose dim ``part.dim + offset`` is the part's)."""
    return tensor.narrow(part.dim + offset, part.start, part.length)


def _shard_modules(model: nn.Module, layout: Mapping[str, Part], group: TPGroup) -> None:
    """Cut ``model``'s tensors in place to ``layout`` and swap in the sharded layers."""
    # Any: the layers' classes and attributes are swapped in place below.
    embeddings: Any = model.get_input_embeddings()  # type: ignore[operator]
    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    tied = head is not None and head.weight is embeddings.weight
    module: Any
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        part = layout.get(f"{prefix}weight")
        sharded = part is not None and not part.is_whole
        # Flags, not isinstance in the branches: mypy would narrow ``module`` to a
        # class whose attributes cannot be set to the sharded layers' fields.
        is_embedding, is_linear = isinstance(module, nn.Embedding), isinstance(module, nn.Linear)
        if is_embedding and sharded:
            assert part is not None
            _replace(module, "weight", _narrow(module.weight, part))
            module.num_embeddings = part.length
            module.__class__ = _VocabParallelEmbedding
            module.vocab_start = part.start
            module.tp_group = group
        elif is_linear and sharded:
            assert part is not None
            _replace(module, "weight", _narrow(module.weight, part))
            if part.dim == 1:
                module.in_features = part.length
                module.__class__ = _RowParallelLinear
            else:
                module.out_features = part.length
                if module.bias is not None:
                    _replace(module, "bias", _narrow(module.bias, layout[f"{prefix}bias"]))
                if module is head:
                    module.__class__ = _VocabParallelHead
            module.tp_group = group
        elif hasattr(module, "gate_up_proj") and (held := _held_experts(layout, prefix)):
            _shard_experts(module, prefix, held, layout, group)
    if tied:
        # The tied head is absent from the checkpoint: it shares the embedding's rows.
        assert head is not None
        head.weight = embeddings.weight
        head.out_features = embeddings.num_embeddings
        head.__class__ = _VocabParallelHead
        head.tp_group = group
    for module in model.modules():
        # Attention: the query heads per key/value head change when fewer
        # key/value heads than ranks are replicated.
        if hasattr(module, "num_key_value_groups") and hasattr(module, "k_proj"):
            head_dim = int(module.head_dim)
            q_heads = module.q_proj.out_features // head_dim
            kv_heads = module.k_proj.out_features // head_dim
            module.num_key_value_groups = q_heads // kv_heads


def _held_experts(layout: Mapping[str, Part], prefix: str) -> range:
    """The experts of the fused module at ``prefix`` (``...mlp.experts.``) whose
    checkpoint names ``layout`` holds (empty: not an experts module, or none held).

    Raises:
        ValueError: the experts held are not one contiguous range.
    """
    held = sorted(
        {
            int(match["e"])
            for name in layout
            if (match := _EXPERT_NAME.match(name)) is not None and match["experts"] == prefix[:-1]
        }
    )
    if not held:
        return range(0)
    experts = range(held[0], held[-1] + 1)
    if len(held) != len(experts):
        raise ValueError(f"{prefix}: the experts held are not contiguous: {held}")
    return experts


def _shard_experts(
    module: Any, prefix: str, held: range, layout: Mapping[str, Part], group: TPGroup
) -> None:
    """Keep experts ``held`` of fused experts (transformers 5: ``gate_up_proj [E, 2*Im, H]``
    with the gate rows first, ``down_proj [E, H, Im]``), each TP-sliced as ``layout``
    says (every expert the same slice), and sum the partial outputs over the replica."""
    first = held[0]
    gate = layout[f"{prefix}{first}.gate_proj.weight"]
    up = layout[f"{prefix}{first}.up_proj.weight"]
    down = layout[f"{prefix}{first}.down_proj.weight"]
    total = int(module.gate_up_proj.shape[0])
    gate_up = module.gate_up_proj[held.start : held.stop]
    im = gate_up.shape[1] // 2
    # The local tensor keeps the fused order: this rank's gate rows, then its up rows.
    local = torch.cat(
        [_narrow(gate_up, gate, offset=1), _narrow(gate_up[:, im:], up, offset=1)], dim=1
    )
    _replace(module, "gate_up_proj", local)
    _replace(module, "down_proj", _narrow(module.down_proj[held.start : held.stop], down, offset=1))
    if hasattr(module, "intermediate_dim"):
        module.intermediate_dim = gate.length
    if len(held) < total:
        # Expert parallelism: transformers' experts forward skips local id
        # ``num_experts`` (its EP sentinel); the routes to other ranks' experts become
        # that id with weight 0, as its AllReduceEP does.
        module.num_experts = len(held)
        module._is_expert_parallel = True

        def localize(_module: nn.Module, args: Any) -> Any:
            hidden, index, weights = args
            off_rank = (index < held.start) | (index >= held.stop)
            local = torch.where(off_rank, len(held), index - held.start)
            return hidden, local, weights.masked_fill(off_rank, 0.0)

        module.register_forward_pre_hook(localize)

    def reduce(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        # The routing-weighted sum of the experts' partial outputs is linear: sum it once.
        return group.all_reduce_(output)

    module.register_forward_hook(reduce)


# -- one rank of a replica ----------------------------------------------------------


class TensorParallel:
    """One worker's place in its replica: the group, the sharding and the step channel.

    Built in the worker process by :meth:`connect`; the runner
    (:class:`~aiosync.engines.embedded.model.HFModelRunner`) calls :meth:`shard`
    once, then on the driver :meth:`announce` before each forward pass and
    :meth:`release` after each request; a follower runs :meth:`serve`.
    """

    def __init__(self, spec: TPSpec, group: TPGroup, ctx: zmq.Context[Any]) -> None:
        self.spec = spec
        self.group = group
        self._ctx = ctx
        self._closed = threading.Event()
        self._requests = itertools.count()
        self._pull: zmq.Socket[Any] | None = None
        self._push: list[zmq.Socket[Any]] = []

    @property
    def rank(self) -> int:
        """This worker's rank in its replica (0: the driver)."""
        return self.spec.rank

    @property
    def size(self) -> int:
        """Ranks per replica."""
        return self.spec.size

    @property
    def is_driver(self) -> bool:
        """True on rank 0, which decodes and samples for the replica."""
        return self.spec.rank == 0

    @classmethod
    def connect(cls, spec: TPSpec) -> TensorParallel:
        """Bind (follower) or connect (driver) the step sockets and join the group.

        Raises:
            TransportError: as :meth:`TPGroup.connect`.
        """
        ctx: zmq.Context[Any] = zmq.Context()
        pull = None
        try:
            if spec.rank > 0:
                # Bound before the group forms, so the driver's first step finds it.
                pull = ctx.socket(zmq.PULL)
                pull.setsockopt(zmq.LINGER, 0)
                pull.bind(spec.endpoints[spec.rank])
            group = TPGroup.connect(spec)
        except BaseException:
            if pull is not None:
                pull.close(linger=0)
            ctx.term()
            raise
        tp = cls(spec, group, ctx)
        tp._pull = pull
        if spec.rank == 0:
            for endpoint in spec.endpoints[1:]:
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.connect(endpoint)
                tp._push.append(push)
        return tp

    def shard(
        self, model: nn.Module, manifest: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[str, Part]:
        """Cut ``model`` (the full model, built from its config) to this rank's slice,
        in place (its EP group's experts only, with ``spec.expert_parallel > 1``);
        returns the :func:`tp_layout` of ``manifest`` (FULL shapes).

        Raises:
            ValueError: as :func:`check_tensor_parallel`.
        """
        layout = tp_layout(manifest, model.config, self.rank, self.size, self.spec.expert_parallel)
        _shard_modules(model, layout, self.group)
        return layout

    # -- the driver --------------------------------------------------------------

    def announce(self, request: int | None, step_input: torch.Tensor, adapter: str | None) -> int:
        """Driver, under the model's lock, before its forward pass: have every follower
        run the same step (``step_input``: ``[1, n]`` int64 ids), then agree that
        every rank may serve it. Returns the request's id (a new one for ``None``).

        Raises:
            SyncError: a follower refused (its weights are invalid, asleep, or a
                LoRA load is in flight there); no rank ran the step.
            TransportError: a follower is gone or out of step.
        """
        if request is None:
            request = next(self._requests)
        self._send({"op": "step", "req": request, "ids": step_input[0].tolist(), "lora": adapter})
        codes = self.group.gather_codes(0)
        refused = [(rank, code) for rank, code in enumerate(codes) if code]
        if refused:
            rank, code = refused[0]
            worker = self.spec.replica * self.size + rank
            raise SyncError(
                f"worker {worker} (tensor-parallel rank {rank} of replica {self.spec.replica}): "
                f"{REFUSALS.get(code, f'refusal code {code}')}"
            )
        return request

    def release(self, request: int) -> None:
        """Driver, under the model's lock: the followers drop ``request``'s KV cache."""
        self._send({"op": "end", "req": request})

    def _send(self, message: dict[str, Any]) -> None:
        payload = encode(message)
        try:
            for push in self._push:
                # Never block under the model's lock: a follower that stopped reading
                # (dead, wedged) fails the step instead.
                push.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransportError(
                f"tensor-parallel step channel of replica {self.spec.replica}: {exc}"
            ) from exc

    # -- a follower --------------------------------------------------------------

    def serve(self, runner: HFModelRunner, refusal: Callable[[], int]) -> None:
        """Follower's loop (its own thread, until :meth:`close`): run every step the
        driver announces, in the driver's order, under the model's lock.

        ``refusal()`` (called under the model's lock) is 0 when this worker's
        weights may serve a step, else a :data:`REFUSALS` code; a refused step
        is run by no rank. Each request's KV cache lives here until the driver
        releases it (or a step of it is refused or fails).
        """
        assert self._pull is not None, "only followers serve"
        caches: dict[int, Any] = {}
        while not self._closed.is_set():
            try:
                if not self._pull.poll(_FOLLOWER_POLL_MS):
                    continue
                message = decode(self._pull.recv())
            except (zmq.ZMQError, TransportError):
                if self._closed.is_set():
                    return
                _log.exception("tensor-parallel rank %d: bad step message", self.rank)
                continue
            request = int(message.get("req", -1))
            if message.get("op") == "end":
                caches.pop(request, None)
                continue
            try:
                with runner.lock:
                    code = refusal()
                    if any(self.group.gather_codes(code)):
                        caches.pop(request, None)
                        continue
                    ids = torch.tensor([message["ids"]], dtype=torch.long, device=runner.device)
                    _, caches[request] = runner.forward_step(
                        ids, caches.get(request), message.get("lora")
                    )
            except Exception:
                caches.pop(request, None)
                _log.exception("tensor-parallel rank %d: step of request %d", self.rank, request)

    def start_serving(self, runner: HFModelRunner, refusal: Callable[[], int]) -> threading.Thread:
        """:meth:`serve` in a daemon thread; returns it."""
        thread = threading.Thread(
            target=self.serve,
            args=(runner, refusal),
            name=f"tp-follower-{self.spec.replica}.{self.rank}",
            daemon=True,
        )
        thread.start()
        return thread

    def close(self) -> None:
        """Stop serving within ``_FOLLOWER_POLL_MS`` (idempotent); the sockets go with
        the process (a socket belongs to the thread that uses it)."""
        self._closed.set()


def endpoints_for(directory: str, ranks: Sequence[int]) -> tuple[str, ...]:
    """The step socket of each global worker rank in ``ranks``, in ``directory``."""
    return tuple(f"ipc://{directory}/tp-{rank}.sock" for rank in ranks)
