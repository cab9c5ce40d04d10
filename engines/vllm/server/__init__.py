"""``VLLMServerBackend``: a remote ``vllm serve``, reached by URL, as a full aiosync engine.

The server's HTTP API as the training loop and the transports use it (contracts
read from vLLM 0.32.0's sources and checked against 0.34.0's, ``docs/vllm-server.md``;
every route, body field and query parameter in :data:`ROUTES`):

* generation: ``POST /v1/completions`` with token-id prompts, streamed
  (``vllm/entrypoints/openai/completion/protocol.py``: ``prompt`` as lists of
  ids, ``return_token_ids``, ``logprobs``, ``stream``);
* the in-flight policy: ``POST /pause?mode=...``, ``POST /resume``,
  ``GET /is_paused`` and the weight-version label ``POST /update_weight_version``,
  ``GET /weight_info`` (``vllm/entrypoints/rl/online/api_router.py``);
* the workers: ``POST /collective_rpc`` into aiosync's worker extension
  (``vllm/entrypoints/serve/dev/rpc/api_router.py``), so that the IPC (same
  host) and collective transports drive it as they drive an in-process engine;
* ``POST /reset_prefix_cache``, ``POST /sleep``, ``POST /wake_up``,
  ``GET /is_sleeping``, ``GET /server_info`` (``vllm/entrypoints/serve/dev/``);
* vLLM's own weight-transfer phases (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``);
* ``POST /abort_requests`` (the ``"abort"`` in-flight policy) and ``POST
  /weight_checker`` (``record_checksums``: :meth:`VLLMServerBackend.verify_recorded_checksums`)
  where the server has them.

The routes a server serves are read once from its ``GET /openapi.json``
(:meth:`VLLMServerBackend.served_routes`): a route of :data:`OPTIONAL_ROUTES` the
server lacks is either done without (``/abort_requests``: ``/pause?mode=abort``) or
refused with a :class:`RouteMissingError` naming it and the vLLM releases that serve it.

Every route but the completions is registered only with ``VLLM_SERVER_DEV_MODE=1``;
the server needs ``--worker-extension-cls
aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension`` for the transports.

Every HTTP error is translated once, in :meth:`VLLMServerBackend._request`: no
answer in time is a :class:`~aiosync.SyncTimeoutError`; a refused or dropped
connection, a non-2xx answer (the server's own message quoted) or a 401 is a
:class:`~aiosync.TransportError`; a worker's aiosync error (``[aiosync:Type]``
in vLLM's message, as :mod:`aiosync.engines.vllm.worker` tags it) keeps its
type. Only httpx and anyio are imported here: no vLLM, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from aiosync.capabilities import EngineKind
from aiosync.engines.vllm.server._generation import _Generation
from aiosync.engines.vllm.server._wire import (
    DEFAULT_GENERATE_TIMEOUT_S,
    OPTIONAL_ROUTES,
    ROUTES,
    SERVER_DEV_MODE_ENV,
    RouteMissingError,
)
from aiosync.generation import SamplingParams

if TYPE_CHECKING:
    from aiosync.capabilities import (
        ChecksumVerifying,
        DiscardNotifier,
        DraftHolding,
        Engine,
        EngineWorkers,
        Generating,
        HealthReporting,
        ManifestReporting,
        PausableEngine,
        VersionedEngine,
    )

__all__ = [
    "DEFAULT_GENERATE_TIMEOUT_S",
    "OPTIONAL_ROUTES",
    "ROUTES",
    "SERVER_DEV_MODE_ENV",
    "RouteMissingError",
    "VLLMServerBackend",
]


class VLLMServerBackend(_Generation):
    """A ``vllm serve`` process, reached by URL, as an aiosync engine.

    An :class:`~aiosync.capabilities.Engine` that is also a ``PausableEngine``,
    ``VersionedEngine``, ``DiscardNotifier``, ``EngineWorkers``, ``Generating``
    and ``ManifestReporting`` (checked by mypy at the end of this module), so
    :class:`~aiosync.IPCWeightSynchronizer` (trainer on the server's host) and
    :class:`~aiosync.CollectiveWeightSynchronizer` (anywhere the workers can
    reach the trainer's store) drive it as they drive an in-process
    :class:`~aiosync.VLLMGenerationBackend`. ``generate()`` is
    :meth:`generate_with_meta`'s token ids.

    The server must run with ``VLLM_SERVER_DEV_MODE=1`` and
    ``--worker-extension-cls aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension``,
    with aiosync importable in its Python (``docs/vllm-server.md``).

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        api_key: the server's ``--api-key``; sent as ``Authorization: Bearer``.
        model: the ``model`` field of completions requests (a served model
            name); None: the server's default model.
        sleep_level: the ``/sleep?level=`` of :meth:`finish_generation`: 1
            offloads the weights, 2 discards them (the transports are told:
            :meth:`add_weights_discarded_listener`).
        rpc_timeout_s: default limit of one request other than generation
            (a :meth:`collective_rpc`, a pause), seconds.
        generate_timeout_s: limit of one :meth:`generate_with_meta` call, seconds.
        record_checksums: at each commit (:meth:`on_weights_committed`) ask the
            server's ``/weight_checker`` for the SHA-256 of every parameter of every
            worker and keep them: :meth:`verify_recorded_checksums` (the
            :class:`~aiosync.capabilities.ChecksumVerifying` capability) then names any
            parameter changed since. Costs one hash of the whole model per sync, on
            the server.
        draft_prefix: the server runs speculative decoding with a draft model whose
            tensors the checkpoint names under this prefix (Qwen3-Next's MTP layers:
            ``"mtp."``). The backend is then a
            :class:`~aiosync.capabilities.DraftHolding`: ``SyncOptions(draft="frozen")``
            works (:meth:`expected_manifest` leaves those names out: the transports
            load into the target model alone, so the draft stays as it is), and
            ``"with_target"`` is refused (:meth:`select_draft_refit` says why). None:
            no draft; ``"with_target"`` is refused as for any engine without one.
        transport: an ``httpx.AsyncBaseTransport`` to use (proxies, tests).

    Raises:
        ValueError: ``sleep_level`` not 1 or 2, a timeout not > 0, a
            ``base_url`` without ``http(s)://``, or an empty ``draft_prefix``.
    """

    #: Which engine this is (:class:`~aiosync.capabilities.KindReporting`): the factory
    #: picks the transport by it.
    engine_kind: EngineKind = "vllm"

    #: ``generate()`` without ``params`` starts from these: 16 tokens, past any
    #: EOS (``generate_with_meta`` has no defaults and stops at EOS, as every engine).
    generate_defaults: ClassVar[SamplingParams | None] = SamplingParams(
        max_tokens=16, ignore_eos=True
    )

    # -- lifetime --------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the HTTP connection pool (the server keeps running). Idempotent."""
        await self._client.aclose()

    async def shutdown(self) -> None:
        """As :meth:`aclose`: the server is not this backend's to stop."""
        await self.aclose()

    async def __aenter__(self) -> VLLMServerBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


if TYPE_CHECKING:
    # mypy checks the capabilities this backend claims (aiosync.capabilities).
    def _claims(
        b: VLLMServerBackend,
    ) -> tuple[
        Engine,
        PausableEngine,
        VersionedEngine,
        DiscardNotifier,
        EngineWorkers,
        Generating,
        ManifestReporting,
        HealthReporting,
        ChecksumVerifying,
        DraftHolding,
    ]:
        return (b, b, b, b, b, b, b, b, b, b)
