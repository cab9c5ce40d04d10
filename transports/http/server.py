"""The SGLang server as the HTTP transport drives it: a protocol, not an adapter class.

:class:`SGLangServer` names exactly the calls a refit makes, plus the validity
bookkeeping that keeps generation refused while the server holds a mix of two
versions; :class:`aiosync.SGLangHTTPBackend` satisfies it, and so can any
client a user already has. :class:`SGLangManifestSource` is optional (the
manifest checked at ``init_communicator()``); :class:`SGLangWeightUpdateSession` is
optional too (SGLang's ``/begin_weight_update`` ... ``/end_weight_update`` bracket),
and so is :class:`SGLangWeightReader` (``/get_weights_by_name``: the ``verify``
read-back), and :class:`SGLangWeightChecker` (``/weights_checker``: ``verify_engine()``'s
checksums). See ``docs/sglang.md`` and, for the endpoints as read in SGLang's sources,
``docs/sglang-contract.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "SGLangDistributedServer",
    "SGLangManifestSource",
    "SGLangServer",
    "SGLangWeightChecker",
    "SGLangWeightReader",
    "SGLangWeightUpdateSession",
]


@runtime_checkable
class SGLangServer(Protocol):
    """What :class:`~aiosync.transports.http.HTTPWeightSynchronizer` needs of an SGLang server.

    Attributes:
        base_url: the server's address, for messages.
        enable_memory_saver: the server runs with ``--enable-memory-saver``.
        tp_size: payloads per ``update_weights_from_tensor`` call (one per
            tensor-parallel rank); None until known (the synchronizer then reads
            ``tp_size`` from :meth:`server_info` and sets it).
    """

    base_url: str
    enable_memory_saver: bool
    tp_size: int | None

    @property
    def asleep_tags(self) -> frozenset[str] | None:
        """Memory regions (``"weights"``, ``"kv_cache"``, ...) released and not yet
        resumed (:class:`~aiosync.capabilities.SleepReporting`): the refit wakes only
        those (SGLang refuses to resume what is not released)."""
        ...

    @property
    def weights_valid(self) -> bool:
        """False while the server holds discarded or partly loaded weights."""
        ...

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the server discards its weights
        (:class:`~aiosync.capabilities.DiscardNotifier`; the synchronizer registers one)."""
        ...

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener` (no error if absent)."""
        ...

    def note_weights_loading(self) -> None:
        """The first bucket of a new version is about to be posted: refuse to generate
        (without calling the discard listeners: the caller is the syncing one)."""
        ...

    def note_weights_loaded(self) -> None:
        """A complete version landed: generation may resume."""
        ...

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Resume released memory regions (``/resume_memory_occupation``), weights first."""
        ...

    async def server_info(self) -> dict[str, Any]:
        """``/get_server_info``: the server's arguments (``tp_size``, ``enable_memory_saver``)."""
        ...

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None,
        flush_cache: bool = False,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> str:
        """POST ``/update_weights_from_tensor`` with one payload per TP rank."""
        ...

    async def flush_cache(self, timeout_s: float | None = None) -> int:
        """POST ``/flush_cache`` until the server accepts it; returns the attempts made."""
        ...

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = False
    ) -> None:
        """POST ``/update_weight_version``: the label the server reports from now on."""
        ...


@runtime_checkable
class SGLangManifestSource(Protocol):
    """An SGLang server that can say which tensors its ``load_weights`` takes."""

    async def expected_manifest(
        self, server_info: Mapping[str, Any] | None = None
    ) -> Mapping[str, tuple[Sequence[int], torch.dtype]] | None:
        """``{hf_name: (shape, dtype)}`` the server loads, or None when it cannot be known.

        Args:
            server_info: ``/get_server_info``'s answer, if the caller already has it.
        """
        ...


@runtime_checkable
class SGLangWeightUpdateSession(Protocol):
    """An SGLang server that may need a weight-update session around its updates.

    SGLang 0.5.23 (PRs #28710, #28001; ``python/sglang/srt/managers/
    scheduler_components/weight_updater.py``) refuses ``update_weights_from_tensor``
    outside ``POST /begin_weight_update`` ... ``POST /end_weight_update`` (400,
    ``"update_weights_from_tensor must run between begin_weight_update() and
    end_weight_update()"``); ``end`` runs the loader's post-processing. The
    synchronizer opens one around every sync's buckets and always ends it.
    """

    async def begin_weight_update(self) -> bool:
        """Open the session; False: the server has none (older SGLang, 404), learned once."""
        ...

    async def end_weight_update(self) -> None:
        """Close the session this object opened (nothing if none is open)."""
        ...


@runtime_checkable
class SGLangWeightReader(Protocol):
    """An SGLang server whose weights can be read back (``/get_weights_by_name``): what
    the HTTP transports' ``verify`` check reads after the last bucket loaded.

    A server object without it is not checked (``verify`` logs a warning naming it
    once); the sync goes on as with ``verify=False`` for that server.
    """

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any] | None:
        """``POST /get_weights_by_name``: the first ``truncate_size`` rows (first
        dimension) of checkpoint tensor ``name`` as the server holds it, float32 values
        in nested lists (one list per DP rank when ``dp_size > 1``); None when the
        server cannot read it (SGLang's 400, ``"Get parameter by name failed"``, or a
        404: no such route)."""
        ...


@runtime_checkable
class SGLangWeightChecker(Protocol):
    """An SGLang server with SGLang's own weight checker (``/weights_checker``, 0.5.23):
    :meth:`~aiosync.transports.http.HTTPWeightSynchronizer.verify_engine` records its
    per-tensor checksums at each commit (``record_checksums=True``) and compares them
    later, naming any tensor that changed since."""

    async def check_weights(
        self,
        action: str,
        *,
        skip_tensor_list: Sequence[str] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any] | None:
        """``POST /weights_checker {action, selector: "target"}``: SGLang's answer
        (``success`` false for a refusal); None: the server has no such route (404)."""
        ...


@runtime_checkable
class SGLangDistributedServer(SGLangServer, Protocol):
    """An SGLang server that can receive its weights over a process group: what
    :class:`~aiosync.transports.collective.SGLangCollectiveWeightSynchronizer` drives
    (SGLang's disaggregated refit, ``python/sglang/srt/entrypoints/http_server.py``,
    read in SGLang 0.5.23; the endpoints: ``docs/sglang-contract.md``)."""

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float | None = None,
    ) -> None:
        """``/init_weights_update_group``: the server's TP ranks join the trainer's group
        as ranks ``rank_offset .. rank_offset + tp_size - 1``."""
        ...

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        load_format: str | None,
        flush_cache: bool = False,
        abort_all_requests: bool = False,
    ) -> None:
        """``/update_weights_from_distributed``: receive the trainer's broadcast of these
        tensors and load them (answers once every rank loaded)."""
        ...

    async def destroy_weights_update_group(
        self, group_name: str, timeout_s: float | None = None
    ) -> None:
        """``/destroy_weights_update_group``: the server's ranks leave the group."""
        ...
