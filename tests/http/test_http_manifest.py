"""C18 over HTTP: the manifest is checked against the server's model before the first bucket.

The server's expected names come from its HF config built on the ``meta``
device (``SGLangHTTPBackend.expected_manifest``); a trainer whose names, shapes
or dtypes differ gets a ``RefitMismatchError`` at ``init_communicator()`` and
the server's weights are never touched.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from aiosync import RefitMismatchError, SGLangHTTPBackend, SyncError
from aiosync.engines.embedded.configs import TINY_QWEN3, TINY_QWEN3_TIED
from aiosync.engines.sglang._manifest import (
    UnknownManifest,
    checkpoint_manifest,
    engine_dtype,
    load_hf_config,
)
from aiosync.sources import RefitManifest, RefitSource
from aiosync.transports.http import HTTPWeightSynchronizer
from tests._support.steps import first_sync

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024


class DictSource(RefitSource):
    """A trainer that sends exactly these tensors, in this order."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def prepare_refit_info(self) -> RefitManifest:
        return {name: (tuple(t.shape), t.dtype) for name, t in self.tensors.items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


def _fuse_qkv(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's in-memory layout of a fused-attention model: one qkv_proj per layer."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".self_attn.q_proj." in name:
            prefix = name.replace(".q_proj.weight", "")
            parts = [tensors[f"{prefix}.{p}_proj.weight"] for p in ("q", "k", "v")]
            out[f"{prefix}.qkv_proj.weight"] = torch.cat(parts)
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        else:
            out[name] = tensor
    return out


@pytest.fixture
def server(tp2_server: Any) -> Any:
    tp2_server.reset()
    return tp2_server


async def _refused_before_any_bucket(server: Any, source: RefitSource, match: str) -> None:
    server.reset()
    before = server.state_dict()
    async with SGLangHTTPBackend(server.url) as backend:
        sync = HTTPWeightSynchronizer(source, backend, bucket_bytes=BUCKET_BYTES)
        with pytest.raises(RefitMismatchError, match=match):
            await sync.init_communicator()
        # Not initialized: a sync cannot start either.
        await sync.mark_stale()
        with pytest.raises(SyncError, match="init_communicator"):
            await sync.sync_weights()
        assert backend.weights_valid
    assert [e["path"] for e in server.log()] == ["/get_server_info"]
    after = server.state_dict()
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


async def test_fused_qkv_names_are_refused_before_any_bucket(
    server: Any, make_trainer: Any
) -> None:
    tensors = _fuse_qkv(make_trainer(seed=50).expected())
    await _refused_before_any_bucket(
        server,
        DictSource(tensors),
        r"refit manifest mismatch: 2 name\(s\) unknown to the engine, first: "
        r"\['model\.layers\.0\.self_attn\.qkv_proj\.weight', "
        r"'model\.layers\.1\.self_attn\.qkv_proj\.weight'\]; "
        r"6 name\(s\) missing from the trainer, first: "
        r"\['model\.layers\.0\.self_attn\.q_proj\.weight', "
        r"'model\.layers\.0\.self_attn\.k_proj\.weight', "
        r"'model\.layers\.0\.self_attn\.v_proj\.weight'\]",
    )


async def test_a_shape_or_dtype_that_differs_is_refused_before_any_bucket(
    server: Any, make_trainer: Any
) -> None:
    tensors = make_trainer(seed=52).expected()
    wide = {n: t.float() for n, t in tensors.items()}
    await _refused_before_any_bucket(
        server,
        DictSource(wide),
        r"model\.embed_tokens\.weight: trainer \(128, 64\) float32 vs engine \(128, 64\) "
        r"bfloat16.*hint: every differing tensor is float32 on the trainer and bfloat16",
    )
    narrow = dict(tensors)
    narrow["model.norm.weight"] = tensors["model.norm.weight"][:32]
    await _refused_before_any_bucket(
        server,
        DictSource(narrow),
        r"model\.norm\.weight: trainer \(32,\) bfloat16 vs engine \(64,\) bfloat16",
    )


async def test_the_same_tensors_in_another_order_sync_bit_exact(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    # SGLang's load_weights takes names in any order: order alone is no mismatch.
    expected = make_trainer(seed=53).expected()
    reversed_source = DictSource(dict(reversed(list(expected.items()))))
    async with SGLangHTTPBackend(server.url) as backend:
        sync = HTTPWeightSynchronizer(reversed_source, backend, bucket_bytes=BUCKET_BYTES)
        await first_sync(sync)
        assert sync.weight_version == 1
    state_equal(server.state_dict(), expected)


async def test_hf_config_given_to_the_backend_is_what_the_trainer_is_checked_against(
    server: Any, make_trainer: Any
) -> None:
    trainer = make_trainer(seed=54)
    three_layers = {**TINY_QWEN3, "num_hidden_layers": 3}
    async with SGLangHTTPBackend(server.url, hf_config=three_layers) as backend:
        sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES)
        with pytest.raises(RefitMismatchError, match=r"missing from the trainer, first: "):
            await sync.init_communicator()
    async with SGLangHTTPBackend(server.url, hf_config="/no/such/config.json") as backend:
        sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES)
        with pytest.raises(
            SyncError,
            match=r"hf_config: ./no/such/config.json. is no config.json or model folder here",
        ):
            await sync.init_communicator()
    assert "/update_weights_from_tensor" not in [e["path"] for e in server.log()]


async def test_a_model_that_cannot_be_built_here_warns_once_and_is_not_checked() -> None:
    info = {"model_path": "no-such-org/no-such-model-aiosync", "dtype": "auto"}
    async with SGLangHTTPBackend("http://127.0.0.1:9") as backend:
        expected = (
            "cannot check the refit manifest against http://127.0.0.1:9 before the first bucket "
            "('no-such-org/no-such-model-aiosync' is no config.json or model folder here, and no "
            "Hub id in the local HF cache (nothing is downloaded)); "
            "pass SGLangHTTPBackend(hf_config=...) to check it"
        )
        with pytest.warns(RuntimeWarning, match=re.escape(expected)):
            assert await backend.expected_manifest(info) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert await backend.expected_manifest(info) is None


async def test_a_tied_head_is_absent_from_the_expected_manifest(make_trainer: Any) -> None:
    # The HF checkpoint omits lm_head.weight when tie_word_embeddings: so does
    # the trainer (DTensorRefitSource), so do the names the server expects.
    trainer = make_trainer(seed=55, config=TINY_QWEN3_TIED)
    async with SGLangHTTPBackend("http://127.0.0.1:9", hf_config=TINY_QWEN3_TIED) as backend:
        engine = await backend.expected_manifest({"model_path": "ignored", "dtype": "bfloat16"})
    assert engine is not None and "lm_head.weight" not in engine
    assert engine == trainer.prepare_refit_info()


@pytest.mark.parametrize(
    ("config", "server_dtype", "expected"),
    [
        ({**TINY_QWEN3, "dtype": "bfloat16"}, "auto", torch.bfloat16),
        ({**TINY_QWEN3, "dtype": "float32"}, "auto", torch.float16),
        (TINY_QWEN3, None, torch.float16),  # no dtype in the config: float32
        ({**TINY_QWEN3, "model_type": "gemma3_text"}, "auto", torch.bfloat16),
        ({**TINY_QWEN3, "dtype": "bfloat16"}, "half", torch.float16),
        (TINY_QWEN3, "float", torch.float32),
    ],
)
def test_the_engine_dtype_is_resolved_as_sglang_does(
    config: dict[str, Any], server_dtype: str | None, expected: torch.dtype
) -> None:
    items = dict(config)
    if items["model_type"] == "gemma3_text":
        items = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64}
        items["dtype"] = "float32"
    assert engine_dtype(load_hf_config(items), server_dtype) == expected


def test_unknown_dtype_and_unknown_model_type_are_typed() -> None:
    with pytest.raises(UnknownManifest, match="unknown dtype 'int8'"):
        engine_dtype(load_hf_config(TINY_QWEN3), "int8")
    with pytest.raises(UnknownManifest, match="no 'model_type'"):
        load_hf_config({"hidden_size": 4})
    with pytest.raises(UnknownManifest, match="does not know model_type 'no-such-arch'"):
        load_hf_config({"model_type": "no-such-arch"})


def test_manifests_built_at_once_from_threads_keep_their_own_dtype() -> None:
    # A fleet checks each server from its own worker thread; transformers builds
    # under a process-wide default dtype, so unserialized builds restored each
    # other's and gave parameters the wrong dtype (29 of 32 here before the fix).
    config = load_hf_config(TINY_QWEN3)
    dtypes = [torch.bfloat16, torch.float16] * 8
    with ThreadPoolExecutor(4) as pool:
        manifests = list(pool.map(lambda d: checkpoint_manifest(config, d), dtypes))
    for manifest, dtype in zip(manifests, dtypes, strict=True):
        assert {d for _, d in manifest.values()} == {dtype}
