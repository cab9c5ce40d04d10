"""Draft / MTP weights on the SGLang test server holding a draft model: ``selector`` "all"
refits target and draft under one version, "target" leaves the draft bit for bit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from aiosync import SGLangHTTPBackend, SyncOptions, create_weight_synchronizer
from aiosync.refit import DTensorRefitSource
from aiosync.sources import with_draft
from aiosync.testing.sglang_server import serve_in_subprocess
from tests._support.configs import DRAFT
from tests._support.configs import SMALL_QWEN3 as TARGET


def _hash(tensor: torch.Tensor) -> str:
    """SGLang's CPU ``tensor_hash`` as ``/weights_checker`` reports it (16 hex digits)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{int.from_bytes(hashlib.sha256(raw).digest()[:8], 'big'):016x}"


async def _checksums(backend: SGLangHTTPBackend, selector: str) -> dict[str, str]:
    answer = await backend.check_weights("checksum", selector=selector)
    assert answer is not None and answer["success"], answer
    (rank,) = answer["ranks"]
    return dict(rank["checksums"])


def _log(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/_aiosync/log", timeout=30).json())


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["with_target", "frozen"])
async def test_sglang_draft_selector_all_refits_it_and_target_keeps_it(
    draft: str, tmp_path: Path
) -> None:
    torch.manual_seed(5)
    target, draft_model = (
        Qwen3ForCausalLM(Qwen3Config(**TARGET)),
        Qwen3ForCausalLM(Qwen3Config(**DRAFT)),
    )
    draft_config = tmp_path / "draft.json"
    draft_config.write_text(json.dumps(Qwen3Config(**DRAFT).to_dict()))
    source = with_draft(DTensorRefitSource(target), DTensorRefitSource(draft_model), prefix="mtp.")
    expected_target = {n: _hash(t) for n, t in DTensorRefitSource(target).iter_weights()}
    expected_draft = {
        f"draft.{n}": _hash(t) for n, t in DTensorRefitSource(draft_model).iter_weights()
    }
    args = ["--speculative-draft-model-path", str(draft_config)]
    async with serve_in_subprocess(Qwen3Config(**TARGET).to_dict(), args=args) as url:
        async with SGLangHTTPBackend(url, draft_prefix="mtp.") as backend:
            draft_before = await _checksums(backend, "draft")
            assert set(draft_before) == set(expected_draft)
            assert draft_before != expected_draft  # the server's own initial draft
            sync = create_weight_synchronizer(
                source,
                backend,
                colocated=True,
                sync=SyncOptions(draft=draft),  # type: ignore[arg-type]
            )
            async with sync:
                await sync.mark_stale()
                await sync.sync_weights()
            assert sync.weight_version == 1
            target_after = await _checksums(backend, "target")
            draft_after = await _checksums(backend, "draft")
            info = httpx.get(f"{url}/model_info", timeout=30).json()
        log = _log(url)
    # The target is the trainer's, bit for bit, under one version label.
    assert {n: target_after[n] for n in expected_target} == expected_target
    assert info["weight_version"] == "1"
    selectors = {
        (e["path"], e.get("selector", "all"))
        for e in log
        if e["path"] in ("/begin_weight_update", "/update_weights_from_tensor")
    }
    updates = [e for e in log if e["path"] == "/update_weights_from_tensor"]
    if draft == "with_target":
        assert draft_after == expected_draft  # the draft refit bit for bit with the target
        assert selectors == {
            ("/begin_weight_update", "all"),
            ("/update_weights_from_tensor", "all"),
        }
    else:
        assert draft_after == draft_before  # frozen: the draft, bit for bit as it was
        assert selectors == {
            ("/begin_weight_update", "target"),
            ("/update_weights_from_tensor", "target"),
        }
        # No draft tensor travelled: the synchronizer's plan holds the target's alone.
        assert set(sync.policy.prepare_refit_info()) == set(expected_target)
    assert updates and all(e.get("status", 200) == 200 for e in updates)
