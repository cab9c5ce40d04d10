"""Generation: streamed ``/v1/completions`` with token-id prompts, each token's weight
version."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from aiosync.engines._http import http_errors, request_timeout
from aiosync.engines._routes import check_request
from aiosync.errors import (
    ExceptionMapping,
    SyncError,
    SyncTimeoutError,
    TransportError,
    map_exceptions,
)
from aiosync.generation import Generation, SamplingParams, sampling_params

if TYPE_CHECKING:
    pass

from aiosync.engines.vllm.server._inflight import _InFlight
from aiosync.engines.vllm.server._wire import ROUTES, _message_of, _raise_for_status


@dataclass
class _Choice:
    """One prompt's answer as it streams in: tokens, their logprobs and versions."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    finish_reason: str | None = None


class _Generation(_InFlight):
    """``generate_with_meta`` on ``/v1/completions``."""

    # -- generation ------------------------------------------------------------------

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        **keywords: Any,
    ) -> list[Generation]:
        """Generate from token-id prompts through ``POST /v1/completions``: one
        :class:`aiosync.Generation` per prompt, in prompt order, the new ids only.

        One streamed request for all prompts (``prompt`` a list of id lists,
        ``return_token_ids``, ``stream``; ``logprobs=0`` when asked: the sampled
        token's log-probability in the server's ``--logprobs-mode``, by default
        the raw logits' ``log_softmax``, :class:`aiosync.Generation`'s
        convention). ``finish_reason`` is vLLM's (``"stop"``, ``"length"``,
        ``"abort"``; ``aborted`` for the latter).

        Versions: the completions API carries no weight-version label, so each
        token is labelled with the version the server computed with when it
        arrived: the server's ``/weight_info`` label when the call was admitted,
        then each version this backend committed (:meth:`on_weights_committed`)
        from the resume of the sync that committed it on. A request kept across
        a ``"keep"`` sync thus reports ``version_change_at`` at its first token
        computed by the new weights. (Exact as long as a chunk the server
        computed before a pause does not reach this client after the sync that
        followed: vLLM's ``/pause`` returns once the outputs computed before it
        were handed to their streams. Versions committed by another client of
        the server are seen at the next call only.)

        Args:
            prompts: one list of token ids per prompt (non-empty).
            params: how to sample (:class:`aiosync.SamplingParams`), or its fields
                as keywords (``max_new_tokens=``, ``temperature=``, ``top_p=``,
                ``seed=``, ``ignore_eos=``, ``logprobs=``).
            timeout_s: how long to wait for a pause of this backend to end
                before generating, seconds (None: ``rpc_timeout_s``). The
                generation itself is bounded by ``generate_timeout_s``.

        Raises:
            ValueError, TypeError: bad sampling parameters or an empty prompt
                (before any request).
            SyncTimeoutError: still paused after ``timeout_s``, or no complete
                answer within ``generate_timeout_s``.
            SyncError: a worker holds half-updated weights (a refit failed
                part-way): refit before generating.
            TransportError: the server failed, is unreachable, or answered
                something else than the request asked for.
        """
        sampling = sampling_params(params, keywords)
        token_prompts = [list(p) for p in prompts]
        if any(not p for p in token_prompts):
            raise ValueError("every prompt needs at least one token id")
        if not token_prompts:
            return []
        wait_s = self.rpc_timeout_s if timeout_s is None else timeout_s
        async with self._gate.shared(wait_s):
            statuses = await self.collective_rpc("aiosync_vllm_status")
            invalid = [s.get("rank") for s in statuses if not s.get("weights_valid", True)]
            if invalid:
                raise SyncError(
                    f"vLLM worker(s) {invalid} of {self.base_url} hold partially updated "
                    "weights; sync before generating"
                )
            admitted = await self.weight_version()
            choices = await self._stream_completions(token_prompts, sampling, admitted)
        return [_generation(c, sampling.logprobs) for c in choices]

    async def _stream_completions(
        self, prompts: list[list[int]], sampling: SamplingParams, admitted: int | None
    ) -> list[_Choice]:
        body: dict[str, Any] = {
            "prompt": prompts,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "ignore_eos": sampling.ignore_eos,
            "return_token_ids": True,
            "stream": True,
        }
        if self.model is not None:
            body["model"] = self.model
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.logprobs:
            body["logprobs"] = 0
        choices = [_Choice() for _ in prompts]
        started = [False] * len(prompts)
        epoch = self._version_epoch
        check_request(ROUTES, "POST", "/v1/completions", body)
        where = f"POST {self.base_url}/v1/completions"
        limit = self.generate_timeout_s

        def version_now() -> int | None:
            return admitted if self._version_epoch == epoch else self._computing

        errors: ExceptionMapping = {
            TimeoutError: lambda _: SyncTimeoutError(
                f"{where}: no complete answer within {limit} s"
            ),
            **http_errors(where, lambda _: f"{where}: no complete answer within {limit} s"),
        }
        try:
            with map_exceptions(errors), anyio.fail_after(limit if math.isfinite(limit) else None):
                async with self._client.stream(
                    "POST", "/v1/completions", json=body, timeout=request_timeout(limit)
                ) as response:
                    if not response.is_success:
                        await response.aread()
                    _raise_for_status(
                        response, where, "/v1/completions", "Authorization" in self._client.headers
                    )
                    async for chunk in _server_sent_events(response, where):
                        for entry in chunk.get("choices") or []:
                            index = _choice_index(entry, len(prompts), where)
                            self._add_tokens(choices[index], entry, version_now(), where)
                            if not started[index] and choices[index].token_ids:
                                started[index] = True
                                self._gate.streaming += 1
                            if entry.get("finish_reason") is not None and started[index]:
                                started[index] = False
                                self._gate.streaming -= 1
                                self._gate.notify()
        finally:
            left = sum(started)
            if left:
                self._gate.streaming -= left
                self._gate.notify()
        unfinished = [i for i, c in enumerate(choices) if c.finish_reason is None]
        if unfinished:
            raise TransportError(
                f"{where}: the stream ended without finishing prompts {unfinished}"
            )
        return choices

    def _add_tokens(
        self, choice: _Choice, entry: Mapping[str, Any], version: int | None, where: str
    ) -> None:
        """Append one streamed chunk of one prompt (``token_ids``, ``logprobs.token_logprobs``)."""
        ids = entry.get("token_ids") or []
        if not isinstance(ids, list):
            raise TransportError(f"{where}: token_ids {str(ids)[:80]} is not a list")
        logprobs = entry.get("logprobs")
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if values is not None and len(values) != len(ids):
            raise TransportError(
                f"{where}: {len(values)} token_logprobs for {len(ids)} token ids in one chunk"
            )
        choice.token_ids.extend(int(t) for t in ids)
        choice.logprobs.extend(values if values is not None else [None] * len(ids))
        choice.versions.extend([version] * len(ids))
        self._streamed_tokens += len(ids)
        if entry.get("finish_reason") is not None:
            choice.finish_reason = str(entry["finish_reason"])


