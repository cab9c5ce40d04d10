"""What a refit costs before the cluster is rented: bytes on every link, the bottleneck, time.

The model behind ``aiosync plan`` (``docs/performance.md``). The trainer holds the
weights as FSDP2 dim-0 shards over ``trainer_ranks`` ranks (an MoE's fused experts
cut into whole experts, as FSDP2 cuts ``gate_up_proj [E, 2*Im, H]``); the fleet is
``engines`` replicas of ``max(tp, ep)`` workers each: Megatron cuts over ``tp``
(column-parallel dim 0, row-parallel dim 1, norms whole) and, with ``ep > 1``, the
experts placed by EP rank (:func:`ep_layouts`). Every rank and worker has one NIC of
``nic_gbps`` each way. For each path aiosync offers:

- ``broadcast``: the rank-0 broadcast (:class:`~aiosync.CollectiveWeightSynchronizer`):
  rank 0 gathers each tensor and broadcasts it to every worker, who keeps its slice.
  A pipelined broadcast (NCCL's ring) moves the whole model over every link once.
- ``sharded``: every rank sends its shards to the workers that hold them, by the plan
  :func:`~aiosync.transports.sharded.make_plan` computes, the same code the transport
  runs: each rank's upload is its plan bytes times the replicas, each worker's
  download its slices.
- ``delta``: the sharded path at ``changed`` fraction of elements changed, each
  transfer of the plan as the transport encodes it (int32 indices and values, or
  the box dense when smaller: :mod:`~aiosync.transports.sharded._delta`).
- ``fp8``: the sharded path with every 2-D projection weight as FP8 (1 byte) plus one
  float32 scale per 128x128 block (:mod:`aiosync.fp8`).

The predicted time is the busiest link's bytes over its payload rate
(:attr:`Links.efficiency` takes the protocol headers off) plus one latency per bucket
on it, plus the costs that do not scale with the links when given (a sync's fixed
overhead, a delta's diff); the lower bound is what no schedule beats on these links:
the larger of the busiest worker's download and the trainers' total upload spread
evenly. ``benchmarks/plan_check.py`` checks it against measured refits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from aiosync._config import DEFAULT_BUCKET_BYTES
from aiosync.layout import Part, even_chunks

from ._plan import Plan, box_numel, make_plan

__all__ = [
    "TCP_MTU1500_EFFICIENCY",
    "Links",
    "PathEstimate",
    "ep_layouts",
    "estimate_refit",
    "fsdp_layouts",
    "tp_layouts",
]

#: ``{hf_name: (shape, dtype)}``.
Manifest = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

#: Megatron's column-parallel (dim 0) and row-parallel (dim 1) weights, by name ending.
COLUMN_PARALLEL = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "embed_tokens.weight",
    "lm_head.weight",
)
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
#: FP8 block size (elements per side) with one float32 scale per block.
FP8_BLOCK = 128
#: Payload share of a TCP/IPv4 stream over 1500-byte-MTU Ethernet as a Linux qdisc
#: counts it: 1448 payload bytes (20 IP, 20 TCP, 12 timestamp option bytes off the MTU)
#: per 1514-byte frame (14 Ethernet header bytes).
TCP_MTU1500_EFFICIENCY = 1448 / 1514
#: One expert's projection in the HF checkpoint (Qwen3-MoE, Qwen3-Next, DeepSeek-V3).
EXPERT_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+?)_proj\.weight$")


@dataclass(frozen=True, slots=True)
class Links:
    """The network: one NIC per trainer rank and per engine worker.

    Raises:
        ValueError: a rate or efficiency outside its range, a negative latency.

    Attributes:
        nic_gbps: each NIC's rate each way, gigabits per second (> 0), as the link
            counts it (with its headers).
        latency_us: one message's latency, microseconds (>= 0).
        efficiency: the share of ``nic_gbps`` that carries payload (0 < x <= 1):
            the protocol headers take the rest. 1.0: none (RDMA's large messages
            come close); TCP over a 1500-byte MTU Ethernet link,
            :data:`TCP_MTU1500_EFFICIENCY`.
    """

    nic_gbps: float
    latency_us: float = 10.0
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.nic_gbps <= 0 or self.latency_us < 0 or not 0 < self.efficiency <= 1:
            raise ValueError(
                "Links need nic_gbps > 0, latency_us >= 0 and 0 < efficiency <= 1, got "
                f"{self.nic_gbps}, {self.latency_us}, {self.efficiency}"
            )

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes per second each way."""
        return self.nic_gbps * 1e9 / 8 * self.efficiency


