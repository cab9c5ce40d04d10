"""Free loopback ports for tests that start their own rendezvous."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (held open together while chosen, so
    the kernel never hands one out twice)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
