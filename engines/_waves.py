"""An :class:`~aiosync.EngineFleet`'s rolling refits: the wave state machine, and which
version each engine serves.

**Rolling refits** (``refit="rolling"``). One ``sync_weights()`` refits the fleet in
*waves* of at most ``max_unavailable`` engines (:meth:`EngineFleet.waves`): the
synchronizer narrows the fleet to a wave (:meth:`EngineFleet.begin_wave`: syncs reach
only its engines, and the transport re-forms over them), pauses, transfers, labels
and resumes them, then goes on to the next; meanwhile ``generate`` goes to the
engines outside the wave, which serve the version they hold, and each
:class:`~aiosync.Generation` says which version computed it. ``weight_version``
advances once every wave committed. A wave that fails (or is cancelled) leaves its
engines *unfit*: they serve nothing until a later sync commits them; the waves
before it serve the new version, those after it the previous one
(:attr:`EngineFleet.versions`), so the fleet keeps generating through a failed refit.
``max_version_lag`` bounds the mix: an engine more versions behind the newest one in
service takes no new requests until it catches up. Engines joining or unfit go in the
first wave (they serve nothing, so refitting them costs no capacity). Each wave
re-forms the transport (the collective: a group over the wave's workers), so a wave
costs one formation besides its transfer. With ``wave_source="peer"`` the waves after
the first copy the new version from an engine of an earlier wave
(:meth:`EngineFleet.copy_wave`) instead of taking it from the trainer.

A wave is a state: none (``_wave is None``: a sync reaches every engine in the sync),
or one in progress (:meth:`~_RollingWaves.begin_wave` to
:meth:`~_RollingWaves.end_wave`: a sync reaches its engines only). Every change of
it is a membership change (the transport re-forms).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from ._membership import _Membership
from ._peer import copy_weights

__all__ = ["FleetRefit", "JoinSource"]

#: How one ``sync_weights()`` refits a fleet: every engine at once (``"all"``: each is
#: paused for the transfer), or in waves while the others serve (``"rolling"``).
FleetRefit = Literal["all", "rolling"]

#: Where an engine added to a fleet takes its first weights from: the trainer, at the
#: next sync (``"trainer"``), or an engine that serves the fleet's newest version, at
#: :meth:`EngineFleet.catch_up` (``"peer"``).
JoinSource = Literal["trainer", "peer"]


class _RollingWaves(_Membership):
    """A fleet's waves and the versions its engines serve (the module docs).

    Raises:
        ValueError: (``_init_waves``) an unknown ``refit`` or ``wave_source``,
            ``wave_source="peer"`` without ``refit="rolling"``, ``max_unavailable`` not
            an int >= 1 nor a fraction in (0, 1), or ``max_version_lag`` < 0.
    """

    def _init_waves(
        self,
        refit: FleetRefit,
        max_unavailable: int | float,
        max_version_lag: int | None,
        wave_source: JoinSource,
    ) -> None:
        if refit not in ("all", "rolling"):
            raise ValueError(f"refit must be 'all' or 'rolling', got {refit!r}")
        if wave_source not in ("trainer", "peer"):
            raise ValueError(f"wave_source must be 'trainer' or 'peer', got {wave_source!r}")
        if wave_source == "peer" and refit != "rolling":
            raise ValueError("wave_source='peer' takes a rolling fleet (refit='rolling')")
        if isinstance(max_unavailable, bool) or not (
            (isinstance(max_unavailable, int) and max_unavailable >= 1)
            or (isinstance(max_unavailable, float) and 0.0 < max_unavailable < 1.0)
        ):
            raise ValueError(
                "max_unavailable must be an int >= 1 or a fraction in (0, 1), "
                f"got {max_unavailable!r}"
            )
        if max_version_lag is not None and (
            isinstance(max_version_lag, bool)
            or not isinstance(max_version_lag, int)
            or max_version_lag < 0
        ):
            raise ValueError(
                f"max_version_lag must be None or an int >= 0, got {max_version_lag!r}"
            )
        self.refit: FleetRefit = refit
        self.max_unavailable = max_unavailable
        self.max_version_lag = max_version_lag
        self.wave_source: JoinSource = wave_source
        # The wave a rolling sync is refitting (None: none); syncs reach only it.
        self._wave: list[Any] | None = None
        # By id(): the version each engine serves (from on_weights_committed), and why
        # an engine in service serves nothing (a failed wave left it unfit).
        self._versions: dict[int, int] = {}
        self._unfit: dict[int, str] = {}

    def _scope(self) -> list[Any]:
        return self.members if self._wave is None else self._wave

    # -- what serves -------------------------------------------------------------------

    @property
    def serving(self) -> list[Any]:
        """The engines new generate calls go to: in service, not left unfit by a failed
        wave, and, where there are others, neither in the wave a rolling refit is
        refitting nor more than ``max_version_lag`` versions behind."""
        fit = self._fit()
        current = fit
        if self.max_version_lag is not None:
            known = [self._versions[id(e)] for e in fit if id(e) in self._versions]
            floor = max(known, default=0) - self.max_version_lag
            current = [e for e in fit if self._versions.get(id(e), floor) >= floor]
        away = {id(e) for e in self._wave or ()}
        # With every current engine in the wave, requests wait for its resume.
        return [e for e in current if id(e) not in away] or current or fit

    def _fit(self) -> list[Any]:
        """The engines in service that a failed wave did not leave unfit."""
        return [e for e in self._in_service() if id(e) not in self._unfit]

    @property
    def versions(self) -> dict[str, int | None]:
        """``{label: version}`` of every engine not quarantined: the version it last
        committed (None: none since it started, or it discarded its weights, or a
        failed wave left it unfit)."""
        return {
            self._name(e): self._versions.get(id(e))
            for e in self.members
            if id(e) not in self._quarantined
        }

    @property
    def unfit(self) -> dict[str, str]:
        """``{label: reason}`` of the engines a failed wave left serving nothing."""
        return {self._name(e): why for e in self.members if (why := self._unfit.get(id(e)))}

    def _serves(self, engine: Any, version: int) -> None:
        """``engine`` committed ``version``: it serves it, fit again."""
        self._versions[id(engine)] = version
        self._unfit.pop(id(engine), None)

    # -- rolling refits (RollingEngines) -----------------------------------------------

    @property
    def rolling(self) -> bool:
        """True when syncs refit the fleet in waves (``refit="rolling"``)."""
        return self.refit == "rolling"

    def waves(self) -> list[list[Any]]:
        """The next sync's waves: every engine the sync reaches once, in fleet order, at
        most ``max_unavailable`` of those in service per wave; the engines that serve
        nothing (joining, unfit) ride in the first. ``refit="all"``: one wave."""
        engines = self.engines
        if not self.rolling:
            return [engines]
        idle = [e for e in engines if id(e) in self._joining or id(e) in self._unfit]
        busy = [e for e in engines if all(e is not i for i in idle)]
        size = self.max_unavailable
        if isinstance(size, float):
            size = max(1, int(size * len(busy)))
        waves = [busy[i : i + size] for i in range(0, len(busy), size)] or [[]]
        waves[0] = idle + waves[0]
        return [wave for wave in waves if wave]

    @property
    def peer_waves(self) -> bool:
        """True when a rolling sync's waves after the first copy from a peer
        (``wave_source="peer"``, :meth:`copy_wave`)."""
        return self.rolling and self.wave_source == "peer"

    async def copy_wave(self, version: int, *, timeout_s: float = 60.0) -> int | None:
        """Copy ``version`` into every engine of the wave in progress from an engine
        outside it that committed ``version`` (worker to worker, verified against the
        peer's digests: :func:`~aiosync.engines._peer.copy_weights`), one engine after
        the other, spreading them over the peers; returns the bytes the peers sent.
        None (nothing copied): no engine outside the wave serves ``version``: the
        trainer's transport moves this wave too.

        Raises:
            RefitMismatchError, RefitVerificationError, TransportError, SyncTimeoutError:
                as :func:`~aiosync.engines._peer.copy_weights`, naming the engine.
        """
        wave = self.engines
        peers = [
            e
            for e in self._fit()
            if self._versions.get(id(e)) == version and all(e is not w for w in wave)
        ]
        if not peers:
            return None
        nbytes = 0
        for i, engine in enumerate(wave):
            peer = peers[i % len(peers)]
            done = await copy_weights(
                peer,
                engine,
                peer_label=self._name(peer),
                label=self._name(engine),
                version=version,
                host="127.0.0.1",
                timeout_s=timeout_s,
            )
            nbytes += done.nbytes
        return nbytes

    def begin_wave(self, engines: Sequence[Any]) -> None:
        """Narrow the fleet to ``engines``: :attr:`engines` (what a sync reaches) is
        theirs, and the membership epoch moves (the transport re-forms over them).

        Raises:
            ValueError: a wave is in progress, or an engine is not in the fleet.
        """
        if self._wave is not None:
            raise ValueError("a rolling refit's wave is already in progress")
        for engine in engines:
            if all(engine is not e for e in self.engines):
                raise ValueError(f"{type(engine).__name__} at {id(engine):#x} is not in the sync")
        self._wave = list(engines)
        self._membership_changed()

    def end_wave(self, *, committed: bool) -> None:
        """Widen the fleet again after a wave. ``committed=False`` (its transfer failed
        or was cancelled): its engines may hold part of a version and are *unfit*, serving
        nothing until a later sync commits them. No wave in progress: nothing."""
        if self._wave is None:
            return
        if not committed:
            for engine in self.engines:
                self._unfit[id(engine)] = "a rolling refit failed while it was in its wave"
                self._versions.pop(id(engine), None)
        self._wave = None
        self._membership_changed()
