"""Hosts with their own network links on one Linux machine: namespaces, veth, a bridge, tc.

A benchmark helper (``benchmarks/many_senders.py``; :class:`ShapedLoopback` for
``benchmarks/delta.py``). :class:`Network` makes one
network namespace per host plus a *hub* namespace holding a bridge; each host's
``mb0`` interface is one end of a veth pair whose other end is a port of the
bridge, so every host has its own full-duplex link. :meth:`Network.shape` limits
each link in both directions with a ``tbf`` qdisc: on the host's ``mb0`` (what
it sends) and on its bridge port (what it receives). Addresses are
``<subnet>.1`` .. ``<subnet>.N`` (``10.77.0.0/24`` by default) and exist only
inside the namespaces made here; nothing is added to the machine's own namespace.

Everything made is removed by :meth:`Network.close`: on ``with`` exit, on an
error, at interpreter exit (``atexit``) and, by the caller turning SIGTERM into
``SystemExit``, on a kill. Deleting a namespace deletes its veth ends and the
bridge with it. Namespaces are named ``aiosync-bench-<pid>-<host>``; a run first
removes the ones whose ``<pid>`` is no longer alive (a run that was SIGKILLed).

Needs root (``CAP_NET_ADMIN``) and iproute2's ``ip`` and ``tc``
(``apt-get install iproute2``); :func:`unavailable_reason` says why not, and
:class:`Unavailable` is raised when the kernel refuses a step (no veth, bridge
or tbf support, namespaces not permitted in a container).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "IFACE",
    "PREFIX",
    "Host",
    "Network",
    "ShapedLoopback",
    "Unavailable",
    "unavailable_reason",
]

#: Prefix of every namespace made here (``aiosync-bench-<pid>-<host>``).
PREFIX = "aiosync-bench"
#: The interface name of each host's link, inside its namespace (``GLOO_SOCKET_IFNAME``).
IFACE = "mb0"
_BRIDGE = "br0"


class Unavailable(RuntimeError):
    """Namespaces, veth, a bridge or tc cannot be set up here (the message says which)."""


def unavailable_reason() -> str | None:
    """Why this machine cannot run :class:`Network` at all, or None (checks no kernel support)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "not root: network namespaces, veth links and tc need CAP_NET_ADMIN (run as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2)"
    return None


def _run(*argv: str) -> str:
    """Run one ``ip``/``tc`` command; raise :class:`Unavailable` quoting its stderr."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"`{' '.join(argv)}` failed: {exc}") from exc
    if out.returncode != 0:
        raise Unavailable(f"`{' '.join(argv)}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    """Names of the machine's named network namespaces (``ip netns list``)."""
    try:
        text = _run("ip", "netns", "list")
    except Unavailable:
        return []
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete namespaces of this helper whose creating process is gone; returns their names."""
    pattern = re.compile(rf"^{re.escape(PREFIX)}-(\d+)-")
    removed = []
    for name in _namespaces():
        match = pattern.match(name)
        if match and not _alive(int(match.group(1))):
            with contextlib.suppress(Unavailable):
                _run("ip", "netns", "delete", name)
                removed.append(name)
    return removed


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its address (on :data:`IFACE`) and its bridge port."""

    name: str
    netns: str
    address: str
    port: str


