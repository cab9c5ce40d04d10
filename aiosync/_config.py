"""Named defaults: the limits every synchronizer applies (:class:`Timeouts`) and sizes.

Engine-side limits (an engine's start-up, SGLang's cache flush) live with their engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "AFTER_FAILURE_TIMEOUT_S",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_EVENT_BACKLOG",
    "DEFAULT_RESUME_TIMEOUT_S",
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_SYNC_TIMEOUT_S",
    "PACK_ALIGNMENT_BYTES",
    "Timeouts",
]

#: Whole-refit limit for one ``sync_weights`` call, in seconds. A 70B model over
#: a slow link takes minutes, so this is generous; the per-step timeouts below
#: are what catch a dead peer quickly.
DEFAULT_SYNC_TIMEOUT_S: float = 600.0

#: Limit for one message, RPC or collective step of a transport, in seconds.
DEFAULT_RPC_TIMEOUT_S: float = 120.0

#: Limit for the engine's ``resume_generation`` after a committed sync, seconds.
DEFAULT_RESUME_TIMEOUT_S: float = 30.0

#: Limit for every clean-up step after a failed or cancelled sync (resume the
#: engine, wake its KV cache), seconds: a healthy engine answers in milliseconds,
#: and a hung one must not delay the sync's own error by a whole RPC timeout (the
#: fault matrix saw 5 + 30 s for an SGLang server stopped mid-sync).
AFTER_FAILURE_TIMEOUT_S: float = 2.0

#: Events a subscriber may leave unread before it gets an overflow event, in events.
DEFAULT_EVENT_BACKLOG: int = 1024

#: Default bucket size, in bytes, when neither an option nor the device's memory
#: gives one (NeMo-RL uses min(2 % of device memory, 5 GiB) on GPU).
DEFAULT_BUCKET_BYTES: int = 512 * 1024 * 1024

#: Alignment of each tensor's offset inside a packed bucket, in bytes. 512 covers
#: every dtype's alignment and the vectorized copy kernels' preferences.
PACK_ALIGNMENT_BYTES: int = 512


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Every limit a synchronizer applies, seconds, in one object (as httpx's ``Timeout``).

    ``create_weight_synchronizer(..., timeouts=Timeouts(sync_s=60))`` or any
    transport's ``timeouts=``; the older keywords (``sync_timeout_s=``,
    ``rpc_timeout_s=``) still work and override the matching field.

    Attributes:
        sync_s: a whole ``sync_weights`` call, the pause included.
        rpc_s: one message, RPC or collective step (what catches a dead peer).
        resume_s: the engine's ``resume_generation`` after a committed sync.
        after_failure_s: each clean-up step after a failed or cancelled sync.
        collective_s: the collective transports' rendezvous and each collective;
            None: the transport's default. The other transports have none.

    Raises:
        ValueError: a limit that is not a finite number > 0.
    """

    sync_s: float = DEFAULT_SYNC_TIMEOUT_S
    rpc_s: float = DEFAULT_RPC_TIMEOUT_S
    resume_s: float = DEFAULT_RESUME_TIMEOUT_S
    after_failure_s: float = AFTER_FAILURE_TIMEOUT_S
    collective_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("sync_s", "rpc_s", "resume_s", "after_failure_s", "collective_s"):
            value = getattr(self, name)
            if value is None and name == "collective_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"Timeouts.{name} must be a number, got {value!r}")
            if not 0 < value < float("inf"):
                raise ValueError(f"Timeouts.{name} must be a finite number > 0, got {value!r}")

    def with_keywords(
        self, *, sync_timeout_s: float | None = None, rpc_timeout_s: float | None = None
    ) -> Timeouts:
        """These limits with the older per-keyword ones (None: keep the field)."""
        changes: dict[str, float] = {}
        if sync_timeout_s is not None:
            changes["sync_s"] = sync_timeout_s
        if rpc_timeout_s is not None:
            changes["rpc_s"] = rpc_timeout_s
        return replace(self, **changes) if changes else self
