"""The in-flight policy tests' reference models, decoding and fault source (``tests/inflight``).

Two trainer weight sets, OLD and NEW (random inits of the same tiny Qwen3 with
two seeds). A test syncs OLD, starts a long greedy request, syncs NEW while it
runs, and compares the request's tokens with what transformers computes from
OLD and NEW, independently of the engine's decode loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.refit import DTensorRefitSource
from aiosync.sources import RefitManifest, RefitSource

CONFIG: dict[str, Any] = dict(TINY_QWEN3)
#: The engine's own init (never a trainer's): a sync must change every tensor.
ENGINE_SEED = 3
OLD_SEED = 11
NEW_SEED = 12
PROMPT = [3, 1, 4, 1, 5]
#: Long enough that a sync lands while the request runs (a few ms per token).
LONG = 600


def build_model(seed: int) -> PreTrainedModel:
    """The tiny Qwen3 initialised with ``seed`` (the trainer's weights), float32, eval."""
    items = dict(CONFIG)
    model_type = items.pop("model_type")
    config = AutoConfig.for_model(model_type, **items)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _cache_arg(model: PreTrainedModel) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def greedy_switch(
    old: PreTrainedModel, new: PreTrainedModel, prompt: Sequence[int], switch_at: int, total: int
) -> list[int]:
    """Greedy tokens ``0..total-1``: token ``i`` computed by ``old`` for ``i < switch_at``
    and by ``new`` from then on, attending to the KV cache of the earlier positions as
    it was computed (the prompt and tokens ``< switch_at - 1`` by ``old``): what an
    engine that keeps a request in flight across a refit computes.

    ``switch_at == total``: ``old``'s greedy output; ``switch_at == 0``: ``new``'s.
    """
    arg = _cache_arg(old)
    cache: Any = None
    step_input = torch.tensor([list(prompt)])
    tokens: list[int] = []
    with torch.no_grad():
        for i in range(total):
            model = old if i < switch_at else new
            out = model(input_ids=step_input, use_cache=True, **{arg: cache})
            cache = out[arg]
            token = int(torch.argmax(out.logits[0, -1, :].float()).item())
            tokens.append(token)
            step_input = torch.tensor([[token]])
    return tokens


def hf_greedy(model: PreTrainedModel, prompt: Sequence[int], total: int) -> list[int]:
    """transformers' own ``generate`` (greedy, no EOS stop): the reference of the engine."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(  # type: ignore[operator]
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=total,
        min_new_tokens=total,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


class FaultySource(RefitSource):
    """The trainer's refit source (``DTensorRefitSource``), with a fault hook:
    ``fail_before`` set, ``offload_before_refit`` raises it (the sync fails
    before any byte moved)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = DTensorRefitSource(model)
        self.fail_before: BaseException | None = None

    def prepare_refit_info(self) -> RefitManifest:
        return self.inner.prepare_refit_info()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.iter_weights()

    def offload_before_refit(self) -> None:
        if self.fail_before is not None:
            raise self.fail_before


@dataclass
class InflightEnv:
    """What every in-flight test drives: the synchronizer, the trainer's model and its source.

    Each transport's test module adds its engine-side handles in a subclass.
    """

    sync: Any  # the transport's WeightSynchronizer
    trainer: torch.nn.Module
    source: FaultySource


def load_into(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Copy ``source``'s weights into ``target`` (the trainer's optimizer step, here)."""
    with torch.no_grad():
        for (name, t), (other, s) in zip(
            target.state_dict().items(), source.state_dict().items(), strict=True
        ):
            assert name == other
            t.copy_(s)


async def sync_old(env: InflightEnv, old: PreTrainedModel) -> int:
    """Bring the engine to OLD (nothing in flight); returns its version."""
    env.source.fail_before = None
    load_into(env.trainer, old)
    version: int = await env.sync.mark_stale()
    await env.sync.sync_weights()
    assert env.sync.weight_version == version
    return version


async def stage(env: InflightEnv, old: PreTrainedModel, new: PreTrainedModel) -> tuple[int, int]:
    """The engine on OLD, then an optimizer step to NEW not yet synced:
    ``(old version, new version)``."""
    old_version = await sync_old(env, old)
    load_into(env.trainer, new)
    return old_version, await env.sync.mark_stale()


async def mid_request(engine: Any, at_least: int = 30) -> None:
    """Wait until the embedded ``engine``'s one running request has started
    ``at_least`` decode steps (its ``status()``)."""
    with anyio.fail_after(120):
        while True:
            (status,) = await engine.status()
            if status["requests"] and status["requests"][0] >= at_least:
                return
            await anyio.sleep(0.005)
