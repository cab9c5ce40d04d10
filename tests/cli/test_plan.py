"""``aiosync plan``: the bytes each path puts on the busiest links, from the plan the
shard-aware transport runs, and the time they take on the given NICs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest
import torch

from aiosync._config import DEFAULT_BUCKET_BYTES
from aiosync._model_shapes import model_manifest
from aiosync.transports.sharded import make_plan
from aiosync.transports.sharded.estimate import (
    Links,
    ep_layouts,
    estimate_refit,
    fsdp_layouts,
    tp_dim,
    tp_layouts,
)

MANIFEST = {
    name: (shape, torch.bfloat16)
    for name, (shape, _) in model_manifest("qwen3-tiny", layers=2).items()
}
MODEL_BYTES = sum(2 * math.prod(shape) for shape, _ in MANIFEST.values())
#: Bytes a TP=2 worker holds: half of every cut tensor, all of every norm.
WORKER_BYTES = sum(
    2 * math.prod(shape) // (1 if tp_dim(name) is None else 2)
    for name, (shape, _) in MANIFEST.items()
)


def test_each_path_loads_the_links_it_should() -> None:
    rows = {
        r.path: r
        for r in estimate_refit(
            MANIFEST, trainer_ranks=2, tp=2, engines=3, links=Links(8.0, 0.0), changed=1.0
        )
    }
    assert list(rows) == ["broadcast", "sharded", "delta", "fp8"]
    # The broadcast moves the whole model over every link: 8 Gbit/s is 1e9 bytes/s.
    assert (rows["broadcast"].upload_bytes, rows["broadcast"].download_bytes) == (
        MODEL_BYTES,
        MODEL_BYTES,
    )
    assert rows["broadcast"].predicted_s == MODEL_BYTES / 1e9
    # The shard-aware path: each worker downloads its slices; each rank uploads its
    # plan bytes once per replica, as the transport's own plan says.
    plan = make_plan(
        fsdp_layouts(MANIFEST, 2),
        tp_layouts(MANIFEST, 2),
        {n: d for n, (_, d) in MANIFEST.items()},
        DEFAULT_BUCKET_BYTES,
    )
    sharded = rows["sharded"]
    assert sharded.download_bytes == WORKER_BYTES == max(plan.receiver_nbytes)
    assert sharded.upload_bytes == 3 * max(plan.sender_nbytes)
    assert sharded.bottleneck == "trainer uplink"  # 3 replicas: uploads outweigh
    assert sharded.lower_bound_s == max(WORKER_BYTES, 3 * plan.total_nbytes / 2) / 1e9
    # Every element changed: the delta is the dense tensors again.
    assert rows["delta"].upload_bytes == sharded.upload_bytes


def test_fp8_halves_the_projections_and_a_delta_costs_its_cheapest_encoding() -> None:
    rows = {
        r.path: r
        for r in estimate_refit(
            MANIFEST, trainer_ranks=1, tp=1, engines=1, links=Links(8.0, 0.0), changed=0.0
        )
    }
    assert rows["delta"].download_bytes == 0  # nothing changed, nothing sent
    proj = sum(
        math.prod(s) for n, (s, _) in MANIFEST.items() if n.endswith("proj.weight") and len(s) == 2
    )
    blocks = sum(
        math.ceil(s[0] / 128) * math.ceil(s[1] / 128)
        for n, (s, _) in MANIFEST.items()
        if n.endswith("proj.weight") and len(s) == 2
    )
    assert rows["fp8"].download_bytes == MODEL_BYTES - proj + 4 * blocks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"tp": 0}, "must be >= 1"), ({"changed": 1.5}, r"changed must be in \[0, 1\]")],
)
def test_bad_arguments_are_refused(kwargs: dict[str, float], match: str) -> None:
    args = {"trainer_ranks": 2, "tp": 2, "engines": 1, "links": Links(8.0), **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_refit(MANIFEST, **args)  # type: ignore[arg-type]


def test_the_command_prints_one_json_object() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aiosync.cli", "plan", "--model", "qwen3-tiny", "--layers", "2",
         "--trainer-ranks", "2", "--tp", "2", "--engines", "3", "--nic-gbps", "8",
         "--latency-us", "0", "--changed", "1", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout.splitlines()[-1])
    assert [r["path"] for r in report["rows"]] == ["broadcast", "sharded", "delta", "fp8"]
    assert report["rows"][1]["download_bytes"] == WORKER_BYTES


# One decoder layer of Qwen3-30B-A3B (bf16): H=2048, V=151936, 32 query and 4 key/value
# heads of D=128, E=128 experts of Im=768. A worker of TP4 x EP4 holds a quarter of the
# embedding and lm_head rows, of q/k/v/o, the norms and the router whole, and 32 whole
# experts (gate, up, down: 3 * 768*2048 each).
QWEN3_30B_EP4_WORKER_BYTES = 2 * (
    2 * (151936 // 4) * 2048  # embed_tokens, lm_head
    + 2048  # model.norm
    + (4096 // 4) * 2048 + 2 * (512 // 4) * 2048 + 2048 * (4096 // 4)  # q, k, v, o
    + 2 * 128 + 2 * 2048  # q/k norms, layer norms
    + 128 * 2048  # the router
    + 32 * 3 * 768 * 2048  # the worker's experts
)  # fmt: skip


def test_expert_parallel_workers_download_their_experts_whole() -> None:
    manifest = {
        name: (shape, torch.bfloat16)
        for name, (shape, _) in model_manifest("qwen3-30b-a3b", layers=1).items()
    }
    dtypes = {n: d for n, (_, d) in manifest.items()}
    workers = ep_layouts(manifest, tp=4, ep=4)
    plan = make_plan(fsdp_layouts(manifest, 8), workers, dtypes, DEFAULT_BUCKET_BYTES)
    assert list(plan.receiver_nbytes) == [QWEN3_30B_EP4_WORKER_BYTES] * 4
    # Worker 1 holds experts 32..63 whole, and no other expert.
    experts = sorted({int(n.split(".")[5]) for n in workers[1] if ".experts." in n})
    assert experts == list(range(32, 64))
    assert workers[1]["model.layers.0.mlp.experts.40.down_proj.weight"].is_whole
    rows = {
        r.path: r
        for r in estimate_refit(
            manifest, trainer_ranks=8, tp=4, ep=4, engines=1, links=Links(8.0, 0.0)
        )
    }
    assert rows["sharded"].download_bytes == QWEN3_30B_EP4_WORKER_BYTES
    assert rows["sharded"].bottleneck == "worker downlink"  # 8 senders, 4 receivers
    # DP4 attention beside EP4 (tp=1): each worker holds the attention whole.
    dp = {r.path: r for r in estimate_refit(
        manifest, trainer_ranks=8, tp=1, ep=4, engines=1, links=Links(8.0, 0.0)
    )}  # fmt: skip
    whole_dense = 2 * (2 * 151936 * 2048 + 2048 + 2 * 4096 * 2048 + 2 * 512 * 2048)
    quarter_dense = 2 * (2 * 151936 // 4 * 2048 + 2048 + 2 * 1024 * 2048 + 2 * 128 * 2048)
    assert dp["sharded"].download_bytes == (
        QWEN3_30B_EP4_WORKER_BYTES + whole_dense - quarter_dense
    )


def test_experts_that_do_not_split_over_ep_are_refused() -> None:
    manifest = {
        name: (shape, torch.bfloat16)
        for name, (shape, _) in model_manifest("qwen3-30b-a3b", layers=1).items()
    }
    with pytest.raises(ValueError, match="128 experts do not split over EP=3"):
        ep_layouts(manifest, tp=1, ep=3)
    with pytest.raises(ValueError, match="tp=4 and ep=6: one must divide the other"):
        ep_layouts(manifest, tp=4, ep=6)


def test_the_command_takes_an_expert_parallel_size() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aiosync.cli", "plan", "--model", "qwen3-30b-a3b", "--layers",
         "1", "--trainer-ranks", "8", "--tp", "4", "--ep", "4", "--nic-gbps", "8",
         "--latency-us", "0", "--efficiency", "0.5", "--overhead-ms", "250", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    sharded = json.loads(out.stdout.splitlines()[-1])["rows"][1]
    assert sharded["download_bytes"] == QWEN3_30B_EP4_WORKER_BYTES
    # 8 workers' download bound, half of 1e9 bytes/s carrying payload, plus the fixed cost.
    assert sharded["bottleneck"] == "worker downlink"
    assert sharded["predicted_s"] == QWEN3_30B_EP4_WORKER_BYTES / 0.5e9 + 0.25


def test_links_outside_their_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match=r"0 < efficiency <= 1, got 8\.0, 10\.0, 1\.5"):
        Links(8.0, efficiency=1.5)


def test_a_delta_costs_what_the_transport_encodes_plus_its_diff() -> None:
    """A quarter of the elements changed: each transfer as int32 indices and bf16 values
    (0.25 * 6 bytes per element, below the box's 2 dense bytes), as the sharded wire
    carries it; the sync's fixed cost and the diff of the busiest rank's shard added."""
    kwargs: dict[str, Any] = {"trainer_ranks": 2, "tp": 2, "engines": 1, "changed": 0.25}
    plain = {r.path: r for r in estimate_refit(MANIFEST, links=Links(8.0, 0.0), **kwargs)}
    assert plain["delta"].download_bytes == 3 * WORKER_BYTES // 4
    assert plain["delta"].predicted_s == 3 * WORKER_BYTES / 4 / 1e9
    shard = max(
        sum(part.numel * 2 for part in layout.values()) for layout in fsdp_layouts(MANIFEST, 2)
    )
    slow = {
        r.path: r
        for r in estimate_refit(
            MANIFEST,
            links=Links(8.0, 0.0, efficiency=0.5),
            sync_overhead_s=0.5,
            diff_bytes_per_s=1e9,
            **kwargs,
        )
    }
    # Half the link carries payload: twice the time; the lower bound has no fixed costs.
    assert slow["delta"].predicted_s == 3 * WORKER_BYTES / 4 / 0.5e9 + 0.5 + shard / 1e9
    assert (
        slow["sharded"].predicted_s
        == max(slow["sharded"].upload_bytes, slow["sharded"].download_bytes) / 0.5e9 + 0.5
    )
    assert slow["sharded"].lower_bound_s == plain["sharded"].lower_bound_s * 2
