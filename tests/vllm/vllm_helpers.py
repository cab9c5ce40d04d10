"""What the real-vLLM tests share: the prompts and the trainer's greedy continuation."""

from __future__ import annotations

from typing import Any

import torch

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
NEW_TOKENS = 8


def trainer_greedy(model: Any, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuation (``new_tokens`` ids, EOS ignored) of every prompt of
    ``PROMPTS`` by a transformers model (the trainer's, or a merged PEFT one)."""
    outputs = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def save_tiny_qwen3(folder: Any, config: dict[str, Any]) -> None:
    """A random Qwen3 of ``config`` (seed 0) plus a word-level tokenizer
    (``t0`` .. ``t<vocab-1>``) saved in ``folder``: a checkpoint vLLM loads offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**config, bos_token_id=None, eos_token_id=None)).save_pretrained(
        folder
    )
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)


async def read_weights(backend: Any, names: list[str]) -> list[dict[str, torch.Tensor]]:
    """Each worker's live tensors under HF names, read back through the kernels vLLM
    computes with (``aiosync_vllm_read_weights``: an embedding or head through its
    GEMM, so a stale packed copy shows; this worker's slice, vocabulary padding included)."""
    from aiosync.transports.packing import dtype_from_name

    replies = await backend.collective_rpc("aiosync_vllm_read_weights", (names,))
    out = []
    for read in replies:
        tensors = {}
        for name, shape, dtype, raw in read:
            flat = torch.frombuffer(bytearray(raw), dtype=dtype_from_name(dtype))
            tensors[name] = flat.reshape(shape)
        out.append(tensors)
    return out


def perturb(model: Any, seed: int) -> None:
    """One 'optimizer step': move every weight (a tied one once) enough to change
    greedy decoding."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
