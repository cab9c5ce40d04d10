"""Mooncake's data plane: a write that cannot land is a lost link. Skipped where
Mooncake's wheel (``mooncake-transfer-engine-non-cuda``) or its ``libibverbs1`` is not
installed.

The plan over Mooncake in real processes (two rounds bit-exact, a receiver killed, a
failed source and sink) is ``test_p2p.py``'s, parametrized over the data planes.
"""

from __future__ import annotations

import socket

import pytest

from aiosync.transports.sharded._mooncake import mooncake_available

_REASON = mooncake_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def test_a_write_to_an_address_the_peer_never_registered_is_a_lost_link() -> None:
    import torch

    from aiosync.transports.sharded._mooncake import _engine, _submit_write, _wait_write
    from aiosync.transports.sharded._p2p import LinkLost

    engine = _engine("127.0.0.1")
    segment = f"127.0.0.1:{engine.get_rpc_port()}"  # its own: the server checks every address
    data, elsewhere = torch.ones(512, dtype=torch.uint8), torch.zeros(512, dtype=torch.uint8)
    batch = _submit_write(engine, segment, data.data_ptr(), elsewhere.data_ptr(), 512, "probe")
    with pytest.raises(LinkLost, match="probe: Mooncake transfer failed"):
        _wait_write(engine, batch, 30.0, "probe")
    assert int(elsewhere.sum()) == 0


def test_a_write_to_a_segment_nobody_listens_on_is_a_lost_link() -> None:
    import torch

    from aiosync.transports.sharded._mooncake import _engine, _submit_write
    from aiosync.transports.sharded._p2p import LinkLost

    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    data = torch.ones(512, dtype=torch.uint8)
    with pytest.raises(LinkLost, match="probe: Mooncake transfer failed"):
        _submit_write(_engine("127.0.0.1"), f"127.0.0.1:{port}", data.data_ptr(), 0, 512, "probe")
