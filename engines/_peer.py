"""One catch-up from a peer, engine to engine: check that both hold the same layout,
move the bytes worker to worker (:mod:`aiosync.transports.peer`), verify.

:meth:`aiosync.EngineFleet.catch_up` decides who copies from whom and when; this module
moves and checks. See ``docs/fleets.md`` ("Catch-up from a peer").
"""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass
from typing import Any

import anyio

from aiosync._fanout import each_named, named
from aiosync.errors import RefitMismatchError, RefitVerificationError

__all__ = ["CatchUp", "check_same_layout", "copy_weights"]

#: How much longer than a catch-up's ``timeout_s`` its worker RPCs may take, seconds:
#: a worker's own waits (group formation, each send) end first and report why.
_RPC_SLACK_S = 10.0


@dataclass(frozen=True)
class CatchUp:
    """One engine's catch-up from a peer.

    Attributes:
        engine: the engine that caught up (its fleet label).
        peer: the engine it copied from (its fleet label).
        version: the weight version it serves from now on (the peer's).
        nbytes: bytes the peer's workers sent it (all its workers together); the
            trainer sent none.
    """

    engine: str
    peer: str
    version: int
    nbytes: int


def check_same_layout(
    peer: list[list[list[Any]]], mine: list[list[list[Any]]], peer_label: str, label: str
) -> None:
    """Refuse a catch-up of ``label`` from ``peer_label`` unless both hold the same
    tensors the same way: per worker, ``[[hf_name, part wire, dtype name], ...]``
    (:func:`aiosync.transports.peer.peer_manifest`) equal, worker for worker.

    Raises:
        RefitMismatchError: another worker count (tensor-parallel size), or the first
            worker and entry that differ, both sides quoted.
    """
    if len(peer) != len(mine):
        raise RefitMismatchError(
            f"{label} cannot catch up from {peer_label}: {len(mine)} worker(s) against the "
            f"peer's {len(peer)} (a catch-up copies worker to worker: the same tensor-"
            "parallel layout on both sides)"
        )
    for rank, (theirs, ours) in enumerate(zip(peer, mine, strict=True)):
        if theirs == ours:
            continue
        their_names = [entry[0] for entry in theirs]
        our_names = [entry[0] for entry in ours]
        if their_names != our_names:
            missing = [n for n in their_names if n not in our_names]
            extra = [n for n in our_names if n not in their_names]
            detail = (
                f"names differ (the peer's only: {missing[:3]}, its only: {extra[:3]})"
                if missing or extra
                else "the same names in another order"
            )
        else:
            a, b = next((a, b) for a, b in zip(theirs, ours, strict=True) if a != b)
            detail = (
                f"{a[0]!r} is [full shape, dim, start, length] {a[1]} {a[2]} on the peer, "
                f"{b[1]} {b[2]} on it"
            )
        raise RefitMismatchError(
            f"{label} cannot catch up from {peer_label}: worker {rank} holds another layout: "
            f"{detail}"
        )


async def copy_weights(
    peer: Any,
    receiver: Any,
    *,
    peer_label: str,
    label: str,
    version: int,
    host: str,
    timeout_s: float,
) -> CatchUp:
    """Copy ``peer``'s live weights into ``receiver``, worker ``r`` to worker ``r``,
    then verify them; returns what moved. Both are
    :class:`~aiosync.capabilities.EngineWorkers` whose workers have
    :class:`~aiosync.transports._identity.WorkerIdentityMixin`'s ``aiosync_peer_*``
    methods.

    The receiver's weights are invalid from its first received byte and are marked
    valid by its own workers only when the SHA-256 of every tensor they hold equals the
    peer's (``aiosync_weight_digests``); this function does not label it.

    Args:
        version: the version the peer serves (for the result).
        host: the address the workers reach this process's rendezvous store at, and the
            interface their gloo pairs bind to (loopback: every engine on this machine).
        timeout_s: limit of the pairs' formation and of each send and receive, seconds.

    Raises:
        RefitMismatchError: the layouts differ (:func:`check_same_layout`), before any
            byte moves.
        RefitVerificationError: a tensor the receiver holds differs from the peer's after
            the copy, named; the receiver's weights stay invalid.
        TransportError, SyncTimeoutError: a worker died, or a pair did not form or
            stalled past ``timeout_s``.
    """
    import torch.distributed as dist  # torch only when a catch-up runs

    from aiosync.transports.peer import PeerSession

    rpc_s = timeout_s + _RPC_SLACK_S

    async def rpc(engine: Any, who: str, method: str, *args: Any) -> list[Any]:
        try:
            replies: list[Any] = await engine.collective_rpc(method, args, timeout_s=rpc_s)
        except Exception as exc:
            raise named(exc, who) from None
        return replies

    theirs = await rpc(peer, peer_label, "aiosync_peer_manifest")
    mine = await rpc(receiver, label, "aiosync_peer_manifest")
    check_same_layout(theirs, mine, peer_label, label)

    # The rendezvous only: a few keys per pair; the weights go worker to worker.
    # It binds a port (the OS picks it): off the event loop.
    store = await anyio.to_thread.run_sync(
        lambda: dist.TCPStore(
            host, 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
    )
    session = PeerSession(
        host, int(store.port), f"aiosync/catch-up/{uuid.uuid4().hex}", timeout_s
    ).to_wire()
    # Both sides at once (each pair meets in the middle); the first to fail cancels the
    # other's wait, and its error names its engine.
    sides = [
        (peer, "aiosync_peer_send", (session,)),
        (receiver, "aiosync_peer_receive", (session, theirs, version)),
    ]
    labels = [peer_label, label]

    async def move(i: int, side: tuple[Any, str, tuple[Any, ...]]) -> list[Any]:
        engine, method, args = side
        replies: list[Any] = await engine.collective_rpc(method, args, timeout_s=rpc_s)
        return replies

    sent, _received = await each_named(sides, move, labels.__getitem__)
    del store

    digests = await rpc(peer, peer_label, "aiosync_weight_digests")
    differ = await rpc(receiver, label, "aiosync_peer_verify", digests)
    for rank, names in enumerate(differ):
        if names:
            raise RefitVerificationError(
                f"{label}: its copy of {peer_label}'s version {version} differs from the "
                f"peer's in worker {rank}: {names[:5]}"
                + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                + "; it serves nothing until a catch-up or a sync succeeds"
            )
    return CatchUp(label, peer_label, version, sum(int(n) for n in sent))
