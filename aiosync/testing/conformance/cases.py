"""The kit's cases and cells: how each transport is built on CPU, and which cells it runs.

A :class:`TransportCase` builds one transport's synchronizer through the factory
against a kit engine; :data:`CASES` are the transports the kit runs, :data:`CELLS` the
contract's cells, and :func:`cells` the ``(case, cell)`` pairs that follow from each
transport's declared :class:`~aiosync.TransportCapabilities`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiosync import SyncOptions, Timeouts, TrainCluster, create_weight_synchronizer
from aiosync.options import (
    CollectiveOptions,
    HTTPOptions,
    IPCOptions,
    LoRAOptions,
    SGLangCollectiveOptions,
    ShardedOptions,
    TransportCapabilities,
    TransportOptions,
)
from aiosync.sources import RefitSource

from .engines import KitEngine
from .trainers import BUCKET_BYTES, KitTrainer, LoRAKitTrainer, _free_port


@dataclass(frozen=True)
class TransportCase:
    """How the kit builds one transport on CPU.

    Attributes:
        name: the case's id (a test id).
        options: the transport's options class (it names the synchronizer class).
        engine: which kit engine it drives: ``"embedded"`` (one worker),
            ``"embedded_tp2"`` (one replica of two tensor-parallel ranks), ``"server"``
            (the SGLang contract test server), ``"lora"`` (an fp32 embedded engine of
            two replicas, serving LoRA adapters: :func:`~.engines.lora_engine`).
        colocated: the topology the factory is told.
        defaults: the options every build starts from (keywords of ``options``).
        trainer: the cells' trainer, given a seed (:class:`~.trainers.KitTrainer`, or
            :class:`~.trainers.LoRAKitTrainer` for an adapter).
        rank_processes: where the transport declares ``sharded_trainer`` but its
            ranks agree over the trainer's own ``torch.distributed`` group (one
            process a rank, so not the kit's), the suite that runs its sharded trainer
            (FSDP2 rank processes): the kit's ``sharded_trainer`` cell runs the ranks
            of one process, which agree through the ``TrainCluster``'s store.
    """

    name: str
    options: type[TransportOptions]
    engine: str
    colocated: bool
    defaults: Mapping[str, Any] = field(default_factory=dict)
    trainer: Callable[[int], Any] = KitTrainer
    rank_processes: str = ""

    @property
    def capabilities(self) -> TransportCapabilities:
        return capabilities_of(self.options)

    def build(
        self,
        source: RefitSource,
        engine: KitEngine,
        *,
        sync: SyncOptions | None = None,
        rank: int = 0,
        ranks: int = 1,
        port: int | None = None,
    ) -> Any:
        """The synchronizer, through :func:`aiosync.create_weight_synchronizer`: of
        trainer rank ``rank`` of ``ranks`` (meeting at ``port``; the engine is rank
        0's alone)."""
        topology: dict[str, Any] = {}
        if not self.colocated:
            cluster = TrainCluster(
                world_size=ranks,
                rank=rank,
                master_addr="127.0.0.1",
                master_port=_free_port() if port is None else port,
            )
            topology = {"train_cluster": cluster, "inference_world_size": engine.workers}
        return create_weight_synchronizer(
            source,
            engine.generation if rank == 0 else None,
            colocated=self.colocated,
            backend=engine.kind,
            transport=self.options(**self.defaults),
            sync=sync,
            timeouts=Timeouts(rpc_s=30.0, collective_s=20.0, sync_s=120.0),
            **topology,
        )

    def build_ranks(self, sources: Sequence[RefitSource], engine: KitEngine) -> list[Any]:
        """One synchronizer per trainer rank, ``sources[r]`` rank ``r``'s."""
        port = _free_port()
        return [
            self.build(source, engine, rank=r, ranks=len(sources), port=port)
            for r, source in enumerate(sources)
        ]


def capabilities_of(options: type[TransportOptions]) -> TransportCapabilities:
    """The ``capabilities`` declared by the synchronizer class ``options`` names."""
    module, name = options.transport
    declared = getattr(importlib.import_module(module), name).capabilities
    assert isinstance(declared, TransportCapabilities)
    return declared


_SMALL = {"bucket_bytes": BUCKET_BYTES}
_GLOO = {"dist_backend": "gloo", **_SMALL}

#: The transports the kit runs on CPU.
CASES: tuple[TransportCase, ...] = (
    TransportCase(
        "ipc", IPCOptions, "embedded", True, _SMALL, rank_processes="tests/ipc/test_sharded.py"
    ),
    TransportCase("collective", CollectiveOptions, "embedded", False, _GLOO),
    TransportCase(
        "sharded",
        ShardedOptions,
        "embedded_tp2",
        False,
        _GLOO,
        rank_processes="tests/sharded/test_sharded_ranks.py",
    ),
    TransportCase("http", HTTPOptions, "server", True, _SMALL),
    TransportCase("sglang_collective", SGLangCollectiveOptions, "server", False, _GLOO),
    TransportCase(
        "lora",
        LoRAOptions,
        "lora",
        True,
        trainer=LoRAKitTrainer,
        rank_processes="tests/lora/test_sharded_lora.py",
    ),
)

#: The kit's cells, in order; each is a ``check_*`` of the package.
CELLS: tuple[str, ...] = (
    "plain",
    "verify_true",
    "verify_sample",
    "bad_verify",
    "delta",
    "kv_scales",
    "trace",
    "verify_engine",
    "cancel",
    "killed_worker",
    "bad_manifest",
    "second_owner",
    "elastic",
    "in_flight_wait",
    "in_flight_abort",
    "in_flight_keep",
    "sharded_trainer",
)


def declares(capabilities: TransportCapabilities, cell: str) -> bool:
    """Whether ``cell`` is a capability the transport declares (else the kit checks
    the typed refusal); ``plain``, ``cancel`` and ``bad_manifest`` every transport owes."""
    if cell == "verify_true":
        return True in capabilities.verify
    if cell == "verify_sample":
        return "sample" in capabilities.verify
    if cell in ("delta", "kv_scales", "trace", "verify_engine", "elastic", "sharded_trainer"):
        return bool(getattr(capabilities, cell))
    return True


#: Cells that need an engine able to respawn a killed worker (the embedded engine): a
#: killed SGLang server is gone for the cells after it.
RESPAWNING = frozenset({"killed_worker"})
#: Cells run only where declared: an undeclared one has no typed refusal to check (the
#: synchronizer refuses ``EngineFleet(refit="rolling")`` on a transport without
#: ``elastic``, not a quarantining fleet; a transport without ``sharded_trainer`` is
#: given no trainer of several ranks).
DECLARED_ONLY = frozenset({"elastic", "sharded_trainer"})
#: Cells of several trainer ranks in this process: a case whose ranks need processes of
#: their own (``rank_processes``) runs them in that suite instead.
IN_PROCESS_RANKS = frozenset({"sharded_trainer"})


def runs(case: TransportCase, cell: str) -> bool:
    """Whether the kit runs ``cell`` on ``case`` (:func:`cells`)."""
    if cell in RESPAWNING and case.engine == "server":
        return False
    if cell in DECLARED_ONLY and not declares(case.capabilities, cell):
        return False
    return not (cell in IN_PROCESS_RANKS and case.rank_processes)


def cells() -> list[tuple[str, str]]:
    """Every ``(case, cell)`` the kit runs: the parametrization of ``test_kit.py``."""
    return [(case.name, cell) for case in CASES for cell in CELLS if runs(case, cell)]
