"""``SGLangHTTPBackend``: an SGLang server, reached by URL, as the loop's generation backend.

It speaks SGLang's native HTTP API (``sglang/srt/entrypoints/http_server.py``;
request bodies are the ``io_struct`` classes):

===================================  ======  ==========================================
endpoint                             method  body → answer
===================================  ======  ==========================================
``/generate``                        POST    ``GenerateReqInput`` → one dict per prompt
                                             with ``output_ids`` and ``meta_info``
``/update_weights_from_tensor``      POST    ``UpdateWeightsFromTensorReqInput`` →
                                             ``{"success", "message"}``, 200 or 400
``/flush_cache``                     POST    none → 200, or 400 while requests run
``/release_memory_occupation``       POST    ``{"tags": [...]}`` → 200 ``null``
``/resume_memory_occupation``        POST    ``{"tags": [...]}`` → 200 ``null``
``/update_weight_version``           POST    ``UpdateWeightVersionReqInput`` →
                                             ``{"success", "message", "new_version"}``
``/get_weight_version``              GET     → ``{"weight_version": str | null}``
``/get_server_info``                 GET     → server args (``tp_size``,
                                             ``enable_memory_saver``, ``model_path``,
                                             ``dtype``, ``enable_lora``,
                                             ``max_lora_rank``, ``lora_target_modules``...)
``/load_lora_adapter``               POST    ``LoadLoRAAdapterReqInput`` (``lora_name``,
                                             ``lora_path``: a PEFT adapter folder,
                                             ``pinned``) → ``LoRAUpdateOutput``
                                             ``{"success", "error_message",
                                             "loaded_adapters"}``, 200 or 400
``/unload_lora_adapter``             POST    ``UnloadLoRAAdapterReqInput`` (``lora_name``)
                                             → ``LoRAUpdateOutput``, 200 or 400
===================================  ======  ==========================================

Errors answer 400 with ``{"error": {"message": ...}}`` (or ``{"message": ...}``);
a server started with ``--api-key`` answers 401 ``{"error": "Unauthorized"}``
to a request without ``Authorization: Bearer <key>``.

Memory saver (server flag ``--enable-memory-saver``): ``finish_generation``
releases the device memory the server holds (weights and KV cache by default);
SGLang *discards* released weights (unless it keeps a CPU backup), so from
then on the engine holds no valid weights until a sync lands: the backend tells
its synchronizer (which becomes stale) and refuses to generate. Waking is
two-phase, driven by the synchronizer: ``prepare_for_generation(["weights"])``,
the refit, then ``prepare_for_generation(["kv_cache"])`` (case C5). A tag that
is not released is never resumed (SGLang raises on it).

Adapter-only refits (``aiosync.LoRAAdapterSynchronizer``, server flag
``--enable-lora``): :meth:`SGLangHTTPBackend.load_lora_adapter` writes the
adapter as a PEFT folder under ``/dev/shm`` (``aiosync-lora-<pid>-*``, as vLLM's backend),
loads it with ``/load_lora_adapter`` under ``aiosync-v{version}``, removes the
folder once the server answered (SGLang reads it during the load), then unloads
the adapter it replaces. ``/generate`` then carries ``lora_path=<that name>``
(SGLang's field names the adapter, not a path). The path endpoint is used
rather than ``/load_lora_adapter_from_tensors``, whose body changed between
SGLang releases (``serialized_tensors`` str vs ``serialized_named_tensors`` list)
and is pickle-based.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError
from aiosync.generation import Generation, parse_version, version_span
from aiosync.interfaces import IN_FLIGHT_POLICIES, InFlightPolicy
from aiosync.lora import LoRAAdapter
from aiosync.transports._leftovers import SHM_DIR, dir_prefix

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "DEFAULT_FLUSH_TIMEOUT_S",
    "DEFAULT_GENERATE_TIMEOUT_S",
    "FLUSH_BACKOFF_INITIAL_S",
    "FLUSH_BACKOFF_MAX_S",
    "MEMORY_TAGS",
    "SGLangGeneration",
    "SGLangHTTPBackend",
]

logger = logging.getLogger(__name__)

#: The memory regions SGLang's memory saver releases/resumes by tag, in wake order.
MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")

#: Total time ``flush_cache`` keeps retrying a busy server, seconds.
DEFAULT_FLUSH_TIMEOUT_S: float = 60.0
#: First wait between ``/flush_cache`` attempts, seconds; doubles each retry.
FLUSH_BACKOFF_INITIAL_S: float = 0.05
#: Longest wait between ``/flush_cache`` attempts, seconds.
FLUSH_BACKOFF_MAX_S: float = 2.0
#: How often :meth:`SGLangHTTPBackend.pause_generation` polls ``/get_load`` while
#: waiting for running requests (``"wait"``), seconds.
WAIT_POLL_S: float = 0.05
#: Limit for one ``/generate`` call, seconds (rollouts are long).
DEFAULT_GENERATE_TIMEOUT_S: float = 600.0
# Connecting to a local server never legitimately takes long.
_CONNECT_TIMEOUT_S = 10.0
_DISCARDED = "they were released by the memory saver and not re-synced"


@dataclass(frozen=True, slots=True)
class SGLangGeneration(Generation):
    """One ``/generate`` result: an :class:`aiosync.Generation` plus the server's ``meta_info``.

    The :class:`~aiosync.Generation` fields come from the answer: ``token_ids``
    from ``output_ids``; ``logprobs`` from ``meta_info.output_token_logprobs``
    (``[[logprob, token_id, text], ...]``, asked with ``return_logprob``);
    ``finish_reason`` from ``meta_info.finish_reason.type`` (``"stop"``,
    ``"length"``, ``"abort"``); the versions from ``meta_info.weight_version``
    (see :meth:`SGLangHTTPBackend.generate_with_meta`).

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
        cls, item: Any, *, logprobs: bool = False, submitted_version: int | None = None
    ) -> SGLangGeneration:
        """From one ``/generate`` answer ``{"output_ids", "meta_info"}``.

        Args:
            item: the answer (one element of a batch answer).
            logprobs: read ``meta_info.output_token_logprobs`` (the request set
                ``return_logprob``).
            submitted_version: the weight version the backend knew live when it
                sent the request (see :meth:`SGLangHTTPBackend.generate_with_meta`).

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
        labels = meta_info.get("aiosync_token_versions")
        if isinstance(labels, list) and len(labels) == len(token_ids):
            # The test server labels every token; SGLang itself does not.
            first, last, change = version_span([parse_version(v) for v in labels])
        else:
            last = parse_version(meta_info.get("weight_version"))
            first, change = last, None
            if token_ids and submitted_version is not None and last is not None:
                # A refit landed between the request and the answer: its tokens may
                # come from both versions (where they changed SGLang does not say).
                first = min(submitted_version, last)
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


class SGLangHTTPBackend:
    """The SGLang server as a :class:`~aiosync.GenerationBackend`, plus the calls a refit needs.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:30000"``.
        api_key: the server's ``--api-key``; sent as ``Authorization: Bearer``.
        enable_memory_saver: the server runs with ``--enable-memory-saver``:
            :meth:`finish_generation` releases device memory and the refit wakes it.
        release_tags: regions :meth:`finish_generation` releases (subset of
            :data:`MEMORY_TAGS`); add ``"cuda_graph"`` on servers that tag it.
        weights_cpu_backup: the server keeps a CPU copy of released weights
            (``--enable-weights-cpu-backup``), so releasing them does not make
            the engine stale.
        tp_size: entries per ``update_weights_from_tensor`` call (one per
            tensor-parallel rank); None: read ``tp_size`` from ``/get_server_info``.
        request_timeout_s: limit for one request other than ``/generate``, seconds.
        generate_timeout_s: limit for one ``/generate`` call, seconds.
        flush_timeout_s: how long :meth:`flush_cache` retries a busy server, seconds.
        transport: an ``httpx.AsyncBaseTransport`` to use (tests, proxies).
        hf_config: the served model's HF config (a ``PretrainedConfig``, a
            config dict, a ``config.json`` or model folder, or a cached Hub id)
            for :meth:`expected_manifest`; None: the server's ``model_path``.

    Raises:
        ValueError: a non-positive timeout or ``tp_size``, or an unknown tag.
        TypeError: ``hf_config`` is none of the accepted types.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        enable_memory_saver: bool = False,
        release_tags: Sequence[str] = ("weights", "kv_cache"),
        weights_cpu_backup: bool = False,
        tp_size: int | None = None,
        request_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        generate_timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
        flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        hf_config: PretrainedConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    ) -> None:
        for label, value in (
            ("request_timeout_s", request_timeout_s),
            ("generate_timeout_s", generate_timeout_s),
            ("flush_timeout_s", flush_timeout_s),
        ):
            if value <= 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        if tp_size is not None and tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        unknown = [t for t in release_tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
        if hf_config is not None and not (
            isinstance(hf_config, Mapping | str | os.PathLike) or hasattr(hf_config, "to_dict")
        ):
            raise TypeError(
                "hf_config must be a PretrainedConfig, a config dict, a path or a Hub id, "
                f"got {type(hf_config).__name__}"
            )
        self.hf_config = hf_config
        self.base_url = base_url.rstrip("/")
        self.enable_memory_saver = enable_memory_saver
        self.release_tags = tuple(t for t in MEMORY_TAGS if t in release_tags)
        self.weights_cpu_backup = weights_cpu_backup
        self.tp_size = tp_size
        self.request_timeout_s = request_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.flush_timeout_s = flush_timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=_CONNECT_TIMEOUT_S),
            transport=transport,
        )
        self._released: set[str] = set()
        # The weight-version label this backend last set on the server (None: none yet).
        self._version_label: str | None = None
        # False from the moment the server discarded its weights, or a refit began
        # loading into them, until a whole sync landed.
        self._weights_valid = True
        self._invalid_reason = ""
        self._listeners: list[Callable[[], None]] = []
        self._manifest_cache: tuple[Any, dict[str, tuple[tuple[int, ...], torch.dtype]]] | None
        self._manifest_cache = None
        self._warned_manifest = False
        # aiosync's adapters this backend loaded on the server and has not unloaded
        # (one whose load failed without an answer may be among them).
        self._lora_names: list[str] = []
        self._lora_active: str | None = None
        # Why generate() refuses on account of an adapter load (in flight or failed).
        self._lora_refusal: str | None = None

    # -- state --------------------------------------------------------------------

    @property
    def released_tags(self) -> frozenset[str]:
        """Memory regions released and not yet resumed."""
        return frozenset(self._released)

    @property
    def weights_valid(self) -> bool:
        """False while the server holds discarded (garbage) weights or a partly loaded
        version (a sync failed, timed out or was cancelled after its first bucket was
        posted), until a sync lands."""
        return self._weights_valid

    @property
    def lora_adapter(self) -> str | None:
        """The LoRA adapter every :meth:`generate` applies (``lora_path``), None: the base model."""
        return self._lora_active

    def add_invalidation_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the server discards its weights.

        ``HTTPWeightSynchronizer`` registers its ``_invalidate_engine_weights``
        so it turns stale at that moment (case C6).
        """
        self._listeners.append(callback)

    def note_weights_loading(self) -> None:
        """For the synchronizer: the first bucket of a new version is about to be posted.

        From here the server may hold a mix of two versions (SGLang loads each
        bucket in place), so :meth:`generate` refuses until
        :meth:`note_weights_loaded`, even if the sync fails or is cancelled. The
        listeners are not called: this is the syncing synchronizer's own load
        (it turns stale itself if the sync fails), not a discard by the server,
        which would fail the sync in flight.
        """
        self._weights_valid = False
        self._invalid_reason = (
            "a sync began loading new weights and did not complete (failed, timed out "
            "or cancelled), so the server may hold a mix of two versions"
        )

    def note_weights_loaded(self) -> None:
        """For the synchronizer: a complete set of weights landed on the server."""
        self._weights_valid = True
        self._invalid_reason = ""

    def _discard_weights(self, reason: str) -> None:
        self._weights_valid = False
        self._invalid_reason = reason
        for callback in self._listeners:
            callback()

    # -- the GenerationBackend protocol ----------------------------------------

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Resume released memory regions, weights first (None: all released ones).

        A region that is not released is skipped. Without the memory saver this
        does nothing.

        Raises:
            ValueError: an unknown tag.
            TransportError, SyncTimeoutError: the server failed or did not answer.
        """
        wanted = MEMORY_TAGS if tags is None else tuple(tags)
        unknown = [t for t in wanted if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
        for tag in MEMORY_TAGS:
            if tag in wanted and tag in self._released:
                await self._post("/resume_memory_occupation", {"tags": [tag]})
                self._released.discard(tag)

    async def finish_generation(self) -> None:
        """With the memory saver: release ``release_tags`` so the trainer gets the device.

        Releasing weights without a CPU backup makes the engine stale (the
        server discards them); the synchronizer is told before this returns.

        Raises:
            TransportError, SyncTimeoutError: the server failed or did not answer.
        """
        if not self.enable_memory_saver:
            return
        tags = [t for t in self.release_tags if t not in self._released]
        if not tags:
            return
        try:
            await self._post("/release_memory_occupation", {"tags": tags})
        except BaseException:
            # The server may have released part of it: assume the worst.
            if "weights" in tags and not self.weights_cpu_backup:
                self._discard_weights(_DISCARDED)
            raise
        self._released.update(tags)
        if "weights" in tags and not self.weights_cpu_backup:
            self._discard_weights(_DISCARDED)

    # -- generation -------------------------------------------------------------

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> list[list[int]]:
        """Generate from token-id prompts via ``/generate``; returns the new token ids.

        :meth:`generate_with_meta` answers the same with each result's ``meta_info``
        (the server's ``weight_version`` among it).

        Args:
            prompts: one list of token ids per prompt.
            max_new_tokens: tokens to generate per prompt.
            temperature: 0 for greedy.
            top_p, seed, ignore_eos: as :meth:`generate_with_meta`.
            sampling_params: more SGLang ``sampling_params`` fields (``stop``...).

        With a LoRA adapter loaded (:meth:`load_lora_adapter`) every prompt is
        generated with it (``lora_path``).

        Raises:
            ValueError: as :meth:`generate_with_meta`.
            SyncError: the server's weights are released or discarded and not
                re-synced (never generate on garbage weights; case C6), or a sync
                posted part of a new version and then failed, timed out or was
                cancelled (never generate on mixed weights), or a LoRA adapter
                load is in flight or failed.
            TransportError, SyncTimeoutError: the server failed or did not answer.
        """
        results = await self.generate_with_meta(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
            sampling_params=sampling_params,
        )
        return [r.output_ids for r in results]

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> list[SGLangGeneration]:
        """:meth:`generate`, with each result's standing: one :class:`SGLangGeneration`
        (an :class:`aiosync.Generation`) per prompt, in prompt order.

        The keywords are those of :class:`aiosync.GenerationBackend`'s
        ``generate_with_meta`` (the same on the embedded engine and vLLM), sent
        as SGLang's: ``sampling_params`` ``max_new_tokens``, ``temperature``,
        ``top_p``, ``sampling_seed`` (only when ``seed`` is given),
        ``ignore_eos``; ``logprobs`` is the request's ``return_logprob`` (with
        SGLang's default ``logprob_start_len``: no prompt position is scored),
        read back from ``meta_info.output_token_logprobs``. SGLang computes them
        from the raw logits for greedy requests; for sampled ones run the
        server with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` to get the raw,
        pre-temperature convention of :class:`aiosync.Generation` (else SGLang
        reports the log of the processed distribution it sampled from).

        Versions: ``meta_info.weight_version`` (the label the synchronizer set:
        ``str(sync.weight_version)``; SGLang's ``"default"`` before any is
        None) is the answer's ``last_version``. SGLang does not say which
        version computed each token, so when the label this backend last set
        (a versioned update or ``/update_weight_version``) was older when the
        request was sent, ``first_version`` is that older one (a request kept
        in flight across a refit, or one that waited through it: counted as
        spanning both, the cautious side) and ``version_change_at`` is None.
        Servers that label each token (the test server's
        ``meta_info.aiosync_token_versions``) give exact versions and the index.

        Args:
            sampling_params: more SGLang ``sampling_params`` fields (``stop``...);
                ``max_new_tokens`` and ``temperature`` always come from the
                keywords, ``top_p``, ``ignore_eos`` and ``sampling_seed`` from
                them unless left at their defaults.

        Raises:
            ValueError: ``max_new_tokens < 1``, ``temperature < 0`` or ``top_p``
                outside ``(0, 1]`` (before any request).
            SyncError: as :meth:`generate`.
            TransportError: as :meth:`generate`, or an answer whose
                ``output_token_logprobs`` does not match its tokens.
            SyncTimeoutError: as :meth:`generate`.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if "weights" in self._released or not self._weights_valid:
            reason = self._invalid_reason or _DISCARDED
            raise SyncError(
                f"the SGLang server holds no valid weights: {reason}; "
                "sync_weights() (and prepare_for_generation()) before generate()"
            )
        if self._released:
            raise SyncError(
                f"memory regions {sorted(self._released)} are released; "
                "await prepare_for_generation() first"
            )
        if self._lora_refusal is not None:
            raise SyncError(
                f"the SGLang server's LoRA adapter is not usable: {self._lora_refusal}; "
                "a sync must succeed before generate()"
            )
        params = {**(sampling_params or {}), "max_new_tokens": max_new_tokens}
        params["temperature"] = temperature
        # A keyword left at its default keeps what sampling_params says.
        for key, value, default in (
            ("top_p", top_p, 1.0),
            ("ignore_eos", ignore_eos, False),
            ("sampling_seed", seed, None),
        ):
            if value != default or key not in params:
                params[key] = value
        if params["sampling_seed"] is None:
            del params["sampling_seed"]
        body: dict[str, Any] = {"input_ids": [list(p) for p in prompts], "sampling_params": params}
        if logprobs:
            body["return_logprob"] = True
        if self._lora_active is not None:
            body["lora_path"] = self._lora_active
        submitted = parse_version(self._version_label)
        answer = await self._post("/generate", body, timeout_s=self.generate_timeout_s)
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(prompts):
            raise TransportError(
                f"/generate answered {len(items)} results for {len(prompts)} prompts"
            )
        return [
            SGLangGeneration.from_answer(item, logprobs=logprobs, submitted_version=submitted)
            for item in items
        ]

    # -- the in-flight policy -------------------------------------------------------

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        """Pause the server's generation (SGLang's ``/pause_generation``) per ``mode``.

        From the call on the server admits no new request (they wait until
        :meth:`resume_generation`); the running ones:

        * ``"abort"``: ``{"mode": "abort"}``: ended now, answered with the tokens
          they have and ``finish_reason`` ``abort`` (:attr:`SGLangGeneration.aborted`).
        * ``"wait"``: SGLang has no such mode: poll ``/get_load`` until no request
          runs (every ``WAIT_POLL_S`` seconds), then ``{"mode": "in_place"}`` with
          nothing left to freeze; a request admitted between the two is let
          finish (``/continue_generation``) and the wait starts over.
        * ``"keep"``: ``{"mode": "retract"}`` with ``clear_cache`` (the default, and
          what a refit passes): the requests go back to the waiting queue, their
          KV cache dropped, so that the refit's ``/flush_cache`` may run (SGLang
          refuses it while requests sit in the running batch); after
          :meth:`resume_generation` the server recomputes their prompt and tokens
          so far with the new weights and continues. ``clear_cache=False``:
          ``{"mode": "in_place"}``, the KV cache of the old weights kept (as
          vLLM's ``keep``); ``/flush_cache`` then fails until they finish.

        ``clear_cache`` sends no request of its own: the refit flushes the radix
        cache once the new weights loaded (``/flush_cache``, which SGLang runs only
        with no request in the running batch: hence ``retract`` for ``keep``).

        Raises:
            ValueError: an unknown ``mode`` (before any request).
            TransportError, SyncTimeoutError: the server failed or did not answer
                (``"wait"``: no time limit of its own; bound it with a cancel scope,
                as the synchronizer does).
        """
        if mode not in IN_FLIGHT_POLICIES:
            raise ValueError(f"mode must be one of {IN_FLIGHT_POLICIES}, got {mode!r}")
        if mode == "abort":
            await self._post("/pause_generation", {"mode": "abort"})
        elif mode == "keep":
            sglang_mode = "retract" if clear_cache else "in_place"
            await self._post("/pause_generation", {"mode": sglang_mode})
        else:
            while True:
                while await self._requests_in_flight():
                    await anyio.sleep(WAIT_POLL_S)
                await self._post("/pause_generation", {"mode": "in_place"})
                if not await self._requests_in_flight():
                    break
                await self._post("/continue_generation", {})

    async def resume_generation(self) -> None:
        """``/continue_generation``: admit requests again, let paused ones continue.
        Idempotent.

        Raises:
            TransportError, SyncTimeoutError: the server failed or did not answer.
        """
        await self._post("/continue_generation", {})

    async def _requests_in_flight(self) -> int:
        """Requests the server holds (running or waiting), from ``/get_load``."""
        load = await self._request("GET", "/get_load")
        ranks = load if isinstance(load, list) else [load]
        try:
            return sum(int(rank["num_reqs"]) for rank in ranks)
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"/get_load answered {str(load)[:200]}") from exc

    # -- the calls a refit makes ----------------------------------------------------

    async def server_info(self) -> dict[str, Any]:
        """``/get_server_info``: the server's arguments and state."""
        info = await self._request("GET", "/get_server_info")
        if not isinstance(info, dict):
            raise TransportError(f"/get_server_info answered {str(info)[:200]}")
        return info

    async def expected_manifest(
        self, server_info: Mapping[str, Any] | None = None
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """``{hf_name: (shape, dtype)}`` the server's ``load_weights`` takes, or None if unknown.

        Derived from the served model's HF config built on the ``meta`` device
        (no memory, typically well under a second): ``hf_config`` if given, else
        the ``model_path`` of ``/get_server_info`` (a local folder, a
        ``config.json`` or a Hub id already in the local HF cache; nothing is
        downloaded, no remote code runs), with the server's
        ``json_model_override_args`` applied, in the dtype the server runs
        (its ``dtype`` argument; ``"auto"`` resolved as SGLang does). Cached
        per configuration.

        Args:
            server_info: ``/get_server_info``'s answer if the caller has it
                (saves a request).

        Returns:
            The manifest in checkpoint order; None when the server's model
            cannot be built here (not cached locally, remote code, quantized):
            a ``RuntimeWarning`` says so once, and a mismatch then surfaces only
            as the server's refusal of a bucket.

        Raises:
            SyncError: the ``hf_config`` given to the backend cannot be loaded or built.
            TransportError, SyncTimeoutError: ``/get_server_info`` failed.
        """
        from ._manifest import UnknownManifest

        info = dict(server_info) if server_info is not None else await self.server_info()
        source = self.hf_config if self.hf_config is not None else info.get("model_path")
        revision = info.get("revision")
        overrides = _overrides(info.get("json_model_override_args"))
        dtype = info.get("dtype")
        key = (
            id(source) if not isinstance(source, str | os.PathLike) else os.fspath(source),
            revision,
            json.dumps(overrides, sort_keys=True, default=str),
            dtype,
        )
        if self._manifest_cache is not None and self._manifest_cache[0] == key:
            return dict(self._manifest_cache[1])
        try:
            if source is None or isinstance(overrides, str):
                raise UnknownManifest(
                    "the server reports no model_path"
                    if source is None
                    else f"unreadable json_model_override_args: {overrides}"
                )
            manifest = await anyio.to_thread.run_sync(
                _derive_manifest, source, revision, overrides, dtype
            )
        except UnknownManifest as exc:
            if self.hf_config is not None:
                raise SyncError(f"hf_config: {exc}") from exc
            if not self._warned_manifest:
                self._warned_manifest = True
                warnings.warn(
                    f"cannot check the refit manifest against {self.base_url} before the first "
                    f"bucket ({exc}); pass SGLangHTTPBackend(hf_config=...) to check it",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None
        self._manifest_cache = (key, manifest)
        return dict(manifest)

    async def resolve_tp_size(self) -> int:
        """``tp_size`` as given, or as the server reports it (cached)."""
        if self.tp_size is None:
            info = await self.server_info()
            tp = info.get("tp_size", 1)
            if not isinstance(tp, int) or tp < 1:
                raise TransportError(f"/get_server_info reports tp_size={tp!r}")
            self.tp_size = tp
        return self.tp_size

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None,
        flush_cache: bool = False,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> str:
        """POST ``/update_weights_from_tensor`` (not retried: not idempotent); returns the message.

        ``flush_cache=True`` makes SGLang *assert* the flush inside the update
        and crash its scheduler when requests are running, so the synchronizer
        always sends False and flushes with :meth:`flush_cache` afterwards.

        Raises:
            TransportError: non-2xx, ``success: false``, or a connection error.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        answer = await self._post("/update_weights_from_tensor", body)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise TransportError(f"/update_weights_from_tensor failed: {answer.get('message')}")
        if weight_version is not None:
            self._version_label = weight_version
        return str(answer.get("message", "")) if isinstance(answer, dict) else ""

    async def flush_cache(self, timeout_s: float | None = None) -> int:
        """POST ``/flush_cache`` until it answers 200; returns the attempts made.

        Retry policy: SGLang answers 400 while requests are running or waiting,
        so a non-2xx answer, a connection error or a per-request timeout is
        retried (flushing is idempotent) after 0.05 s, doubling to at most 2 s
        (:data:`FLUSH_BACKOFF_INITIAL_S`, :data:`FLUSH_BACKOFF_MAX_S`), for at
        most ``timeout_s`` (default ``flush_timeout_s``) seconds in total.

        Raises:
            TransportError: still failing after ``timeout_s``; names the last answer.
        """
        budget = self.flush_timeout_s if timeout_s is None else timeout_s
        delay = FLUSH_BACKOFF_INITIAL_S
        attempts = 0
        last = "no attempt"
        per_try = min(budget, self.request_timeout_s)
        with anyio.move_on_after(budget):
            while True:
                attempts += 1
                try:
                    await self._post("/flush_cache", None, timeout_s=per_try)
                    return attempts
                except (TransportError, SyncTimeoutError) as exc:
                    last = str(exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, FLUSH_BACKOFF_MAX_S)
        raise TransportError(
            f"/flush_cache did not succeed within {budget} s ({attempts} attempts); last: {last}"
        )

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = False
    ) -> None:
        """POST ``/update_weight_version``: the server reports ``new_version`` from now on
        (``/get_weight_version``, ``meta_info.weight_version``); the weights are untouched.

        Args:
            new_version: the label, e.g. ``str(sync.weight_version)``.
            abort_all_requests: abort running requests first (SGLang's default is
                True; the synchronizer sends False: it flushed an idle cache already).

        Raises:
            TransportError: non-2xx, ``success: false``, or a connection error.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        answer = await self._post("/update_weight_version", body)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise TransportError(f"/update_weight_version failed: {answer.get('message')}")
        self._version_label = new_version

    async def get_weight_version(self) -> str | None:
        """``/get_weight_version``: the ``weight_version`` of the last completed update."""
        answer = await self._request("GET", "/get_weight_version")
        if not isinstance(answer, dict) or "weight_version" not in answer:
            raise TransportError(f"/get_weight_version answered {str(answer)[:200]}")
        version = answer["weight_version"]
        return None if version is None else str(version)

    # -- LoRA adapters (adapter-only refits) ------------------------------------------

    async def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Make ``adapter`` the LoRA adapter every later :meth:`generate` applies.

        Writes it as a PEFT adapter folder (:meth:`~aiosync.LoRAAdapter.save`) in
        ``/dev/shm`` (the temp dir where there is none), named
        ``aiosync-lora-<pid>-*``; POSTs ``/load_lora_adapter`` with
        ``lora_name=adapter.name``; removes the folder once the server answered
        (or the request failed, timed out or was cancelled); then unloads, with
        ``/unload_lora_adapter``, every other adapter this backend loaded. The
        server must run with ``--enable-lora`` (and ``--max-lora-rank``,
        ``--lora-target-modules`` covering the adapter). From the call until it
        returns, and after it raised, :meth:`generate` refuses until a load
        succeeds: the previous adapter is never served silently.

        Raises:
            SyncError: the server's base weights were discarded (memory saver
                without a CPU backup): an adapter cannot restore them.
            TransportError: the server refused the adapter (its ``error_message``
                quoted), an unload failed, or the connection failed.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        name = adapter.name
        self._lora_refusal = (
            f"loading LoRA adapter {name!r} did not complete (failed, timed out or cancelled)"
        )
        self._lora_active = None
        if not self._weights_valid or ("weights" in self._released and not self.weights_cpu_backup):
            reason = self._invalid_reason or _DISCARDED
            raise SyncError(
                f"the SGLang server holds no valid base weights ({reason}): an adapter-only "
                "refit cannot restore them"
            )
        if name in self._lora_names:
            # An earlier load of this name may have landed before it failed; SGLang
            # refuses a name it holds. Unknown to the server is fine too.
            await self._unload_lora(name, quiet=True)
        directory = tempfile.mkdtemp(
            prefix=dir_prefix("lora"), dir=SHM_DIR if os.path.isdir(SHM_DIR) else None
        )
        try:
            await anyio.to_thread.run_sync(adapter.save, directory)
            # Recorded first: a request that fails without an answer may have loaded it.
            self._lora_names.append(name)
            body = {"lora_name": name, "lora_path": directory, "pinned": False}
            answer = await self._post("/load_lora_adapter", body)
            _check_lora_answer(answer, "/load_lora_adapter")
        finally:
            # SGLang read the folder during the request; a failed one needs it no more.
            shutil.rmtree(directory, ignore_errors=True)
        failures = []
        for old in [n for n in self._lora_names if n != name]:
            try:
                await self._unload_lora(old)
            except (TransportError, SyncTimeoutError) as exc:
                failures.append(f"{old}: {exc}")
        if failures:
            raise TransportError(
                f"loaded LoRA adapter {name!r} but could not unload the one(s) it replaces: "
                + "; ".join(failures)
            )
        self._lora_active = name
        self._lora_refusal = None

    async def _unload_lora(self, name: str, *, quiet: bool = False) -> None:
        """POST ``/unload_lora_adapter``; ``quiet``: a refusal (not loaded) is no error."""
        try:
            _check_lora_answer(
                await self._post("/unload_lora_adapter", {"lora_name": name}),
                "/unload_lora_adapter",
            )
        except TransportError:
            if not quiet:
                raise
        if name in self._lora_names:
            self._lora_names.remove(name)

    async def check_lora_adapter(
        self, config: Mapping[str, Any], target_modules: Sequence[str], max_rank: int
    ) -> None:
        """Check that the server can load an adapter of this shape (before any byte moves).

        Args:
            config: the adapter's ``adapter_config.json`` dict.
            target_modules: the adapted layers' names (``q_proj``, ``down_proj``...).
            max_rank: the adapter's largest rank ``r``.

        Raises:
            ValueError: ``/get_server_info`` says the server runs without
                ``--enable-lora``, or ``max_rank`` exceeds its ``--max-lora-rank`` (the
                engine's configuration, as vLLM's ``enable_lora``/``max_lora_rank``).
            RefitMismatchError: a target module is outside its ``--lora-target-modules``
                (SGLang's names: ``q/k/v_proj`` count as ``qkv_proj``, ``gate/up_proj``
                as ``gate_up_proj``).
            TransportError, SyncTimeoutError: ``/get_server_info`` failed.
        """
        info = await self.server_info()
        if "enable_lora" in info and not info["enable_lora"] and not info.get("lora_paths"):
            raise ValueError(
                f"the SGLang server {self.base_url} runs without --enable-lora: it cannot load "
                "LoRA adapters (start it with --enable-lora --max-lora-rank R "
                "--lora-target-modules ...)"
            )
        limit = info.get("max_lora_rank")
        if isinstance(limit, int) and max_rank > limit:
            raise ValueError(
                f"the adapter's rank {max_rank} exceeds the SGLang server's --max-lora-rank {limit}"
            )
        allowed = info.get("lora_target_modules")
        if isinstance(allowed, list | tuple) and allowed and "all" not in allowed:
            outside = sorted(_sglang_modules(target_modules) - _sglang_modules(allowed))
            if outside:
                raise RefitMismatchError(
                    f"the adapter targets {outside}, outside the SGLang server's "
                    f"--lora-target-modules {sorted(allowed)}"
                )

    async def aclose(self) -> None:
        """Close the HTTP connection pool. Idempotent."""
        await self._client.aclose()

    async def __aenter__(self) -> SGLangHTTPBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- plumbing ---------------------------------------------------------------

    async def _post(self, path: str, body: Any, *, timeout_s: float | None = None) -> Any:
        return await self._request("POST", path, body, timeout_s=timeout_s)

    async def _request(
        self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None
    ) -> Any:
        limit = self.request_timeout_s if timeout_s is None else timeout_s
        timeout = httpx.Timeout(limit, connect=min(limit, _CONNECT_TIMEOUT_S))
        where = f"{method} {self.base_url}{path}"
        try:
            if body is None:
                response = await self._client.request(method, path, timeout=timeout)
            else:
                response = await self._client.request(method, path, json=body, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise SyncTimeoutError(f"{where}: no answer within {limit} s ({exc!r})") from exc
        except httpx.HTTPError as exc:
            raise TransportError(f"{where}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 401:
            raise TransportError(
                f"{where}: 401 Unauthorized: the server rejected the API key "
                f"({'none sent' if 'Authorization' not in self._client.headers else 'wrong key'})"
            )
        if not response.is_success:
            raise TransportError(
                f"{where}: HTTP {response.status_code}: {_server_message(response)}"
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text


def _overrides(raw: Any) -> dict[str, Any] | str:
    """SGLang's ``json_model_override_args`` (a JSON object as a string); the text if unreadable."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(str(raw))
    except ValueError:
        return str(raw)
    return dict(value) if isinstance(value, dict) else str(raw)


def _derive_manifest(
    source: Any, revision: Any, overrides: Mapping[str, Any], dtype: Any
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Config → dtype → meta model → checkpoint manifest (worker thread: it imports and builds)."""
    from ._manifest import checkpoint_manifest, engine_dtype, load_hf_config

    config = load_hf_config(
        source, revision=None if revision is None else str(revision), overrides=overrides
    )
    return checkpoint_manifest(config, engine_dtype(config, None if dtype is None else str(dtype)))


#: SGLang's names for the layers it adapts (``lora/utils.py``, ``get_normalized_target_modules``).
_SGLANG_MODULE = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def _sglang_modules(names: Sequence[str]) -> set[str]:
    return {_SGLANG_MODULE.get(str(n), str(n)) for n in names}


def _check_lora_answer(answer: Any, path: str) -> None:
    """A ``LoRAUpdateOutput`` that says ``success: false`` (with a 2xx) is a failure too."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise TransportError(f"{path} failed: {answer.get('error_message')}")


def _server_message(response: httpx.Response) -> str:
    """The server's own words: ``error.message``, ``message``, ``error_message``
    (``LoRAUpdateOutput``), ``error``, or the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
        if data.get("error_message"):
            return str(data["error_message"])
        if error is not None:
            return str(error)
    return str(data)[:500]
