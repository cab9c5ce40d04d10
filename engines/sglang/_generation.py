"""``/generate`` both ways: a :class:`~aiosync.SamplingParams` as SGLang's request body,
SGLang's answer as an :class:`~aiosync.Generation` (:class:`SGLangGeneration`).

The field mapping and the version rules: ``docs/sglang.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiosync.errors import TransportError
from aiosync.generation import Generation, SamplingParams, parse_version, version_span

__all__ = ["SGLangGeneration", "continued", "generate_body", "token_labels", "version_spans"]


def generate_body(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    extra: Mapping[str, Any] | None = None,
    *,
    lora_name: str | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body (SGLang's ``GenerateReqInput``) for token-id prompts.

    ``sampling_params`` gets ``max_new_tokens`` (= ``params.max_tokens``) and
    ``temperature`` always; ``top_p``, ``ignore_eos`` and ``sampling_seed``
    (only with a seed) unless ``extra`` sets them and ``params`` leaves them at
    their defaults. ``params.logprobs`` is ``return_logprob`` (SGLang's default
    ``logprob_start_len``: no prompt position is scored); ``lora_name`` is
    ``lora_path`` (SGLang's field names the adapter, not a path).

    Args:
        extra: more SGLang ``sampling_params`` fields (``stop``, ...).
    """
    sampling = {**(extra or {}), "max_new_tokens": params.max_tokens}
    sampling["temperature"] = params.temperature
    for key, value, default in (
        ("top_p", params.top_p, 1.0),
        ("ignore_eos", params.ignore_eos, False),
        ("sampling_seed", params.seed, None),
    ):
        if value != default or key not in sampling:
            sampling[key] = value
    if sampling["sampling_seed"] is None:
        del sampling["sampling_seed"]
    body: dict[str, Any] = {"input_ids": [list(p) for p in prompts], "sampling_params": sampling}
    if params.logprobs:
        body["return_logprob"] = True
    if lora_name is not None:
        body["lora_path"] = lora_name
    return body


@dataclass(frozen=True, slots=True)
class SGLangGeneration(Generation):
    """One ``/generate`` result: an :class:`aiosync.Generation` plus the server's ``meta_info``.

    The :class:`~aiosync.Generation` fields come from the answer: ``token_ids``
    from ``output_ids``; ``logprobs`` from ``meta_info.output_token_logprobs``
    (``[[logprob, token_id, text], ...]``, asked with ``return_logprob``);
    ``finish_reason`` from ``meta_info.finish_reason.type`` (``"stop"``,
    ``"length"``, ``"abort"``); the versions from ``meta_info.weight_versions``
    (SGLang 0.5.23's per-token spans), else ``meta_info.weight_version`` (see
    :meth:`SGLangGeneration.from_answer`).

    Attributes:
        meta_info: SGLang's ``meta_info`` as the server answered it (``finish_reason``,
            ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ...).
    """

    meta_info: dict[str, Any] = field(default_factory=dict)

    @property
    def output_ids(self) -> list[int]:
        """The generated token ids (SGLang's name for :attr:`token_ids`)."""
        return self.token_ids

    @property
    def weight_version(self) -> str | None:
        """``meta_info["weight_version"]``: the version the server reported when it
        answered (what the last completed ``/update_weight_version`` or versioned
        update set), None if it reports none."""
        version = self.meta_info.get("weight_version")
        return None if version is None else str(version)

    @classmethod
    def from_answer(
        cls,
        item: Any,
        *,
        logprobs: bool = False,
        submitted_version: int | None = None,
        spanned: bool = False,
    ) -> SGLangGeneration:
        """From one ``/generate`` answer ``{"output_ids", "meta_info"}``.

        Versions: SGLang 0.5.23 answers ``meta_info.weight_versions``, the label
        each run of output tokens was computed under (``[{"version", "start",
        "end"}]``, token positions ``[start, end)`` covering every output token;
        ``sglang/srt/utils/weight_versions.py``): ``first_version``,
        ``last_version`` and ``version_change_at`` (the first token of another
        version) are exact, as on vLLM (labels parsed by
        :func:`~aiosync.generation.parse_version`: SGLang's ``"default"`` before any
        update is None). An older server answers only ``meta_info.weight_version``
        (the answer's): that is ``last_version``, and when a refit landed between
        request and answer (``spanned``, or ``submitted_version`` another label)
        ``first_version`` is ``submitted_version`` (None: the initial weights;
        counted as spanning both, the cautious side) and ``version_change_at``
        None. Spans that do not cover the output tokens exactly are ignored (the
        older server's rules apply).

        Args:
            item: the answer (one element of a batch answer).
            logprobs: read ``meta_info.output_token_logprobs`` (the request set
                ``return_logprob``).
            submitted_version: the weight version the backend knew live when it
                sent the request (None: none set yet, the initial weights).
            spanned: a sync committed on the server while the request was in it.

        Raises:
            TransportError: no ``output_ids``, or ``output_token_logprobs`` missing
                or not one ``[logprob, token_id, ...]`` per output token.
        """
        ids = item.get("output_ids", item.get("token_ids")) if isinstance(item, dict) else None
        if not isinstance(ids, list):
            raise TransportError(f"/generate answer without output_ids: {str(item)[:200]}")
        token_ids = [int(i) for i in ids]
        meta = item.get("meta_info")
        meta_info = dict(meta) if isinstance(meta, dict) else {}
        reason = meta_info.get("finish_reason")
        finish = reason.get("type") if isinstance(reason, dict) else reason
        finish_reason = None if finish is None else str(finish)
        values: list[float] | None = None
        if logprobs:
            values = _output_logprobs(meta_info.get("output_token_logprobs"), token_ids)
        labels = token_labels(meta_info, len(token_ids))
        if labels is not None:
            first, last, change = version_span([parse_version(v) for v in labels])
        else:
            last = parse_version(meta_info.get("weight_version"))
            first, change = last, None
            # Not min(submitted, last): a restarted trainer's versions start again
            # at 0, so a newer label may be a lower number (case C27).
            if token_ids and (spanned or (submitted_version is not None and last is not None)):
                first = submitted_version
            if not token_ids:
                first = last = None
        return cls(
            token_ids=token_ids,
            logprobs=values,
            first_version=first,
            last_version=last,
            version_change_at=change,
            aborted=finish_reason == "abort",
            finish_reason=finish_reason,
            meta_info=meta_info,
        )


