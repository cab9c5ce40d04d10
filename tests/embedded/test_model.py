"""HFModelRunner: the checkpoint layout save_pretrained writes, loaded bit-exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from aiosync.engines.embedded.configs import TINY_QWEN3_MOE, TINY_QWEN3_TIED
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import RefitMismatchError

MOE = TINY_QWEN3_MOE
DENSE_TIED = TINY_QWEN3_TIED


def _saved(runner: HFModelRunner, tmp_path: Path) -> dict[str, torch.Tensor]:
    runner.model.save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("config", [MOE, DENSE_TIED], ids=["qwen3_moe", "qwen3_tied"])
def test_manifest_and_state_dict_are_what_save_pretrained_writes(
    config: dict[str, Any], tmp_path: Path
) -> None:
    runner = HFModelRunner.from_config(config, seed=1)
    saved = _saved(runner, tmp_path)
    manifest = runner.expected_manifest()
    assert sorted(manifest) == sorted(saved)
    assert manifest == {name: (tuple(t.shape), t.dtype) for name, t in saved.items()}
    state = runner.hf_state_dict()
    assert list(state) == list(manifest)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_manifest_order_is_save_pretrained_order(tmp_path: Path) -> None:
    runner = HFModelRunner.from_config(MOE, seed=1)
    runner.model.save_pretrained(tmp_path)
    names = list(runner.expected_manifest())
    assert names[:5] == [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.experts.0.down_proj.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight",
    ]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(names)


def test_moe_expert_weights_land_in_the_fused_tensors(tmp_path: Path) -> None:
    source = HFModelRunner.from_config(MOE, seed=1)
    target = HFModelRunner.from_config(MOE, seed=2)
    saved = _saved(source, tmp_path)
    assert target.load_weights(saved.items()) == len(saved)
    experts = target.model.model.layers[0].mlp.experts
    im = MOE["moe_intermediate_size"]
    prefix = "model.layers.0.mlp.experts"
    for e in range(MOE["num_experts"]):
        gate = saved[f"{prefix}.{e}.gate_proj.weight"]
        up = saved[f"{prefix}.{e}.up_proj.weight"]
        assert torch.equal(experts.gate_up_proj[e, :im], gate)
        assert torch.equal(experts.gate_up_proj[e, im:], up)
        assert torch.equal(experts.down_proj[e], saved[f"{prefix}.{e}.down_proj.weight"])
    for name, tensor in target.hf_state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_reloaded_checkpoint_generates_like_its_source(tmp_path: Path) -> None:
    source = HFModelRunner.from_config(MOE, seed=1)
    target = HFModelRunner.from_config(MOE, seed=2)
    target.load_weights(_saved(source, tmp_path).items())
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    outs = target.generate(prompts, max_new_tokens=6)
    assert outs == source.generate(prompts, max_new_tokens=6)
    direct = source.model.generate(
        torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False, pad_token_id=0
    )
    assert outs[0] == direct[0, 3:].tolist()
    assert all(len(o) <= 6 for o in outs)


def test_sampling_is_reproducible_with_a_seed() -> None:
    runner = HFModelRunner.from_config(DENSE_TIED, seed=1)
    first = runner.generate([[1, 2]], max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    again = runner.generate([[1, 2]], max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert first == again
    assert len(first[0]) == 8


def test_tied_lm_head_is_accepted_and_aliases_the_embedding() -> None:
    runner = HFModelRunner.from_config(DENSE_TIED, seed=1)
    assert "lm_head.weight" not in runner.expected_manifest()
    table = torch.full((128, 64), 0.5)
    assert runner.load_weights([("lm_head.weight", table)]) == 1
    assert torch.equal(runner.hf_state_dict()["model.embed_tokens.weight"], table)


def test_load_rejects_unknown_names_and_wrong_shapes() -> None:
    runner = HFModelRunner.from_config(DENSE_TIED, seed=1)
    with pytest.raises(RefitMismatchError, match=r"model\.final_norm\.weight"):
        runner.load_weights([("model.final_norm.weight", torch.ones(64))])
    with pytest.raises(RefitMismatchError, match=r"model\.norm\.weight: model \(64,\)"):
        runner.load_weights([("model.norm.weight", torch.ones(65))])
    with pytest.raises(RefitMismatchError, match="bfloat16"):
        runner.load_weights([("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))])


def test_kv_cache_scales_are_recorded_as_vllm_names_them() -> None:
    runner = HFModelRunner.from_config(DENSE_TIED, seed=1)
    before = runner.hf_state_dict()
    loaded = runner.load_weights(
        [
            ("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
            ("model.layers.1.self_attn.v_scale", torch.tensor([0.25])),
        ]
    )
    assert loaded == 2
    assert runner.kv_scales == {
        "model.layers.0.self_attn.k_scale": 0.5,
        "model.layers.1.self_attn.v_scale": 0.25,
    }
    after = runner.hf_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    with pytest.raises(RefitMismatchError, match=r"layers\.9\.self_attn\.k_scale"):
        runner.load_weights([("model.layers.9.self_attn.k_scale", torch.tensor(1.0))])
    with pytest.raises(RefitMismatchError, match="float32 of shape"):
        runner.load_weights([("model.layers.0.self_attn.k_scale", torch.ones(2))])


def test_from_config_loads_a_local_checkpoint_folder(tmp_path: Path) -> None:
    source = HFModelRunner.from_config(MOE, seed=1, dtype="bfloat16")
    saved = _saved(source, tmp_path)
    loaded = HFModelRunner.from_config(tmp_path, dtype=torch.bfloat16)
    state = loaded.hf_state_dict()
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_from_config_requires_a_model_type() -> None:
    with pytest.raises(ValueError, match="model_type"):
        HFModelRunner.from_config({"vocab_size": 8})
