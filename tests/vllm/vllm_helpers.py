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