@dataclass(frozen=True, slots=True)
class PathEstimate:
    """One path's bytes and times.

    Attributes:
        path: ``"broadcast"``, ``"sharded"``, ``"delta"`` or ``"fp8"``.
        upload_bytes: the busiest trainer rank's upload.
        download_bytes: the busiest engine worker's download.
        bottleneck: ``"trainer uplink"`` or ``"worker downlink"``.
        predicted_s: the busiest link's bytes over its rate, plus its latencies.
        lower_bound_s: what no schedule beats on these links.
    """

    path: str
    upload_bytes: int
    download_bytes: int
    bottleneck: str
    predicted_s: float
    lower_bound_s: float


def _experts(manifest: Manifest) -> dict[str, int]:
    """``{experts module: number of experts}`` of the per-expert checkpoint names."""
    counts: dict[str, int] = {}
    for name in manifest:
        match = EXPERT_NAME.match(name)
        if match is not None:
            counts[match["experts"]] = max(counts.get(match["experts"], 0), int(match["e"]) + 1)
    return counts


def fsdp_layouts(manifest: Manifest, ranks: int) -> list[dict[str, Part]]:
    """FSDP2 ``Shard(0)``: rank ``r`` holds chunk ``r`` of dim 0 of every tensor.

    Per-expert names (``...experts.{e}.*_proj.weight``) are of one fused in-memory
    tensor ``[E, ...]`` in the trainer: rank ``r`` holds chunk ``r`` of its ``E``
    experts whole (what :func:`~aiosync.transports.sharded.dtensor_layouts` reports for
    a transformers MoE under ``fully_shard``), the other ranks none of them.
    """
    experts = _experts(manifest)
    layouts: list[dict[str, Part]] = [{} for _ in range(ranks)]
    for name, (shape, _) in manifest.items():
        match = EXPERT_NAME.match(name)
        if match is not None:
            e = int(match["e"])
            for rank, (start, length) in enumerate(even_chunks(experts[match["experts"]], ranks)):
                if start <= e < start + length:
                    layouts[rank][name] = Part.whole(shape)
            continue
        for rank, (start, length) in enumerate(even_chunks(shape[0], ranks)):
            layouts[rank][name] = Part(shape, 0, start, length)
    return layouts


