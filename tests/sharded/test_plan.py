"""The many-senders plan: exact boxes, replica balancing, coverage errors, a stable digest."""

from __future__ import annotations

import pytest
import torch

from aiosync.errors import RefitMismatchError
from aiosync.layout import Layout, Part, even_chunks
from aiosync.transports.sharded import (
    Plan,
    box_numel,
    box_within,
    make_plan,
    replicated_layouts,
    single_rank_layouts,
)

F32 = torch.float32
BIG = 1 << 20  # a bucket limit no test tensor reaches


def fsdp(name: str, shape: tuple[int, ...], ranks: int) -> list[Layout]:
    """Each rank's FSDP2 ``Shard(0)`` chunk of one tensor (``torch.chunk`` cuts)."""
    return [{name: Part(shape, 0, s, n)} for s, n in even_chunks(shape[0], ranks)]


def tp(name: str, shape: tuple[int, ...], dim: int, ranks: int) -> list[Layout]:
    """Each worker's Megatron TP slice of one tensor along ``dim``."""
    return [{name: Part(shape, dim, s, n)} for s, n in even_chunks(shape[dim], ranks)]


def merge(*per_tensor: list[Layout]) -> list[Layout]:
    """Rank-wise union of several single-tensor layouts."""
    return [
        {k: v for lay in layouts for k, v in lay.items()}
        for layouts in zip(*per_tensor, strict=True)
    ]


def moves(plan: Plan) -> list[tuple[str, int, int, tuple[tuple[int, int], ...]]]:
    """``(name, src, dst, box)`` of every transfer, sorted."""
    return sorted((t.name, t.src, t.dst, t.box) for t in plan.transfers())


def test_fsdp2_to_tp2_column_parallel_sends_each_worker_its_rows_from_their_holders() -> None:
    shape = (8, 4)
    plan = make_plan(fsdp("q", shape, 2), tp("q", shape, 0, 2), {"q": F32}, BIG)
    assert moves(plan) == [
        ("q", 0, 0, ((0, 4), (0, 4))),
        ("q", 1, 1, ((4, 8), (0, 4))),
    ]
    assert plan.pair_nbytes == {(0, 0): 64, (1, 1): 64}


def test_fsdp3_to_tp2_column_parallel_cuts_where_the_chunks_and_slices_disagree() -> None:
    shape = (8, 4)  # FSDP chunks [0,3) [3,6) [6,8); TP slices [0,4) [4,8)
    plan = make_plan(fsdp("q", shape, 3), tp("q", shape, 0, 2), {"q": F32}, BIG)
    assert moves(plan) == [
        ("q", 0, 0, ((0, 3), (0, 4))),
        ("q", 1, 0, ((3, 4), (0, 4))),
        ("q", 1, 1, ((4, 6), (0, 4))),
        ("q", 2, 1, ((6, 8), (0, 4))),
    ]


def test_fsdp2_to_tp2_row_parallel_sends_every_worker_a_box_from_every_rank() -> None:
    shape = (8, 6)  # FSDP cuts dim 0, row-parallel TP dim 1: boxes cut along both
    plan = make_plan(fsdp("o", shape, 2), tp("o", shape, 1, 2), {"o": F32}, BIG)
    assert moves(plan) == [
        ("o", 0, 0, ((0, 4), (0, 3))),
        ("o", 0, 1, ((0, 4), (3, 6))),
        ("o", 1, 0, ((4, 8), (0, 3))),
        ("o", 1, 1, ((4, 8), (3, 6))),
    ]
    assert plan.receiver_nbytes == (96, 96)
    assert plan.sender_nbytes == (96, 96)


def test_uneven_fsdp_chunk_of_size_5_over_2_ranks() -> None:
    plan = make_plan(fsdp("b", (5, 2), 2), [{"b": Part.whole((5, 2))}], {"b": F32}, BIG)
    assert moves(plan) == [("b", 0, 0, ((0, 3), (0, 2))), ("b", 1, 0, ((3, 5), (0, 2)))]


def test_size_1_over_3_ranks_comes_from_the_only_rank_with_a_chunk() -> None:
    sources = fsdp("s", (1,), 3)
    assert [lay["s"].length for lay in sources] == [1, 0, 0]  # empty chunks are listed
    plan = make_plan(sources, [{"s": Part.whole((1,))}] * 2, {"s": F32}, BIG)
    assert moves(plan) == [("s", 0, 0, ((0, 1),)), ("s", 0, 1, ((0, 1),))]


def test_replicated_sources_are_spread_round_robin_over_the_senders() -> None:
    manifest = {f"w{i}": ((4, 4), F32) for i in range(4)}
    sources = replicated_layouts(manifest, 2)
    dests = replicated_layouts(manifest, 1)
    plan = make_plan(sources, dests, dict.fromkeys(manifest, F32), BIG)
    assert [(t.name, t.src) for t in sorted(plan.transfers(), key=lambda t: t.name)] == [
        ("w0", 0),
        ("w1", 1),
        ("w2", 0),
        ("w3", 1),
    ]
    assert plan.sender_nbytes == (128, 128)


