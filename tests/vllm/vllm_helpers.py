"""What the real-vLLM tests share: the prompts and the trainer's greedy continuation."""

from __future__ import annotations

from typing import Any

import torch

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
NEW_TOKENS = 8


def engine_options(model_dir: Any, **overrides: Any) -> dict[str, Any]:
    """The options of every test engine (``vllm.LLM`` or ``AsyncEngineArgs``) over the
    checkpoint in ``model_dir``: aiosync's worker extension, eager, float32, 128
    positions, 4 sequences, seed 0; ``overrides`` replace or add options."""
    from aiosync.engines.vllm.backend import WORKER_EXTENSION

    options = dict(
        model=str(model_dir),
        worker_extension_cls=WORKER_EXTENSION,
        enforce_eager=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
    )
    return options | overrides


def nudge_tensors(model: Any, names: Any, seed: int, per_tensor: int) -> None:
    """Change ``per_tensor`` random elements (seeded by ``seed``) of each named
    parameter of ``model`` by 0.5 to 1.5: a sparse "optimizer step" for delta syncs."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            flat = params[name].view(-1)
            where = torch.randperm(flat.numel(), generator=gen)[:per_tensor]
            flat[where] += torch.rand(per_tensor, generator=gen) + 0.5


async def sync_and_generate(sync: Any, backend: Any) -> list[list[int]]:
    """One sync of an initialised ``sync`` (``mark_stale``, ``sync_weights``), then
    ``backend``'s greedy continuation of :data:`PROMPTS` under the new weights."""
    await sync.mark_stale()
    await sync.sync_weights()
    await backend.prepare_for_generation()
    return await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)


def gloo_collective(source: Any, backend: Any, port: int, **options: Any) -> Any:
    """A ``CollectiveWeightSynchronizer`` from ``source`` into ``backend`` over gloo, its
    trainer meeting at ``port``: one engine worker and timeouts of 120 s unless
    ``options`` say otherwise (``options`` replace or add constructor options)."""
    from aiosync.transports.collective import CollectiveWeightSynchronizer

    return _over_gloo(CollectiveWeightSynchronizer, source, backend, port, **options)


def gloo_sharded(source: Any, backend: Any, port: int, **options: Any) -> Any:
    """:func:`gloo_collective`'s ``ShardedWeightSynchronizer``."""
    from aiosync.transports.sharded import ShardedWeightSynchronizer

    return _over_gloo(ShardedWeightSynchronizer, source, backend, port, **options)


def _over_gloo(cls: Any, source: Any, backend: Any, port: int, **options: Any) -> Any:
    from aiosync import TrainCluster

    defaults: dict[str, Any] = dict(
        train_cluster=TrainCluster(master_port=port),
        inference_world_size=1,
        dist_backend="gloo",
        collective_timeout_s=120,
        rpc_timeout_s=120,
    )
    return cls(source, backend, **(defaults | options))


def async_llm(model_dir: Any, **overrides: Any) -> Any:
    """An ``AsyncLLM`` with :func:`engine_options` (CPU, eager)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_options(model_dir, **overrides)))


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
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    save_with_tokenizer(
        folder, Qwen3ForCausalLM(Qwen3Config(**config, bos_token_id=None, eos_token_id=None))
    )


def save_with_tokenizer(folder: Any, model: Any) -> None:
    """``model`` saved in ``folder`` with a word-level tokenizer of its vocabulary
    (``t0`` .. ``t<vocab-1>``): a checkpoint vLLM loads offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
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
