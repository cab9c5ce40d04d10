"""Who holds an SGLang server's weight-update group: owner records, and a rendezvous
that a refusal can cancel.

SGLang keeps one weight-update group per name and says nothing of who formed it: a
second ``/init_weights_update_group`` of the same name is refused ("The specified
group name has already been created"), and ``/destroy_weights_update_group`` destroys
whoever's group it is. So :class:`SGLangCollectiveWeightSynchronizer` keeps a record of
each group it formed (:class:`GroupRecord`, a JSON file per server URL and group name
in :func:`records_dir`), removed when it destroys the group. A group is reclaimed
(destroyed, then formed again) only when its record says its holder is dead
(:func:`holder_gone`): the record was written on this host, by a process that no
longer runs (its pid gone, or the pid now another process: another start time), and
the server has not restarted since (:func:`server_restarted`: a record older than the
server's ``startup_time`` is only dropped, its group gone with the old server). Anything else, a
live holder, a holder on another host, no record, is refused with
:class:`~aiosync.errors.OwnershipError` and never destroyed. The rules and their
limits: ``docs/sglang.md``.

:class:`CancellableStore` lets a refused formation end the trainer's own rendezvous
at once instead of at the backend's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import socket
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from aiosync.errors import SyncTimeoutError, TransportError

from .._leftovers import pid_alive

__all__ = [
    "RECORDS_ENV",
    "CancellableStore",
    "GroupRecord",
    "holder_gone",
    "process_start",
    "read_record",
    "records_dir",
    "records_of",
    "remove_record",
    "server_restarted",
    "write_record",
]

#: Environment variable naming the folder of the group records (default: a folder of
#: this user's in the temp dir). A trainer restarted in a fresh container finds its
#: dead predecessor's record only where this folder outlives the container.
RECORDS_ENV = "AIOSYNC_GROUP_RECORDS"

# How often a cancellable wait looks for its keys and the cancel flag, seconds.
_POLL_S = 0.05


@dataclass(frozen=True)
class GroupRecord:
    """The trainer that formed weight-update group ``group_name`` on server ``url``.

    Attributes:
        url: the server's base URL.
        group_name: SGLang's ``group_name``.
        host: ``socket.gethostname()`` of the trainer.
        pid: the trainer's process id.
        started: the trainer's start time (``/proc/<pid>/stat`` field 22, clock ticks
            since boot; None where there is no ``/proc``): tells a reused pid apart.
        master_address, master_port: the trainer's store (the group's rendezvous).
        server_started: the server's ``startup_time`` when the group formed (None: not
            reported); a server started since holds none of this trainer's groups.
    """

    url: str
    group_name: str
    host: str
    pid: int
    started: int | None
    master_address: str
    master_port: int
    server_started: float | None

    def describe(self) -> str:
        """``"pid P on host H (store A:P)"``."""
        return (
            f"pid {self.pid} on host {self.host} (store {self.master_address}:{self.master_port})"
        )


def records_dir() -> Path:
    """Where the records live: ``$AIOSYNC_GROUP_RECORDS``, else
    ``<tempdir>/aiosync-sglang-groups-<uid>``."""
    configured = os.environ.get(RECORDS_ENV)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"aiosync-sglang-groups-{os.getuid()}"


def _path(url: str, group_name: str) -> Path:
    key = hashlib.sha256(f"{url}\0{group_name}".encode()).hexdigest()[:32]
    return records_dir() / f"{key}.json"


def write_record(record: GroupRecord) -> None:
    """Write ``record`` (replacing the one of the same server and group), atomically.
    Never raises: a record that cannot be written only costs a later reclaim (logged
    by the caller's OwnershipError, which then names no holder)."""
    path = _path(record.url, record.group_name)
    with contextlib.suppress(OSError):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(asdict(record)))
        os.replace(temp, path)


def read_record(url: str, group_name: str) -> GroupRecord | None:
    """The record of group ``group_name`` on ``url``; None: none (or unreadable)."""
    return _load(_path(url, group_name))


def records_of(url: str) -> list[GroupRecord]:
    """Every record of server ``url``."""
    folder = records_dir()
    if not folder.is_dir():
        return []
    found = (_load(path) for path in sorted(folder.glob("*.json")))
    return [record for record in found if record is not None and record.url == url]


def remove_record(url: str, group_name: str, *, pid: int | None = None) -> None:
    """Remove the record of group ``group_name`` on ``url`` (only if it is ``pid``'s,
    when given). Never raises."""
    path = _path(url, group_name)
    record = _load(path)
    if record is None or (pid is not None and record.pid != pid):
        return
    with contextlib.suppress(OSError):
        path.unlink()


def _load(path: Path) -> GroupRecord | None:
    try:
        return GroupRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def process_start(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot, ``/proc/<pid>/stat`` field
    22); None: no such process, or no ``/proc``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19])


def server_restarted(record: GroupRecord, server_started: float | None) -> bool:
    """Whether the server restarted since ``record`` (another ``startup_time``; False
    when either is unknown): it then holds none of the recorded trainer's groups."""
    return (
        record.server_started is not None
        and server_started is not None
        and record.server_started != server_started
    )


def holder_gone(record: GroupRecord) -> bool:
    """Whether ``record``'s trainer is certainly dead, so that destroying its group
    harms nobody: only when the record was written on this host and its process is
    gone (the pid does not run, or runs with another start time: a reused pid). A
    process of another user counts as alive; a record of another host, too."""
    if record.host != socket.gethostname():
        return False
    if not pid_alive(record.pid):
        return True
    return record.started is not None and process_start(record.pid) != record.started


class CancellableStore(dist.Store):
    """A store whose blocking waits (``get``, ``wait``) poll and end at :meth:`cancel`.

    The trainer's rendezvous of a weight-update group blocks in the backend's
    constructor until every server rank joined, up to the backend's timeout; over
    this store a server's refusal ends it within :data:`_POLL_S`: the blocked wait
    raises :class:`~aiosync.errors.TransportError`, the constructor with it, and no
    thread is left inside the backend.

    Args:
        store: the trainer's ``TCPStore`` (every call is passed on to it).
        timeout_s: the limit of each wait, seconds (the formation's).
    """

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        super().__init__()
        self._store = store
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """End every wait now and from now on."""
        self._cancelled.set()

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self._store.get(key)

    def add(self, key: str, value: int) -> int:
        return self._store.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait(keys, timeout)

    def _wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        waited = 0.0
        while not self._store.check(keys):
            if self._cancelled.wait(_POLL_S):
                raise TransportError("the rendezvous was cancelled (a server refused the group)")
            waited += _POLL_S
            if waited >= limit:
                raise SyncTimeoutError(f"no rank set {keys} within {limit} s (rendezvous)")
