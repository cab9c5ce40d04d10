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

:func:`reclaim_dead_groups` applies these rules before a formation,
:func:`record_formation` writes the records after it, and :func:`held_elsewhere`
words a refusal. :class:`CancellableStore` lets a refused formation end the trainer's own rendezvous
at once instead of at the backend's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import torch.distributed as dist

from aiosync._fanout import each_named
from aiosync.errors import OwnershipError, SyncTimeoutError, TransportError

from .._leftovers import pid_alive
from ._stores import ForwardingStore

if TYPE_CHECKING:
    from ..http import SGLangDistributedServer

__all__ = [
    "ALREADY_CREATED",
    "NO_SUCH_GROUP",
    "RECORDS_ENV",
    "CancellableStore",
    "GroupRecord",
    "held_elsewhere",
    "holder_gone",
    "process_start",
    "read_record",
    "reclaim_dead_groups",
    "record_formation",
    "records_dir",
    "records_of",
    "remove_record",
    "server_restarted",
    "write_record",
]

_log = logging.getLogger(__name__)

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


#: SGLang's refusal of a group name it holds (torch's ``_new_process_group_helper``).
ALREADY_CREATED = "group name has already been created"
#: SGLang's answer to destroying a group it does not hold.
NO_SUCH_GROUP = "does not exist"


def held_elsewhere(
    server: SGLangDistributedServer, name: str, server_started: float | None
) -> OwnershipError:
    """The error of a formation ``server`` refused because it holds group ``name``:
    who holds it, from the record, and why it is left alone."""
    where = f"SGLang server {server.base_url}"
    record = read_record(server.base_url, name)
    if record is None or server_restarted(record, server_started):
        return OwnershipError(
            f"{where} holds weight-update group {name!r} for another trainer, and there is "
            f"no record of its holder on this host ({records_dir()}): a trainer on another "
            "host, or one whose record is gone, is never torn down from here. Use another "
            f"group_name, or destroy the group once its holder is gone "
            f"(SGLangHTTPBackend.destroy_weights_update_group({name!r}))"
        )
    if holder_gone(record):
        return OwnershipError(
            f"{where}: weight-update group {name!r} was held by {record.describe()}, which "
            "died since this formation began; the next init_communicator() reclaims it"
        )
    return OwnershipError(
        f"{where} holds weight-update group {name!r} for a live trainer, "
        f"{record.describe()}: left alone (use another group_name to run beside it)"
    )


def record_formation(
    servers: Sequence[SGLangDistributedServer],
    started: Sequence[float | None],
    group_name: str,
    master_address: str,
    master_port: int,
) -> None:
    """Record this process as the holder of ``group_name`` on every server of
    ``servers`` (each started at ``started``, as :func:`reclaim_dead_groups` found)."""
    for server, server_started in zip(servers, started, strict=True):
        write_record(
            GroupRecord(
                url=server.base_url,
                group_name=group_name,
                host=socket.gethostname(),
                pid=os.getpid(),
                started=process_start(os.getpid()),
                master_address=master_address,
                master_port=master_port,
                server_started=server_started,
            )
        )


async def reclaim_dead_groups(
    servers: Sequence[SGLangDistributedServer], timeout_s: float, label: Callable[[int], str]
) -> list[float | None]:
    """Destroy every group on ``servers`` whose record says its trainer is dead
    (:func:`holder_gone`), so that a trainer restarted after a
    killed one forms its group on the first try; returns each server's
    ``startup_time`` (None: not reported). ``timeout_s`` bounds each server's
    ``/destroy_weights_update_group``; ``label(i)`` names server ``i`` in the log."""
    started: list[float | None] = [None] * len(servers)

    async def reclaim(index: int, server: SGLangDistributedServer) -> None:
        records = records_of(server.base_url)
        # Asked every formation: the record this one writes keeps it.
        info = await server.server_info()
        now = info.get("startup_time")
        started[index] = float(now) if isinstance(now, (int, float)) else None
        for record in records:
            if record.pid == os.getpid() and record.host == socket.gethostname():
                continue  # this process's own (another synchronizer's, or ours)
            restarted = server_restarted(record, started[index])
            if not restarted and not holder_gone(record):
                continue
            if not restarted:
                try:
                    with anyio.fail_after(timeout_s):
                        await server.destroy_weights_update_group(
                            record.group_name, timeout_s=timeout_s
                        )
                except TransportError as exc:
                    if NO_SUCH_GROUP not in str(exc):
                        raise
                _log.warning(
                    "%s: reclaimed weight-update group %r of a dead trainer (%s)",
                    label(index),
                    record.group_name,
                    record.describe(),
                )
            remove_record(server.base_url, record.group_name)

    await each_named(servers, reclaim, label)
    return started


class CancellableStore(ForwardingStore):
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
        super().__init__(store)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """End every wait now and from now on."""
        self._cancelled.set()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        waited = 0.0
        while not self._inner.check(keys):
            if self._cancelled.wait(_POLL_S):
                raise TransportError("the rendezvous was cancelled (a server refused the group)")
            waited += _POLL_S
            if waited >= limit:
                raise SyncTimeoutError(f"no rank set {keys} within {limit} s (rendezvous)")