def tp_dim(name: str) -> int | None:
    """The dim Megatron TP cuts ``name`` along; None for a replicated tensor (norms)."""
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def tp_layouts(manifest: Manifest, tp: int) -> list[dict[str, Part]]:
    """Megatron TP parts of one replica's ``tp`` workers (equal chunks; norms whole).

    With fewer key/value heads than ranks (GQA, ``K < tp``: the head size from the
    layer's ``k_norm.weight [D]``), worker ``w`` holds head ``w * K // tp`` of
    ``k_proj``/``v_proj`` whole, replicated as vLLM and the embedded engine do.

    Raises:
        ValueError: a cut dimension is not a multiple of ``tp``.
    """
    layouts: list[dict[str, Part]] = [{} for _ in range(tp)]
    for name, (shape, _) in manifest.items():
        dim = tp_dim(name)
        head = _kv_head_dim(manifest, name)
        if head is not None and shape[0] // head < tp and tp % (shape[0] // head) == 0:
            heads = shape[0] // head
            for w in range(tp):
                layouts[w][name] = Part(shape, 0, (w * heads // tp) * head, head)
            continue
        if dim is not None and shape[dim] % tp:
            raise ValueError(f"{name}: dim {dim} of {shape} does not split over TP={tp}")
        for w in range(tp):
            if dim is None:
                layouts[w][name] = Part.whole(shape)
            else:
                start, length = even_chunks(shape[dim], tp)[w]
                layouts[w][name] = Part(shape, dim, start, length)
    return layouts


def _kv_head_dim(manifest: Manifest, name: str) -> int | None:
    """The head size of a ``self_attn.{k,v}_proj.weight`` (its layer's ``k_norm.weight``
    length, Qwen3's); None for another name or without a ``k_norm``."""
    for proj in ("k_proj.weight", "v_proj.weight"):
        if name.endswith(f"self_attn.{proj}"):
            norm = manifest.get(name[: -len(proj)] + "k_norm.weight")
            return None if norm is None or len(norm[0]) != 1 else int(norm[0][0])
    return None


def ep_layouts(manifest: Manifest, *, tp: int, ep: int) -> list[dict[str, Part]]:
    """One engine replica of ``max(tp, ep)`` workers with experts placed by EP rank.

    Worker ``w`` holds the Megatron TP parts (:func:`tp_layouts`) of TP rank
    ``w % tp`` for everything but the experts (``ep > tp``: ``ep / tp`` attention
    replicas, vLLM's data-parallel attention beside EP); of the experts it holds
    those of EP rank ``g = w // (workers / ep)``, ``[g * E / ep, (g + 1) * E / ep)``
    whole, each cut over the ``workers / ep`` ranks of its EP group like a dense MLP
    (``ep == workers``: whole experts). The names of other experts are absent. This
    is the embedded engine's own placement (``_tp.tp_layout``) when ``ep`` divides
    ``tp``, and vLLM's (``--enable-expert-parallel``, linear expert placement).

    Raises:
        ValueError: neither of ``tp``, ``ep`` divides the other, the experts do not
            split over ``ep``, or a cut dimension does not split.
    """
    workers = max(tp, ep)
    if workers % tp or workers % ep:
        raise ValueError(f"tp={tp} and ep={ep}: one must divide the other")
    group = workers // ep
    dense = tp_layouts(manifest, tp)
    experts = _experts(manifest)
    layouts: list[dict[str, Part]] = [{} for _ in range(workers)]
    for name, (shape, _) in manifest.items():
        match = EXPERT_NAME.match(name)
        if match is None:
            for w in range(workers):
                layouts[w][name] = dense[w % tp][name]
            continue
        count = experts[match["experts"]]
        if count % ep:
            raise ValueError(f"{match['experts']}: {count} experts do not split over EP={ep}")
        dim = 1 if match["proj"] == "down" else 0
        if shape[dim] % group:
            raise ValueError(f"{name}: dim {dim} of {shape} does not split over {group} ranks")
        owner = int(match["e"]) // (count // ep)
        for within, (start, length) in enumerate(even_chunks(shape[dim], group)):
            layouts[owner * group + within][name] = Part(shape, dim, start, length)
    return layouts


def _delta_bytes(plan: Plan, changed: float) -> tuple[list[float], list[float]]:
    """Bytes each sender uploads and each receiver downloads in a delta sync of ``plan``
    at ``changed`` of every box's elements changed (spread evenly), as the transport
    encodes each transfer (:func:`~aiosync.transports.sharded._delta.encode_transfer`):
    int32 flat indices (int64 past 2**31 elements) and values, or the box dense when
    that is no larger."""
    up = [0.0] * plan.num_senders
    down = [0.0] * plan.num_receivers
    for t in plan.transfers():
        n, size = box_numel(t.box), t.torch_dtype.itemsize
        index = 8 if math.prod(t.shape) > 2**31 else 4
        cost = min(n * size, changed * n * (index + size))
        up[t.src] += cost
        down[t.dst] += cost
    return up, down


def _fp8_fraction(manifest: Manifest) -> float:
    """FP8 bytes over full bytes: 2-D projection weights at 1 byte per element plus a
    float32 scale per block; the rest as they are."""
    full = fp8 = 0.0
    for name, (shape, dtype) in manifest.items():
        n = math.prod(shape)
        full += n * dtype.itemsize
        if len(shape) == 2 and name.endswith("proj.weight"):
            blocks = math.ceil(shape[0] / FP8_BLOCK) * math.ceil(shape[1] / FP8_BLOCK)
            fp8 += n + 4 * blocks
        else:
            fp8 += n * dtype.itemsize
    return fp8 / full if full else 0.0


def _row(
    path: str,
    up: float,
    down: float,
    total_up: float,
    ranks: int,
    links: Links,
    messages: int,
    fixed_s: float = 0.0,
) -> PathEstimate:
    rate = links.bytes_per_s
    busiest = max(up, down)
    return PathEstimate(
        path=path,
        upload_bytes=round(up),
        download_bytes=round(down),
        bottleneck="trainer uplink" if up >= down else "worker downlink",
        predicted_s=busiest / rate + messages * links.latency_us * 1e-6 + fixed_s,
        lower_bound_s=max(down, total_up / ranks) / rate,
    )


def estimate_refit(
    manifest: Manifest,
    *,
    trainer_ranks: int,
    tp: int,
    engines: int,
    links: Links,
    ep: int = 1,
    changed: float = 0.05,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    sync_overhead_s: float = 0.0,
    diff_bytes_per_s: float | None = None,
) -> list[PathEstimate]:
    """The bytes on the busiest links and the time of each path (see the module).

    The time is the busiest link's bytes over its payload rate, plus one latency per
    message on it, plus two costs that do not scale with the links, both zero unless
    given: ``sync_overhead_s`` per sync (the group's handshakes and vote, waking the
    processes), and a delta's diff (each trainer rank compares its shard with its
    baseline and encodes the changes, each worker applies them).

    Args:
        manifest: ``{hf_name: (shape, dtype)}`` (the HF checkpoint's).
        trainer_ranks: FSDP2 ranks holding dim-0 shards (>= 1).
        tp: tensor-parallel size of an engine replica (>= 1; every cut dim a
            multiple of it).
        engines: engine replicas (>= 1).
        ep: expert-parallel size of an engine replica (>= 1; 1: every worker holds a
            TP slice of every expert): a replica is ``max(tp, ep)`` workers
            (:func:`ep_layouts`).
        links: the NICs.
        changed: the fraction of elements a delta refit finds changed (0..1).
        bucket_bytes: the transports' bucket size, bytes (one latency each).
        sync_overhead_s: fixed cost of one sync, seconds (>= 0), added to every path
            but the lower bound.
        diff_bytes_per_s: how fast a delta's diff goes, bytes of the busiest trainer
            rank's shard per second (encoding there and applying on the workers
            together); None: free (a GPU diffs at memory speed, far above a NIC).

    Raises:
        ValueError: a count < 1, ``changed`` outside [0, 1], a dim TP cannot cut,
            or experts EP cannot place (:func:`ep_layouts`).
    """
    if min(trainer_ranks, tp, engines, ep) < 1:
        raise ValueError(
            f"trainer_ranks, tp, engines, ep must be >= 1: {trainer_ranks, tp, engines, ep}"
        )
    if not 0.0 <= changed <= 1.0:
        raise ValueError(f"changed must be in [0, 1], got {changed}")
    if sync_overhead_s < 0 or (diff_bytes_per_s is not None and diff_bytes_per_s <= 0):
        raise ValueError(
            f"sync_overhead_s must be >= 0 and diff_bytes_per_s > 0: "
            f"{sync_overhead_s}, {diff_bytes_per_s}"
        )
    model = sum(math.prod(shape) * dtype.itemsize for shape, dtype in manifest.values())
    rows = [
        # Every link carries the model once; rank 0 also downloads the others' shards.
        _row(
            "broadcast",
            model,
            model,
            model,
            1,
            links,
            math.ceil(model / bucket_bytes),
            sync_overhead_s,
        )
    ]
    dtypes = {name: dtype for name, (_, dtype) in manifest.items()}
    workers = ep_layouts(manifest, tp=tp, ep=ep) if ep > 1 else tp_layouts(manifest, tp)
    plan = make_plan(fsdp_layouts(manifest, trainer_ranks), workers, dtypes, bucket_bytes)
    up = max(plan.sender_nbytes) * engines
    down = max(plan.receiver_nbytes)
    total_up = plan.total_nbytes * engines
    per_link_buckets = max(
        sum(1 for src in range(trainer_ranks) for _ in plan.buckets_between(src, dst))
        for dst in range(len(workers))
    )
    rows.append(
        _row("sharded", up, down, total_up, trainer_ranks, links, per_link_buckets, sync_overhead_s)
    )
    # A delta: one message each way per pair (handshake, header, payload, finish) and
    # the diff, over the busiest rank's shard.
    delta_up, delta_down = _delta_bytes(plan, changed)
    pairs = max(sum(1 for _, dst in plan.buckets if dst == w) for w in range(len(workers)))
    shard = max(
        sum(part.numel * dtypes[name].itemsize for name, part in layout.items())
        for layout in plan.sources
    )
    diff_s = 0.0 if diff_bytes_per_s is None else shard / diff_bytes_per_s
    rows.append(
        _row(
            "delta",
            max(delta_up) * engines,
            max(delta_down),
            sum(delta_up) * engines,
            trainer_ranks,
            links,
            4 * pairs,
            sync_overhead_s + diff_s,
        )
    )
    fraction = _fp8_fraction(manifest)
    rows.append(
        _row(
            "fp8",
            up * fraction,
            down * fraction,
            total_up * fraction,
            trainer_ranks,
            links,
            math.ceil(per_link_buckets * fraction),
            sync_overhead_s,
        )
    )
    return rows
