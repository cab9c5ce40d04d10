"""An :class:`~aiosync.EngineFleet`'s engines added from a peer, and the gate between
its syncs and its catch-ups.

**Catch-up from a peer** (``add_engine(engine, source="peer")``, then
:meth:`EngineFleet.catch_up`). The engine takes the weights of the newest version the
fleet serves from an engine that serves it, worker to worker, instead of from the
trainer: no sync reaches it while it waits, the trainer's source is not read and the
synchronizer sends nothing for it. Its weights are invalid from the first byte
received; it serves, labelled with the peer's version, only once the digests of every
tensor it holds equal the peer's. A sync waits (in :meth:`EngineFleet.pause_generation`)
before it refits an engine being copied from or into; a catch-up waits for a sync that is
refitting its peer. See ``docs/fleets.md`` ("Catch-up from a peer").

This module decides who copies from whom and when; :mod:`._peer` moves and checks
the bytes.
"""

from __future__ import annotations

from typing import Any

import anyio

from aiosync.capabilities import EngineWorkers, VersionedEngine
from aiosync.errors import SyncError, SyncTimeoutError

from ._peer import CatchUp, copy_weights
from ._waves import JoinSource, _RollingWaves

__all__ = ["CatchUp"]


class _PeerCatchUp(_RollingWaves):
    """Adding engines to a fleet, from the trainer or from a peer (the module docs)."""

    def _init_catch_up(self) -> None:
        # By id(): engines a sync paused (from pause_generation to resume_generation) and
        # engines a catch-up copies from or into. Each side waits for the other under
        # _gate: a sync never writes an engine whose bytes are moving to a peer.
        self._refitting: set[int] = set()
        self._copying: set[int] = set()
        self._gate = anyio.Condition()
        self._catch_up_lock = anyio.Lock()

    def _relay_discards(self, engine: Any) -> None:
        """Hear a new member's discard notices (the fleet's, :mod:`.fleet`)."""

    def add_engine(self, engine: Any, *, source: JoinSource = "trainer") -> None:
        """Bring ``engine`` (a new one, or a quarantined one healed or respawned) in.

        ``source="trainer"``: as *joining*: the next sync gives it every tensor; it
        serves once that committed. ``source="peer"``: it waits for :meth:`catch_up`,
        which copies the newest version the fleet serves into it from an engine that
        serves it; no sync reaches it until then. An engine waiting for a catch-up
        (one failed, say) may be added again with the other source.

        Raises:
            ValueError: an unknown ``source``, or ``engine`` is already in the fleet
                (neither quarantined nor waiting for a catch-up).
        """
        if source not in ("trainer", "peer"):
            raise ValueError(f"source must be 'trainer' or 'peer', got {source!r}")
        away = self._quarantined.keys() | self._catching_up.keys()
        if any(e is engine and id(e) not in away for e in self.members):
            raise ValueError(f"{self._name(engine)} is already in the fleet")
        if not any(e is engine for e in self.members):
            self.members.append(engine)
            self._relay_discards(engine)
        self._quarantined.pop(id(engine), None)
        if source == "peer":
            # Whatever it served before (a quarantined engine) is no version of the fleet's.
            self._versions.pop(id(engine), None)
            self._unfit.pop(id(engine), None)
            self._catching_up[id(engine)] = None
            return  # no sync reaches it: the synchronizer's membership is unchanged
        self._catching_up.pop(id(engine), None)
        self._joining.add(id(engine))
        self._membership_changed()

    @property
    def catching_up(self) -> dict[str, str | None]:
        """``{label: why its last catch-up failed (None: none tried)}`` of the engines
        waiting for :meth:`catch_up` (``add_engine(engine, source="peer")``)."""
        return {
            self._name(e): self._catching_up[id(e)]
            for e in self.members
            if id(e) in self._catching_up
        }

    async def catch_up(self, *, host: str = "127.0.0.1", timeout_s: float = 60.0) -> list[CatchUp]:
        """Copy the newest version the fleet serves into every engine waiting for a
        catch-up (``add_engine(engine, source="peer")``), one after the other, each from
        an engine that serves that version, worker to worker; each then serves, labelled
        with that version (``on_weights_committed``). The trainer is not involved: its
        source is not read and its synchronizer sends nothing, and it may sync meanwhile
        (a sync waits, in :meth:`pause_generation`, before it refits the peer or the
        engine being copied into; this call waits for a sync refitting the peer).

        The peer: among the engines in service and fit, those at the newest known version
        (:attr:`versions`), the first not being refit. Its weights were checked against
        the trainer's when it committed that version if its synchronizer verifies
        (``verify=True``); the copy is checked against the peer's: the SHA-256 of every
        tensor each worker holds (``aiosync_weight_digests``) must match, or the engine
        keeps waiting, its weights invalid (refusing to generate). Costs: the peer's
        workers hold one more host copy of their weights while they send; the bytes
        move once, over gloo between the paired workers.

        Args:
            host: the address the engines' workers reach this process at (a rendezvous
                store of a few keys) and their gloo pairs bind to; loopback: every
                engine on this machine.
            timeout_s: limit of each wait: for a sync refitting the peer, each pair's
                formation, each tensor's send and receive, seconds.

        Returns:
            One :class:`CatchUp` per engine that caught up, in fleet order (empty: none
            waiting).

        Raises:
            SyncError: no engine in service serves a committed version (sync the fleet
                first).
            RefitMismatchError: the peer holds another layout (another
                tensor-parallel size, other tensors, shapes or dtypes), before any byte
                moves; the engine keeps its weights and keeps waiting.
            RefitVerificationError: the copy differs from the peer's (named tensors);
                the engine keeps waiting, its weights invalid.
            TransportError, SyncTimeoutError: a worker died or a wait ran past
                ``timeout_s``; the engine keeps waiting.
            TypeError: the engine or its peer has no ``collective_rpc``.
            Each error names the engine it comes from (the peer, or the engine
            catching up); the engines after it are not tried.
        """
        async with self._catch_up_lock:
            done: list[CatchUp] = []
            for engine in [e for e in self.members if id(e) in self._catching_up]:
                label = self._name(engine)
                if not isinstance(engine, EngineWorkers):
                    raise TypeError(f"{label} has no collective_rpc: it cannot catch up")
                try:
                    done.append(await self._catch_up_one(engine, host, timeout_s))
                except Exception as exc:
                    self._catching_up[id(engine)] = f"{type(exc).__name__}: {exc}"
                    raise
            return done

    async def _catch_up_one(self, engine: Any, host: str, timeout_s: float) -> CatchUp:
        """:meth:`catch_up` of one engine: wait for a peer that no sync is refitting,
        hold both out of syncs while the bytes move and are verified, then put the
        engine in service at the peer's version."""
        label = self._name(engine)
        try:
            with anyio.fail_after(timeout_s):
                async with self._gate:
                    while (peer := self._peer_for(label)) is None:
                        await self._gate.wait()
                    self._copying.update((id(peer), id(engine)))
        except TimeoutError:
            raise SyncTimeoutError(
                f"{label}: every engine at the newest version was being refit by a sync "
                f"for {timeout_s} s"
            ) from None
        version = self._versions[id(peer)]
        try:
            if not isinstance(peer, EngineWorkers):
                raise TypeError(f"{self._name(peer)} has no collective_rpc: no catch-up from it")
            done = await copy_weights(
                peer,
                engine,
                peer_label=self._name(peer),
                label=label,
                version=version,
                host=host,
                timeout_s=timeout_s,
            )
            if isinstance(engine, VersionedEngine):
                await engine.on_weights_committed(version)
            # In service before the syncs waiting for these engines go on: a sync that
            # starts now reaches it like every other engine.
            del self._catching_up[id(engine)]
            self._serves(engine, version)
            self._membership_changed()
        finally:
            with anyio.CancelScope(shield=True):
                async with self._gate:
                    self._copying.difference_update((id(peer), id(engine)))
                    self._gate.notify_all()
        return done

    def _peer_for(self, label: str) -> Any | None:
        """The engine to copy from: in service and fit, at the newest version known, the
        first that no sync is refitting; None while every such engine is refit.

        Raises:
            SyncError: no engine in service has committed a version.
        """
        fit = self._fit()
        known = [self._versions[id(e)] for e in fit if id(e) in self._versions]
        if not known:
            raise SyncError(
                f"{label} cannot catch up from a peer: no engine in service serves a "
                "committed version (sync the fleet first)"
            )
        newest = max(known)
        at_newest = [e for e in fit if self._versions.get(id(e)) == newest]
        return next((e for e in at_newest if id(e) not in self._refitting), None)

    # -- the gate between syncs and catch-ups -----------------------------------------

    async def _refit_begins(self) -> None:
        """A sync is about to pause (and then write) the engines it reaches: wait while a
        catch-up copies from or into one of them, then hold catch-ups off them."""
        async with self._gate:
            while any(id(e) in self._copying for e in self.engines):
                await self._gate.wait()
            self._refitting.update(id(e) for e in self.engines)

    async def _refit_ends(self) -> None:
        """Every engine a sync paused is resumed (one set aside since included): no sync
        writes now; the catch-ups waiting for a peer go on."""
        with anyio.CancelScope(shield=True):
            async with self._gate:
                self._refitting.clear()
                self._gate.notify_all()
