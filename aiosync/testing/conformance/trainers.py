"""The kit's trainers and the model they train: what a sync must leave on the engine.

:class:`KitTrainer` is the full-checkpoint trainer every case but LoRA syncs;
:class:`LoRAKitTrainer` a PEFT LoRA adapter on the engine's own base model (the
LoRA case's). Both yield their tensors through hooks the cells use (``on_tensor``,
``rename``) and say what the engine must hold (``state``) and generate (``generate``).
"""

from __future__ import annotations

import copy
import random
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from aiosync.refit import LoRAAdapterRefitSource
from aiosync.sources import RefitManifest, RefitSource

#: trainer's dtype too, so the engine must hold its tensors bit for bit).
DTYPE = "bfloat16"
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9]]
#: Small buckets: every sync moves several of them, so a cancel lands mid-stream.
BUCKET_BYTES = 16 * 1024
#: The scales ``kv_scales`` sends: layer -> scale (both K and V).
KV_SCALES = {0: 0.5, 1: 0.25}
#: The manifest entry ``bad_manifest`` renames (the engine has no tensor of the new name).
RENAMED = ("model.norm.weight", "model.final_norm.weight")
#: The live weight the delta cell corrupts (replicated on tensor-parallel ranks).
CORRUPTED = "model.layers.1.post_attention_layernorm.weight"
#: The engines' own init: a seed no trainer uses, so a sync changes every tensor (and the
#: base model a LoRA trainer's adapter is trained on).
ENGINE_SEED = 3
#: The in-flight and elastic cells' request: its prompt and length (tokens; long enough
#: that the sync lands while it runs), and how many tokens it has when the sync starts.
LONG_PROMPT = [3, 1, 4, 1, 5]
LONG = 400
STARTED = 30


def _tiny_config() -> dict[str, Any]:
    from aiosync.engines.embedded.configs import TINY_QWEN3

    return dict(TINY_QWEN3)


def _free_port() -> int:
    """A loopback port nothing holds, drawn below the kernel's ephemeral range: a port
    ``bind(0)`` hands out may go to an outgoing connection before the group binds it."""
    for _ in range(1000):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free loopback port in 20000-32767")


