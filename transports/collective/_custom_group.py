"""SGLang's weight-update group: the process group a disaggregated SGLang server joins.

``POST /init_weights_update_group {master_address, master_port, rank_offset,
world_size, group_name, backend}`` makes each of the server's workers (TP rank
``r``) call SGLang's ``init_custom_process_group`` (``python/sglang/srt/utils``,
read in SGLang 0.5.23) with ``init_method=f"tcp://{master_address}:{master_port}"``,
``rank=rank_offset + r``: a ``TCPStore`` client of the trainer's store, wrapped in
``PrefixStore(group_name)``, handed to torch's ``_new_process_group_helper``, which
prefixes it again with ``f"{group_name}/"`` and, for the backend itself, with the
device type (``"cpu/"`` for gloo, ``"cuda/"`` for nccl; read in torch 2.13's
``distributed_c10d``). The trainer, rank 0, hosts that store and must meet the
workers under exactly those keys.

:func:`join_custom_group` builds the backend over that key layout from torch's
backend classes directly: ``_new_process_group_helper`` would register the group
name process-wide (a second group of the same name in one process is refused,
and SGLang's default name is the same for every server) and is private.
``tests/collective/test_custom_group.py`` checks the layout against torch's own
helper, rank for rank.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions

from aiosync.errors import SyncError, TransportError

from ._group import _make_backend
from ._sync_group import _release, translate_error

__all__ = ["CustomGroup", "custom_group_store", "join_custom_group"]


def custom_group_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """``store`` under the prefixes SGLang's ``init_custom_process_group`` gives the
    backend of group ``group_name`` (``group_name``, then ``f"{group_name}/"``, then
    the device type)."""
    device = "cuda" if backend == "nccl" else "cpu"
    named = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore(f"{device}/", named)


@dataclass(eq=False)
class CustomGroup:
    """One rank's membership of a weight-update group (see the module docstring).

    Attributes:
        rank: this rank (the trainer: 0; a server's TP rank ``r``: ``rank_offset + r``).
        world_size: every rank of the group.
        group_name: SGLang's ``group_name``.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: the limit of every broadcast, seconds.
        pg: torch's backend object (None once closed).
        store: the store the group met over (held: the backend refers to it).
        broken: a broadcast failed; the group must be formed again.
    """

    rank: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    pg: Any
    store: dist.Store | None
    broken: bool = False

    def broadcast(self, tensor: torch.Tensor, *, what: str) -> None:
        """Broadcast contiguous ``tensor`` from rank 0 to every rank and wait for it
        (blocking: call it from a worker thread). An empty tensor is not sent.

        Raises:
            TransportError, SyncTimeoutError: a rank died, closed its connection
                or timed out (the group is :attr:`broken` from then on).
        """
        if self.broken or self.pg is None:
            raise TransportError(f"{what}: the weight-update group is broken; form it again")
        if tensor.numel() == 0:
            return
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self.pg.broadcast([tensor], opts).wait()
        except SyncError:
            self.broken = True
            raise
        except Exception as exc:
            self.broken = True
            raise translate_error(exc, what) from exc

    def close(self) -> None:
        """Tear the backend down (aborted when broken; then released in a daemon
        thread, as a gloo backend with a pending broadcast blocks its destructor until
        that times out) and drop the store. Idempotent; never raises; never blocks on
        a peer."""
        backends, self.pg, self.store = [self.pg], None, None
        _release(backends, broken=self.broken)
        self.broken = True


def join_custom_group(
    store: dist.Store,
    *,
    group_name: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
) -> CustomGroup:
    """Join weight-update group ``group_name`` as ``rank`` over ``store`` (blocking
    until every rank joined, at most ``timeout_s``).

    Args:
        store: the trainer's ``TCPStore`` (its server on rank 0; on a server's
            worker a client of it, one per rank, as SGLang's rendezvous makes).
        group_name, rank, world_size, backend: as ``/init_weights_update_group``
            passes them (``rank = rank_offset + tp_rank``).
        timeout_s: the formation's and every broadcast's limit, seconds.

    Raises:
        ValueError: ``rank`` outside ``0..world_size-1`` or an unknown backend.
        TransportError, SyncTimeoutError: the group did not form.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size} ranks")
    timeout = datetime.timedelta(seconds=timeout_s)
    what = f"weight-update group {group_name!r} (rank {rank} of {world_size})"
    try:
        pg = _make_backend(
            backend, custom_group_store(store, group_name, backend), rank, world_size, timeout
        )
    except (ValueError, SyncError):
        raise
    except Exception as exc:
        raise translate_error(exc, what) from exc
    return CustomGroup(rank, world_size, group_name, backend, timeout_s, pg, store)
