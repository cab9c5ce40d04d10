"""The main job, at reduced size: async GRPO refitting a real engine process through aiosync."""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.modules import load_module

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "async_grpo.py"

pytestmark = pytest.mark.slow

#: The engine computes each token's log-prob as the trainer does (``log_softmax`` of
#: float32 logits of the same weights), one token at a time against a KV cache where
#: the trainer runs the whole sequence at once: equal up to float32 rounding.
ONPOLICY_LOGPROB_ATOL = 1e-5
#: The same for a bf16 run: a few bf16 ulps (2**-7 relative) of the log-probs.
BF16_ONPOLICY_LOGPROB_ATOL = 2e-2


def load_example() -> Any:
    """The example as a module (not run)."""
    return load_module(EXAMPLE, "async_grpo_example")


def run_example(tmp_path: Path, *args: str) -> dict[str, Any]:
    report, _ = run_example_logged(tmp_path, "--quiet", *args)
    return report


def run_example_logged(tmp_path: Path, *args: str) -> tuple[dict[str, Any], list[str]]:
    """The run's report and its console lines (stderr)."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--json-report", str(report), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data: dict[str, Any] = json.loads(report.read_text())
    return data, proc.stderr.splitlines()


def assert_run_invariants(
    report: dict[str, Any], onpolicy_atol: float | None = ONPOLICY_LOGPROB_ATOL
) -> None:
    """What every run reports; ``onpolicy_atol``: the most the engine's on-policy
    log-probs may differ from the trainer's (None: not checked)."""
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
    # The first batch is generated before any step: there are on-policy tokens, and
    # on them the engine's behaviour log-probs are the trainer's (importance weight 1).
    assert report["onpolicy_tokens"] > 0
    if onpolicy_atol is not None:
        assert report["onpolicy_logprob_diff_max"] < onpolicy_atol
    assert report["is_cap"] == 2.0
    assert 0.0 <= report["clip_frac"] <= 1.0
    assert 0.0 <= report["is_truncated_frac"] <= 1.0


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


def test_async_grpo_log_off_a_terminal_is_one_whole_line_per_step(tmp_path: Path) -> None:
    # stderr is a pipe here, as in a CI log or `2> run.log`: no progress bar, a line
    # per step, and no line wrapped at any width.
    report, lines = run_example_logged(tmp_path, "--colocated", "--steps", "2")
    steps = [line for line in lines if line.startswith("step ")]
    assert [re.split(" {2,}", line)[:4] for line in steps] == [
        ["step", f"{n}/2", f"reward {r:.3f}", f"policy v{2 * n} (2 optimizer steps/batch)"]
        for n, r in enumerate(report["rewards"], start=1)
    ]
    assert all(re.search(r"  clip \d\.\d\d$", line) for line in steps), steps
    (summary,) = [line for line in lines if line.startswith("off-policy correction")]
    assert summary.endswith(f"IS-truncated {report['is_truncated_frac']:.3f}"), summary


@pytest.mark.parametrize(
    ("placement", "synchronizer"),
    [("--colocated", "IPCWeightSynchronizer"), ("--no-colocated", "CollectiveWeightSynchronizer")],
)
def test_async_grpo_delta_refits_move_only_the_changed_bits_and_print_their_bytes(
    tmp_path: Path, placement: str, synchronizer: str
) -> None:
    # bf16 at an RL learning rate: most steps move a weight by less than half a bf16 ulp.
    report, lines = run_example_logged(
        tmp_path, "--steps", "3", "--delta", "--dtype", "bfloat16", "--lr", "1e-5", placement
    )
    assert report["synchronizer"] == synchronizer
    colocated = placement == "--colocated"
    assert (report["colocated"], report["delta"], report["dtype"]) == (colocated, True, "bfloat16")
    full = checkpoint_numel(quick_config()) * BF16_BYTES
    assert report["full_nbytes"] == full == 152_320
    # The first refit has no baseline on the workers: full; every later one a delta.
    first, *rest = report["refits"]
    assert (first["delta"], first["nbytes"]) == (0, full)
    assert rest and all(r["delta"] == 1 and r["nbytes"] < full / 2 for r in rest)
    assert sum(r["nbytes"] for r in rest) > 0
    # Each refit's bytes are printed next to the full size.
    for r in report["refits"]:
        kind = "delta" if r["delta"] else "full"
        share = r["nbytes"] / full
        want = f"refit v{r['version']}: {kind} {r['nbytes']:,} B of {full:,} B full ({share:.2%})"
        assert want in lines
    # Patches land bit-exact: the engine equals the trainer after every refit. The
    # on-policy log-probs agree to bf16 precision only: the engine's cached decode and
    # the trainer's full forward take other bf16 kernels, which differ by CPU (no
    # AVX-512 BF16 on some: 1.6e-3 seen on an AMD EPYC).
    assert_run_invariants(report, onpolicy_atol=BF16_ONPOLICY_LOGPROB_ATOL)


