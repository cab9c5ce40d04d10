"""``aiosync plan``: the bytes each path puts on the busiest links, from the plan the
shard-aware transport runs, and the time they take on the given NICs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from aiosync._config import DEFAULT_BUCKET_BYTES
from aiosync._model_shapes import model_manifest
from aiosync.transports.sharded import make_plan
from aiosync.transports.sharded.estimate import (
    Links,
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
