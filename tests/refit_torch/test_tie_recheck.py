"""Case C37: a tie broken after the manifest was built is caught at the next sync (issue 42).

The config ties ``lm_head.weight`` to ``model.embed_tokens.weight``, so the
manifest (built once, at init) omits the head. A trainer that later unties it
(``load_state_dict(..., assign=True)`` of a checkpoint, a re-assigned
``Parameter``, ``param.data = ...``) trains a head the engine never receives:
the source re-checks the tie at every sync and refuses with a
``RefitMismatchError`` naming both tensors, before anything is sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from aiosync import RefitMismatchError, share_parameters
from aiosync.engines.embedded.configs import TINY_QWEN3_TIED
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.builders import factory_pick

BuildModel = Callable[..., nn.Module]
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
PROMPT = [3, 1, 4, 1, 5]


def _assign_a_checkpoint(model: Any) -> None:
    """A resume from a checkpoint holding both names (as a non-safetensors save does),
    loaded with ``assign=True``: two tensors of their own; then a training step of the head."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    with torch.no_grad():
        model.lm_head.weight.add_(0.25)


def _replace_the_head_data(model: Any) -> None:
    """An aliasing tie (two ``Parameter`` objects on one storage, what ``assign=True`` of
    the model's own state dict gives), then ``param.data = ...`` of the head."""
    model.load_state_dict(model.state_dict(), assign=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.lm_head.weight.data = model.lm_head.weight.data + 0.25


def _replace_the_head_parameter(model: Any) -> None:
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach() + 0.25)


UNTIE = {
    "load_state_dict_assign": _assign_a_checkpoint,
    "param_data": _replace_the_head_data,
    "new_parameter": _replace_the_head_parameter,
}


@pytest.mark.parametrize("untie", list(UNTIE))
def test_a_tie_broken_after_the_manifest_is_refused_naming_it(
    build_model: BuildModel, untie: str
) -> None:
    model: Any = build_model("qwen3_tied")
    source = DTensorRefitSource(model)
    manifest = source.prepare_refit_info()
    assert HEAD not in manifest and source.broken_ties == {}
    assert list(dict(source.iter_weights())) == list(manifest)
    UNTIE[untie](model)
    with pytest.raises(RefitMismatchError) as info:
        next(iter(source.iter_weights()))
    message = str(info.value)
    assert f"{HEAD} is no longer tied to {EMBED}" in message
    assert "model.tie_weights()" in message
    # Re-tied, the sync streams again: the manifest's tensors, the head's value the embedding's.
    model.tie_weights()
    streamed = dict(source.iter_weights())
    assert list(streamed) == list(manifest)
    assert torch.equal(streamed[EMBED], model.model.embed_tokens.weight)


def _synchronizer(transport: str, model: Any, engine: EmbeddedEngine) -> Any:
    source = DTensorRefitSource(model)
    if transport == "ipc":
        return IPCWeightSynchronizer(source, engine, rpc_timeout_s=60)
    return factory_pick(
        source,
        engine,
        world_size=1,
        overlap=transport.removeprefix("collective "),
        collective_timeout_s=60.0,
    )


@pytest.mark.parametrize("transport", ["ipc", "collective inplace", "collective staged"])
async def test_an_untied_trainer_never_commits_a_head_and_the_engine_keeps_serving(
    transport: str,
) -> None:
    from tests._support.inflight import hf_greedy

    config = dict(TINY_QWEN3_TIED)
    async with EmbeddedEngine(config, num_workers=1, seed=3) as engine:
        from aiosync.engines.embedded.model import HFModelRunner

        model: Any = HFModelRunner.from_config(config, seed=7).model.float().eval()
        with share_parameters(model) if transport == "ipc" else contextlib.nullcontext():
            async with _synchronizer(transport, model, engine) as sync:
                await sync.mark_stale()
                await sync.sync_weights()
                tokens = hf_greedy(model, PROMPT, 6)
                assert await engine.generate([PROMPT], max_new_tokens=6) == [tokens]
                held = await engine.hf_state_dicts()
                _assign_a_checkpoint(model)
                await sync.mark_stale()
                with pytest.raises(RefitMismatchError, match=f"{HEAD} is no longer tied"):
                    await sync.sync_weights()
                assert (sync.weight_version, sync.is_stale) == (1, True)
                # Refused before the pause and the first byte (the collective once
                # broadcast filler buckets after its source failed, into live weights):
                # the engine holds version 1 exactly and serves it.
                now = await engine.hf_state_dicts()
                assert [list(s) for s in now] == [list(s) for s in held]
                assert all(
                    torch.equal(a[n], b[n]) for a, b in zip(now, held, strict=True) for n in a
                )
                assert await engine.generate([PROMPT], max_new_tokens=6) == [tokens]
                # Re-tied (the head takes the embedding's values), the next sync heals.
                model.tie_weights()
                await sync.sync_weights()
                assert (sync.weight_version, sync.is_stale) == (2, False)
                assert await engine.generate([PROMPT], max_new_tokens=6) == [
                    hf_greedy(model, PROMPT, 6)
                ]
