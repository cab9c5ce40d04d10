"""Two "hosts" on one machine: the trainer and the engine in separate network namespaces.

The test makes two Linux network namespaces joined by a veth pair (10.77.0.1 for
the trainer, 10.77.0.2 for the engine), runs the trainer in the first and the
engine's worker in the second (multiprocessing starts it through ``ip netns exec``),
and refits over the collective transport: the group rendezvouses at the
trainer's namespace address and gloo is bound to the veth interfaces
(``GLOO_SOCKET_IFNAME``), as on two real hosts. No other address is used.

Skips, saying why, where namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TRAINER_ADDR = "10.77.0.1"
ENGINE_ADDR = "10.77.0.2"


@dataclass(frozen=True)
class _Hosts:
    trainer_ns: str
    engine_ns: str
    trainer_if: str
    engine_if: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def hosts() -> Iterator[_Hosts]:
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: the `ip` tool (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces: creating them needs root")
    tag = f"{os.getpid() % 100000}"
    h = _Hosts(f"aiosync-t{tag}", f"aiosync-e{tag}", f"avt{tag}", f"ave{tag}")
    try:
        _ip("netns", "add", h.trainer_ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"network namespaces cannot be created here: {exc.stderr.strip()}")
    try:
        _ip("netns", "add", h.engine_ns)
        _ip("link", "add", h.trainer_if, "type", "veth", "peer", "name", h.engine_if)
        for ns, ifname, addr in (
            (h.trainer_ns, h.trainer_if, TRAINER_ADDR),
            (h.engine_ns, h.engine_if, ENGINE_ADDR),
        ):
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield h
    finally:
        for ns in (h.trainer_ns, h.engine_ns):  # deleting a namespace deletes its veth end
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


# Runs inside the trainer's namespace. The engine's worker process is started by
# multiprocessing through ENGINE_PYTHON, a wrapper that enters the engine's namespace.
_TRAINER = """
import asyncio, multiprocessing, os, sys
import torch
from aiosync import TrainCluster, create_weight_synchronizer
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource


def tx_bytes(ifname):
    return int(open(f"/sys/class/net/{ifname}/statistics/tx_bytes").read())


async def main():
    multiprocessing.set_executable(os.environ["ENGINE_PYTHON"])
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=5)
    async with EmbeddedEngine(TINY_QWEN3, num_workers=1, seed=9) as engine:
        [pid] = engine.pids
        print("engine netns", os.stat(f"/proc/{pid}/ns/net").st_ino)
        print("trainer netns", os.stat("/proc/self/ns/net").st_ino)
        sync = create_weight_synchronizer(
            DTensorRefitSource(trainer.model), engine, colocated=False, backend="embedded",
            train_cluster=TrainCluster(master_addr=sys.argv[1], master_port=29650),
            inference_world_size=1, collective_timeout_s=60.0,
        )
        async with sync:  # initializes the communicator
            before = tx_bytes(os.environ["GLOO_SOCKET_IFNAME"])
            await sync.mark_stale()
            await sync.sync_weights()
            sent = tx_bytes(os.environ["GLOO_SOCKET_IFNAME"]) - before
        [state] = await engine.hf_state_dicts()
    expected = trainer.hf_state_dict()
    exact = list(state) == list(expected) and all(
        torch.equal(state[n], t) for n, t in expected.items()
    )
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    print("weight_version", sync.weight_version, "bit-exact", exact)
    print("veth tx bytes", sent, "manifest bytes", nbytes)


if __name__ == "__main__":
    asyncio.run(main())
"""


def test_collective_refit_between_two_network_namespaces_is_bit_exact(
    hosts: _Hosts, tmp_path: Path
) -> None:
    engine_python = tmp_path / "engine-python"
    engine_python.write_text(
        "#!/bin/sh\n"
        f"export GLOO_SOCKET_IFNAME={hosts.engine_if}\n"
        f'exec ip netns exec {hosts.engine_ns} {sys.executable} "$@"\n'
    )
    engine_python.chmod(0o755)
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    env = {
        **os.environ,
        "ENGINE_PYTHON": str(engine_python),
        "GLOO_SOCKET_IFNAME": hosts.trainer_if,
    }
    proc = subprocess.run(
        ["ip", "netns", "exec", hosts.trainer_ns, sys.executable, str(script), TRAINER_ADDR],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    engine_ns = os.stat(f"/var/run/netns/{hosts.engine_ns}").st_ino
    trainer_ns = os.stat(f"/var/run/netns/{hosts.trainer_ns}").st_ino
    assert out["engine"] == f"netns {engine_ns}"
    assert out["trainer"] == f"netns {trainer_ns}"
    assert out["weight_version"] == "1 bit-exact True"
    # Every weight byte crossed the veth pair (plus headers and the control traffic).
    sent, manifest = (int(x) for x in out["veth"].split()[2::3])
    assert sent >= manifest > 0
