"""Named defaults. Every timeout and size aiosync uses without being told lives here."""

from __future__ import annotations

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_EVENT_BACKLOG",
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_SYNC_TIMEOUT_S",
    "PACK_ALIGNMENT_BYTES",
]

#: Whole-refit limit for one ``sync_weights`` call, in seconds. A 70B model over
#: a slow link takes minutes, so this is generous; the per-step timeouts below
#: are what catch a dead peer quickly.
DEFAULT_SYNC_TIMEOUT_S: float = 600.0

#: Limit for one message, RPC or collective step of a transport, in seconds.
DEFAULT_RPC_TIMEOUT_S: float = 120.0

#: Events a subscriber may leave unread before it gets an overflow event, in events.
DEFAULT_EVENT_BACKLOG: int = 1024

#: Default bucket size, in bytes, when neither an option nor the device's memory
#: gives one (NeMo-RL uses min(2 % of device memory, 5 GiB) on GPU).
DEFAULT_BUCKET_BYTES: int = 512 * 1024 * 1024

#: Alignment of each tensor's offset inside a packed bucket, in bytes. 512 covers
#: every dtype's alignment and the vectorized copy kernels' preferences.
PACK_ALIGNMENT_BYTES: int = 512
