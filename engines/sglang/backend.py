"""``SGLangHTTPBackend``: an SGLang server, reached by URL, as the loop's generation engine.

The facade over the HTTP client (:mod:`._client`), the ``/generate`` mapping
(:mod:`._generation`) and LoRA adapters (:mod:`._lora`): it owns what the
engine *is* (the memory saver's released regions, whether its weights can be
trusted, who is told when they are discarded). SGLang's endpoints, the memory
saver's two-phase wake and the adapter path: ``docs/sglang.md``.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.capabilities import (
    DRAFT_REFITS,
    IN_FLIGHT_POLICIES,
    DraftRefit,
    EngineKind,
    InFlightPolicy,
)
from aiosync.errors import SyncError, TransportError, UnsupportedOptionError
from aiosync.generation import Generation, SamplingParams, parse_version
from aiosync.generation import sampling_params as resolve_sampling
from aiosync.lora import LoRAAdapter

from .._generate import GenerateFromMeta
from ._client import (
    DEFAULT_FLUSH_TIMEOUT_S,
    FLUSH_BACKOFF_INITIAL_S,
    FLUSH_BACKOFF_MAX_S,
    SGLangClient,
    http_status,
)
from ._generation import SGLangGeneration, continued, generate_body
from ._lora import SGLangAdapters, check_adapter_fits
from ._manifest import ServerManifests

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from aiosync.capabilities import (
        ConfigReporting,
        DiscardNotifier,
        DraftHolding,
        Engine,
        Generating,
        HealthReporting,
        ManifestReporting,
        PausableEngine,
        RestartReporting,
        SleepReporting,
        ValidityReporting,
    )

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

#: How often :meth:`SGLangHTTPBackend.pause_generation` polls ``/v1/loads`` while
#: waiting for running requests (``"wait"``), seconds.
WAIT_POLL_S: float = 0.05
#: Limit for one ``/generate`` call, seconds (rollouts are long).
DEFAULT_GENERATE_TIMEOUT_S: float = 600.0
_DISCARDED = "they were released by the memory saver and not re-synced"


class SGLangHTTPBackend(GenerateFromMeta, SGLangClient):
    """The SGLang server as an :class:`~aiosync.capabilities.Engine`, plus the calls a refit needs.

    Satisfies :class:`~aiosync.transports.http.SGLangServer` (what
    :class:`~aiosync.transports.http.HTTPWeightSynchronizer` drives) and the
    capabilities :class:`~aiosync.capabilities.PausableEngine`,
    :class:`~aiosync.capabilities.DiscardNotifier`,
    :class:`~aiosync.capabilities.SleepReporting`,
    :class:`~aiosync.capabilities.Generating`,
    :class:`~aiosync.capabilities.ValidityReporting`,
    :class:`~aiosync.capabilities.ManifestReporting` and
    :class:`~aiosync.capabilities.ConfigReporting` (checked statically at
    the end of this module). ``generate()`` is :meth:`generate_with_meta`'s token ids.

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
            for :meth:`expected_manifest` and :meth:`expected_config`; None: the
            server's ``model_path``.
        draft_prefix: the server runs a speculative-decoding draft model (MTP,
            ``--speculative-algorithm NEXTN``) whose tensors the updates name under this
            prefix (``"mtp."``: Qwen3-Next's MTP layers); it is then a
            :class:`~aiosync.capabilities.DraftHolding` (``docs/draft.md``). None: the
            server's draft, if any, is not refit (updates keep SGLang's ``selector``
            ``"all"``; the draft's loader skips the target's names).
        draft_hf_config: the draft model's HF config, as ``hf_config``, for the draft's
            part of :meth:`expected_manifest` (its names under ``draft_prefix``); None:
            ``/get_server_info``'s ``speculative_draft_model_path``.

    Raises:
        ValueError: a non-positive timeout or ``tp_size``, or an unknown tag.
        TypeError: ``hf_config`` is none of the accepted types.
    """

    #: Which engine this is (:class:`~aiosync.capabilities.KindReporting`): the factory
    #: picks the transport by it.
    engine_kind: EngineKind = "sglang"

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
        draft_prefix: str | None = None,
        draft_hf_config: PretrainedConfig
        | Mapping[str, Any]
        | str
        | os.PathLike[str]
        | None = None,
    ) -> None:
        if generate_timeout_s <= 0:
            raise ValueError(f"generate_timeout_s must be > 0, got {generate_timeout_s}")
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
        super().__init__(
            base_url,
            api_key=api_key,
            tp_size=tp_size,
            request_timeout_s=request_timeout_s,
            flush_timeout_s=flush_timeout_s,
            transport=transport,
        )
        self.enable_memory_saver = enable_memory_saver
        self.release_tags = tuple(t for t in MEMORY_TAGS if t in release_tags)
        self.weights_cpu_backup = weights_cpu_backup
        self.generate_timeout_s = generate_timeout_s
        self._manifests = ServerManifests(hf_config, self.base_url)
        if draft_prefix is not None and (not isinstance(draft_prefix, str) or not draft_prefix):
            raise ValueError(f"draft_prefix must be a non-empty string, got {draft_prefix!r}")
        self._draft_prefix = draft_prefix
        self._draft_config_given = draft_hf_config is not None
        self._draft_manifests = ServerManifests(draft_hf_config, self.base_url)
        self._adapters = SGLangAdapters(self._post)
        self._released: set[str] = set()
        # False from the moment the server discarded its weights, or a refit began
        # loading into them, until a whole sync landed.
        self._weights_valid = True
        self._invalid_reason = ""
        # Discards seen (_discard_weights), and how many there were when the load in
        # progress began: one in between voids that load (note_weights_loaded).
        self._discards = 0
        self._discards_at_load = 0
        self._listeners: list[Callable[[], None]] = []
        # The SGLang pause mode this backend put the server in (None: not paused).
        self._pause_mode: str | None = None
        # Set when the pause ends (resume_generation): requests requeued by a
        # "keep" flush (see flush_cache) wait for it to continue or give up.
        self._pause_ended: anyio.Event | None = None
        # How many times a "keep" flush aborted the retracted requests to requeue them.
        self._requeues = 0
        # The server's startup_time (/get_server_info) when this backend first saw it:
        # another one is another process on the same URL (C38). None: not seen yet.
        self._startup_time: object = None
        # How many restarts this backend noticed.
        self._restarts = 0

    # -- the draft model (DraftHolding) ------------------------------------------

    @property
    def draft_prefix(self) -> str | None:
        """The prefix of the draft model's tensors in the updates; None: not refit."""
        return self._draft_prefix

    def select_draft_refit(self, mode: DraftRefit) -> None:
        """``"with_target"``: later updates load the target and the draft (SGLang's
        ``selector="all"``); ``"frozen"``: the target alone (``selector="target"``: the
        draft runner is neither begun, loaded nor ended, and no draft tensor is sent).

        Raises:
            ValueError: an unknown ``mode``.
            UnsupportedOptionError: ``"with_target"`` without ``draft_prefix``.
        """
        if mode not in DRAFT_REFITS:
            raise ValueError(f"mode must be one of {DRAFT_REFITS}, got {mode!r}")
        if mode == "with_target" and self._draft_prefix is None:
            raise UnsupportedOptionError(
                "draft='with_target': this SGLangHTTPBackend was given no draft_prefix (the "
                "names of the server's draft tensors, e.g. 'mtp.')"
            )
        self.selector = "all" if mode == "with_target" else "target"

    async def _draft_manifest(
        self, info: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """The draft's manifest under :attr:`draft_prefix` (empty when the updates do not
        load it); None: it cannot be built here (a ``RuntimeWarning`` says why)."""
        if self._draft_prefix is None or self.selector != "all":
            return {}
        path = info.get("speculative_draft_model_path")
        if not self._draft_config_given and not path:
            warnings.warn(
                f"{self.base_url}: the server reports no speculative_draft_model_path and the "
                "backend was given no draft_hf_config: the draft's tensors are not checked "
                "before the refit",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        manifest = await self._draft_manifests.derive(
            {**info, "model_path": path, "json_model_override_args": "{}"}
        )
        if manifest is None:
            return None
        return {f"{self._draft_prefix}{name}": spec for name, spec in manifest.items()}

    @property
    def hf_config(self) -> PretrainedConfig | Mapping[str, Any] | str | os.PathLike[str] | None:
        """The served model's HF config as given (None: the server's ``model_path``)."""
        return self._manifests.hf_config

    # -- state --------------------------------------------------------------------

    @property
    def asleep_tags(self) -> frozenset[str]:
        """Memory regions released (:meth:`finish_generation`) and not yet resumed."""
        return frozenset(self._released)

    @property
    def weights_valid(self) -> bool:
        """False while the server holds discarded (garbage) weights or a partly loaded
        version (a sync failed, timed out or was cancelled after its first bucket was
        posted), until a sync lands."""
        return self._weights_valid

    @property
    def lora_adapter(self) -> str | None:
        """The LoRA adapter every generation applies (``lora_path``), None: the base model."""
        return self._adapters.active

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the server discards its weights (the memory
        saver released them without a CPU backup). Every synchronizer registers one."""
        self._listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener` (no error if absent)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def note_weights_loading(self) -> None:
        """For the synchronizer: the first bucket of a new version is about to be posted.

        From here the server may hold a mix of two versions (SGLang loads each
        bucket in place), so generation refuses until :meth:`note_weights_loaded`,
        even if the sync fails or is cancelled. The listeners are not called:
        this is the syncing synchronizer's own load (it turns stale itself if
        the sync fails), not a discard by the server, which would fail the sync
        in flight.
        """
        self._weights_valid = False
        self._discards_at_load = self._discards
        self._invalid_reason = (
            "a sync began loading new weights and did not complete (failed, timed out "
            "or cancelled), so the server may hold a mix of two versions"
        )

    def note_weights_loaded(self) -> None:
        """For the synchronizer: a complete set of weights landed on the server.

        Unless the server discarded its weights after :meth:`note_weights_loading` (a
        release while the sync flushed): then they stay invalid, with the discard's
        reason, as the synchronizer (which fails that sync) says too.
        """
        if self._discards != self._discards_at_load:
            return
        self._weights_valid = True
        self._invalid_reason = ""

    # -- a server restarted behind its URL (C38) -------------------------------------

    async def server_info(self) -> dict[str, Any]:
        """``/get_server_info`` (see :meth:`SGLangClient.server_info`); a ``startup_time``
        other than the one first seen means the server was restarted (see
        :meth:`check_restarted`)."""
        info = await super().server_info()
        started = info.get("startup_time")
        if started is not None:
            previous, self._startup_time = self._startup_time, started
            if previous is not None and started != previous:
                self._restarted(f"/server_info reports startup_time {started!r}, was {previous!r}")
        return info

    async def check_restarted(self) -> bool:
        """Whether the server was restarted since this backend last saw it
        (:class:`~aiosync.capabilities.RestartReporting`; :func:`~aiosync.refit_if_stale`
        asks before it reads ``is_stale``).

        A restarted SGLang server holds fresh weights (its checkpoint's, or random ones)
        under its launch label (``"default"``). Two signs, from two cheap GETs: its
        ``startup_time`` (``/get_server_info``) differs from the one first seen, or
        ``/model_info``'s ``weight_version`` is not the label this backend last set
        (read only when no label was set in between). On either the weights count as
        discarded: generation refuses and the listeners run (the synchronizer turns
        stale), as for a memory-saver release.

        Returns:
            True when it was restarted (and the listeners ran).

        Raises:
            TransportError, SyncTimeoutError: the server did not answer.
        """
        restarts, epoch, ours = self._restarts, self._label_epoch, self._version_label
        await self.server_info()
        if self._restarts != restarts:
            return True
        if ours is None:
            return False
        label = await self.get_weight_version()
        if self._label_epoch == epoch and self._restarts == restarts and label != ours:
            self._restarted(
                f"/model_info reports weight_version {label!r}, not {ours!r}, the label "
                "this backend set"
            )
            return True
        return self._restarts != restarts

    def _restarted(self, sign: str) -> None:
        """The server is another process than the one synced: what this backend knew of
        the old one (its label, released regions) is void; its weights are not ours."""
        self._restarts += 1
        self._version_label = None
        self._released.clear()
        logger.warning("%s was restarted (%s): its weights count as discarded", self.base_url, sign)
        self._discard_weights(
            f"the server was restarted ({sign}), so it holds its own fresh weights, not "
            "the synced ones"
        )

    def _check_labels(self, items: Sequence[Any], ours: str | None) -> None:
        """Refuse ``/generate`` answers labelled otherwise than this backend set the
        server: computed by a restarted (or otherwise relabelled) server's weights.

        Raises:
            SyncError: an answer's ``meta_info.weight_version`` is not ``ours``.
        """
        if ours is None:
            return
        for item in items:
            meta = item.get("meta_info") if isinstance(item, Mapping) else None
            label = meta.get("weight_version") if isinstance(meta, Mapping) else None
            if label is not None and str(label) != ours:
                self._restarted(
                    f"it answered /generate under weight_version {str(label)!r}, not "
                    f"{ours!r}, the label this backend set"
                )
                raise SyncError(
                    f"{self.base_url} answered /generate under weight_version "
                    f"{str(label)!r}, not {ours!r}: the server was restarted (or relabelled "
                    "by another client) and computed it with other weights; the answer "
                    "is dropped; sync_weights() before generate()"
                )

    def _discard_weights(self, reason: str) -> None:
        self._discards += 1
        self._weights_valid = False
        self._invalid_reason = reason
        for listener in list(self._listeners):
            listener()

    # -- waking and sleeping --------------------------------------------------------

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Resume released memory regions, in :data:`MEMORY_TAGS` order (None: all).

        A region that is not released is skipped (SGLang raises on it). Without
        the memory saver this does nothing.

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

        Releasing weights without a CPU backup discards them: the listeners (the
        synchronizer, which turns stale) are told before this returns.

        Raises:
            TransportError, SyncTimeoutError: the server failed or did not answer.
        """
        if not self.enable_memory_saver:
            return
        tags = [t for t in self.release_tags if t not in self._released]
        if not tags:
            return
        discards = "weights" in tags and not self.weights_cpu_backup
        try:
            await self._post("/release_memory_occupation", {"tags": tags})
        except BaseException:
            # The server may have released part of it: assume the worst.
            if discards:
                self._discard_weights(_DISCARDED)
            raise
        self._released.update(tags)
        if discards:
            self._discard_weights(_DISCARDED)

    # -- generation -------------------------------------------------------------

    async def generate_with_meta(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        sampling_params: Mapping[str, Any] | None = None,
        **keywords: Any,
    ) -> list[Generation]:
        """Generate from token-id prompts via ``/generate``: one :class:`SGLangGeneration`
        (an :class:`aiosync.Generation` with the server's ``meta_info``) per prompt,
        in prompt order. (Typed ``list[Generation]``, as :class:`~aiosync.capabilities.Generating`
        says: a list is invariant.)

        With a LoRA adapter loaded (:meth:`load_lora_adapter`) every prompt is
        generated with it. Logprobs: SGLang computes them from the raw logits for
        greedy requests; for sampled ones run the server with
        ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` for :class:`aiosync.Generation`'s
        raw convention. Versions: see :meth:`SGLangGeneration.from_answer`.

        Args:
            prompts: one list of token ids per prompt.
            params: how to sample (:class:`aiosync.SamplingParams`); or its fields
                as keywords (``max_new_tokens=``, ``temperature=``, ``top_p=``,
                ``seed=``, ``ignore_eos=``, ``logprobs=``), which override ``params``'.
            sampling_params: more SGLang ``sampling_params`` fields (``stop``...);
                ``top_p``, ``ignore_eos`` and ``sampling_seed`` there are kept
                unless ``params`` sets them to other than their defaults.

        Raises:
            TypeError, ValueError: bad sampling parameters (see
                :func:`aiosync.generation.sampling_params`), before any request.
            SyncError: the server's weights are released or discarded and not
                re-synced, or a sync posted part of a new version and then failed,
                timed out or was cancelled (never generate on mixed weights), or a
                LoRA adapter load is in flight or failed.
            TransportError: the server failed, or an answer does not match the
                request (result count, ``output_token_logprobs``).
            SyncTimeoutError: no answer within ``generate_timeout_s``.
        """
        sampling = resolve_sampling(params, keywords)
        self._check_can_generate()
        lora_name = self._adapters.active
        body = generate_body(prompts, sampling, sampling_params, lora_name=lora_name)
        label = self._version_label
        submitted = parse_version(label)
        epoch, requeues = self._label_epoch, self._requeues
        answer = await self._post("/generate", body, timeout_s=self.generate_timeout_s)
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(prompts):
            raise TransportError(
                f"/generate answered {len(items)} results for {len(prompts)} prompts"
            )
        # A sync committed while this request was in the server: it was kept across
        # the refit, so its tokens may come from both versions (SGLang labels only
        # the answer): never report it as one version.
        spanned = self._label_epoch != epoch
        if not spanned:
            self._check_labels(items, label)
        generations = [
            SGLangGeneration.from_answer(
                item, logprobs=sampling.logprobs, submitted_version=submitted, spanned=spanned
            )
            for item in items
        ]
        if self._requeues != requeues:
            generations = await self._continue_requeued(
                prompts, generations, sampling, sampling_params, lora_name
            )
        return list(generations)

    async def _continue_requeued(
        self,
        prompts: Sequence[Sequence[int]],
        generations: list[SGLangGeneration],
        sampling: SamplingParams,
        extra: Mapping[str, Any] | None,
        lora_name: str | None,
    ) -> list[SGLangGeneration]:
        """Continue the requests a ``"keep"`` flush aborted (see :meth:`flush_cache`).

        Each aborted one waits for the pause to end; if the sync committed, it is
        sent again as its prompt plus the tokens it had, for the tokens it still
        may make, and the two answers are joined (the versions exact: the first
        part's tokens are the old version's, the rest the new one's). If the sync
        failed the weights are not valid: it stays aborted, with the tokens it had
        (never generated on half-loaded weights).
        """
        if self._pause_ended is not None:
            await self._pause_ended.wait()
        out = list(generations)
        if not self._weights_valid or self._released or self._adapters.active != lora_name:
            return out

        async def resume(index: int) -> None:
            first = out[index]
            left = sampling.max_tokens - len(first.token_ids)
            if left <= 0:
                return
            prompt = [*prompts[index], *first.token_ids]
            rest_params = replace(sampling, max_tokens=left)
            body = generate_body([prompt], rest_params, extra, lora_name=lora_name)
            submitted = parse_version(self._version_label)
            answer = await self._post("/generate", body, timeout_s=self.generate_timeout_s)
            item = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
            rest = SGLangGeneration.from_answer(
                item, logprobs=sampling.logprobs, submitted_version=submitted
            )
            out[index] = continued(first, rest)

        async with anyio.create_task_group() as tg:
            for index, generation in enumerate(out):
                if generation.aborted:
                    tg.start_soon(resume, index)
        return out

    def _check_can_generate(self) -> None:
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
        if self._adapters.refusal is not None:
            raise SyncError(
                f"the SGLang server's LoRA adapter is not usable: {self._adapters.refusal}; "
                "a sync must succeed before generate()"
            )

    # -- the in-flight policy -------------------------------------------------------

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        """Pause the server's generation (SGLang's ``/pause_generation``) per ``mode``.

        From the call on the server admits no new request (they wait until
        :meth:`resume_generation`); the running ones:

        * ``"abort"``: ``{"mode": "abort"}``: ended now, answered with the tokens
          they have and ``finish_reason`` ``abort`` (:attr:`SGLangGeneration.aborted`).
        * ``"wait"``: SGLang has no such mode: poll ``/v1/loads`` until no request
          runs (every :data:`WAIT_POLL_S` seconds), then ``{"mode": "in_place"}``
          with nothing left to freeze; a request admitted between the two is let
          finish (``/continue_generation``) and the wait starts over.
        * ``"keep"``: ``{"mode": "retract"}`` with ``clear_cache`` (the default, and
          what a refit passes): the requests go back to the waiting queue, their
          KV cache dropped, so that the refit's ``/flush_cache`` may run (SGLang
          refuses it while requests sit in the running batch); after
          :meth:`resume_generation` the server recomputes their prompt and tokens
          so far with the new weights and continues. ``clear_cache=False``:
          ``{"mode": "in_place"}``, the KV cache of the old weights kept (as
          vLLM's ``keep``); ``/flush_cache`` then fails until they finish.
          SGLang 0.5.23 refuses ``/flush_cache`` after a retract while its waiting
          queue is not empty (issue #33783): :meth:`flush_cache` then requeues the
          requests through this backend instead (see there).

        Raises:
            ValueError: an unknown ``mode`` (before any request).
            TransportError, SyncTimeoutError: the server failed or did not answer
                (``"wait"``: no time limit of its own; bound it with a cancel scope,
                as the synchronizer does).
        """
        if mode not in IN_FLIGHT_POLICIES:
            raise ValueError(f"mode must be one of {IN_FLIGHT_POLICIES}, got {mode!r}")
        if self._pause_ended is None:
            self._pause_ended = anyio.Event()
        if mode == "abort":
            self._pause_mode = "abort"
            await self._post("/pause_generation", {"mode": "abort"})
        elif mode == "keep":
            sglang_mode = "retract" if clear_cache else "in_place"
            self._pause_mode = sglang_mode
            await self._post("/pause_generation", {"mode": sglang_mode})
        else:
            self._pause_mode = "in_place"
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

        After a sync that began loading and did not commit (:attr:`weights_valid`
        False), the requests kept paused are aborted first
        (``/pause_generation {"mode": "abort"}``: answered with the tokens they
        had, ``finish_reason`` ``abort``): none continues on half-loaded weights.

        Raises:
            TransportError, SyncTimeoutError: the server failed or did not answer.
        """
        try:
            if self._pause_mode is not None and not self._weights_valid:
                await self._post("/pause_generation", {"mode": "abort"})
            await self._post("/continue_generation", {})
        finally:
            self._pause_mode = None
            ended, self._pause_ended = self._pause_ended, None
            if ended is not None:
                ended.set()

    async def flush_cache(self, timeout_s: float | None = None) -> int:
        """POST ``/flush_cache`` until the server accepts it; returns the attempts made.

        As :meth:`SGLangClient.flush_cache`, except while this backend holds the
        server paused with ``"retract"`` (``in_flight="keep"``): SGLang 0.5.23's
        ``flush_cache`` requires ``is_fully_idle()``, an empty waiting queue,
        which retract fills (sgl-project/sglang issue #33783; the fixes, PRs
        #31962 and #33784, let a paused server flush). Skipping the flush, as
        miles does (radixark/miles PR #1497), would let the retracted requests
        match the radix tree's prefix of the old weights: retract only
        ``dec_lock_ref``'s that prefix (PR #33784). So after one refused attempt
        the waiting requests are aborted (``/pause_generation {"mode":
        "abort"}``), the flush retried as usual, and each request this backend
        sent is continued after the sync by :meth:`generate_with_meta` (its
        prompt plus the tokens it had, recomputed on the new weights, as a
        retract would), the answers joined. Requests other clients sent are
        answered aborted.

        Raises:
            TransportError: still failing after ``timeout_s``; names the last answer.
        """
        if self._pause_mode != "retract":
            return await super().flush_cache(timeout_s)
        try:
            await self._post("/flush_cache", None)
            return 1
        except TransportError as exc:
            if http_status(exc) != 400:
                return 1 + await super().flush_cache(timeout_s)
        logger.info(
            "%s refused /flush_cache after a retract (waiting queue not empty, SGLang "
            "issue #33783): requeueing the kept requests",
            self.base_url,
        )
        self._requeues += 1
        await self._post("/pause_generation", {"mode": "abort"})
        self._pause_mode = "abort"
        return 1 + await super().flush_cache(timeout_s)

    async def _requests_in_flight(self) -> int:
        """Requests the server holds (running or waiting, every DP rank), from
        ``GET /v1/loads`` (SGLang 0.5.23 has no ``/get_load``): the sum of each
        rank's ``num_running_reqs`` and ``num_waiting_reqs`` under ``loads``."""
        answer = await self._request("GET", "/v1/loads")
        try:
            return sum(
                int(rank["num_running_reqs"]) + int(rank["num_waiting_reqs"])
                for rank in answer["loads"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"/v1/loads answered {str(answer)[:200]}") from exc

    # -- checks before a refit ------------------------------------------------------

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
        info = dict(server_info) if server_info is not None else await self.server_info()
        target = await self._manifests.derive(info)
        drafted = await self._draft_manifest(info)
        if target is None or drafted is None:
            return None
        return {**target, **drafted}

    async def expected_config(
        self, server_info: Mapping[str, Any] | None = None
    ) -> PretrainedConfig | None:
        """The HF config the server computes with, or None if it cannot be loaded here.

        The config :meth:`expected_manifest` builds the manifest from: ``hf_config``
        if given, else ``/get_server_info``'s ``model_path`` (nothing downloaded,
        no remote code), with the server's ``json_model_override_args`` applied.
        Cached per configuration; callers must not modify it. The transports
        compare it with the trainer's at init (``aiosync._hf_config``).

        Args:
            server_info: ``/get_server_info``'s answer if the caller has it
                (saves a request).

        Returns:
            A transformers ``PretrainedConfig``; None when it cannot be loaded here
            (a ``RuntimeWarning`` says so once, shared with :meth:`expected_manifest`).

        Raises:
            SyncError: the ``hf_config`` given to the backend cannot be loaded.
            TransportError, SyncTimeoutError: ``/get_server_info`` failed.
        """
        info = dict(server_info) if server_info is not None else await self.server_info()
        return await self._manifests.config(info)

    async def check_lora_adapter(
        self, config: Mapping[str, Any], target_modules: Sequence[str], max_rank: int
    ) -> None:
        """Check that the server can load an adapter of this shape (before any byte moves).

        Args:
            config: the adapter's ``adapter_config.json`` dict.
            target_modules: the adapted layers' names (``q_proj``, ``down_proj``...).
            max_rank: the adapter's largest rank ``r``.

        Raises:
            ValueError: the server runs without ``--enable-lora``, or ``max_rank``
                exceeds its ``--max-lora-rank``.
            RefitMismatchError: a target module is outside its ``--lora-target-modules``.
            TransportError, SyncTimeoutError: ``/get_server_info`` failed.
        """
        check_adapter_fits(await self.server_info(), self.base_url, target_modules, max_rank)

    # -- LoRA adapters (adapter-only refits) ------------------------------------------

    async def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Make ``adapter`` the LoRA adapter every later generation applies.

        Writes it as a PEFT adapter folder in ``/dev/shm`` (the temp dir where
        there is none), loads it with ``/load_lora_adapter`` under
        ``adapter.name``, removes the folder once the server answered, then
        unloads every other adapter this backend loaded. The server must run
        with ``--enable-lora`` (and ``--max-lora-rank``, ``--lora-target-modules``
        covering the adapter). From the call until it returns, and after it
        raised, generation refuses until a load succeeds: the previous adapter
        is never served silently.

        Raises:
            SyncError: the server's base weights were discarded (memory saver
                without a CPU backup): an adapter cannot restore them.
            TransportError: the server refused the adapter (its ``error_message``
                quoted), an unload failed, or the connection failed.
            SyncTimeoutError: no answer within ``request_timeout_s``.
        """
        self._adapters.begin(adapter.name)
        if not self._weights_valid or ("weights" in self._released and not self.weights_cpu_backup):
            reason = self._invalid_reason or _DISCARDED
            raise SyncError(
                f"the SGLang server holds no valid base weights ({reason}): an adapter-only "
                "refit cannot restore them"
            )
        await self._adapters.load(adapter)

    async def __aenter__(self) -> SGLangHTTPBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


if TYPE_CHECKING:

    def _claims(
        b: SGLangHTTPBackend,
    ) -> tuple[
        Engine,
        PausableEngine,
        DiscardNotifier,
        SleepReporting,
        Generating,
        ValidityReporting,
        ManifestReporting,
        ConfigReporting,
        HealthReporting,
        RestartReporting,
        DraftHolding,
    ]:
        return (b, b, b, b, b, b, b, b, b, b, b)