def _generation(choice: _Choice, logprobs: bool) -> Generation:
    """A :class:`~aiosync.Generation` from one prompt's streamed answer.

    Raises:
        TransportError: asked for logprobs and the server answered none for a token.
    """
    from aiosync.generation import version_span

    values: list[float] | None = None
    if logprobs:
        if any(v is None for v in choice.logprobs):
            raise TransportError("the vLLM server answered no logprob for a sampled token")
        values = [float(v) for v in choice.logprobs if v is not None]
    first, last, change = version_span(choice.versions)
    return Generation(
        token_ids=list(choice.token_ids),
        logprobs=values,
        first_version=first,
        last_version=last,
        version_change_at=change,
        aborted=choice.finish_reason == "abort",
        finish_reason=choice.finish_reason,
    )


async def _server_sent_events(
    response: httpx.Response, where: str
) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a ``text/event-stream`` answer, up to ``data: [DONE]``.

    Raises:
        TransportError: a chunk that is not a JSON object, or an ``error`` chunk
            (the server's message quoted).
    """
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except ValueError as exc:
            raise TransportError(f"{where}: a chunk is not JSON: {payload[:200]}") from exc
        if not isinstance(chunk, dict):
            raise TransportError(f"{where}: a chunk is not an object: {payload[:200]}")
        if "error" in chunk:
            raise TransportError(f"{where}: {_message_of(chunk)}")
        yield chunk


def _choice_index(entry: Any, count: int, where: str) -> int:
    index = entry.get("index") if isinstance(entry, dict) else None
    if not isinstance(index, int) or not 0 <= index < count:
        raise TransportError(f"{where}: a choice with index {index!r} for {count} prompts")
    return index
