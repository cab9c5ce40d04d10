"""Who an :class:`~aiosync.EngineFleet` syncs: its members, each in service, joining,
quarantined or waiting for a catch-up, and the quarantine after a failed sync.

**Elastic fleets** (``on_engine_failure="quarantine"``). After a failed sync the
synchronizer asks the fleet which members failed (:meth:`EngineFleet.set_aside_failed`):
each engine in the sync is probed (its :class:`~aiosync.capabilities.HealthReporting`
check, then one round trip to every worker, within ``probe_timeout_s``: a hung
worker fails it as a dead one does); the ones that fail are *quarantined*: no more
syncs, no generate calls. If at least ``min_engines`` remain, the synchronizer re-forms
its transport over them and syncs them again within the same ``sync_weights()``
(``weight_version`` then means "live on every engine in service"); below it the
sync fails as with ``"fail"``. :meth:`EngineFleet.add_engine` (a new engine, or a
healed one) brings an engine in as *joining*: the next sync gives it every
tensor, and it serves only once that sync committed. Worker ranks stay
contiguous over the engines in the sync; each membership change bumps
:attr:`EngineFleet.membership_epoch`, which makes the synchronizer re-initialize
before its next transfer.

The fleet's other parts build on this one: its rolling waves (:mod:`._waves`) narrow
what a sync reaches (:meth:`_Membership._scope`), its catch-ups (:mod:`._catch_up`)
hold engines out of syncs, and its workers' global ranks (:mod:`._fleet_workers`) are
assigned again after each membership change (:meth:`_Membership._forget_ranks`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import anyio

from aiosync.capabilities import EngineWorkers, HealthReporting, engines_of
from aiosync.errors import TransportError

__all__ = ["OnEngineFailure"]

# The public module's name: logging is configured by it.
_log = logging.getLogger("aiosync.engines.fleet")

#: What a fleet does with an engine that fails a sync: fail the sync (``"fail"``), or
#: set the engine aside and commit on the others (``"quarantine"``).
OnEngineFailure = Literal["fail", "quarantine"]


class _Membership:
    """The members of a fleet and their standing (the module docs); the base of
    :class:`~aiosync.EngineFleet`, whose constructor calls each layer's ``_init_*``
    with the arguments its docs name.

    Raises:
        ValueError: (``_init_membership``) an unknown ``on_engine_failure``, or
            ``min_engines`` < 1.
    """

    def _init_membership(
        self,
        engines: Sequence[Any],
        on_engine_failure: OnEngineFailure,
        min_engines: int,
        probe_timeout_s: float,
    ) -> None:
        if on_engine_failure not in ("fail", "quarantine"):
            raise ValueError(
                f"on_engine_failure must be 'fail' or 'quarantine', got {on_engine_failure!r}"
            )
        if isinstance(min_engines, bool) or not isinstance(min_engines, int) or min_engines < 1:
            raise ValueError(f"min_engines must be an int >= 1, got {min_engines!r}")
        # A plain list: engines_of would take a fleet given here for its members.
        #: Every engine ever in the fleet, in order (quarantined ones included).
        self.members: list[Any] = list(engines_of(list(engines)))
        self.on_engine_failure: OnEngineFailure = on_engine_failure
        self.min_engines = min_engines
        self.probe_timeout_s = probe_timeout_s
        # By id(): absent = in service.
        self._joining: set[int] = set()
        self._quarantined: dict[int, str] = {}
        self._joined: list[str] = []
        # Engines waiting for a catch-up from a peer (add_engine(source="peer")), by id():
        # why their last catch-up failed (None: none tried yet). No sync reaches them.
        self._catching_up: dict[int, str | None] = {}
        #: Incremented by every membership change (a quarantine, an add_engine).
        self.membership_epoch = 0

    # -- who a sync reaches, who serves ----------------------------------------------

    @property
    def engines(self) -> list[Any]:
        """The engines syncs reach, in order: those in service and those joining
        (never a quarantined one, nor one waiting for a catch-up from a peer); during a
        rolling refit's wave, the wave's."""
        return [
            e
            for e in self._scope()
            if id(e) not in self._quarantined and id(e) not in self._catching_up
        ]

    def _scope(self) -> list[Any]:
        """The engines a sync may reach before quarantine and catch-ups are left out:
        every member (a rolling refit narrows it to its wave)."""
        return self.members

    def _in_service(self) -> list[Any]:
        """Neither quarantined nor joining nor waiting for a catch-up (whatever a rolling
        refit is doing)."""
        away = self._quarantined.keys() | self._joining | self._catching_up.keys()
        return [e for e in self.members if id(e) not in away]

    @property
    def quarantined(self) -> dict[str, str]:
        """``{label: reason}`` of the engines set aside."""
        return {self._name(e): why for e in self.members if (why := self._quarantined.get(id(e)))}

    def take_joined(self) -> list[str]:
        """The labels of the engines that went into service at the last commit (once)."""
        joined, self._joined = self._joined, []
        return joined

    # -- quarantine --------------------------------------------------------------------

    async def set_aside_failed(self, error: BaseException) -> list[tuple[str, str]]:
        """After a sync failed with ``error``: check every engine in the sync and, with
        ``on_engine_failure="quarantine"``, quarantine those that fail the check,
        provided ``min_engines`` stay in service. Returns ``[(label, reason)]`` of the
        engines set aside (empty: none, or too few would remain: the sync fails)."""
        if self.on_engine_failure != "quarantine":
            return []
        engines = self.engines
        reasons: list[str | None] = [None] * len(engines)

        async def check(i: int, engine: Any) -> None:
            try:
                with anyio.fail_after(self.probe_timeout_s):
                    await self._probe(engine)
            except TimeoutError as exc:
                # A hung engine (a stopped worker, a frozen server) answers nothing.
                detail = f" ({type(exc).__name__}: {exc})" if str(exc) else ""
                reasons[i] = f"did not answer its probe within {self.probe_timeout_s} s{detail}"
            except Exception as exc:
                reasons[i] = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)

        async with anyio.create_task_group() as tg:
            for i, engine in enumerate(engines):
                tg.start_soon(check, i, engine)
        failed = [(e, why) for e, why in zip(engines, reasons, strict=True) if why is not None]
        if not failed:
            return []
        left = [e for e in self._in_service() if all(e is not f for f, _ in failed)]
        if len(left) < self.min_engines:
            # The sync fails with ``error``, which may name a healthy engine (one
            # that waited for the hung one): say which failed the probe.
            failed_probe = "; ".join(f"{self._name(e)}: {why}" for e, why in failed)
            error.add_note(f"failed the fleet's probe after it: {failed_probe}")
            _log.warning(
                "engine fleet: %d engine(s) failed their check after a failed sync, which "
                "would leave %d in service (min_engines=%d): the sync fails",
                len(failed),
                len(left),
                self.min_engines,
            )
            return []
        labels = [
            (self._name(e), f"{why} (after the sync failed with {error!r})") for e, why in failed
        ]
        for (engine, _why), (_label, reason) in zip(failed, labels, strict=True):
            self._quarantined[id(engine)] = reason
            self._joining.discard(id(engine))
        self._membership_changed()
        return labels

    async def _probe(self, engine: Any) -> None:
        """One engine's probe after a failed sync: its own check
        (:class:`~aiosync.capabilities.HealthReporting`: workers alive, server
        answering), then a round trip to every worker (``aiosync_device_identity``,
        :class:`~aiosync.capabilities.EngineWorkers`): a stopped or hung worker
        passes the first (its process lives) but not the second (case C35).

        Raises:
            TimeoutError: a worker did not answer within ``probe_timeout_s``.
            TransportError: a worker (or the engine's process) is dead.
            Whatever the engine's ``check_health`` raises.
        """
        if isinstance(engine, HealthReporting):
            await engine.check_health()
        if isinstance(engine, EngineWorkers):
            try:
                await engine.collective_rpc(
                    "aiosync_device_identity", timeout_s=self.probe_timeout_s
                )
            except (TimeoutError, TransportError):
                raise
            except Exception:
                # Every worker answered, if with an error (one without aiosync's
                # worker methods): each is alive, which is all the probe asks.
                return

    # -- bookkeeping -------------------------------------------------------------------

    def _membership_changed(self) -> None:
        self.membership_epoch += 1
        self._forget_ranks()

    def _forget_ranks(self) -> None:
        """Drop what depends on which engines a sync reaches (the fleet's workers'
        global ranks: :mod:`._fleet_workers`)."""

    def _name(self, engine: Any) -> str:
        index = next(i for i, e in enumerate(self.members) if e is engine)
        return f"engine {index} of {len(self.members)} ({type(engine).__name__})"
