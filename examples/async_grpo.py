"""Async GRPO on CPU: a Qwen3-architecture policy learns a verifiable task while aiosync refits.

The trainer (this process, torch) optimizes a small Qwen3 causal LM, built with
transformers from a config (no download), with GRPO: group-relative advantages,
a clipped policy-gradient loss made off-policy-correct with the engine's
behaviour log-probs (decoupled PPO, below) and an optional KL penalty to the
initial policy. The generation engine runs in its own process(es) — the embedded
transformers engine by default — and gets every new version through the
synchronizer that ``aiosync.create_weight_synchronizer`` picks for
``--colocated/--no-colocated`` and ``--backend``. The loop never asks which.

The task: the prompt is ``[BOS, d1, ..., dn, SEP]`` with random digits
(token ids 0-9); the completion should copy the digits. The reward, computed
by code, is the fraction of positions copied right (random policy: ~0.06).

Async: rollouts for batch k+1 are generated while batch k trains (an anyio task
group). The loop speaks only the handshake: each optimizer step inside
``sync.policy_update()``, ``refit_if_stale()`` before generating. A
``VersionedReplayBuffer`` stamps every group with the weight version it was
generated under and never hands out one staler than ``--max-staleness``.

In-flight requests (``--in-flight {abort,wait,keep}``): a refitter task syncs
as soon as the trainer stepped, with that policy (``sync_weights(in_flight=...)``),
while rollouts are being generated: ``wait`` lets running requests finish on the
old weights, ``abort`` ends them (groups with an aborted completion are dropped
and counted), ``keep`` lets the new weights finish them. Rollouts come from
``generate_with_meta``, whose results say which weight versions computed their
tokens; a group is stamped with the oldest, and the summary counts the samples
that spanned two versions. Without ``--in-flight`` the loop refits only between
rollout batches (before generating), so no sample spans two versions.

Off-policy correction: a sample trained at policy version ``p`` was generated
by older weights (staleness), by two versions (``keep``), or by an engine whose
numerics differ from the trainer's. The engine returns each token's
behaviour-policy log-prob (``generate_with_meta(logprobs=True)``, the raw
``log_softmax``), and the loss is decoupled PPO (AReaL; verl's truncated
importance sampling) per token::

    ratio  = exp(logp - logp_prox)                  # PPO's trust region, clipped to 1 +- --clip-eps
    weight = min(exp(logp_prox - logp_behav), --is-cap)   # behaviour -> proximal, no gradient
    loss   = -mean(weight * min(ratio * A, clip(ratio) * A))

``logp_prox`` is the trainer's log-prob at the start of the batch (its first
pass), so on-policy samples get ``weight == 1`` and the plain GRPO loss. That
first pass is also a check: on a sample generated under the version being
trained, ``|logp_prox - logp_behav|`` must be ~0 (engine and trainer compute
the same model); the summary reports it, the stale samples' gap and the
fractions of clipped and truncated tokens.

LoRA (``--lora-rank N``, N > 0): the trainer wraps the policy with PEFT
(``LoraConfig(r=N, lora_alpha=2N)`` on ``q/k/v/o_proj`` and ``gate/up/down_proj``;
only the adapter trains) and refits it either adapter-only (``--lora-refit
adapter``, the default: ``LoRAAdapterRefitSource``; the factory picks
``LoRAAdapterSynchronizer`` and the engine loads the adapter as
``aiosync-v{version}``) or merged (``--lora-refit merged``: ``DTensorRefitSource``
streams the base checkpoint with the adapter merged in, through the usual
transport). The loop is the same either way.

Refit size (``--delta``, ``--fp8``; the embedded engine): ``--delta`` sends, per
tensor, only the elements whose bits changed since the last version every worker
committed (:mod:`aiosync.delta`; the first refit is full), and the summary prints
the bytes each refit moved next to the full checkpoint's (the COMMITTED events'
``nbytes`` and ``delta``), colocated (IPC) or not (``--no-colocated``: the
broadcast). Pair it with ``--dtype bfloat16``
and an RL learning rate: in float32 nearly every element changes at every step.
``--fp8`` refits the block-FP8 checkpoint (``FP8RefitSource``: linear weights
``float8_e4m3fn`` with a ``float32`` scale per 128 x 128 block, the rest in
``--dtype``) into ``EmbeddedEngine(quantization="fp8")``, which generates with the
dequantized weights: the on-policy log-prob gap then measures the quantization,
which the off-policy correction absorbs.

Run::

    python examples/async_grpo.py                     # colocated: IPC into the embedded engine
    python examples/async_grpo.py --no-colocated      # torch.distributed broadcast (gloo)
    python examples/async_grpo.py --backend sglang    # HTTP into aiosync's SGLang test server
    python examples/async_grpo.py --backend vllm      # a real vLLM (where installed)
    python examples/async_grpo.py --lora-rank 8       # PEFT LoRA, adapter-only refits
    python examples/async_grpo.py --lora-rank 8 --lora-refit merged
    python examples/async_grpo.py --in-flight keep    # refit while rollouts run
    python examples/async_grpo.py --delta --dtype bfloat16 --lr 1e-5   # changed bits only
    python examples/async_grpo.py --fp8 --dtype bfloat16                # block-FP8 engine
    python examples/async_grpo.py --quick --json-report report.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import random
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from aiosync import (
    IN_FLIGHT_POLICIES,
    Generation,
    SyncOptions,
    TrainCluster,
    VersionEventKind,
    WeightSynchronizer,
    create_weight_synchronizer,
    lora_adapter_name,
    refit_if_stale,
)
from aiosync.replay import VersionedReplayBuffer

if TYPE_CHECKING:
    from aiosync.metrics import WeightSyncMetrics

# -- the task ----------------------------------------------------------------------

DIGITS = 10  #: token ids 0..9 are digits
BOS, SEP, EOS, PAD = 10, 11, 12, 13
VOCAB_SIZE = 16


def policy_config(args: argparse.Namespace) -> dict[str, Any]:
    """A small Qwen3 config (HF ``config.json`` fields); the engine builds the same model."""
    return {
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": args.hidden_size,
        "intermediate_size": 2 * args.hidden_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": args.hidden_size // 4,
        "tie_word_embeddings": False,
        "max_position_embeddings": 64,
        "bos_token_id": BOS,
        # No end-of-sequence: every completion has exactly ``--digits`` tokens.
        "eos_token_id": None,
        "pad_token_id": PAD,
    }


#: The layers LoRA adapts: every linear layer of a Qwen3 decoder layer (attention and MLP).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: ``max_lora_rank`` values vLLM accepts (its ``LoRAConfig``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def make_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    """``n`` prompts ``[BOS, d1..d_length, SEP]`` of random digits."""
    return [[BOS, *(rng.randrange(DIGITS) for _ in range(length)), SEP] for _ in range(n)]


def reward(prompt: Sequence[int], completion: Sequence[int]) -> float:
    """Fraction of the prompt's digits the completion copies at the right position."""
    digits = prompt[1:-1]
    return sum(int(a == b) for a, b in zip(completion, digits, strict=False)) / len(digits)