def continued(first: SGLangGeneration, rest: SGLangGeneration) -> SGLangGeneration:
    """One request answered in two parts: ``first`` (aborted part-way) and ``rest`` (its
    continuation from the prompt plus ``first``'s tokens), as one generation.

    Tokens, logprobs, and the version spans where the server gives them
    (``weight_versions``, ``rest``'s shifted past ``first``'s tokens), are joined;
    ``finish_reason`` is ``rest``'s; ``meta_info`` is ``rest``'s with
    ``prompt_tokens`` and ``completion_tokens`` of the whole request and
    ``aiosync_continued_at`` (``len(first.token_ids)``). The versions: ``first``'s
    tokens are its own, ``rest``'s its own, so ``version_change_at`` is exact
    unless ``first`` itself spanned a refit without saying where.
    """
    tokens = [*first.token_ids, *rest.token_ids]
    logprobs = None
    if first.logprobs is not None and rest.logprobs is not None:
        logprobs = [*first.logprobs, *rest.logprobs]
    meta = dict(rest.meta_info)
    meta["prompt_tokens"] = first.meta_info.get("prompt_tokens", meta.get("prompt_tokens"))
    meta["completion_tokens"] = len(tokens)
    meta["aiosync_continued_at"] = len(first.token_ids)
    a, b = first.meta_info.get("output_token_logprobs"), rest.meta_info.get("output_token_logprobs")
    if isinstance(a, list) and isinstance(b, list):
        meta["output_token_logprobs"] = [*a, *b]
    else:
        meta.pop("output_token_logprobs", None)
    head = token_labels(first.meta_info, len(first.token_ids))
    tail = token_labels(rest.meta_info, len(rest.token_ids))
    labels = None if head is None or tail is None else [*head, *tail]
    if labels is not None:
        meta["weight_versions"] = version_spans(labels, meta.get("weight_version"))
    else:
        meta.pop("weight_versions", None)
    change: int | None
    if labels is not None:
        first_v, last_v, change = version_span([parse_version(v) for v in labels])
    elif not first.token_ids or not rest.token_ids:
        whole = rest if rest.token_ids else first
        first_v, last_v, change = whole.first_version, whole.last_version, whole.version_change_at
    else:
        first_v, last_v = first.first_version, rest.last_version
        if first.spans_versions:
            change = first.version_change_at
        elif rest.first_version != first.last_version:
            change = len(first.token_ids)
        elif rest.version_change_at is not None:
            change = len(first.token_ids) + rest.version_change_at
        else:
            change = None
    return SGLangGeneration(
        token_ids=tokens,
        logprobs=logprobs,
        first_version=first_v,
        last_version=last_v,
        version_change_at=change,
        aborted=rest.aborted,
        finish_reason=rest.finish_reason,
        meta_info=meta,
    )


def token_labels(meta_info: Mapping[str, Any], count: int) -> list[Any] | None:
    """The version label of each of ``count`` output tokens, from SGLang's
    ``meta_info["weight_versions"]`` (``[{"version", "start", "end"}]``, consecutive
    ``[start, end)`` runs from 0); None when absent or not covering exactly ``count``
    tokens (an older server, or an answer this reading does not trust)."""
    spans = meta_info.get("weight_versions")
    if not isinstance(spans, list) or not spans:
        return None
    labels: list[Any] = []
    for span in spans:
        start = span.get("start") if isinstance(span, dict) else None
        end = span.get("end") if isinstance(span, dict) else None
        if (
            not isinstance(start, int)
            or not isinstance(end, int)
            or not start == len(labels) <= end
        ):
            return None
        labels.extend([span.get("version")] * (end - start))
    return labels if len(labels) == count else None


def version_spans(labels: Sequence[Any], current: Any = None) -> list[dict[str, Any]]:
    """``labels`` (one per output token) as SGLang's ``weight_versions``: one
    ``{"version", "start", "end"}`` per run of equal labels; no token: one empty
    span of ``current`` (as SGLang answers a request that made none)."""
    spans: list[dict[str, Any]] = []
    for index, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": label, "start": index, "end": index + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


def _output_logprobs(entries: Any, token_ids: list[int]) -> list[float]:
    """``[logprob, ...]`` from SGLang's ``output_token_logprobs``
    (``[[logprob, token_id, text_or_None], ...]``), checked against ``token_ids``."""
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        raise TransportError(
            f"/generate answered output_token_logprobs {str(entries)[:200]} for "
            f"{len(token_ids)} output tokens (asked with return_logprob)"
        )
    values: list[float] = []
    for entry, token in zip(entries, token_ids, strict=True):
        if not (isinstance(entry, list | tuple) and len(entry) >= 2 and entry[1] == token):
            raise TransportError(
                f"/generate answered output_token_logprobs entry {entry!r} for token {token}"
            )
        values.append(float(entry[0]))
    return values