class Network:
    """One namespace per host, all joined by veth links to one bridge (see the module docstring).

    Args:
        hosts: host names (short: letters and digits), in address order.
        subnet: the first three octets of the /24 the hosts get (``.1`` onwards).
        mtu: MTU of every link, bytes.

    Raises (from :meth:`open`):
        Unavailable: a step was refused (everything made so far is removed first).
    """

    def __init__(self, hosts: Sequence[str], *, subnet: str = "10.77.0", mtu: int = 1500) -> None:
        if len(hosts) > 250:
            raise ValueError("at most 250 hosts fit one /24")
        base = f"{PREFIX}-{os.getpid()}"
        self.hub = f"{base}-hub"
        self.hosts = {
            name: Host(name, f"{base}-{name}", f"{subnet}.{i + 1}", f"p{i}")
            for i, name in enumerate(hosts)
        }
        self.mtu = mtu
        self.rate: str | None = None
        self._made: list[str] = []

    def __enter__(self) -> Network:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Make the hub, the bridge and every host's namespace and link (blocking)."""
        remove_stale()
        atexit.register(self.close)
        try:
            self._add_netns(self.hub)
            _run("ip", "-n", self.hub, "link", "add", _BRIDGE, "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", _BRIDGE, "up")
            for host in self.hosts.values():
                self._add_netns(host.netns)
                _run(
                    "ip", "-n", self.hub, "link", "add", host.port, "mtu", str(self.mtu),
                    "type", "veth", "peer", "name", IFACE, "mtu", str(self.mtu),
                    "netns", host.netns,
                )  # fmt: skip
                _run("ip", "-n", self.hub, "link", "set", host.port, "master", _BRIDGE, "up")
                _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", IFACE)
                _run("ip", "-n", host.netns, "link", "set", IFACE, "up")
                _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def shape(self, rate: str, *, burst: str = "256kb", latency: str = "20ms") -> None:
        """Limit every link to ``rate`` (a tc rate, e.g. ``"1gbit"``) each way, with ``tbf``.

        ``burst`` (bytes the bucket holds) is kept above a 64 KiB GSO segment, so
        tbf never has to cut one up; ``latency`` bounds the queue.
        """
        for host in self.hosts.values():
            for netns, dev in ((host.netns, IFACE), (self.hub, host.port)):
                _run(
                    "tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", burst, "latency", latency,
                )  # fmt: skip
        self.rate = rate

    def unshape(self) -> None:
        """Remove the limits: links run as fast as the CPUs move bytes."""
        for host in self.hosts.values():
            for netns, dev in ((host.netns, IFACE), (self.hub, host.port)):
                with contextlib.suppress(Unavailable):
                    _run("tc", "-n", netns, "qdisc", "del", "dev", dev, "root")
        self.rate = None

    def qdiscs(self) -> str:
        """``tc qdisc show`` of every link (both ends), for the record."""
        lines = []
        for host in self.hosts.values():
            for netns, dev in ((host.netns, IFACE), (self.hub, host.port)):
                text = _run("tc", "-n", netns, "qdisc", "show", "dev", dev).strip()
                lines.append(f"{host.name}/{dev}: {text}")
        return "\n".join(lines)

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec``, which execs it)."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def close(self) -> None:
        """Delete every namespace made (hosts first, then the hub). Idempotent; never raises."""
        while self._made:
            name = self._made.pop()
            with contextlib.suppress(Unavailable):
                _run("ip", "netns", "delete", name)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)


class ShapedLoopback:
    """One namespace whose loopback is limited to ``rate`` with ``tbf``: a process tree
    run inside it (:meth:`command`) talks over 127.0.0.1 as over one shared link.

    For a trainer and its engine's worker processes (the workers are the trainer's
    children, so they share its namespace): every byte between them crosses the
    shaped ``lo``, one direction or the other, so the busier direction is bounded
    by ``rate`` (both share it; a refit's replies are a few bytes).

    Args:
        rate: a tc rate, e.g. ``"1000mbit"``.
        burst: bytes the bucket holds; above loopback's 64 KiB segments.
        latency: bound on the queue.

    Raises (from :meth:`open`):
        Unavailable: a step was refused (the namespace is removed first).
    """

    def __init__(self, rate: str, *, burst: str = "256kb", latency: str = "20ms") -> None:
        self.netns = f"{PREFIX}-{os.getpid()}-lo"
        self.rate, self.burst, self.latency = rate, burst, latency
        self._made = False

    def __enter__(self) -> ShapedLoopback:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Make the namespace, bring ``lo`` up and shape it (blocking)."""
        remove_stale()
        atexit.register(self.close)
        try:
            _run("ip", "netns", "add", self.netns)
            self._made = True
            _run("ip", "-n", self.netns, "link", "set", "lo", "up")
            _run(
                "tc", "-n", self.netns, "qdisc", "replace", "dev", "lo", "root", "tbf",
                "rate", self.rate, "burst", self.burst, "latency", self.latency,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise

    def qdisc(self) -> str:
        """``tc qdisc show dev lo`` inside the namespace, for the record."""
        return _run("tc", "-n", self.netns, "qdisc", "show", "dev", "lo").strip()

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec``, which execs it)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def close(self) -> None:
        """Delete the namespace. Idempotent; never raises."""
        if self._made:
            self._made = False
            with contextlib.suppress(Unavailable):
                _run("ip", "netns", "delete", self.netns)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
