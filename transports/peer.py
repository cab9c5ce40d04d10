"""Catch-up from a peer, the worker side: an engine worker sends the weights it holds
straight to the worker of the same rank in another engine, over a 2-rank gloo group of
the pair's own (never through the trainer's process).

The orchestration (choosing the peer, checking layouts, verifying, labelling) is the
fleet's: :meth:`aiosync.EngineFleet.catch_up`. See ``docs/fleets.md`` ("Catch-up from a
peer").

Wire protocol of one pair (peer worker: group rank :data:`SENDER`, receiver worker:
:data:`RECEIVER`): for each checkpoint tensor the worker holds, in its
:meth:`weight_layout` order, one gloo ``send`` of its raw bytes (``uint8``, the held
slice's ``numel * element_size`` bytes, tag = the tensor's index); empty tensors are
skipped by both sides. Both sides derive the order and sizes from their own layouts,
which the fleet has checked equal (:func:`peer_manifest`) before any byte moves.

The group meets over a ``TCPStore`` the fleet's process serves (a rendezvous of a few
keys; the weights never pass through it), under a key prefix of the catch-up's own
(``<session>/<local worker rank>``).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from aiosync.errors import SyncTimeoutError, TransportError
from aiosync.layout import Part

from ._verify import transit_fault
from .packing import dtype_from_name, dtype_name

__all__ = ["RECEIVER", "SENDER", "PeerModel", "PeerSession", "peer_manifest", "receive", "send"]

#: The peer worker's rank in its pair's group.
SENDER = 0
#: The receiving worker's rank in its pair's group.
RECEIVER = 1


@runtime_checkable
class PeerModel(Protocol):
    """What a worker's model offers a catch-up (the embedded engine's
    :class:`~aiosync.engines.embedded.model.HFModelRunner`)."""

    def hf_state_dict(self) -> Mapping[str, torch.Tensor]:
        """Copies of the held weights under checkpoint names (a TP rank: its slices)."""
        ...

    def weight_layout(self) -> Mapping[str, Part]:
        """``{hf_name: part}`` held, in checkpoint order."""
        ...

    def load_weight_parts(self, parts: Iterable[tuple[str, Part, torch.Tensor]]) -> int:
        """Write received slices into the live weights; returns the elements written."""
        ...


@dataclass(frozen=True)
class PeerSession:
    """Where a pair meets: the fleet's ``TCPStore`` at ``host:port``, keys under
    ``key``; every wait of the group (its formation, each ``send``/``recv``) is
    limited to ``timeout_s`` seconds."""

    host: str
    port: int
    key: str
    timeout_s: float

    def to_wire(self) -> list[Any]:
        """``[host, port, key, timeout_s]`` (msgpack-safe, for a worker RPC)."""
        return [self.host, self.port, self.key, self.timeout_s]

    @classmethod
    def from_wire(cls, fields: list[Any]) -> PeerSession:
        """The inverse of :meth:`to_wire`."""
        host, port, key, timeout_s = fields
        return cls(str(host), int(port), str(key), float(timeout_s))


def peer_manifest(model: PeerModel) -> list[list[Any]]:
    """What ``model`` holds, as a catch-up needs both sides to agree on it:
    ``[[hf_name, part as Part.to_wire() ([full shape, dim, start, length]), held dtype
    name], ...]`` in :meth:`PeerModel.weight_layout` order (msgpack-safe)."""
    held = model.hf_state_dict()
    return [
        [name, part.to_wire(), dtype_name(held[name].dtype)]
        for name, part in model.weight_layout().items()
    ]


def _group(session: PeerSession, pair: int, rank: int) -> tuple[Any, dist.Store]:
    """The pair's 2-rank ``ProcessGroupGloo``, bound to ``session.host`` (blocking
    until both ranks joined, at most ``timeout_s``), and the store client it met
    over (held as long as the group: the group holds its C++ half).

    Raises:
        TransportError: the store did not answer, or the group did not form.
    """
    timeout = datetime.timedelta(seconds=session.timeout_s)
    what = f"forming the catch-up group of worker pair {pair} at {session.host}:{session.port}"
    try:
        # A client of the fleet's store: it never binds a port.
        store = dist.TCPStore(session.host, session.port, None, False, timeout)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=session.host)]
        prefixed = dist.PrefixStore(f"{session.key}/{pair}", store)
        return dist.ProcessGroupGloo(prefixed, rank, 2, options), store
    except Exception as exc:
        raise TransportError(f"{what}: {exc}") from exc


def _wait(work: Any, what: str) -> None:
    """Wait for a gloo send or receive, its error as aiosync's."""
    try:
        work.wait()
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "timeout" in text.lower() or "timed out" in text.lower():
            raise SyncTimeoutError(f"{what}: {text}") from exc
        raise TransportError(f"{what}: {text}") from exc


def send(model: PeerModel, session: PeerSession, pair: int) -> int:
    """Send every tensor ``model`` holds to the pair's receiver (see the module docs);
    returns the bytes sent. The live weights are read once (a copy, so the engine keeps
    serving while the bytes move: the peer's memory grows by one copy of what it holds).

    Raises:
        TransportError: the group did not form, or the receiver went away.
        SyncTimeoutError: a send waited past ``session.timeout_s``.
    """
    group, _store = _group(session, pair, SENDER)
    state = model.hf_state_dict()
    sent = 0
    for index, name in enumerate(model.weight_layout()):
        flat = state[name].contiguous().reshape(-1).view(torch.uint8)
        if flat.numel() == 0:
            continue
        _wait(group.send([flat], RECEIVER, index), f"sending {name!r} to its catch-up")
        sent += flat.numel()
    return sent


def receive(model: PeerModel, manifest: list[list[Any]], session: PeerSession, pair: int) -> int:
    """Receive every tensor of ``manifest`` (:func:`peer_manifest` of this worker's model,
    as the fleet checked it against the peer's) from the pair's sender and write it into
    ``model``'s live weights; returns the bytes received. The caller marks the weights
    invalid before and valid only once verified. A transit fault a test armed
    (:func:`aiosync.transports._verify.arm_transit_fault`, bucket = the tensor's index)
    is applied to its bytes before they are written.

    Raises:
        TransportError: the group did not form, or the sender went away.
        SyncTimeoutError: a receive waited past ``session.timeout_s``.
        RefitMismatchError: the model refused a tensor (its layout changed since).
    """
    group, _store = _group(session, pair, RECEIVER)
    received = 0
    for index, (name, part_wire, dtype) in enumerate(manifest):
        part = Part.from_wire(part_wire)
        tensor = torch.empty(part.local_shape, dtype=dtype_from_name(dtype))
        flat = tensor.reshape(-1).view(torch.uint8)
        if flat.numel() == 0:
            continue
        _wait(group.recv([flat], SENDER, index), f"receiving {name!r} from the peer")
        transit_fault(flat, index)
        model.load_weight_parts([(name, part, tensor)])
        received += flat.numel()
    return received