def test_async_grpo_fp8_refits_serve_the_trainers_block_fp8_checkpoint(tmp_path: Path) -> None:
    wide = ("--hidden-size", "128")
    report = run_example(tmp_path, "--steps", "2", "--fp8", "--dtype", "bfloat16", *wide)
    assert report["synchronizer"] == "IPCWeightSynchronizer"
    assert report["fp8"] is True
    # A linear weight of whole 128 x 128 blocks: one float8 byte per element and one
    # float32 scale per block; k_proj/v_proj [64, 128] are not whole blocks and stay
    # bf16, as transformers' FP8 quantizer leaves them (C45); the rest bf16.
    config = quick_config(*wide)
    tiled = {m: (i, o) for m, (i, o) in linear_features(config).items() if not (i % 128 or o % 128)}
    assert set(tiled) == {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    fp8 = sum(i * o + (i // 128) * (o // 128) * FP32_BYTES for i, o in tiled.values())
    layers = int(config["num_hidden_layers"])
    rest = checkpoint_numel(config) - layers * sum(i * o for i, o in tiled.values())
    full = layers * fp8 + rest * BF16_BYTES
    assert report["full_nbytes"] == full == 337_472
    assert [r["nbytes"] for r in report["refits"]] == [full] * len(report["refits"])
    # verified: every worker holds the FP8 checkpoint of the trainer's weights, bit for bit.
    # The engine generates with the dequantized weights, so even on-policy tokens'
    # log-probs differ from the trainer's: the gap the off-policy correction absorbs.
    assert_run_invariants(report, onpolicy_atol=None)
    assert report["onpolicy_logprob_diff_max"] > ONPOLICY_LOGPROB_ATOL


def test_async_grpo_sglang_http_test_server(tmp_path: Path) -> None:
    report = run_example(tmp_path, "--backend", "sglang", "--steps", "2")
    assert report["synchronizer"] == "HTTPWeightSynchronizer"
    assert_run_invariants(report)


# -- LoRA (PEFT) -------------------------------------------------------------------

LORA_RANK = 4
FP32_BYTES = 4
BF16_BYTES = 2
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


# -- off-policy correction ---------------------------------------------------------


def test_decoupled_ppo_loss_weights_each_token_by_its_truncated_importance_ratio() -> None:
    example = load_example()
    # Two tokens of one completion, advantage 1. Token 0: the engine sampled it as
    # the trainer would (p = 0.5 both), and the policy moved to ratio 1.5 (clipped
    # to 1.2). Token 1: the engine found it 4x less likely than the trainer's
    # proximal policy (0.05 vs 0.2): weight 4, truncated at 2.
    proximal = torch.log(torch.tensor([[0.5, 0.2]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.05]]))
    logp = proximal + torch.log(torch.tensor([[1.5, 1.0]]))
    logp.requires_grad_(True)
    adv = torch.tensor([1.0])

    loss, stats = example.decoupled_ppo_loss(
        logp, proximal, behaviour, adv, clip_eps=0.2, is_cap=2.0
    )
    assert loss.item() == pytest.approx(-(1 * 1.2 + 2 * 1.0) / 2)
    assert stats == pytest.approx(
        {"clip_frac": 0.5, "is_truncated_frac": 0.5, "is_weight_mean": 1.5}
    )
    loss.backward()
    assert logp.grad is not None
    # The clipped token gets no gradient; the other one weight * ratio / L = 2 * 1 / 2.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.0]]))

    # Without truncation the weight is the full ratio, 4.
    loss, stats = example.decoupled_ppo_loss(
        logp, proximal, behaviour, adv, clip_eps=0.2, is_cap=float("inf")
    )
    assert loss.item() == pytest.approx(-(1 * 1.2 + 4 * 1.0) / 2)
    assert stats["is_truncated_frac"] == 0.0


async def test_behaviour_logprobs_are_the_trainers_at_the_version_that_generated_them() -> None:
    """Embedded engine, in-flight "wait": a completion the engine labels with
    version v carries the trainer's log-probs at v (importance weight 1 when
    trained at v); the same completion trained at v + 1 gets the weight
    exp(logp_{v+1} - logp_v), exactly as the trainer's two versions give it."""
    import copy

    import anyio

    from aiosync import create_weight_synchronizer
    from aiosync.engines.embedded.engine import EmbeddedEngine
    from aiosync.refit import DTensorRefitSource

    example = load_example()
    args = example.parse_args(["--quick"])
    config = example.policy_config(args)
    model = example.build_policy(config, args.seed)
    trainer = example.GRPOTrainer(model, lr=1e-2, clip_eps=0.2, kl_coef=0.0)
    snapshots = {0: copy.deepcopy(model).eval()}  # the trainer's weights per version
    prompts = example.make_prompts(random.Random(0), 4, args.digits)
    plen = len(prompts[0])

    def trainer_logprobs(version: int, gens: list[Any]) -> torch.Tensor:
        """The trainer's log-probs ``[len(prompts), L]`` at ``version`` of the
        completions ``gens`` of ``prompts``."""
        seqs = torch.tensor([p + g.token_ids for p, g in zip(prompts, gens, strict=True)])
        with torch.no_grad():
            return trainer._logprobs(snapshots[version], seqs, plen)

    def behaviour(gens: list[Any]) -> torch.Tensor:
        return torch.tensor([example.behaviour_logprobs(g) for g in gens])

    async with EmbeddedEngine(
        config, num_workers=1, seed=args.seed, threads_per_worker=1
    ) as engine:
        sync = create_weight_synchronizer(
            DTensorRefitSource(model, optimizer=trainer.optimizer),
            engine,
            colocated=True,
            backend="embedded",
        )
        async with sync:  # initializes the communicator
            await engine.prepare_for_generation()

            async def generate(max_new_tokens: int, seed: int) -> list[Any]:
                gens: list[Any] = await engine.generate_with_meta(
                    prompts,
                    max_new_tokens=max_new_tokens,
                    temperature=1.0,
                    seed=seed,
                    ignore_eos=True,
                    logprobs=True,
                )
                return gens

            at_v0 = await generate(args.digits, seed=1)
            # One optimizer step on those completions (fixed non-zero advantages, so
            # that the step surely moves the policy) makes version 1.
            seqs = torch.tensor([p + g.token_ids for p, g in zip(prompts, at_v0, strict=True)])
            proximal, _ = trainer.old_logprobs(seqs, plen)
            adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
            trainer.backward(seqs, adv, plen, proximal, behaviour(at_v0), None)
            async with sync.policy_update():
                trainer.step()
            snapshots[1] = copy.deepcopy(model).eval()

            # A long request in flight while version 1 is synced with "wait": it
            # finishes on the weights it started with, and says which.
            results: dict[str, list[Any]] = {}

            async def in_flight() -> None:
                results["in_flight"] = await generate(40, seed=2)

            async with anyio.create_task_group() as tg:
                tg.start_soon(in_flight)
                await anyio.sleep(0.05)
                await sync.sync_weights(in_flight="wait")
            assert sync.weight_version == 1
            at_v1 = await generate(args.digits, seed=3)

    # Engine labels: None is the initial weights, version 0. "wait" never mixes two
    # versions in one completion (requests admitted during the sync ran on version 1).
    def version(g: Any) -> int:
        assert not g.spans_versions
        return int(g.first_version or 0)

    assert [version(g) for g in at_v0] == [0] * len(prompts)
    assert [version(g) for g in at_v1] == [1] * len(prompts)
    for name, gens in {"at_v0": at_v0, "in_flight": results["in_flight"], "at_v1": at_v1}.items():
        # On-policy: the behaviour log-probs are the trainer's at the labelled version.
        at_label = torch.stack([trainer_logprobs(version(g), gens)[i] for i, g in enumerate(gens)])
        gap = (at_label - behaviour(gens)).abs().max().item()
        assert gap < ONPOLICY_LOGPROB_ATOL, (name, [version(g) for g in gens], gap)

    # Off-policy: the v0 completions trained at v1. The trainer's first pass at v1
    # is the proximal policy; the importance weight is exactly the ratio of the
    # trainer's two versions, and the step moved it away from 1.
    proximal_v1 = trainer_logprobs(1, at_v0)
    weight = torch.exp(proximal_v1 - behaviour(at_v0))
    expected = torch.exp(proximal_v1 - trainer_logprobs(0, at_v0))
    torch.testing.assert_close(weight, expected, rtol=1e-4, atol=1e-5)
    assert (weight - 1).abs().max().item() > 1e-3
    # The loss applies that weight (untruncated, first epoch: ratio 1, no clip).
    _, stats = example.decoupled_ppo_loss(
        proximal_v1, proximal_v1, behaviour(at_v0), adv, clip_eps=0.2, is_cap=float("inf")
    )
    assert stats["is_weight_mean"] == pytest.approx(expected.mean().item(), rel=1e-4)
    assert stats["clip_frac"] == 0.0
