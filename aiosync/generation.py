"""What every engine's ``generate_with_meta`` answers: :class:`Generation`.

One result type for the embedded engine, vLLM and SGLang, so that one rollout
loop drives any of them unchanged (see :class:`~aiosync.GenerationBackend`).
A result carries, besides the new token ids, the behaviour policy's
log-probability of each sampled token (for importance correction of
off-policy samples) and the weight version(s) that computed its tokens (for
staleness accounting, :class:`~aiosync.VersionedReplayBuffer`).

Log-probability convention (every engine): ``logprobs[i]`` is the natural
log of the probability the model's *raw* next-token distribution gave token
``token_ids[i]``: ``log_softmax(logits)[token_ids[i]]`` of the float32 logits,
**before** temperature, top-p or any other processing. This is vLLM's default
(``logprobs_mode="raw_logprobs"``) and what a trainer recomputes with its own
forward pass (``torch.log_softmax(model(ids).logits, -1)``), so the two compare
directly whatever the sampling temperature. Values are float32 precision,
``<= 0``.

No torch here: importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["Generation", "SamplingParams", "sampling_params"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How an engine samples, the same on every engine (vLLM's name, a subset of its fields).

    Attributes:
        max_tokens: the most new tokens per prompt, >= 1 (vLLM's name; the
            keyword form ``generate_with_meta(..., max_new_tokens=N)`` is accepted too).
        temperature: 0.0 is greedy; else sampling from ``softmax(logits / temperature)``.
        top_p: nucleus sampling, in ``(0, 1]`` (1.0: every token; ignored when greedy).
        seed: seeds each worker's sampler (the same seed on one engine gives the same
            tokens; not across engines); None: random.
        ignore_eos: generate ``max_tokens`` tokens whatever is sampled.
        logprobs: fill :attr:`Generation.logprobs` (see the module docstring).

    Raises:
        ValueError: ``max_tokens < 1``, ``temperature`` negative or not finite, or
            ``top_p`` outside ``(0, 1]``.
        TypeError: ``max_tokens`` or ``seed`` not an int.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")

    @property
    def greedy(self) -> bool:
        """Whether the most probable token is always taken (``temperature == 0``)."""
        return self.temperature == 0


_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def sampling_params(
    params: SamplingParams | None = None, keywords: Mapping[str, Any] | None = None
) -> SamplingParams:
    """The one adapter from ``generate_with_meta``'s two call forms to :class:`SamplingParams`.

    ``params`` as given, or built from keywords (``max_new_tokens`` is ``max_tokens``);
    keywords given beside ``params`` override its fields.

    Raises:
        TypeError: an unknown keyword, or neither ``params`` nor a token limit.
        ValueError: see :class:`SamplingParams`.
    """
    given = dict(keywords or {})
    if "max_new_tokens" in given:
        if "max_tokens" in given:
            raise TypeError("give max_new_tokens or max_tokens, not both")
        given["max_tokens"] = given.pop("max_new_tokens")
    unknown = sorted(set(given) - _FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling keyword(s) {unknown}; known: {sorted(_FIELDS)}")
    if params is None:
        if "max_tokens" not in given:
            raise TypeError("generate needs params=SamplingParams(...) or max_new_tokens=")
        return SamplingParams(**given)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be an aiosync.SamplingParams, got {type(params).__name__}")
    return replace(params, **given) if given else params


@dataclass(frozen=True, slots=True)
class Generation:
    """One prompt's result from an engine's ``generate_with_meta``.

    Attributes:
        token_ids: the new token ids, in order (the prompt excluded).
        logprobs: with ``logprobs=True``: per token, the behaviour policy's
            natural-log probability of the sampled token under the raw
            (pre-temperature) distribution, float32 precision,
            ``len(logprobs) == len(token_ids)`` (see the module docstring);
            None when not asked for.
        first_version: the synchronizer's ``weight_version`` of the weights that
            computed the first token; None: no token, the engine's initial
            weights (never synced), or an engine that reports no version
            (:class:`~aiosync.VersionedReplayBuffer` counts None as version 0,
            the initial weights).
        last_version: the same for the last token; equals ``first_version``
            unless a refit landed while the request was kept in flight
            (``sync_weights(in_flight="keep")``).
        version_change_at: index into ``token_ids`` of the first token computed
            by other weights than token 0's; None when one version computed
            them all, or when the engine does not say where (then compare
            ``first_version`` and ``last_version``: :attr:`spans_versions`).
        aborted: the engine ended the request early (a sync paused it with
            ``in_flight="abort"``); ``token_ids`` are those it had by then.
        finish_reason: why the request ended, as the engine says it:
            ``"stop"`` (an EOS or stop token), ``"length"`` (``max_new_tokens``
            reached), ``"abort"``; None when the engine does not say.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    first_version: int | None = None
    last_version: int | None = None
    version_change_at: int | None = None
    aborted: bool = False
    finish_reason: str | None = None

    @property
    def spans_versions(self) -> bool:
        """True when more than one weight version computed the tokens (a "keep"
        request that lived through a refit)."""
        return self.version_change_at is not None or self.first_version != self.last_version


def version_span(versions: Sequence[int | None]) -> tuple[int | None, int | None, int | None]:
    """``(first_version, last_version, version_change_at)`` from per-token versions.

    Args:
        versions: the weight version each token was computed with, in token
            order (None: the initial, never-synced weights).
    """
    if not versions:
        return None, None, None
    first = versions[0]
    change = next((i for i, v in enumerate(versions) if v != first), None)
    return first, versions[-1], change


def parse_version(label: object) -> int | None:
    """An engine's version label as an int: ``"3"`` -> 3; None, ``"default"``
    (SGLang's label before any update) and other non-integer labels -> None."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        return int(label)
    return None
