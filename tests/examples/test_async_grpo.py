"""The main job, at reduced size: async GRPO refitting a real engine process through aiosync."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "async_grpo.py"

pytestmark = pytest.mark.slow


def load_example() -> Any:
    """The example as a module (not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("async_grpo_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses look their module up
    spec.loader.exec_module(example)
    return example


def run_example(tmp_path: Path, *args: str) -> dict[str, Any]:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--quiet", "--json-report", str(report), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def assert_run_invariants(report: dict[str, Any]) -> None:
    committed = [int(r["version"]) for r in report["refits"]]
    # Every refit committed a strictly increasing version, the last one the final policy.
    assert committed, "no refit happened"
    assert all(a < b for a, b in itertools.pairwise(committed))
    assert committed[-1] == report["final_policy_version"] == report["final_weight_version"]
    assert report["refit_failures"] == 0
    # Engine weights equal the trainer's bit for bit at start and after every refit.
    assert report["verified"] == [[0, True]] + [[v, True] for v in committed]
    # Every used sample: target version <= policy version at use, never too stale.
    assert len(report["samples"]) == report["steps"] * 4
    for target, policy, staleness in report["samples"]:
        assert target <= policy
        assert staleness == policy - target
        assert staleness <= report["max_staleness"]
    used = {int(k): v for k, v in report["staleness_histogram"].items()}
    assert sum(used.values()) == len(report["samples"])
    # Each used group's [oldest, newest] producing version; stamped with the oldest.
    assert len(report["sample_versions"]) == len(report["samples"])
    for (oldest, newest), (target, _, _) in zip(
        report["sample_versions"], report["samples"], strict=True
    ):
        assert oldest == target <= newest <= report["final_weight_version"]
    spanning = sum(oldest != newest for oldest, newest in report["sample_versions"])
    assert report["spanning_samples"] == spanning


def test_async_grpo_colocated_ipc_keeps_engine_equal_to_trainer(tmp_path: Path) -> None:
    report = run_example(tmp_path, "--colocated", "--steps", "4")
    assert report["synchronizer"] == "IPCWeightSynchronizer"
    # Refits only between rollout batches: no sample spans two versions.
    assert (report["in_flight"], report["spanning_samples"]) == (None, 0)
    assert report["final_policy_version"] == 4 * 2  # two optimizer steps per batch
    assert_run_invariants(report)


def test_async_grpo_in_flight_keep_counts_the_samples_that_spanned_two_versions(
    tmp_path: Path,
) -> None:
    # A refitter syncs with in_flight="keep" as soon as the trainer steps, while
    # rollouts run: requests it catches finish on the new weights.
    report = run_example(tmp_path, "--colocated", "--steps", "4", "--in-flight", "keep")
    assert report["in_flight"] == "keep"
    assert report["aborted_rollouts"] == 0  # keep never aborts
    assert_run_invariants(report)
    assert "spanning_samples" in report and report["spanning_samples"] == sum(
        oldest != newest for oldest, newest in report["sample_versions"]
    )


def test_async_grpo_not_colocated_collective_with_tight_staleness(tmp_path: Path) -> None:
    report = run_example(tmp_path, "--no-colocated", "--steps", "3", "--max-staleness", "1")
    assert report["synchronizer"] == "CollectiveWeightSynchronizer"
    assert report["max_staleness"] == 1
    assert_run_invariants(report)


def test_async_grpo_sglang_http_test_server(tmp_path: Path) -> None:
    report = run_example(tmp_path, "--backend", "sglang", "--steps", "2")
    assert report["synchronizer"] == "HTTPWeightSynchronizer"
    assert_run_invariants(report)


def test_metrics_port_serves_refit_and_staleness_metrics() -> None:
    import socket

    import httpx

    example = load_example()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = example._Metrics(port)
    metrics.refit(1000, 0.5)
    metrics.refit(24, 0.25)
    metrics.failure()
    for steps in (0, 2, 2):
        metrics.staleness(steps)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("aiosync_"))
    assert float(values["aiosync_refit_bytes_total"]) == 1024
    assert float(values["aiosync_refit_seconds_sum"]) == 0.75
    assert float(values["aiosync_refit_failures_total"]) == 1
    assert float(values['aiosync_sample_staleness_bucket{le="1.0"}']) == 1
    assert float(values["aiosync_sample_staleness_count"]) == 3


# -- LoRA (PEFT) -------------------------------------------------------------------

LORA_RANK = 4
FP32_BYTES = 4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def quick_config(*args: str) -> dict[str, Any]:
    """The Qwen3 config (HF ``config.json`` fields) a ``--quick`` run trains and serves."""
    example = load_example()
    config: dict[str, Any] = example.policy_config(example.parse_args(["--quick", *args]))
    return config


def linear_features(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each linear layer of one Qwen3 decoder layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_numel(config: dict[str, Any], rank: int) -> int:
    """Elements of a rank-``rank`` LoRA adapter on every linear layer: per layer and
    module ``lora_A`` ``[rank, in]`` plus ``lora_B`` ``[out, rank]``."""
    per_layer = sum(rank * (i + o) for i, o in linear_features(config).values())
    return int(config["num_hidden_layers"]) * per_layer


def checkpoint_numel(config: dict[str, Any]) -> int:
    """Elements of the whole checkpoint: embeddings, untied head, final norm, and per
    layer the linear weights, ``q_norm``/``k_norm`` ``[head_dim]`` and two RMSNorms."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert config["tie_word_embeddings"] is False
    linears = sum(i * o for i, o in linear_features(config).values())
    per_layer = linears + 2 * config["head_dim"] + 2 * hidden
    return 2 * vocab * hidden + hidden + int(config["num_hidden_layers"]) * per_layer


def assert_lora_run(report: dict[str, Any], refit: str, steps: int) -> None:
    """What every LoRA run reports: settings, versions, stamped samples, rewards."""
    assert (report["lora_rank"], report["lora_alpha"]) == (LORA_RANK, 2 * LORA_RANK)
    assert report["lora_target_modules"] == LORA_TARGETS
    assert report["lora_refit"] == refit
    # Only the adapter trains.
    assert report["trainable_params"] == adapter_numel(quick_config(), LORA_RANK)
    # Two optimizer steps per batch; every refit committed, the last the final policy.
    assert report["steps"] == steps
    assert report["final_policy_version"] == report["final_weight_version"] == 2 * steps
    assert_run_invariants(report)
    # Every sample is stamped with a version the engine really served.
    committed = {0} | {int(r["version"]) for r in report["refits"]}
    assert {target for target, _, _ in report["samples"]} <= committed
    assert len(report["rewards"]) == steps
    assert all(0.0 <= r <= 1.0 for r in report["rewards"])
    assert 0.0 <= report["end_reward"] <= 1.0


def test_async_grpo_lora_adapter_only_refits_move_the_adapter_alone(tmp_path: Path) -> None:
    report = run_example(tmp_path, "--steps", "4", "--lora-rank", str(LORA_RANK))
    assert report["synchronizer"] == "LoRAAdapterSynchronizer"
    assert_lora_run(report, "adapter", steps=4)
    # 2 layers x r=4 x (128 + 96 + 96 + 128 + 192 + 192 + 192) = 8,192 fp32 elements.
    expected = adapter_numel(quick_config(), LORA_RANK) * FP32_BYTES
    assert expected == 32_768
    assert [r["nbytes"] for r in report["refits"]] == [expected] * len(report["refits"])
    # verified: the engine's base weights equal the trainer's frozen ones and every
    # worker applies aiosync-v{version} (assert_run_invariants checks every entry).


def test_async_grpo_lora_merged_refits_move_the_merged_checkpoint(tmp_path: Path) -> None:
    report = run_example(
        tmp_path, "--steps", "4", "--lora-rank", str(LORA_RANK), "--lora-refit", "merged"
    )
    assert report["synchronizer"] == "IPCWeightSynchronizer"
    assert_lora_run(report, "merged", steps=4)
    expected = checkpoint_numel(quick_config()) * FP32_BYTES
    assert expected == 304_640
    assert [r["nbytes"] for r in report["refits"]] == [expected] * len(report["refits"])
    # verified: every worker holds W + scale * B @ A of the trainer's adapter, bit for bit.


def test_async_grpo_lora_adapter_refits_refuse_the_sglang_test_server() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--backend", "sglang", "--lora-rank", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--lora-refit adapter: the SGLang test server this example launches runs without " in (
        proc.stderr
    )
    assert "use --lora-refit merged with --backend sglang" in proc.stderr
