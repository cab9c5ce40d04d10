"""``/generate`` and ``/pause_generation``: decoding on the embedded engine through the
scheduler, SGLang's ``meta_info`` (weight-version spans)."""

from __future__ import annotations

import uuid
from typing import Any

from aiosync.engines.sglang._generation import version_spans
from aiosync.engines.sglang.contract_server._base import _Routes
from aiosync.engines.sglang.contract_server._lora import _lora_names
from aiosync.engines.sglang.contract_server._state import _PAUSE_MODES
from aiosync.engines.sglang.contract_server._wire import _error


class _GenerationRoutes(_Routes):
    """SGLang's generation routes."""

    def _generate(self, data: dict[str, Any]) -> Any:
        state = self.server.state
        input_ids = data.get("input_ids")
        single = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], int)
        prompts = [input_ids] if single else input_ids
        if not isinstance(prompts, list) or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
        ):
            raise _error("input_ids must be a non-empty list of token ids or a list of them")
        params = data.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        temperature = float(params.get("temperature", 1.0))
        ignore_eos = bool(params.get("ignore_eos", False))
        top_p = float(params.get("top_p", 1.0))
        seed = params.get("sampling_seed")
        return_logprob = bool(data.get("return_logprob", False))
        names = _lora_names(data.get("lora_path"), len(prompts))
        with state.lock:
            if state.released:
                raise _error(f"memory released ({sorted(state.released)}); resume it first")
            unknown = sorted({n for n in names if n is not None} - set(state.lora_adapters))
            if unknown:
                # SGLang's TokenizerManager: a ValueError, answered 400.
                raise _error(
                    f"The following requested LoRA adapters are not loaded: {set(unknown)}\n"
                    f"Loaded adapters: {set(state.lora_adapters)}."
                )
            lora_ids = [None if n is None else state.lora_adapters[n][0] for n in names]
        results = []
        for prompt, lora_id in zip(prompts, lora_ids, strict=True):
            key = (tuple(prompt), max_new, lora_id, ignore_eos)
            with state.lock:
                cached = state.cache.get(key) if temperature == 0 else None
            aborted = stale = False
            versions: list[str | None] = []
            if cached is None:
                out, logprobs, aborted, versions, stale = self._decode(
                    prompt, max_new, temperature, ignore_eos, lora_id, top_p, seed
                )
                if temperature == 0 and not aborted and len(set(versions)) == 1:
                    with state.lock:
                        state.cache[key] = (out, logprobs)
            else:
                out, logprobs = cached
            finish: dict[str, Any] = {"type": "length", "length": max_new}
            if aborted:
                finish = {"type": "abort", "message": "Abort in waiting queue"}
            elif out and not ignore_eos and out[-1] in state.runner.eos_ids():
                # SGLang's FINISH_MATCHED_TOKEN.
                finish = {"type": "stop", "matched": out[-1]}
            # A cached answer was computed by the weights now live (a flush clears it).
            labels = versions if cached is None else [state.weight_version] * len(out)
            spans = version_spans(labels, state.weight_version)
            meta_info: dict[str, Any] = {
                "id": uuid.uuid4().hex,
                "finish_reason": finish,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "cached_tokens": len(prompt) if cached is not None else 0,
                # SGLang 0.5.23 (utils/weight_versions.py): the label of each run of
                # output tokens, and the answer's label is the last run's.
                "weight_versions": spans,
                "weight_version": spans[-1]["version"],
                # Test-server only: a retracted request was recomputed on top of
                # prefix KV of other weights (no flush between retract and resume).
                "aiosync_stale_kv": stale,
            }
            if return_logprob:
                # SGLang's shape: one [logprob, token_id, text] per output token
                # (text None unless return_text_in_logprobs); with the default
                # logprob_start_len (-1) no prompt position is scored.
                meta_info["output_token_logprobs"] = [
                    [lp, tok, None] for lp, tok in zip(logprobs, out, strict=True)
                ]
                meta_info["input_token_logprobs"] = []
            results.append({"text": "", "output_ids": out, "meta_info": meta_info})
        return results[0] if single else results

    def _decode(
        self,
        prompt: list[int],
        max_new: int,
        temperature: float,
        ignore_eos: bool,
        lora_id: str | None,
        top_p: float = 1.0,
        seed: Any = None,
    ) -> tuple[list[int], list[float], bool, list[str | None], bool]:
        """One request, token by token, at the scheduler: ``(ids, logprobs, aborted,
        versions, stale)`` (``stale``: see :meth:`_Scheduler.readmit`); ``logprobs``:
        each token's ``log_softmax(logits)[token]`` before temperature and top-p
        (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB`` convention, and what SGLang
        reports for greedy requests)."""
        state = self.server.state
        ticket = state.scheduler.admit()
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[str | None] = []
        stale = False
        generator = state.runner.make_generator(None if seed is None else int(seed))

        def before_forward() -> str | None:
            with state.lock:
                versions.append(state.weight_version)
            return lora_id

        def gate(_step: int) -> bool:
            return state.scheduler.step(ticket)

        try:
            while True:
                result = state.runner.decode(
                    prompt + out,
                    max_new_tokens=max_new - len(out),
                    temperature=temperature,
                    ignore_eos=ignore_eos,
                    before_forward=before_forward,
                    gate=gate,
                    top_p=top_p,
                    generator=generator,
                )
                out += result.token_ids
                logprobs += result.logprobs
                ended = bool(out) and not ignore_eos and out[-1] in state.runner.eos_ids()
                if not result.aborted or ticket.aborted or ended or len(out) >= max_new:
                    return out, logprobs, ticket.aborted, versions, stale
                # Retracted: back in the queue, KV cache dropped; recomputed from the
                # prompt and the tokens so far once generation continues.
                stale |= state.scheduler.readmit(ticket)
                if ticket.aborted:
                    return out, logprobs, True, versions, stale
        finally:
            state.scheduler.finish(ticket)

    def _pause_generation(self, data: Any) -> Any:
        """SGLang's ``PauseGenerationReqInput``: ``mode`` ``"abort"`` (default),
        ``"in_place"`` or ``"retract"`` (see :class:`_Scheduler`)."""
        mode = (data or {}).get("mode", "abort") if isinstance(data, dict) else "abort"
        if mode not in _PAUSE_MODES:
            raise _error(f"Invalid mode: {mode!r}. Expected one of {list(_PAUSE_MODES)}.")
        self.server.state.scheduler.pause(mode)
        return {"message": "Generation paused successfully.", "status": "ok"}
