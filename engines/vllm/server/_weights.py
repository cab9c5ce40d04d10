"""The weights' side of the backend: version labels, the server's checksums
(``/weight_checker``), the manifest before a refit, the draft model and vLLM's own
weight-transfer routes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiosync.capabilities import (
    DRAFT_REFITS,
    DraftRefit,
)
from aiosync.engines.vllm._checksums import RecordedChecksums
from aiosync.errors import (
    TransportError,
    UnsupportedOptionError,
)
from aiosync.generation import parse_version

if TYPE_CHECKING:
    import torch


from aiosync.engines.vllm.server._base import _ServerBase
from aiosync.engines.vllm.server._wire import RouteMissingError, _log


class _WeightRoutes(_ServerBase):
    """Versions, checksums, the draft and vLLM's weight-transfer routes."""

    # -- the server's own weight checksums: /weight_checker ------------------------------

    async def weight_checksums(self) -> dict[str, str]:
        """``POST /weight_checker {"action": "checksum"}``: the SHA-256 (hex) of every
        parameter of every worker, as the server holds it now.

        Keys are ``"dp{d}:pp{p}:pcp{c}:tp{t}:{name}"``: the worker's data-, pipeline-,
        context- and tensor-parallel ranks, and vLLM's own parameter name
        (``model.layers.0.self_attn.qkv_proj.weight``: fused, sharded, after
        vLLM's post-processing; a tensor subclass's inner tensors as
        ``{name}.{attr}``). vLLM hashes each parameter's bytes in its dtype
        (``vllm/model_executor/model_loader/weight_checksum.py``), copied to host
        memory: the whole model, on every call.

        Raises:
            RouteMissingError: the server has no ``/weight_checker`` (before the request).
            TransportError, SyncTimeoutError: the request failed, or the answer is not
                ``{"checksums": {str: str}}``.
        """
        await self._require_route("/weight_checker")
        answer = await self._request(
            "POST", "/weight_checker", body={"action": "checksum"}, fresh_connection=True
        )
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if not isinstance(sums, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in sums.items()
        ):
            raise TransportError(f"/weight_checker answered {str(answer)[:200]}")
        return dict(sums)

    async def _record_checksums(self, version: int) -> None:
        """Keep ``/weight_checker``'s checksums as those of ``version``; a server without
        the route records nothing (warned once)."""
        self._checksums = None
        try:
            sums = await self.weight_checksums()
        except RouteMissingError as exc:
            if not self._warned_no_checker:
                self._warned_no_checker = True
                _log.warning("record_checksums: %s; no checksums are recorded", exc)
            return
        self._checksums = RecordedChecksums(version, sums)

    async def verify_recorded_checksums(self) -> int | None:
        """Compare ``/weight_checker``'s checksums now with those recorded at the last
        commit (``record_checksums=True``); :class:`~aiosync.capabilities.ChecksumVerifying`.

        This says which of the server's parameters changed since the commit (each
        named with its worker's ranks), not that the commit held the trainer's
        tensors: the server's parameters are fused, sharded and post-processed, so
        the trainer cannot recompute their hashes (the workers' read-back of
        ``verify_engine()`` compares those with the trainer's).

        Returns:
            How many parameters (summed over workers) matched; None: nothing
            recorded (``record_checksums=False``, no commit yet, or no
            ``/weight_checker`` on the server).

        Raises:
            RefitVerificationError: a parameter's checksum differs, is gone or is new
                (up to five named, and how many in all).
            TransportError, SyncTimeoutError: the request failed.
        """
        if self._checksums is None:
            return None
        now = await self.weight_checksums()
        return self._checksums.compare(
            now, f"the vLLM server at {self.base_url}", "/weight_checker checksums"
        )

    async def weight_version(self) -> int | None:
        """``GET /weight_info``: the server's weight-version label as an int; None:
        vLLM's ``"default"`` before any sync labelled it.

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        answer = await self._request("GET", "/weight_info")
        if not isinstance(answer, dict) or "weight_version" not in answer:
            raise TransportError(f"/weight_info answered {str(answer)[:200]}")
        return parse_version(answer["weight_version"])

    def _set_computing(self, version: int) -> None:
        self._computing = version
        self._version_epoch += 1

    # -- checks before a refit -------------------------------------------------------

    async def expected_manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """``{hf_name: (shape, torch.dtype)}`` of the checkpoint the server loaded, or None.

        Read by worker 0 from the safetensors headers of the server's local
        checkpoint folder (``aiosync_vllm_checkpoint_manifest``), in the server's
        dtype; None when the model is not a local, unquantized safetensors folder.

        Raises:
            TransportError, SyncTimeoutError: as :meth:`collective_rpc`.
        """
        from aiosync.transports.packing import dtype_from_name

        reply = (await self.collective_rpc("aiosync_vllm_checkpoint_manifest"))[0]
        if reply["manifest"] is None:
            _log.debug("no checkpoint manifest for %s: %s", self.base_url, reply["reason"])
            return None
        # The draft's tensors (in the same checkpoint: Qwen3-Next's mtp.*) are never
        # loaded by aiosync's transfers into vLLM (select_draft_refit).
        draft = self._draft_prefix
        return {
            name: (tuple(int(d) for d in shape), dtype_from_name(dtype))
            for name, shape, dtype in reply["manifest"]
            if draft is None or not name.startswith(draft)
        }

    # -- the speculative draft model (DraftHolding) ------------------------------------

    @property
    def draft_prefix(self) -> str | None:
        """The prefix of the draft model's checkpoint names (``"mtp."``); None: no draft."""
        return self._draft_prefix

    def select_draft_refit(self, mode: DraftRefit) -> None:
        """``"frozen"``: later syncs load the target model alone, and
        :meth:`expected_manifest` leaves the draft's names out (what it does whenever
        ``draft_prefix`` is set, so nothing changes). ``"with_target"`` is refused.

        Why it is refused: aiosync's transports load every tensor through the worker
        extension into the target model (``model_runner.get_model()``); vLLM's draft
        model (``get_draft_model()``) is loaded only in vLLM's own weight-transfer
        session, ``POST /start_draft_weight_update`` then ``/update_weights`` and
        ``/finish_weight_update`` (vLLM 0.32.0 and 0.34.0; refused by the server
        unless its ``--weight-transfer-config`` backend supports draft updates and a
        speculative draft model is configured), whose NCCL and IPC backends need
        CUDA and which no aiosync synchronizer drives for a draft yet
        (:meth:`start_draft_weight_update` is the route, for a caller that does).

        Raises:
            ValueError: an unknown ``mode``.
            UnsupportedOptionError: ``"with_target"`` (without a ``draft_prefix``:
                no draft to refit, named so).
        """
        if mode not in DRAFT_REFITS:
            raise ValueError(
                f"draft must be one of {', '.join(map(repr, DRAFT_REFITS))}, got {mode!r}"
            )
        if mode == "with_target" and self._draft_prefix is None:
            raise UnsupportedOptionError(
                f"draft='with_target': VLLMServerBackend({self.base_url}) holds no draft "
                "model (no draft_prefix)"
            )
        if mode == "with_target":
            raise UnsupportedOptionError(
                f"draft='with_target': the vLLM server at {self.base_url} loads aiosync's "
                "transfers into its target model only; its draft model is refit only by "
                "vLLM's own weight-transfer session (POST /start_draft_weight_update, with "
                "a --weight-transfer-config backend that supports draft updates: NCCL or "
                "IPC, CUDA), which aiosync does not drive yet: pass draft='frozen' (the "
                "draft keeps its weights) or leave draft unset (docs/draft.md)"
            )

    # -- vLLM's own weight-transfer routes ---------------------------------------------

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """``POST /init_weight_transfer_engine {"init_info": ...}``: phase 1 of vLLM's own
        weight transfer (the server needs ``--weight-transfer-config``; its NCCL and
        IPC backends need CUDA). Phases 2-4 are :meth:`start_weight_update`,
        :meth:`update_weights`, :meth:`finish_weight_update`.

        Raises:
            TransportError, SyncTimeoutError: the server refused (its message) or failed.
        """
        await self._request(
            "POST",
            "/init_weight_transfer_engine",
            body={"init_info": dict(init_info)},
            fresh_connection=True,
        )

    async def start_weight_update(self) -> None:
        """``POST /start_weight_update``: the workers open vLLM's layerwise reload.

        Raises:
            TransportError, SyncTimeoutError: the server refused or failed.
        """
        await self._request("POST", "/start_weight_update", fresh_connection=True)

    async def start_draft_weight_update(self) -> None:
        """``POST /start_draft_weight_update``: as :meth:`start_weight_update`, the
        session's :meth:`update_weights` loading into the speculative draft model
        (vLLM 0.32.0, 0.34.0: ``set_weight_update_target(draft_model, ...)``); then
        :meth:`finish_weight_update`.

        Raises:
            TransportError: the server refused (its transfer backend cannot update a
                draft, no draft model is configured, a session is open) or failed.
            SyncTimeoutError: no answer within ``rpc_timeout_s``.
        """
        await self._request("POST", "/start_draft_weight_update", fresh_connection=True)

    async def update_weights(self, update_info: Mapping[str, Any]) -> None:
        """``POST /update_weights {"update_info": ...}``: names, dtypes and shapes of the
        tensors the trainer sends next through vLLM's transfer backend.

        Raises:
            TransportError, SyncTimeoutError: the server refused or failed.
        """
        await self._request(
            "POST",
            "/update_weights",
            body={"update_info": dict(update_info)},
            fresh_connection=True,
        )

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update {"weight_version": ...}``: the workers finish the
        reload (``process_weights_after_loading``) and the server takes the label.

        Raises:
            TransportError, SyncTimeoutError: the server refused or failed.
        """
        await self._request(
            "POST",
            "/finish_weight_update",
            body={"weight_version": weight_version},
            fresh_connection=True,
        )

    async def shutdown_weight_transfer_engine(self) -> None:
        """``POST /shutdown_weight_transfer_engine``: the workers leave the transfer group.

        Raises:
            RouteMissingError: the server has no such route (vLLM after 0.34).
            TransportError, SyncTimeoutError: the server refused or failed.
        """
        await self._require_route("/shutdown_weight_transfer_engine")
        await self._request("POST", "/shutdown_weight_transfer_engine", fresh_connection=True)
