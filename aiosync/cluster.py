"""Where the trainer's ranks are: :class:`TrainCluster`, and this process among them as a
synchronizer asks it (:class:`Ranks`). See ``docs/topology.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["Ranks", "SingleRank", "TrainCluster"]


@runtime_checkable
class Ranks(Protocol):
    """This process among the trainer's ranks, as the synchronizer asks it: a part the
    synchronizer holds (``sync.ranks``), given by the transport (the IPC and LoRA
    transports: the trainer's process group; the collective: its trainer ranks'
    control group), never a hook it overrides."""

    @property
    def rank(self) -> int:
        """This process's trainer rank (0 for a single-process trainer)."""
        ...

    @property
    def sharded(self) -> bool:
        """Whether several trainer ranks run the synchronizer (they agree on every outcome)."""
        ...

    @property
    def drives_generation(self) -> bool:
        """Whether this process pauses, wakes and labels the engine (one rank does)."""
        ...

    async def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (small, picklable), in rank order; None where there is no
        group to gather over. A collective: every rank calls it at the same point."""
        ...


class SingleRank:
    """A single-process trainer: rank 0, not sharded, driving the engine (:class:`Ranks`)."""

    rank = 0
    sharded = False
    drives_generation = True

    async def gather(self, obj: Any) -> list[Any] | None:
        """None: no other rank."""
        return None


@dataclass(frozen=True, slots=True)
class TrainCluster:
    """Where the trainer's ranks are, and where a non-colocated sync group meets.

    Attributes:
        world_size: trainer ranks taking part in the refit (all gather; rank 0 sends).
        rank: this process's rank among them.
        master_addr: host of the sync group's ``TCPStore`` (loopback in tests).
        master_port: its TCP port, bound by trainer rank 0. ``0`` (the default):
            rank 0 lets the OS pick a free port, logs it and exposes it as the
            synchronizer's ``master_port``, and passes it to the engine's workers.
            Only with ``world_size == 1``: the other trainer ranks cannot learn a
            port rank 0 has not bound yet, so with several ranks pick one port
            (as for ``MASTER_PORT``) and give it to every rank.

    Raises:
        ValueError: ``master_port`` outside ``0..65535``, or ``0`` with ``world_size > 1``.
        TypeError: ``master_port`` is not an int.
    """

    world_size: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int):
            raise TypeError(f"master_port must be an int, got {type(self.master_port).__name__}")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in 0..65535, got {self.master_port}")
        if self.master_port == 0 and self.world_size > 1:
            raise ValueError(
                f"master_port=0 (let rank 0 pick a free port) needs world_size == 1, got "
                f"{self.world_size} ranks, which must all be told the same port: choose one "
                "(as for MASTER_PORT) and pass it to every rank"
            )