@dataclass(frozen=True, slots=True)
class Group:
    """One prompt and its ``G`` sampled completions with their rewards."""

    prompt: list[int]
    completions: list[list[int]]
    rewards: list[float]
    #: per completion, per token: the behaviour policy's log-prob (the engine's,
    #: from the weights that generated that token)
    behaviour_logprobs: list[list[float]]


# -- the trainer (GRPO) ------------------------------------------------------------


def build_policy(config: dict[str, Any], seed: int, dtype: str = "float32") -> torch.nn.Module:
    """The Qwen3 causal LM in ``dtype`` (``"float32"``, ``"bfloat16"``), initialised
    exactly as the embedded engine initialises it with the same ``dtype``."""
    from aiosync.engines.embedded.model import HFModelRunner

    return HFModelRunner.from_config(config, seed=seed, dtype=dtype).model.train()


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` wrapped with a PEFT LoRA adapter of rank ``rank`` (``lora_alpha = 2 rank``)
    on :data:`LORA_TARGET_MODULES`; only the adapter's fp32 ``lora_A`` ``[rank, in]``
    and ``lora_B`` ``[out, rank]`` train, the base weights are frozen.

    PEFT's default init (``B = 0``) keeps the policy equal to the base model
    until the first step, so the engine's initial weights are the policy's.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(LORA_TARGET_MODULES),
        init_lora_weights=True,
        task_type="CAUSAL_LM",
    )
    peft_model: torch.nn.Module = get_peft_model(model, config)
    return peft_model.train()


def base_checkpoint(peft_model: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights of a PEFT model under checkpoint names, copies.

    PEFT wraps each target ``nn.Linear`` so its weight appears as
    ``<module>.base_layer.weight`` next to ``<module>.lora_A.<adapter>.weight``:
    drop the adapters' tensors and the ``base_layer`` level.
    """
    return {
        key.replace(".base_layer.", "."): tensor.detach().clone()
        for key, tensor in peft_model.get_base_model().state_dict().items()
        if ".lora_" not in key
    }


def decoupled_ppo_loss(
    logp: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_eps: float,
    is_cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled PPO policy loss (AReaL) with a truncated importance weight (verl's TIS).

    Args:
        logp: the current policy's log-probs of the completion tokens, ``[B, L]``
            float32, with gradient.
        proximal: the trainer's log-probs at the start of the batch, ``[B, L]``.
        behaviour: the engine's log-probs of the same tokens, from the weights
            that generated each one, ``[B, L]``.
        adv: one advantage per completion, ``[B]``.
        clip_eps: the ratio ``exp(logp - proximal)`` is clipped to ``[1 - eps, 1 + eps]``.
        is_cap: the importance weight ``exp(proximal - behaviour)`` is truncated
            at this value (``inf``: not truncated).

    Returns:
        The scalar loss (mean over tokens) and ``{"clip_frac", "is_truncated_frac",
        "is_weight_mean"}``: the fractions of tokens whose ratio was clipped and
        whose weight was truncated, and the mean truncated weight.
    """
    # PPO's clip bounds the step away from the proximal policy, which the trainer
    # computed itself; measuring it from the behaviour policy instead would clip
    # every token of a stale sample and learn nothing from it.
    ratio = torch.exp(logp - proximal)
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    surrogate = torch.min(ratio * adv[:, None], clipped * adv[:, None])
    # Behaviour -> proximal: importance sampling for the weights that sampled the
    # tokens. A constant (no gradient), truncated so that one token the engine
    # found unlikely cannot dominate the batch.
    weight = torch.exp(proximal - behaviour)
    truncated = weight.clamp(max=is_cap)
    loss = -(truncated * surrogate).mean()
    stats = {
        "clip_frac": ((ratio - clipped).abs() > 0).float().mean().item(),
        "is_truncated_frac": (weight > is_cap).float().mean().item(),
        "is_weight_mean": truncated.mean().item(),
    }
    return loss, stats


class GRPOTrainer:
    """GRPO updates on groups: advantages ``(r - mean_g) / (std_g + eps)``, the
    :func:`decoupled_ppo_loss`.

    Args:
        model: the policy (trained in place: every parameter that requires a
            gradient, i.e. a PEFT model's adapter alone).
        lr: AdamW learning rate.
        clip_eps: PPO clip range, the ratio is clipped to ``[1 - eps, 1 + eps]``.
        kl_coef: weight of the k3 KL estimate to the initial policy; 0 disables it.
        is_cap: truncation of the behaviour importance weight (``inf``: none).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        clip_eps: float,
        kl_coef: float,
        is_cap: float = 2.0,
    ) -> None:
        self.model = model
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if kl_coef else None
        # Every parameter for full fine-tuning; a LoRA model's adapter alone.
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.clip_eps = clip_eps
        self.kl_coef = kl_coef
        self.is_cap = is_cap

    @staticmethod
    def tensors(groups: Sequence[Group]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(sequences [B, P+L] int64, advantages [B] float32, behaviour log-probs
        [B, L] float32, prompt length P)``."""
        seqs = [g.prompt + c for g in groups for c in g.completions]
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        behaviour = torch.tensor([lp for g in groups for lp in g.behaviour_logprobs])
        return torch.tensor(seqs), adv.reshape(-1), behaviour, len(groups[0].prompt)

    def _logprobs(self, model: torch.nn.Module, seqs: torch.Tensor, plen: int) -> torch.Tensor:
        logits = model(seqs).logits[:, plen - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, seqs[:, plen:, None]).squeeze(-1)

    def old_logprobs(
        self, seqs: torch.Tensor, plen: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Completion log-probs ``[B, L]`` before this batch's updates (the proximal
        policy's), and the reference's."""
        with torch.no_grad():
            old = self._logprobs(self.model, seqs, plen)
            ref = None if self.reference is None else self._logprobs(self.reference, seqs, plen)
        return old, ref

    def backward(
        self,
        seqs: torch.Tensor,
        adv: torch.Tensor,
        plen: int,
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> dict[str, float]:
        """Compute the GRPO loss and its gradients (reads the weights, does not change them)."""
        # Grad mode is per thread, and this runs on a pooled worker thread.
        with torch.enable_grad():
            return self._backward(seqs, adv, plen, proximal, behaviour, ref)

    def _backward(
        self,
        seqs: torch.Tensor,
        adv: torch.Tensor,
        plen: int,
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> dict[str, float]:
        logp = self._logprobs(self.model, seqs, plen)
        loss, stats = decoupled_ppo_loss(
            logp, proximal, behaviour, adv, clip_eps=self.clip_eps, is_cap=self.is_cap
        )
        kl = torch.zeros(())
        if ref is not None:
            kl = (torch.exp(ref - logp) - (ref - logp) - 1).mean()
            loss = loss + self.kl_coef * kl
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return {"loss": loss.item(), "kl": kl.item(), **stats}

    def step(self) -> None:
        """The optimizer step: the only place the weights change."""
        self.optimizer.step()


# -- the run -----------------------------------------------------------------------


@dataclass
class RunReport:
    """What a run did; tests assert on it, ``--json-report`` writes it."""

    backend: str
    colocated: bool
    synchronizer: str
    steps: int
    max_staleness: int
    #: LoRA rank; 0 for full fine-tuning (then the other ``lora_*`` fields are empty)
    lora_rank: int = 0
    lora_alpha: int = 0
    lora_target_modules: list[str] = field(default_factory=list)
    #: ``"adapter"`` (adapter-only refits) or ``"merged"``; None for full fine-tuning
    lora_refit: str | None = None
    #: parameters the optimizer trains (a LoRA model: the adapter's)
    trainable_params: int = 0
    rewards: list[float] = field(default_factory=list)
    start_reward: float = 0.0
    end_reward: float = 0.0
    eval_start: float = 0.0
    eval_end: float = 0.0
    #: ``--dtype`` of the trainer and the engine
    dtype: str = "float32"
    #: ``--delta``: refits of the changed bits only (after a first full one)
    delta: bool = False
    #: ``--fp8``: the engine serves the block-FP8 checkpoint the trainer streams
    fp8: bool = False
    #: bytes of a full refit: the refit source's manifest (the FP8 one with ``--fp8``)
    full_nbytes: int = 0
    #: one ``{version, nbytes, seconds, gbps, delta}`` per COMMITTED event, in order
    #: (``nbytes``: the bytes of that refit, the adapter's for adapter-only refits,
    #: the patches' for a delta; ``delta``: 1 for a delta refit, else 0)
    refits: list[dict[str, float]] = field(default_factory=list)
    refit_failures: int = 0
    #: ``[weight_version, engine weights equal the trainer's]`` after each refit
    #: (adapter-only refits: the engine's base weights equal the trainer's frozen
    #: ones and every worker applies the adapter of that version)
    verified: list[tuple[int, bool]] = field(default_factory=list)
    #: ``[target_weight_version, policy_version at use, staleness]`` per used group
    samples: list[tuple[int, int, int]] = field(default_factory=list)
    #: ``--in-flight`` policy of the refits; None: refits only between rollout batches
    in_flight: str | None = None
    #: ``[oldest, newest]`` weight version that computed any token of each used
    #: group (the engine's labels, ``Generation.first_version``/``last_version``),
    #: in the order of ``samples``; ``target_weight_version`` is the oldest
    sample_versions: list[tuple[int, int]] = field(default_factory=list)
    #: used groups whose tokens came from two versions (oldest != newest)
    spanning_samples: int = 0
    #: completions a refit aborted (``--in-flight abort``); their groups were dropped
    aborted_rollouts: int = 0
    #: ``--is-cap``: truncation of the behaviour importance weight
    is_cap: float = 0.0
    #: ``|logp_train - logp_behaviour|`` on the trainer's first pass over the
    #: tokens of samples generated under the version being trained (one version,
    #: staleness 0): ~0 when the engine computes the trainer's model
    onpolicy_tokens: int = 0
    onpolicy_logprob_diff_mean: float = 0.0
    onpolicy_logprob_diff_max: float = 0.0
    #: the same over the tokens of the other (stale or spanning) samples
    offpolicy_tokens: int = 0
    offpolicy_logprob_diff_mean: float = 0.0
    #: over every backward pass: tokens whose PPO ratio was clipped, and whose
    #: importance weight was truncated at ``is_cap``
    clip_frac: float = 0.0
    is_truncated_frac: float = 0.0
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    dropped_stale: int = 0
    final_policy_version: int = 0
    final_weight_version: int = 0
    seconds: float = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def open_engine(
    args: argparse.Namespace, config: dict[str, Any], model: Any
) -> AsyncIterator[Any]:
    """The generation engine for ``--backend``, holding the trainer's initial weights.

    Construction only: whatever it is, the loop drives it the same way.
    """
    if args.backend == "embedded":
        from aiosync.engines.embedded.engine import EmbeddedEngine

        async with EmbeddedEngine(
            config,
            num_workers=args.engine_workers,
            seed=args.seed,
            threads_per_worker=1,
            dtype=args.dtype,
            quantization="fp8" if args.fp8 else None,
        ) as embedded:
            yield embedded
    elif args.backend == "sglang":
        # aiosync's SGLang test server (the embedded engine behind SGLang's HTTP API).
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from sglang_http import launch_test_server

        async with launch_test_server(config, seed=args.seed) as server:
            yield server
    else:
        try:
            from aiosync.engines.vllm.backend import VLLMGenerationBackend
        except ImportError as exc:
            raise SystemExit(f"--backend vllm needs vLLM installed: {exc}") from exc
        lora: dict[str, Any] = {}
        if adapter_refits(args):  # vLLM serves adapters only when built for them
            rank = min(r for r in VLLM_LORA_RANKS if r >= args.lora_rank)
            lora = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}
        with tempfile.TemporaryDirectory(prefix="aiosync-grpo-") as folder:
            save_checkpoint(model, folder)
            vllm_engine = await anyio.to_thread.run_sync(
                functools.partial(
                    VLLMGenerationBackend.from_model,
                    folder,
                    skip_tokenizer_init=True,
                    dtype="float32",
                    enforce_eager=True,
                    tensor_parallel_size=args.engine_workers,
                    **lora,
                )
            )
            try:
                yield vllm_engine
            finally:
                await vllm_engine.shutdown()


def topology(args: argparse.Namespace) -> dict[str, Any]:
    """Where the trainer and the engine meet; only a non-colocated setup needs it."""
    if args.colocated:
        return {}
    return {
        "train_cluster": TrainCluster(world_size=1, rank=0, master_port=_free_port()),
        "inference_world_size": args.engine_workers,
    }


def save_checkpoint(model: Any, folder: str) -> None:
    """``save_pretrained`` of the policy's initial weights, as an engine loads them
    (a PEFT model: its base model's checkpoint, without the adapter)."""
    if callable(getattr(model, "get_base_model", None)):
        model.get_base_model().save_pretrained(folder, state_dict=base_checkpoint(model))
    else:
        model.save_pretrained(folder)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (``torch.equal`` has
    no float8 kernel)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def manifest_nbytes(source: Any) -> int:
    """Bytes of one full refit of ``source``: its manifest's tensors."""
    return sum(
        math.prod(shape) * dtype.itemsize for shape, dtype in source.prepare_refit_info().values()
    )


def make_verifier(
    engine: Any, model: torch.nn.Module, enabled: bool, *, adapter_only: bool, fp8: bool = False
) -> Callable[[int], Awaitable[bool | None]]:
    """``await verify(weight_version)``: do all engine workers hold exactly the trainer's weights?

    Full and merged refits: every worker's checkpoint equals the trainer's
    (merged) one bit for bit; with ``fp8`` the trainer's FP8 checkpoint
    (:class:`~aiosync.refit.FP8RefitSource` of its weights). Adapter-only
    refits: every worker's base weights equal the trainer's frozen ones bit for
    bit and every worker applies the adapter of ``weight_version`` (none at
    version 0).
    """
    from aiosync.refit import DTensorRefitSource, FP8RefitSource

    source: Any = None if adapter_only else DTensorRefitSource(model)
    if fp8:
        source = FP8RefitSource(source, dtype=next(model.parameters()).dtype)
    read_engine = getattr(engine, "hf_state_dicts", None)
    read_status = getattr(engine, "status", None)

    async def verify(version: int) -> bool | None:
        if not enabled or read_engine is None:
            return None
        if source is None:
            trainer = base_checkpoint(model)
        else:
            trainer = {k: v.detach().clone() for k, v in source.iter_weights()}
        engines = await read_engine()
        equal = all(
            e.keys() == trainer.keys() and all(same_bits(e[k], v) for k, v in trainer.items())
            for e in engines
        )
        if adapter_only:
            if read_status is None:
                return None
            want = lora_adapter_name(version) if version else None
            equal = equal and all(w["lora_adapter"] == want for w in await read_status())
        return equal

    return verify


async def run(args: argparse.Namespace) -> RunReport:
    """Train for ``args.steps`` batches; returns the :class:`RunReport`."""
    from aiosync.refit import DTensorRefitSource, FP8RefitSource, LoRAAdapterRefitSource

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = policy_config(args)
    model = build_policy(config, args.seed, args.dtype)
    if args.lora_rank:
        model = with_lora(model, args.lora_rank)
    trainer = GRPOTrainer(
        model, lr=args.lr, clip_eps=args.clip_eps, kl_coef=args.kl_coef, is_cap=args.is_cap
    )
    source: Any
    if adapter_refits(args):  # the adapter's tensors alone, loaded by the engine's LoRA API
        source = LoRAAdapterRefitSource(model)
    else:  # the whole checkpoint (a LoRA model's with the adapter merged in)
        source = DTensorRefitSource(model, optimizer=trainer.optimizer)
    if args.fp8:  # quantized per 128 x 128 block, the rest in --dtype
        source = FP8RefitSource(source, dtype=getattr(torch, args.dtype))
    P, G, L = args.prompts_per_step, args.group_size, args.digits
    console = make_console(args.quiet)
    metrics = serve_metrics(args.metrics_port)

    async with open_engine(args, config, model) as engine:
        sync: WeightSynchronizer = create_weight_synchronizer(
            source,
            engine,
            colocated=args.colocated,
            backend=args.backend,
            sync=SyncOptions(delta=True) if args.delta else None,
            **topology(args),
        )
        report = RunReport(
            backend=args.backend,
            colocated=args.colocated,
            synchronizer=type(sync).__name__,
            steps=args.steps,
            max_staleness=args.max_staleness,
            trainable_params=sum(
                p.numel() for group in trainer.optimizer.param_groups for p in group["params"]
            ),
            in_flight=args.in_flight,
            is_cap=args.is_cap,
            dtype=args.dtype,
            delta=args.delta,
            fp8=args.fp8,
            full_nbytes=manifest_nbytes(source),
        )
        if args.lora_rank:
            report.lora_rank = args.lora_rank
            report.lora_alpha = 2 * args.lora_rank
            report.lora_target_modules = list(LORA_TARGET_MODULES)
            report.lora_refit = args.lora_refit
        verify = make_verifier(
            engine, model, args.verify, adapter_only=adapter_refits(args), fp8=args.fp8
        )
        eval_prompts = make_prompts(random.Random(args.seed + 1), args.eval_prompts, L)

        async def check_engine() -> None:
            version = sync.weight_version
            equal = await verify(version)
            if equal is not None:
                report.verified.append((version, equal))

        async def evaluate() -> float:
            outs = await engine.generate(eval_prompts, max_new_tokens=L, ignore_eos=True)
            return sum(map(reward, eval_prompts, outs)) / len(outs)

        async with sync:  # initializes the communicator
            await engine.prepare_for_generation()
            buffer: VersionedReplayBuffer[Group] = VersionedReplayBuffer(
                sync, max_staleness=args.max_staleness
            )
            refit_events = sync.subscribe()
            weights_lock = anyio.Lock()  # steps vs. the engine==trainer check after a refit
            gaps = _LogprobGaps()
            loss_stats: list[dict[str, float]] = []
            last = {"gbps": 0.0, "seconds": 0.0}
            await check_engine()
            report.eval_start = await evaluate()

            async def follow_refits() -> None:
                async for ev in refit_events:
                    if metrics is not None:
                        metrics.record(ev)
                    if ev.kind is VersionEventKind.COMMITTED:
                        gbps = ev.nbytes / ev.duration_s / 1e9 if ev.duration_s else 0.0
                        report.refits.append(
                            {
                                "version": ev.version,
                                "nbytes": ev.nbytes,
                                "seconds": ev.duration_s,
                                "gbps": gbps,
                                "delta": int(ev.delta),
                            }
                        )
                        if args.delta or args.fp8:
                            console.print(refit_line(ev.version, ev.nbytes, ev.delta, report))
                        last.update(gbps=gbps, seconds=ev.duration_s)
                    elif ev.kind is VersionEventKind.FAILED:
                        report.refit_failures += 1

            async def refitter() -> None:
                # --in-flight: refit as soon as the trainer stepped, while rollouts run.
                async for ev in sync.subscribe():
                    if ev.kind is not VersionEventKind.STALE:
                        continue
                    async with weights_lock:
                        if sync.is_stale:
                            await sync.sync_weights(in_flight=args.in_flight)
                            await engine.prepare_for_generation()
                            await check_engine()

            async def rollouts() -> None:
                rng = random.Random(args.seed)
                for batch_index in range(sys.maxsize):
                    await buffer.wait_below(P)  # stay at most one batch ahead
                    if args.in_flight is None:
                        async with weights_lock:
                            if await refit_if_stale(sync, engine):
                                await check_engine()
                    prompts = make_prompts(rng, P, L)
                    outs: list[Generation] = await engine.generate_with_meta(
                        [p for p in prompts for _ in range(G)],
                        max_new_tokens=L,
                        temperature=1.0,
                        seed=args.seed * 100_003 + batch_index,
                        ignore_eos=True,
                        logprobs=True,  # the behaviour policy, for the off-policy correction
                    )
                    for i, prompt in enumerate(prompts):
                        gens = outs[i * G : (i + 1) * G]
                        aborted = sum(g.aborted for g in gens)
                        if aborted:  # fewer than L tokens: not a complete group
                            report.aborted_rollouts += aborted
                            continue
                        completions = [g.token_ids for g in gens]
                        rewards = [reward(prompt, c) for c in completions]
                        behaviour = [behaviour_logprobs(g) for g in gens]
                        # Stamped with the oldest version that computed any token.
                        versions = [v for g in gens for v in (g.first_version, g.last_version)]
                        group = Group(prompt, completions, rewards, behaviour)
                        buffer.add(group, versions=versions)

            progress = StepLog(console, args.steps)
            async with buffer, anyio.create_task_group() as tg:
                tg.start_soon(follow_refits)
                tg.start_soon(rollouts)
                if args.in_flight is not None:
                    tg.start_soon(refitter)
                with progress:
                    for _ in range(args.steps):
                        batch = await buffer.pop_batch(P)
                        # On-policy: one version made every token, the one being trained.
                        onpolicy = [
                            s.staleness == 0 and s.other_weight_version is None for s in batch
                        ]
                        for s in batch:
                            report.samples.append(
                                (s.target_weight_version, sync.policy_version, s.staleness)
                            )
                            versions = (s.target_weight_version, s.target_weight_version)
                            if s.other_weight_version is not None:
                                versions = (s.target_weight_version, s.other_weight_version)
                                report.spanning_samples += 1
                            report.sample_versions.append(versions)
                        if metrics is not None:
                            metrics.observe_staleness(buffer.stats)
                        groups = [s.item for s in batch]
                        step_reward = sum(r for g in groups for r in g.rewards) / (P * G)
                        report.rewards.append(step_reward)
                        seqs, adv, behaviour, plen = trainer.tensors(groups)
                        proximal, ref = await anyio.to_thread.run_sync(
                            trainer.old_logprobs, seqs, plen
                        )
                        gaps.add(proximal, behaviour, onpolicy, G)
                        for _ in range(args.ppo_epochs):
                            stats = await anyio.to_thread.run_sync(
                                trainer.backward, seqs, adv, plen, proximal, behaviour, ref
                            )
                            loss_stats.append(stats)
                            # policy_update: no sync reads a half-stepped policy; it marks
                            # the new version stale on exit.
                            async with weights_lock, sync.policy_update():
                                await anyio.to_thread.run_sync(trainer.step)
                        progress.step(step_info(step_reward, sync, args.ppo_epochs, last, stats))
                # The final policy goes to the engine too, then a greedy evaluation.
                async with weights_lock:
                    if await refit_if_stale(sync, engine):
                        await check_engine()
                report.eval_end = await evaluate()
                with anyio.fail_after(30):  # let follow_refits record the last commit
                    while sync.weight_version > max(
                        (r["version"] for r in report.refits), default=0
                    ):
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
            report.staleness_histogram = buffer.histogram()
            report.dropped_stale = sum(buffer.stats.dropped.values())
            report.final_policy_version = sync.policy_version
            report.final_weight_version = sync.weight_version
            histogram_text = buffer.format_histogram()
            gaps.fill(report)
            if loss_stats:
                n = len(loss_stats)
                report.clip_frac = sum(s["clip_frac"] for s in loss_stats) / n
                report.is_truncated_frac = sum(s["is_truncated_frac"] for s in loss_stats) / n

    k = max(1, len(report.rewards) // 5)
    report.start_reward = sum(report.rewards[:k]) / k
    report.end_reward = sum(report.rewards[-k:]) / k
    report.seconds = time.perf_counter() - started
    _print_summary(console, report, histogram_text)
    return report


def make_console(quiet: bool = False) -> Console:
    """The run's console, on stderr. Off a terminal (a pipe, a file, a CI log) no line
    is wrapped: rich would break lines at 80 columns (or ``$COLUMNS``)."""
    console = Console(stderr=True, quiet=quiet)
    console.soft_wrap = not console.is_terminal
    return console


class StepLog:
    """Training progress on ``console``: a bar on a terminal; elsewhere a line
    ``step N/steps  info`` every tenth of the run (every step in a run of < 20)."""

    def __init__(self, console: Console, steps: int) -> None:
        self.console, self.steps, self.done = console, steps, 0
        self.every = max(1, steps // 10)
        self.bar = Progress(
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            disable=not console.is_terminal,
        )
        self.task = self.bar.add_task("train", total=steps, info="")

    def __enter__(self) -> StepLog:
        self.bar.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bar.stop()

    def step(self, info: str) -> None:
        """One more step done; ``info``: its one-line summary."""
        self.done += 1
        self.bar.update(self.task, advance=1, info=info)
        if not self.console.is_terminal and self.done % self.every == 0:
            self.console.print(f"step {self.done:>4}/{self.steps}  {info}")


def step_info(
    reward: float,
    sync: WeightSynchronizer,
    ppo_epochs: int,
    last_refit: dict[str, float],
    stats: dict[str, float],
) -> str:
    """A training step in one line: the batch's mean reward, the versions, the last
    refit's GB/s and seconds (``last_refit``) and the last optimizer step's clip fraction."""
    # The policy version counts optimizer steps, ppo_epochs per batch (step): after
    # 60 steps of 2, v120.
    return (
        f"reward {reward:.3f}  policy v{sync.policy_version} "
        f"({ppo_epochs} optimizer steps/batch)  "
        f"weights v{sync.weight_version}  refit {last_refit['gbps']:.3f} GB/s "
        f"{last_refit['seconds']:.3f} s  clip {stats['clip_frac']:.2f}"
    )


def refit_line(version: int, nbytes: int, delta: bool, report: RunReport) -> str:
    """One refit's bytes next to the full checkpoint's, e.g.
    ``refit v4: delta 1,234 B of 152,320 B full (0.81%)``."""
    share = nbytes / report.full_nbytes if report.full_nbytes else 0.0
    kind = "delta" if delta else "full"
    return f"refit v{version}: {kind} {nbytes:,} B of {report.full_nbytes:,} B full ({share:.2%})"


def _print_summary(console: Console, report: RunReport, histogram_text: str) -> None:
    mean_gbps = sum(r["gbps"] for r in report.refits) / max(1, len(report.refits))
    console.print(
        f"{report.synchronizer} ({report.backend}, "
        f"{'colocated' if report.colocated else 'not colocated'}): "
        f"{report.steps} steps in {report.seconds:.0f} s"
    )
    if report.lora_rank:
        per_refit = report.refits[-1]["nbytes"] if report.refits else 0
        console.print(
            f"LoRA r={report.lora_rank} (alpha {report.lora_alpha}), {report.lora_refit} "
            f"refits: {report.trainable_params} trainable parameters, {per_refit:.0f} bytes "
            "per refit"
        )
    if report.delta or report.fp8:
        deltas = [r["nbytes"] for r in report.refits if r["delta"]]
        what = f"{report.dtype}" + (" block-FP8" if report.fp8 else "")
        line = f"refit bytes ({what}): full {report.full_nbytes:,} B"
        if deltas:
            mean = sum(deltas) / len(deltas)
            line += (
                f"; {len(deltas)} deltas: mean {mean:,.0f} B "
                f"({mean / report.full_nbytes:.2%}), max {max(deltas):,.0f} B"
            )
        console.print(line)
    console.print(
        f"reward (sampled): start {report.start_reward:.3f} -> end {report.end_reward:.3f}   "
        f"greedy eval: start {report.eval_start:.3f} -> end {report.eval_end:.3f}"
    )
    console.print(
        f"refits: {len(report.refits)} committed (v{report.final_weight_version}), "
        f"{report.refit_failures} failed, mean {mean_gbps:.3f} GB/s; engine == trainer after "
        f"every refit: {all(ok for _, ok in report.verified)}"
    )
    console.print(histogram_text, markup=False)
    console.print(
        f"in-flight policy: {report.in_flight or 'none (refits between rollout batches)'}; "
        f"samples spanning two weight versions: {report.spanning_samples} of "
        f"{len(report.samples)}; completions aborted by a refit: {report.aborted_rollouts}"
    )
    console.print(
        f"off-policy correction (decoupled PPO, IS cap {report.is_cap:g}): "
        f"|logp_train - logp_engine| on-policy mean {report.onpolicy_logprob_diff_mean:.1e} "
        f"max {report.onpolicy_logprob_diff_max:.1e} ({report.onpolicy_tokens} tokens), "
        f"off-policy mean {report.offpolicy_logprob_diff_mean:.3f} "
        f"({report.offpolicy_tokens} tokens); "
        f"tokens clipped {report.clip_frac:.3f}, IS-truncated {report.is_truncated_frac:.3f}"
    )


def behaviour_logprobs(generation: Generation) -> list[float]:
    """The engine's per-token log-probs of a completion asked with ``logprobs=True``."""
    if generation.logprobs is None:
        raise RuntimeError("the engine returned no logprobs although asked (logprobs=True)")
    return generation.logprobs


class _LogprobGaps:
    """``|logp_train - logp_behaviour|`` per token on the trainer's first pass,
    kept apart for on-policy samples (~0 expected) and the others."""

    def __init__(self) -> None:
        self._on: list[torch.Tensor] = []
        self._off: list[torch.Tensor] = []

    def add(
        self,
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
        onpolicy: Sequence[bool],
        group_size: int,
    ) -> None:
        """``proximal``, ``behaviour``: ``[B, L]``, ``B = len(onpolicy) * group_size``
        (a sample is a group)."""
        gap = (proximal - behaviour).abs()
        rows = torch.tensor(onpolicy).repeat_interleave(group_size)
        self._on.append(gap[rows].flatten())
        self._off.append(gap[~rows].flatten())

    def fill(self, report: RunReport) -> None:
        on = torch.cat(self._on) if self._on else torch.zeros(0)
        off = torch.cat(self._off) if self._off else torch.zeros(0)
        report.onpolicy_tokens, report.offpolicy_tokens = on.numel(), off.numel()
        if on.numel():
            report.onpolicy_logprob_diff_mean = on.mean().item()
            report.onpolicy_logprob_diff_max = on.max().item()
        if off.numel():
            report.offpolicy_logprob_diff_mean = off.mean().item()


def serve_metrics(port: int | None) -> WeightSyncMetrics | None:
    """aiosync's weight-sync metrics (:mod:`aiosync.metrics`, on a registry of their own)
    served for Prometheus on ``http://127.0.0.1:port/metrics``; None without a port.

    The server runs until the process exits. Needs ``prometheus-client`` (the
    ``metrics`` extra).
    """
    if port is None:
        return None
    from prometheus_client import CollectorRegistry

    from aiosync.metrics import WeightSyncMetrics

    metrics = WeightSyncMetrics(CollectorRegistry())
    metrics.serve(port, addr="127.0.0.1")
    return metrics


#: Backends this example can refit adapter-only (they load LoRA adapters: ``load_lora_adapter``).
ADAPTER_BACKENDS = frozenset({"embedded", "vllm"})
ADAPTER_BACKENDS_WHY = (
    "the SGLang test server this example launches runs without --enable-lora, so it cannot "
    "load LoRA adapters"
)


def adapter_refits(args: argparse.Namespace) -> bool:
    """Whether the run refits a LoRA adapter alone (``--lora-rank N --lora-refit adapter``)."""
    return bool(args.lora_rank) and args.lora_refit == "adapter"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` shrinks everything for tests."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a few small steps (tests)")
    p.add_argument(
        "--colocated",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the trainer's device (IPC; default) or not (the collective broadcast)",
    )
    p.add_argument("--backend", choices=("embedded", "vllm", "sglang"), default="embedded")
    p.add_argument("--engine-workers", type=int, default=1)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--digits", type=int, default=3, help="digits to copy")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--lora-rank", type=int, default=0, help="train a PEFT LoRA adapter of this rank (0: all)"
    )
    p.add_argument(
        "--lora-refit",
        choices=("adapter", "merged"),
        default="adapter",
        help="with --lora-rank: send the adapter alone, or the checkpoint with it merged",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="parameter dtype of the trainer and the engine",
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="refit only the elements whose bits changed (embedded engine)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="refit the block-FP8 checkpoint into EmbeddedEngine(quantization='fp8')",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL to the initial policy")
    p.add_argument(
        "--is-cap",
        type=float,
        default=2.0,
        help="truncate the behaviour importance weight at this value (inf: no truncation)",
    )
    p.add_argument("--ppo-epochs", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--max-staleness", type=int, default=4, help="in optimizer steps")
    p.add_argument(
        "--in-flight",
        choices=IN_FLIGHT_POLICIES,
        default=None,
        help="refit while rollouts run, with this policy for the requests in flight "
        "(default: refit only between rollout batches)",
    )
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="trainer torch threads")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus on 127.0.0.1")
    p.add_argument("--json-report", default=None, help="write the RunReport here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if not args.is_cap > 0:
        p.error(f"--is-cap must be > 0, got {args.is_cap}")
    if args.lora_rank < 0:
        p.error(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if args.max_staleness < 0:
        p.error(f"--max-staleness must be >= 0, got {args.max_staleness}")
    if adapter_refits(args) and args.backend not in ADAPTER_BACKENDS:
        p.error(
            f"--lora-refit adapter: {ADAPTER_BACKENDS_WHY}; use --lora-refit merged with "
            f"--backend {args.backend}, or --backend {' or '.join(sorted(ADAPTER_BACKENDS))}"
        )
    if adapter_refits(args) and args.backend == "vllm" and args.lora_rank > VLLM_LORA_RANKS[-1]:
        p.error(
            f"--lora-rank {args.lora_rank}: vLLM's max_lora_rank is at most {VLLM_LORA_RANKS[-1]}"
        )
    for flag in ("delta", "fp8"):
        if getattr(args, flag) and args.backend != "embedded":
            p.error(f"--{flag} needs --backend embedded (its workers apply patches / serve FP8)")
        if getattr(args, flag) and adapter_refits(args):
            p.error(f"--{flag}: adapter-only LoRA refits move the adapter alone")
    if args.fp8 and args.lora_rank:
        p.error("--fp8 quantizes the full checkpoint: not with --lora-rank")
    if args.colocated is None:
        args.colocated = True
    if args.quick:
        args.steps = min(args.steps, 4)
        args.prompts_per_step, args.group_size, args.eval_prompts = 4, 4, 8
    return args


def main(argv: Sequence[str] | None = None) -> RunReport:
    args = parse_args(argv)
    report = anyio.run(run, args)
    if args.json_report:
        with open(args.json_report, "w") as f:
            json.dump(asdict(report), f, indent=1)
    return report


if __name__ == "__main__":
    main()
