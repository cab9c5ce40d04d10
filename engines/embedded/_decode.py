"""Generation in the embedded engine: one token per forward pass, a gate between steps.

:class:`_Decoding` is the generation half of
:class:`~aiosync.engines.embedded.model.HFModelRunner` (the other, its module, builds
the model and loads its weights): :meth:`~_Decoding.decode` runs one prompt with a KV
cache, one forward pass per token, and calls the engine's gate between steps, so an
engine can pause a request mid-way (the in-flight policy of
:class:`aiosync.WeightSynchronizer`); on a tensor-parallel replica the driver tells the
other ranks to run each step. Sampling: greedy, or temperature and top-p
(:func:`_nucleus`), and each token's log-probability.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from aiosync.errors import TransportError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ._fp8 import _FP8Weights
    from ._lora import PeftAdapters
    from ._tp import TensorParallel

__all__ = ["DecodeResult"]


class _Decoding:
    """The generation methods of :class:`~aiosync.engines.embedded.model.HFModelRunner`,
    over the state its constructor sets (declared here)."""

    model: PreTrainedModel
    #: Held by the weight loads and by each forward pass (see ``HFModelRunner``).
    lock: threading.RLock
    tensor_parallel: TensorParallel | None
    _adapters: PeftAdapters
    _fp8: _FP8Weights | None
    # The forward's KV-cache argument and output (``cache`` or ``past_key_values``).
    _cache_arg: str

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live."""
        return next(self.model.parameters()).device

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        lora_adapter: str | None = None,
    ) -> list[list[int]]:
        """Generate for each prompt (token ids) with :meth:`decode`; returns only new ids.

        Greedy when ``temperature == 0`` (token for token what transformers'
        ``model.generate(do_sample=False)`` answers); else sampling at
        ``temperature`` (no top-k/top-p), reproducible with ``seed`` (one
        ``torch.Generator`` for the call, so concurrent calls do not disturb each
        other). Prompts run one by one, unpadded, so a prompt's output does not
        depend on the others in the batch. ``lora_adapter`` names a loaded
        adapter (:meth:`load_lora_adapter`) to apply; None: the base model alone,
        whatever adapters are loaded.

        Raises:
            ValueError: an empty prompt, ``max_new_tokens < 1`` or ``temperature < 0``.
            KeyError: ``lora_adapter`` is not loaded.
        """
        _check_sampling(max_new_tokens, temperature)
        generator = self.make_generator(seed)
        return [
            self.decode(
                prompt,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                generator=generator,
                ignore_eos=ignore_eos,
                before_forward=lambda: lora_adapter,
            ).token_ids
            for prompt in prompts
        ]

    def make_generator(self, seed: int | None) -> torch.Generator:
        """A ``torch.Generator`` on the model's device, seeded with ``seed`` (None: random)."""
        generator = torch.Generator(self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator

    def decode(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        ignore_eos: bool = False,
        before_forward: Callable[[], str | None] = lambda: None,
        gate: Callable[[int], bool] | None = None,
        top_p: float = 1.0,
    ) -> DecodeResult:
        """Generate for one prompt, one token per forward pass, with a KV cache.

        Step ``i`` (``0 <= i < max_new_tokens``) computes new token ``i``: step 0
        runs the prompt (``[1, len(prompt)]`` token ids, int64) through the model,
        step ``i > 0`` the single token ``i - 1`` against the KV cache of all
        earlier positions (transformers' ``DynamicCache``, ``use_cache=True``),
        exactly as ``model.generate`` does. The next token is the argmax of the
        last position's logits (float32, ``[vocab_size]``), or a sample of
        ``softmax(logits / temperature)`` restricted to its top-``top_p``
        nucleus (the most probable tokens whose mass reaches ``top_p``; 1.0:
        all). Decoding stops after an EOS token
        (``generation_config.eos_token_id``) unless ``ignore_eos``.

        Each token's log-probability (``DecodeResult.logprobs``) is
        ``log_softmax(logits)[token]`` of those float32 logits, before
        temperature and top-p (vLLM's default ``raw_logprobs``).

        Between steps, outside :attr:`lock`, ``gate(i)`` is called before step
        ``i``: it may block (an engine pausing in place), raise, or return False
        to end the request now (``DecodeResult.aborted``). The forward pass runs
        under :attr:`lock`; ``before_forward()`` is called there first and names
        the LoRA adapter to apply (None: the base model); it may raise to end
        the request. A refit never lands in the middle of a step, and one that
        lands between steps is seen from the next step on. The KV cache of the
        earlier positions is kept across such a refit (what vLLM's ``keep`` and
        SGLang's ``in_place`` pause modes do): after it, the new weights compute
        the remaining tokens while attending to keys and values the old weights
        computed.

        On a tensor-parallel replica this runs on the driver (rank 0): before each
        forward pass, under :attr:`lock`, every other rank is told to run the same
        step (``TensorParallel.announce``), so the replica's collectives pair up;
        only the driver samples, from the all-gathered logits.

        Raises:
            ValueError: an empty prompt, ``max_new_tokens < 1``, ``temperature < 0``
                or ``top_p`` outside ``(0, 1]``; or this runner is a tensor-parallel
                follower (rank > 0), which never drives generation.
            KeyError: ``before_forward()`` names an adapter that is not loaded.
            SyncError: a tensor-parallel peer refused the step (its weights are
                not valid, or it is asleep).
            TransportError: a tensor-parallel peer is gone or out of step.
            Whatever ``gate`` or ``before_forward`` raise.
        """
        _check_sampling(max_new_tokens, temperature, top_p)
        if not prompt:
            raise ValueError("prompts must not be empty")
        tp = self.tensor_parallel
        if tp is not None and not tp.is_driver:
            raise ValueError(
                f"tensor-parallel rank {tp.rank} follows its replica's rank 0, which "
                "drives generation; send generate requests to rank 0"
            )
        eos = set() if ignore_eos else self.eos_ids()
        step_input = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        cache: Any = None
        request: int | None = None  # this request's id among the replica's ranks
        tokens: list[int] = []
        logprobs: list[float] = []
        try:
            for i in range(max_new_tokens):
                if gate is not None and not gate(i):
                    return DecodeResult(tokens, aborted=True, logprobs=logprobs)
                with self.lock:
                    adapter = before_forward()
                    if tp is not None:
                        request = tp.announce(request, step_input, adapter)
                    logits, cache = self.forward_step(step_input, cache, adapter)
                if temperature > 0:
                    probs = _nucleus(torch.softmax(logits / temperature, dim=-1), top_p)
                    token = int(torch.multinomial(probs, 1, generator=generator).item())
                else:
                    token = int(torch.argmax(logits).item())
                tokens.append(token)
                logprobs.append(float(torch.log_softmax(logits, dim=-1)[token].item()))
                if token in eos:
                    break
                step_input = torch.tensor([[token]], dtype=torch.long, device=self.device)
        finally:
            if tp is not None and request is not None:
                # The channel's sockets are used under the lock only. A release that
                # fails (a follower gone) must not hide why the request ended; such
                # a follower's replica is respawned whole, its caches with it.
                with self.lock, contextlib.suppress(TransportError):
                    tp.release(request)
        return DecodeResult(tokens, aborted=False, logprobs=logprobs)

    def forward_step(
        self, step_input: torch.Tensor, cache: Any, adapter: str | None
    ) -> tuple[torch.Tensor, Any]:
        """One forward pass (hold :attr:`lock`): ``step_input`` (``[1, n]`` int64 ids)
        against ``cache`` (None: a new request), with LoRA adapter ``adapter``
        (None: the base model). Returns the last position's logits (float32,
        ``[vocab_size]``, all of them on a tensor-parallel rank) and the new cache.

        Raises:
            KeyError: ``adapter`` is not loaded.
        """
        with self._adapters.using(adapter), torch.no_grad():
            if self._fp8 is not None:
                self._fp8.refresh()
            out = self.model(input_ids=step_input, use_cache=True, **{self._cache_arg: cache})
            return out.logits[0, -1, :].to(dtype=torch.float32), out[self._cache_arg]

    def eos_ids(self) -> set[int]:
        """The EOS token ids decoding stops at (``generation_config.eos_token_id``)."""
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        if eos is None:
            return set()
        return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """One prompt's generation by :meth:`HFModelRunner.decode`.

    Attributes:
        token_ids: the new token ids, in order.
        aborted: the request was ended early (its gate said so): ``token_ids``
            holds what it had by then.
        logprobs: per token, ``log_softmax(logits)[token]`` of the float32
            logits before temperature and top-p (natural log, ``<= 0``);
            ``len(logprobs) == len(token_ids)``.
    """

    token_ids: list[int]
    aborted: bool
    logprobs: list[float] = field(default_factory=list)


def _check_sampling(max_new_tokens: int, temperature: float, top_p: float = 1.0) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` (``[vocab_size]``, float32, summing to 1) with every token outside
    the top-``top_p`` nucleus zeroed: the most probable tokens, in order, until
    their mass reaches ``top_p`` (the first token always stays). Not renormalized
    (``torch.multinomial`` takes weights). ``top_p >= 1``: ``probs`` itself."""
    if top_p >= 1:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
