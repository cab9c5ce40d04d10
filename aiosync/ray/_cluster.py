"""Where a trainer's sync group meets when its ranks are Ray actors: :class:`SyncGroupAddress`.

Trainer rank 0 calls :func:`sync_group_address` in its own actor: its node's IP
as Ray knows it and a port it chose there. The driver passes the result (the
ObjectRef of that call) to every rank's actor, Ray resolving it before each
runs, and each rank builds its :class:`~aiosync.TrainCluster` from it
(:meth:`SyncGroupAddress.train_cluster`). See ``docs/ray.md``.
"""

from __future__ import annotations

import socket
from typing import NamedTuple

import ray

from aiosync.cluster import TrainCluster

__all__ = ["SyncGroupAddress", "sync_group_address"]


class SyncGroupAddress(NamedTuple):
    """A host and a TCP port on it where a sync group (or any ``torch.distributed``
    group) meets: trainer rank 0's node and a port rank 0 chose.

    Attributes:
        host: rank 0's node IP address, as Ray knows it (``ray.util.get_node_ip_address()``).
        port: a TCP port that was free on ``host`` when chosen.
    """

    host: str
    port: int

    def train_cluster(self, *, rank: int, world_size: int) -> TrainCluster:
        """Trainer rank ``rank``'s :class:`~aiosync.TrainCluster` of ``world_size`` ranks
        meeting here (the same address on every rank)."""
        return TrainCluster(
            world_size=world_size, rank=rank, master_addr=self.host, master_port=self.port
        )

    @property
    def init_method(self) -> str:
        """``tcp://host:port``, for ``torch.distributed.init_process_group(init_method=...)``."""
        return f"tcp://{self.host}:{self.port}"


def sync_group_address() -> SyncGroupAddress:
    """This process's node IP (Ray's view) and a TCP port free there, chosen by the OS.

    Call it in trainer rank 0's process (its actor), once per group to form: the
    port is free when chosen and bound by rank 0 when the group forms (as a
    ``MASTER_PORT`` is), so choose it just before. Every rank then gets the same
    address (pass the call's ObjectRef to their actors).

    Raises:
        RuntimeError: Ray is not initialized in this process.
    """
    if not ray.is_initialized():
        raise RuntimeError("sync_group_address() runs in a Ray process: ray.init() first")
    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    return SyncGroupAddress(host, port)