def test_replicas_go_to_the_least_loaded_sender_after_its_own_shards() -> None:
    # Rank 0 alone holds the big sharded tensor's first half, so both small
    # replicated tensors go to rank 1, which then sends as many bytes as rank 0.
    big = (8, 4)
    sources = merge(
        [{"a": Part(big, 0, 0, 8)}, {}],
        replicated_layouts({"n1": ((2, 4), F32), "n2": ((2, 4), F32)}, 2),
    )
    dests = [{"a": Part.whole(big), "n1": Part.whole((2, 4)), "n2": Part.whole((2, 4))}]
    plan = make_plan(sources, dests, {"a": F32, "n1": F32, "n2": F32}, BIG)
    assert [(n, s) for n, s, _, _ in moves(plan)] == [("a", 0), ("n1", 1), ("n2", 1)]


def test_gqa_replicated_destination_parts_each_get_their_own_copy() -> None:
    # k_proj of 2 KV heads (head_dim 2) over TP=4: workers 0,1 hold head 0, workers 2,3 head 1.
    shape = (4, 6)
    dests = [{"k": Part(shape, 0, 2 * (w // 2), 2)} for w in range(4)]
    plan = make_plan(fsdp("k", shape, 2), dests, {"k": F32}, BIG)
    assert moves(plan) == [
        ("k", 0, 0, ((0, 2), (0, 6))),
        ("k", 0, 1, ((0, 2), (0, 6))),
        ("k", 1, 2, ((2, 4), (0, 6))),
        ("k", 1, 3, ((2, 4), (0, 6))),
    ]
    assert plan.receiver_nbytes == (48, 48, 48, 48)


def test_tp2_receiver_gets_half_of_sharded_and_all_of_replicated_bytes() -> None:
    manifest = {
        "q": ((8, 6), torch.bfloat16),  # column-parallel
        "o": ((6, 8), torch.bfloat16),  # row-parallel
        "norm": ((6,), F32),  # replicated on the workers
    }
    sources = merge(fsdp("q", (8, 6), 2), fsdp("o", (6, 8), 2), fsdp("norm", (6,), 2))
    dests = merge(
        tp("q", (8, 6), 0, 2),
        tp("o", (6, 8), 1, 2),
        replicated_layouts({"norm": manifest["norm"]}, 2),
    )
    plan = make_plan(sources, dests, {n: d for n, (_, d) in manifest.items()}, BIG)
    sharded = 8 * 6 * 2 + 6 * 8 * 2
    assert plan.receiver_nbytes == (sharded // 2 + 6 * 4, sharded // 2 + 6 * 4)
    assert plan.total_nbytes == sum(plan.receiver_nbytes) == sum(plan.sender_nbytes)


def test_each_destination_element_is_covered_exactly_once() -> None:
    # Overlapping sources (a whole replica and two shards) and an uneven row-parallel split.
    shape = (7, 5)
    sources = merge(
        [{"w": Part.whole(shape)}, {"w": Part(shape, 0, 0, 4)}, {"w": Part(shape, 0, 4, 3)}]
    )
    dests = tp("w", shape, 1, 3)
    plan = make_plan(sources, dests, {"w": F32}, BIG)
    for w, layout in enumerate(dests):
        count = torch.zeros(layout["w"].local_shape, dtype=torch.int64)
        for t in plan.transfers():
            if t.dst == w:
                count[box_within(t.box, layout["w"])] += 1
        assert torch.equal(count, torch.ones_like(count)), w


def test_buckets_respect_the_limit_and_split_a_larger_transfer_along_dim_0() -> None:
    shape = (16, 8)  # 512 bytes of float32; rows of 32 bytes
    plan = make_plan(
        single_rank_layouts({"e": (shape, F32)}, 1), [{"e": Part.whole(shape)}], {"e": F32}, 100
    )
    buckets = plan.buckets_between(0, 0)
    assert [t.box for b in buckets for t in b.transfers] == [
        ((r, min(r + 3, 16)), (0, 8)) for r in range(0, 16, 3)
    ]
    assert all(b.nbytes <= 100 for b in buckets)
    assert plan.pair_bytes(0, 0) == 512


def test_a_row_larger_than_the_bucket_is_split_along_the_next_dim() -> None:
    shape = (2, 8)  # rows of 32 bytes, limit 12: 3 elements per piece, row by row
    plan = make_plan([{"e": Part.whole(shape)}], [{"e": Part.whole(shape)}], {"e": F32}, 12)
    boxes = [t.box for t in plan.transfers()]
    assert boxes == [((r, r + 1), (c, min(c + 3, 8))) for r in range(2) for c in (0, 3, 6)]


def test_small_transfers_share_a_bucket_at_512_byte_aligned_offsets() -> None:
    manifest = {n: ((3,), torch.bfloat16) for n in ("a", "b", "c")}
    plan = make_plan(
        single_rank_layouts(manifest, 1),
        replicated_layouts(manifest, 1),
        dict.fromkeys(manifest, torch.bfloat16),
        1000,
    )
    ((first, second),) = [plan.buckets_between(0, 0)]
    assert [(t.name, t.offset) for t in first.transfers] == [("a", 0), ("b", 512)]
    assert [(t.name, t.offset) for t in second.transfers] == [("c", 0)]
    assert (first.nbytes, second.nbytes) == (518, 6)


def test_a_0d_tensor_is_one_element_box() -> None:
    plan = make_plan(
        replicated_layouts({"s": ((), F32)}, 2), [{"s": Part.whole(())}], {"s": F32}, BIG
    )
    (t,) = plan.transfers()
    assert (t.box, t.nbytes, box_numel(t.box)) == ((), 4, 1)


def test_missing_coverage_raises_naming_the_tensor_and_worker() -> None:
    sources = [{"w": Part((5, 2), 0, 0, 3)}, {}]  # rows [3, 5) held by nobody
    with pytest.raises(
        RefitMismatchError, match=r"w: region \(\(3, 5\), \(0, 2\)\) of inference worker 1"
    ):
        make_plan(sources, [{}, {"w": Part.whole((5, 2))}], {"w": F32}, BIG)


def test_a_tensor_no_source_holds_raises_naming_it() -> None:
    with pytest.raises(
        RefitMismatchError, match=r"lm_head\.weight: inference worker 0 .* no trainer rank"
    ):
        make_plan(
            [{"a": Part.whole((2,))}],
            [{"lm_head.weight": Part.whole((2,))}],
            {"lm_head.weight": F32},
            BIG,
        )


def test_shapes_that_disagree_raise_naming_both_sides() -> None:
    with pytest.raises(
        RefitMismatchError,
        match=r"w: trainer rank 0 holds it as shape \(4, 2\), inference worker 0 as \(4, 3\)",
    ):
        make_plan([{"w": Part.whole((4, 2))}], [{"w": Part.whole((4, 3))}], {"w": F32}, BIG)


def test_a_tensor_without_a_dtype_raises() -> None:
    with pytest.raises(RefitMismatchError, match=r"w: .* no dtype"):
        make_plan([{"w": Part.whole((4,))}], [{"w": Part.whole((4,))}], {}, BIG)


def test_digest_is_identical_for_dicts_built_in_different_orders() -> None:
    names = [f"layer.{i}.w" for i in range(5)]
    shape = (6, 4)

    def layouts(order: list[str]) -> tuple[list[Layout], list[Layout], dict[str, torch.dtype]]:
        sources = [{n: Part(shape, 0, s, k) for n in order} for s, k in even_chunks(6, 2)]
        dests = [{n: Part(shape, 1, s, k) for n in order} for s, k in even_chunks(4, 2)]
        return sources, dests, {n: torch.bfloat16 for n in order}

    one = make_plan(*layouts(names), 200)
    two = make_plan(*layouts(names[::-1]), 200)
    assert one.digest == two.digest
    assert moves(one) == moves(two)
    assert make_plan(*layouts(names), 300).digest != one.digest


def test_box_within_indexes_the_holders_local_tensor() -> None:
    part = Part((8, 6), 1, 3, 3)
    full = torch.arange(48).view(8, 6)
    local = full[:, 3:6]
    box = ((2, 5), (4, 6))
    assert torch.equal(local[box_within(box, part)], full[2:5, 4:6])
    with pytest.raises(ValueError, match="not inside"):
        box_within(((0, 1), (0, 6)), part)


def test_expert_parallel_workers_receive_only_the_experts_they_own() -> None:
    # 4 experts over 2 expert-parallel workers (experts 0-1 on worker 0, 2-3 on worker 1),
    # each held whole; the router replicated. A name absent from a layout is not held.
    shape = (6, 4)
    experts = [f"mlp.experts.{e}.down_proj.weight" for e in range(4)]
    sources = merge(*(fsdp(n, shape, 2) for n in experts), fsdp("mlp.gate.weight", (4, 4), 2))
    destinations = [
        {**{n: Part.whole(shape) for n in experts[2 * w : 2 * w + 2]}, "mlp.gate.weight": p}
        for w, p in enumerate([Part.whole((4, 4))] * 2)
    ]
    dtypes = dict.fromkeys([*experts, "mlp.gate.weight"], F32)
    plan = make_plan(sources, destinations, dtypes, BIG)
    owners = {n: {t.dst for t in plan.transfers() if t.name == n} for n in experts}
    assert owners == {experts[0]: {0}, experts[1]: {0}, experts[2]: {1}, experts[3]: {1}}
    # Each worker: its two experts and the router, from both ranks (3 rows each of 6).
    assert list(plan.receiver_nbytes) == [(2 * 24 + 16) * 4] * 2
    assert all(n > 0 for n in plan.sender_nbytes)