class KitTrainer(RefitSource):
    """A bf16 tiny Qwen3 behind :class:`~aiosync.refit.DTensorRefitSource`.

    ``step(seed)`` changes every 7th element of every parameter (an "optimizer step"
    a delta can compress); ``on_tensor(i)`` runs before the ``i``-th tensor is yielded;
    ``rename`` renames manifest entries (and the tensors yielded); ``drift_at = i``
    yields the ``i``-th tensor cut to its first row, once (a rank whose gather went
    wrong: the tensor no longer matches the manifest).
    """

    #: What ``bad_manifest`` renames (entries of the manifest to names the engine lacks),
    #: and what its refusal must name: both names (the engine lacks the new one, the
    #: trainer the old one).
    renames: ClassVar[dict[str, str]] = dict([RENAMED])
    refusal_names: ClassVar[tuple[str, ...]] = RENAMED

    def __init__(self, seed: int, *, rename: Mapping[str, str] | None = None) -> None:
        from aiosync.engines.embedded.model import HFModelRunner
        from aiosync.refit import DTensorRefitSource

        self.runner = HFModelRunner.from_config(_tiny_config(), seed=seed, dtype=torch.bfloat16)
        self.model = self.runner.model
        self.inner = DTensorRefitSource(self.model)
        self.seed = seed
        self.rename = dict(rename or {})
        self.on_tensor: Callable[[int], None] | None = None
        self.drift_at: int | None = None

    def prepare_refit_info(self) -> RefitManifest:
        return {self.rename.get(n, n): spec for n, spec in self.inner.prepare_refit_info().items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from _hooked(self, self.inner.iter_weights())

    def hf_config(self) -> Any:
        return self.inner.hf_config()

    def step(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                flat = p.view(-1)
                flat[::7] += (torch.randn(flat[::7].shape, generator=gen) * 0.05).to(p.dtype)

    def state(self) -> dict[str, torch.Tensor]:
        """What the engine must hold after a sync: the source's tensors, copies."""
        return {n: t.clone() for n, t in self.inner.iter_weights()}

    def full_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())

    def generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        return self.runner.generate([list(p) for p in prompts], max_new_tokens=n, ignore_eos=True)


def _hooked(
    trainer: Any, weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` through a kit trainer's hooks: ``on_tensor``, ``drift_at``, ``rename``."""
    for i, (name, tensor) in enumerate(weights):
        if trainer.on_tensor is not None:
            trainer.on_tensor(i)
        if i == trainer.drift_at:
            trainer.drift_at = None
            tensor = tensor[:1]
        yield trainer.rename.get(name, name), tensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def patch_bytes(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the smallest encoding of every changed tensor: what a delta moves."""
    from aiosync.delta import encode_patch

    patches = (encode_patch(n, 0, _bits(old[n]), new[n]) for n in new)
    return sum(p.nbytes for p in patches if p is not None)


def box_patch_bytes(
    plan: Any, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> int:
    """Bytes a shard-aware delta moves: per transfer of ``plan`` (one box of one tensor),
    nothing when no bit of the box changed, else the smaller of its dense bytes and int32
    indices + values of its changed elements (ties dense)."""
    total = 0
    for t in plan.transfers():
        index = tuple(slice(lo, hi) for lo, hi in t.box)
        before, after = old[t.name][index], new[t.name][index]
        changed = int((_bits(before.contiguous()) != _bits(after.contiguous())).sum())
        if changed:
            size = after.element_size()
            total += min(after.numel() * size, changed * (4 + size))
    return total


#: The LoRA trainer's adapter: rank, and the linear layers of a Qwen3 block it targets.
LORA_RANK = 4
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The LoRA case's engine's dtype: the adapter's (PEFT keeps fp32 adapters), so that the
#: engine applying the adapter and the trainer's merged model compute the same tokens.
LORA_DTYPE = "float32"


class LoRAKitTrainer(LoRAAdapterRefitSource):
    """A PEFT LoRA adapter (r=4 on every linear layer, ``lora_B`` random and nonzero)
    on the LoRA engine's own base model (fp32, :data:`ENGINE_SEED`), behind
    :class:`~aiosync.refit.LoRAAdapterRefitSource`: the LoRA case's trainer.

    The interface of :class:`KitTrainer`: ``state()`` is the adapter's tensors (PEFT's
    saved names: what every engine worker must apply), ``generate`` the greedy output
    of ``merge_and_unload()`` of a copy, ``step(seed)`` changes every 7th element of
    every adapter parameter (the base stays frozen)."""

    #: What ``bad_manifest`` renames: one module's adapter pair to a layer the engine's
    #: 2-layer model lacks; its refusal names that module (an adapter need not target
    #: every module, so the old one is not missed).
    renames: ClassVar[dict[str, str]] = {
        f"base_model.model.model.layers.1.mlp.down_proj.lora_{ab}.weight": (
            f"base_model.model.model.layers.7.mlp.down_proj.lora_{ab}.weight"
        )
        for ab in "AB"
    }
    refusal_names: ClassVar[tuple[str, ...]] = ("model.layers.7.mlp.down_proj",)

    def __init__(self, seed: int) -> None:
        from peft import LoraConfig, get_peft_model

        from aiosync.engines.embedded.model import HFModelRunner

        base = HFModelRunner.from_config(
            _tiny_config(), seed=ENGINE_SEED, dtype=getattr(torch, LORA_DTYPE)
        ).model
        config = LoraConfig(
            r=LORA_RANK,
            lora_alpha=2 * LORA_RANK,
            target_modules=list(LORA_TARGETS),
            init_lora_weights=False,  # lora_B nonzero: the adapter changes the outputs
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = get_peft_model(base, config)
        peft_model.eval()
        super().__init__(peft_model)
        self.seed = seed
        self.rename: dict[str, str] = {}
        self.on_tensor: Callable[[int], None] | None = None
        self.drift_at: int | None = None

    def prepare_refit_info(self) -> RefitManifest:
        manifest = super().prepare_refit_info()
        return {self.rename.get(n, n): spec for n, spec in manifest.items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from _hooked(self, super().iter_weights())

    def _adapter(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in self.model.named_parameters() if "lora_" in n)

    def step(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in self._adapter():
                flat = p.view(-1)
                flat[::7] += torch.randn(flat[::7].shape, generator=gen).to(p.dtype) * 0.5

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in super().iter_weights()}

    def full_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())

    def generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        from aiosync.engines.embedded.model import HFModelRunner

        peft_model: Any = copy.deepcopy(self.model)
        runner = HFModelRunner(peft_model.merge_and_unload())
        return runner.generate([list(p) for p in prompts], max_new_tokens=n, ignore_eos=True)
