"""Free loopback ports for tests that start their own rendezvous.

Ports are drawn below the kernel's ephemeral range (``ip_local_port_range``,
32768-60999 by default): a port the kernel hands out for ``bind(0)`` is also what it
hands to outgoing connections, so between choosing it and a rank binding it, one of
the many connections a parallel suite opens (gloo's, ZMQ's, HTTP's) could take it
(``EADDRINUSE``). A port below that range is taken only by a deliberate bind.
"""

from __future__ import annotations

import random
import socket

#: Where ports are drawn from: above the registered services most machines run,
#: below the ephemeral range.
PORT_RANGE = (20000, 32768)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that nothing holds now, drawn from
    :data:`PORT_RANGE` (held open together while chosen, so none is given twice).

    Raises:
        OSError: no free port was found in 1000 draws.
    """
    socks: list[socket.socket] = []
    draws = 0
    try:
        while len(socks) < count:
            if draws == 1000:
                raise OSError(f"no {count} free ports in {PORT_RANGE} after 1000 draws")
            draws += 1
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.randrange(*PORT_RANGE)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]
