"""Many senders vs one: the sharded plan against rank 0's broadcast, over shaped links.

Issue 27's benchmark. T trainer *hosts* and W engine hosts, each a Linux network
namespace with its own full-duplex link to one bridge (``_netns``), every link
limited each way with ``tc tbf`` (``--rate-mbit``, 1 Gbit/s; 500 Mbit/s with
``--quick``), so the links, not this machine's cores, bound the transfer. Each
host runs one process (``ip netns exec NS python many_senders.py --worker``);
trainer hosts are ranks ``0..T-1`` of each sync group, engine hosts stand for
the ``W = TP`` tensor-parallel workers of one engine replica (each TP rank its
own host, so its own link). Both methods move the same manifest, with random
bf16 bytes (seeded, so every host knows what each worker must end up holding),
and every worker keeps its Megatron TP part of each tensor:

(a) broadcast  what :class:`~aiosync.transports.collective.CollectiveWeightSynchronizer`
               does: the engine's session is trainer rank 0 plus the W workers
               (``create_sync_group(train_world_size=1)``, as the synchronizer
               forms it); rank 0 runs the real send loop
               (``_loops.send_buckets``: header, packed buckets two in flight,
               vote) over gloo's broadcast, every worker ``receive_buckets`` and
               copies its TP slice out of each bucket (what ``load_weights``
               does). Trainer hosts ``1..T-1`` stay idle: the gather that would
               bring their FSDP shards to rank 0 is not modelled (it would only
               add time to (a)), so (a) does not depend on T and is measured once
               per TP.
(b) sharded    :func:`~aiosync.transports.sharded.make_plan` from dim-0 FSDP
               chunks over the T ranks (``aiosync.layout.even_chunks``) to
               Megatron TP parts over the W workers (column-parallel dim 0:
               q/k/v/gate/up, embed, lm_head; row-parallel dim 1: o/down; norms
               whole), then :func:`~aiosync.transports.sharded.run_plan` over the
               data group of ``create_sync_group(every_rank_sends=True)`` and the
               vote, as :class:`~aiosync.transports.sharded.ShardedWeightSynchronizer`
               runs one sync.

Figures per (T, TP): seconds (best of ``--repeat``, at least 3; 1 with
``--quick``, after one warm-up run whose result every worker checks byte for
byte); the *link limit*, the least time any schedule needs on these links:
the bytes of the busiest link (the busiest worker's download or the busiest
trainer's upload, the plan's byte counts) over the link rate; the sharded
time over it (goal: <= 1.2); the broadcast's time, and the speed-up
broadcast / sharded next to the issue's goal ``0.8 x T x TP`` and to what the
links allow at best (the broadcast's own bound over the plan's). gloo's
broadcast is a binomial tree, so rank 0 uploads the manifest
``ceil(log2(W + 1))`` times (twice for W = 2). The rate counts link-layer bytes:
TCP/IP and Ethernet headers take ~4.4% of a 1500-byte MTU frame, so payload
moves at most ~0.956 x the rate.

A CPU check follows: the same runs with the limits removed (``--unshaped``: every
configuration, only the largest with ``--quick``); while they are several times
faster than the shaped ones, the links, not the 2 cores, are the bound.

Needs root, ``ip`` and ``tc`` (iproute2); otherwise it prints ``skipped: <reason>``
(and ``{"skipped": reason}`` with ``--json``) and exits 0. Every namespace and
link it made is removed when it ends, also on an error, Ctrl-C or SIGTERM.

Usage: ``python benchmarks/many_senders.py [--quick] [--json]`` (as root).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import _netns
import torch
from _machine import Machine, repeats_for

from aiosync._model_shapes import MODEL_CONFIGS, model_manifest
from aiosync.delta import apply_patch
from aiosync.layout import Layout, Part
from aiosync.transports.collective._group import STATUS_OK, SyncGroup, create_sync_group, open_store
from aiosync.transports.collective._loops import RotatingBuffers, receive_buckets, send_buckets
from aiosync.transports.packing import Bucket, dtype_from_name, plan_buckets, unpack
from aiosync.transports.sharded import Box, box_within, make_plan, manifest_dtypes, run_plan
from aiosync.transports.sharded._delta import ShardBaseline, run_delta_plan
from aiosync.transports.sharded.estimate import ep_layouts, fsdp_layouts, tp_layouts

Manifest = dict[str, tuple[tuple[int, ...], torch.dtype]]

MB = 1e6
#: The model whose dimensions the manifest takes (``aiosync._model_shapes``).
MODEL = "qwen3-0.6b"
#: The TCPStore's port on trainer host 0 (its namespace is fresh: nothing else binds there).
STORE_PORT = 29577
#: Seed of the random weights: every host draws the same bytes.
SEED = 27


# -- the manifest and its layouts ----------------------------------------------


def manifest_for(
    quick: bool, layers: int | None, vocab: int | None, config: dict[str, Any] | None = None
) -> tuple[str, Manifest]:
    """``(label, {hf_name: (shape, dtype)})``: Qwen3-0.6B's dims (or ``config``'s, an HF
    config dict with ``model_type``), cut to ``layers`` layers."""
    model = MODEL if config is None else str(config.get("name", config["model_type"]))
    config = dict(MODEL_CONFIGS[MODEL] if config is None else config)
    config.pop("name", None)
    full_layers, full_vocab = int(config["num_hidden_layers"]), int(config["vocab_size"])
    layers = layers or (1 if quick else 6)
    config["vocab_size"] = vocab or (8192 if quick else full_vocab)
    shapes = model_manifest(config, layers=layers)
    label = f"{model} dims, {min(layers, full_layers)}/{full_layers} layers"
    if config["vocab_size"] != full_vocab:
        label += f", vocab {config['vocab_size']}"
    return label, {name: (shape, dtype_from_name(dt)) for name, (shape, dt) in shapes.items()}


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def layout_nbytes(manifest: Manifest, layout: Layout) -> int:
    """Bytes of what ``layout`` holds, from its parts (independent of any plan)."""
    return sum(part.numel * manifest[name][1].itemsize for name, part in layout.items())


def part_of(full: torch.Tensor, part: Part) -> torch.Tensor:
    """The view of ``part`` in the full tensor (contiguous for a dim-0 part)."""
    return full.narrow(part.dim, part.start, part.length) if full.dim() else full


def random_weights(manifest: Manifest, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Random bytes of every tensor, the same on every host for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in manifest.items():
        raw = torch.empty(nbytes_of(shape, dtype), dtype=torch.uint8)
        raw.random_(generator=gen)
        out[name] = raw.view(dtype).view(shape)
    return out


def layouts_for(manifest: Manifest, cmd: dict[str, Any]) -> tuple[list[Layout], list[Layout]]:
    """The trainers' FSDP2 layouts (``cmd["T"]`` ranks) and the ``cmd["W"]`` workers':
    Megatron TP over ``cmd.get("tp", W)`` ranks, experts by EP rank with
    ``cmd.get("ep", 1) > 1`` (:func:`~aiosync.transports.sharded.estimate.ep_layouts`).

    Raises:
        ValueError: the layouts are not ``W`` workers'.
    """
    workers = cmd["W"]
    tp, ep = int(cmd.get("tp", workers)), int(cmd.get("ep", 1))
    dests = ep_layouts(manifest, tp=tp, ep=ep) if ep > 1 else tp_layouts(manifest, tp)
    if len(dests) != workers:
        raise ValueError(f"tp={tp}, ep={ep} make {len(dests)} workers, not W={workers}")
    return fsdp_layouts(manifest, cmd["T"]), list(dests)


def change_weights(weights: dict[str, torch.Tensor], fraction: float, seed: int = SEED + 1) -> None:
    """Flip the lowest bit of ``fraction`` of every tensor's elements, in place (the same
    elements on every host for the same seed): a delta sync's change."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in weights.values():
        raw = tensor.view(-1).view(torch.int16 if tensor.element_size() == 2 else torch.int32)
        mask = torch.rand(raw.numel(), generator=gen) < fraction
        raw[mask] ^= 1


def broadcast_root_sends(workers: int) -> int:
    """How many times rank 0 sends each buffer in gloo's binomial-tree broadcast to ``workers``."""
    return math.ceil(math.log2(workers + 1))


# -- one host's process (--worker) ---------------------------------------------


class _Host:
    """What one host's process keeps between configurations: the weights and the store."""

    def __init__(self, cmd: dict[str, Any]) -> None:
        self.role: str = cmd["role"]
        self.index: int = cmd["index"]
        self.timeout_s: float = cmd["timeout_s"]
        self.bucket_bytes: int = cmd["bucket_bytes"]
        self.repeats: int = cmd["repeats"]
        _, self.manifest = manifest_for(
            cmd["quick"], cmd["layers"], cmd["vocab"], cmd.get("config")
        )
        # Trainers send these; workers check what they received against them.
        self.full = random_weights(self.manifest)
        self.store = open_store(
            cmd["master"],
            STORE_PORT,
            is_master=self.role == "trainer" and self.index == 0,
            timeout_s=self.timeout_s,
        )

    @property
    def is_trainer(self) -> bool:
        return self.role == "trainer"

    def group(self, cmd: dict[str, Any], rank: int, world: int, trainers: int) -> SyncGroup:
        return create_sync_group(
            store=self.store,
            rank=rank,
            world_size=world,
            train_world_size=trainers,
            backend="gloo",
            device=torch.device("cpu"),
            timeout_s=self.timeout_s,
            session=cmd["session"],
            every_rank_sends=cmd["op"] == "sharded",
        )

    def targets(self, layout: Layout) -> dict[str, torch.Tensor]:
        """A worker's own storage of its parts, zeroed (so a missed box shows)."""
        return {
            name: torch.zeros(part.local_shape, dtype=self.manifest[name][1])
            for name, part in layout.items()
        }

    def verify(self, local: dict[str, torch.Tensor], layout: Layout) -> list[str]:
        """Names whose stored part differs, byte for byte, from the trainer's bytes."""
        return [
            name
            for name, part in layout.items()
            if not torch.equal(
                local[name].reshape(-1).view(torch.uint8),
                part_of(self.full[name], part).contiguous().reshape(-1).view(torch.uint8),
            )
        ]

    def timed(self, group: SyncGroup, fn: Callable[[], Any]) -> list[float]:
        """Seconds of each of ``repeats`` runs of ``fn``, between barriers of the whole group."""
        times = []
        for _ in range(self.repeats):
            group.exchange(STATUS_OK)
            start = time.perf_counter()
            fn()
            group.exchange(STATUS_OK)  # every rank is done
            times.append(time.perf_counter() - start)
        return times

    def sharded(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One (T, TP) configuration of (b): plan, warm-up, check, timed runs."""
        if cmd.get("changed") is not None:
            return self.sharded_delta(cmd)
        trainers = cmd["T"]
        rank = self.index if self.is_trainer else trainers + self.index
        sources, dests = layouts_for(self.manifest, cmd)
        plan = make_plan(sources, dests, manifest_dtypes(self.manifest), self.bucket_bytes)
        group = self.group(cmd, rank, trainers + len(dests), trainers)
        try:
            group.agree(STATUS_OK, "", plan.digest)  # as the synchronizer does once formed
            local: dict[str, torch.Tensor] = {}
            if self.is_trainer:
                mine = sources[rank]

                def source(name: str) -> torch.Tensor:
                    return part_of(self.full[name], mine[name])  # a dim-0 chunk: contiguous

                def once() -> Any:
                    result = run_plan(
                        plan, group.data, rank, source=source, timeout_s=self.timeout_s
                    )
                    group.agree(STATUS_OK)  # the sync's vote
                    return result

            else:
                layout = dests[self.index]
                local = self.targets(layout)

                def sink(name: str, box: Box, tensor: torch.Tensor) -> None:
                    local[name][box_within(box, layout[name])].copy_(tensor)

                def once() -> Any:
                    result = run_plan(plan, group.data, rank, sink=sink, timeout_s=self.timeout_s)
                    group.agree(STATUS_OK)
                    return result

            first = once()  # warm-up: first touch of every buffer and target
            wrong = [] if self.is_trainer else self.verify(local, dests[self.index])
            times = self.timed(group, once)
        finally:
            group.destroy()
        return {
            "ok": True,
            "rank": rank,
            "digest": plan.digest,
            "nbytes": first.nbytes,
            "by_peer": {str(k): v for k, v in first.by_peer.items()},
            "buckets": first.buckets,
            "wrong": wrong,
            "times": times,
        }

    def sharded_delta(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A delta sync on the plan of ``cmd``: one full sync (the baseline), then
        ``cmd["changed"]`` of every tensor's elements change (the same ones on every
        host: the trainers send them, the workers check them), then timed delta syncs
        of that change, each against the same uncommitted baseline (so each repeat
        moves the same patches, as :class:`~aiosync.transports.sharded.ShardedWeightSynchronizer`'s
        delta sync does)."""
        trainers = cmd["T"]
        rank = self.index if self.is_trainer else trainers + self.index
        sources, dests = layouts_for(self.manifest, cmd)
        plan = make_plan(sources, dests, manifest_dtypes(self.manifest), self.bucket_bytes)
        group = self.group(cmd, rank, trainers + len(dests), trainers)
        baseline = ShardBaseline()
        local: dict[str, torch.Tensor] = {}
        try:
            group.agree(STATUS_OK, "", plan.digest)
            if self.is_trainer:
                mine = sources[rank]

                def source(name: str) -> torch.Tensor:
                    return part_of(self.full[name], mine[name])

                run_plan(
                    plan,
                    group.data,
                    rank,
                    source=baseline.stage_source(1, source),
                    timeout_s=self.timeout_s,
                )
                group.agree(STATUS_OK)
                baseline.commit()
                change_weights(self.full, cmd["changed"])

                def once() -> Any:
                    result = run_delta_plan(
                        plan,
                        group.data,
                        rank,
                        base=1,
                        version=2,
                        source=source,
                        baseline=baseline,
                        timeout_s=self.timeout_s,
                    )
                    group.agree(STATUS_OK)
                    return result

            else:
                layout = dests[self.index]
                local = self.targets(layout)

                def sink(name: str, box: Box, tensor: torch.Tensor) -> None:
                    local[name][box_within(box, layout[name])].copy_(tensor)

                def apply(boxes: list[tuple[str, Box, torch.Tensor]], patches: list[Any]) -> None:
                    for name, box, tensor in boxes:
                        sink(name, box, tensor)
                    for patch in patches:
                        apply_patch(local[patch.name], layout[patch.name], patch)

                run_plan(plan, group.data, rank, sink=sink, timeout_s=self.timeout_s)
                group.agree(STATUS_OK)
                change_weights(self.full, cmd["changed"])

                def once() -> Any:
                    result = run_delta_plan(
                        plan, group.data, rank, base=1, apply=apply, timeout_s=self.timeout_s
                    )
                    group.agree(STATUS_OK)
                    return result

            first = once()
            wrong = [] if self.is_trainer else self.verify(local, dests[self.index])
            times = self.timed(group, once)
        finally:
            group.destroy()
            # The next configuration starts from the unchanged weights again.
            self.full = random_weights(self.manifest)
        return {
            "ok": True,
            "rank": rank,
            "digest": plan.digest,
            "nbytes": first.nbytes,
            "by_peer": {str(k): v for k, v in first.by_peer.items()},
            "buckets": first.buckets,
            "wrong": wrong,
            "times": times,
        }

    def broadcast(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One TP configuration of (a): the collective loops from rank 0 to W workers."""
        workers = cmd["W"]
        rank = 0 if self.is_trainer else 1 + self.index
        plan = plan_buckets(self.manifest, self.bucket_bytes)
        buffers = RotatingBuffers(plan, torch.device("cpu"))
        group = self.group(cmd, rank, 1 + workers, 1)
        version = 0
        received = 0
        try:
            group.agree(STATUS_OK, "", plan.digest)
            local: dict[str, torch.Tensor] = {}
            if self.is_trainer:

                def weights() -> Iterator[tuple[str, torch.Tensor]]:
                    for name in self.manifest:
                        yield name, self.full[name]

                def once() -> Any:
                    nonlocal version
                    version += 1
                    return send_buckets(
                        group, plan, buffers, weights(), version=version, kv=[], verify=False
                    )

            else:
                layout = tp_layouts(self.manifest, workers)[self.index]
                local = self.targets(layout)

                def load(bucket: Bucket, buf: torch.Tensor) -> None:
                    # load_weights of a TP worker: keep its slice of each full tensor.
                    nonlocal received
                    for slot, (name, view) in zip(bucket.slots, unpack(buf, bucket), strict=True):
                        local[name].copy_(part_of(view, layout[name]))
                        received += slot.nbytes

                def once() -> Any:
                    nonlocal version
                    version += 1
                    return receive_buckets(
                        group,
                        plan,
                        buffers,
                        version=version,
                        n_kv=0,
                        verify=False,
                        on_bucket=load,
                    )

            once()
            nbytes = plan.total_bytes if self.is_trainer else received
            wrong = [] if self.is_trainer else self.verify(local, layout)
            times = self.timed(group, once)
        finally:
            group.destroy()
        return {
            "ok": True,
            "rank": rank,
            "digest": plan.digest,
            "nbytes": nbytes,
            "buckets": len(plan.buckets),
            "wrong": wrong,
            "times": times,
        }


def _die_with(parent: int) -> None:
    """Exit when the benchmark's process dies (``ip netns exec`` execs us: it is our parent)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def worker_main(parent: int) -> int:
    """A host's process: JSON commands on stdin, one JSON reply line each on stdout."""
    _die_with(parent)
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (gloo, warnings) go to the log, not the replies
    torch.set_num_threads(1)  # gloo's threads need the other core
    host: _Host | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            if cmd["op"] == "init":
                host = _Host(cmd)
                out: dict[str, Any] = {"ok": True}
            elif host is None:
                raise RuntimeError(f"{cmd['op']} before init")
            elif cmd["op"] == "sharded":
                out = host.sharded(cmd)
            elif cmd["op"] == "broadcast":
                out = host.broadcast(cmd)
            else:
                raise ValueError(f"unknown op {cmd['op']!r}")
        except Exception:
            out = {"ok": False, "error": traceback.format_exc()}
        reply.write(json.dumps(out) + "\n")
    return 0


# -- the benchmark's own process ------------------------------------------------


class HostFailed(RuntimeError):
    """A host's process failed, exited or stalled (the message quotes its log)."""


class _Pool:
    """One process per host, started in its namespace; commands and replies as JSON lines."""

    def __init__(self, net: _netns.Network, names: Sequence[str], logs: Path) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, Path] = {}
        self.replies: queue.Queue[tuple[str, str | None]] = queue.Queue()
        env = dict(os.environ, GLOO_SOCKET_IFNAME=_netns.IFACE, OMP_NUM_THREADS="1")
        script = str(Path(__file__).resolve())
        for name in names:
            self.logs[name] = logs / f"{name}.log"
            with self.logs[name].open("w") as log:
                self.procs[name] = subprocess.Popen(
                    net.command(name, [sys.executable, script, "--worker", str(os.getpid())]),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=env,
                    start_new_session=True,  # a terminal's Ctrl-C reaches us, not the hosts
                )
        for name, proc in self.procs.items():
            assert proc.stdout is not None
            threading.Thread(target=self._read, args=(name, proc.stdout), daemon=True).start()

    def _read(self, name: str, stream: IO[str]) -> None:
        for line in stream:
            self.replies.put((name, line))
        self.replies.put((name, None))

    def tail(self, name: str, lines: int = 25) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.logs[name].read_text().splitlines()[-lines:])
        return ""

    def ask(self, commands: dict[str, dict[str, Any]], timeout_s: float) -> dict[str, Any]:
        """Send each host its command; every reply, or :class:`HostFailed` at the first failure."""
        for name, cmd in commands.items():
            stdin = self.procs[name].stdin
            assert stdin is not None
            stdin.write(json.dumps(cmd) + "\n")
            stdin.flush()
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(commands):
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(set(commands) - set(got))
                raise HostFailed(f"no reply from {late} within {timeout_s:.0f} s")
            try:
                name, line = self.replies.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise HostFailed(f"host {name} exited; its log:\n{self.tail(name)}")
            reply = json.loads(line)
            if not reply.get("ok"):
                raise HostFailed(f"host {name} failed:\n{reply.get('error')}")
            got[name] = reply
        return got

    def close(self, graceful: bool = True) -> None:
        """Ask every process to exit (``graceful``), then kill the ones still running.

        Not graceful (an error, Ctrl-C, SIGTERM): kill at once; a host may be
        blocked in a transfer whose peers are gone.
        """
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                if graceful:
                    proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                proc.stdin.close()
        deadline = time.monotonic() + (10 if graceful else 0)
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # runs the finally blocks and atexit: namespaces removed


def _skip(reason: str, args: argparse.Namespace, machine: Machine) -> int:
    machine.finish()
    print(f"skipped: {reason}")
    print(machine.caption())
    if args.json:
        print(json.dumps({"skipped": reason, **machine.fields()}))
    return 0


def _configs(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    ts = args.trainers or ([1, 2] if args.quick else [1, 2, 4])
    tps = args.tp or [1, 2]
    return sorted(set(ts)), sorted(set(tps))


def _measure(
    pool: _Pool, args: argparse.Namespace, ts: list[int], tps: list[int], limit_s: float, tag: str
) -> dict[str, Any]:
    """Run every configuration on the current links (``tag``: shaped or unshaped); all replies."""
    only_largest = tag == "unshaped" and args.unshaped == "largest"
    out: dict[str, Any] = {"broadcast": {}, "sharded": {}}
    timeout = args.timeout_s + 4 * (args.repeat + 1) * limit_s + 60
    for tp in tps:
        if only_largest and tp != max(tps):
            continue
        cmd = {"op": "broadcast", "W": tp, "session": f"{tag}/broadcast/W{tp}"}
        names = ["t0", *(f"w{j}" for j in range(tp))]
        print(f"  {tag}: broadcast to TP={tp}", file=sys.stderr, flush=True)
        out["broadcast"][tp] = pool.ask(dict.fromkeys(names, cmd), timeout)
    for t in ts:
        for tp in tps:
            if only_largest and (t, tp) != (max(ts), max(tps)):
                continue
            cmd = {"op": "sharded", "T": t, "W": tp, "session": f"{tag}/sharded/T{t}W{tp}"}
            names = [*(f"t{i}" for i in range(t)), *(f"w{j}" for j in range(tp))]
            print(f"  {tag}: sharded T={t} TP={tp}", file=sys.stderr, flush=True)
            out["sharded"][(t, tp)] = pool.ask(dict.fromkeys(names, cmd), timeout)
    return out


def _rows(
    manifest: Manifest,
    ts: list[int],
    tps: list[int],
    shaped: dict[str, Any],
    unshaped: dict[str, Any] | None,
    rate_bps: float,
    bucket_bytes: int,
) -> list[dict[str, Any]]:
    """One row per (T, TP): times, byte counts (plan and measured), bounds, ratios, goals."""
    total = sum(nbytes_of(s, d) for s, d in manifest.values())
    rows = []
    for t in ts:
        for tp in tps:
            plan = make_plan(
                fsdp_layouts(manifest, t),
                tp_layouts(manifest, tp),
                manifest_dtypes(manifest),
                bucket_bytes,
            )
            sharded = shaped["sharded"][(t, tp)]
            bcast = shaped["broadcast"][tp]
            workers = [sharded[f"w{j}"] for j in range(tp)]
            trainers = [sharded[f"t{i}"] for i in range(t)]
            parts = [layout_nbytes(manifest, lay) for lay in tp_layouts(manifest, tp)]
            rx, tx = max(plan.receiver_nbytes), max(plan.sender_nbytes)
            limit = max(rx, tx) / rate_bps
            bcast_limit = broadcast_root_sends(tp) * total / rate_bps
            sharded_s = min(sharded["t0"]["times"])
            bcast_s = min(bcast["t0"]["times"])
            row: dict[str, Any] = {
                "T": t,
                "TP": tp,
                "manifest_bytes": total,
                "plan_digest": plan.digest,
                "digests_agree": {r["digest"] for r in sharded.values()} == {plan.digest},
                "part_bytes": parts,
                "plan_receiver_bytes": list(plan.receiver_nbytes),
                "receiver_bytes": [r["nbytes"] for r in workers],
                "plan_sender_bytes": list(plan.sender_nbytes),
                "sender_bytes": [r["nbytes"] for r in trainers],
                "broadcast_sent_bytes": bcast["t0"]["nbytes"],
                "broadcast_receiver_bytes": [bcast[f"w{j}"]["nbytes"] for j in range(tp)],
                "sharded_wrong": sorted({n for r in workers for n in r["wrong"]}),
                "broadcast_wrong": sorted({n for j in range(tp) for n in bcast[f"w{j}"]["wrong"]}),
                "receiver_limit_s": rx / rate_bps,
                "link_limit_s": limit,
                "sharded_s": sharded_s,
                "sharded_times": sharded["t0"]["times"],
                "sharded_over_limit": sharded_s / limit,
                "broadcast_s": bcast_s,
                "broadcast_times": bcast["t0"]["times"],
                "broadcast_limit_s": bcast_limit,
                "broadcast_over_limit": bcast_s / bcast_limit,
                "speedup": bcast_s / sharded_s,
                "goal_speedup": 0.8 * t * tp,
                "link_bound_speedup": bcast_limit / limit,
            }
            row["limit_goal_met"] = row["sharded_over_limit"] <= 1.2
            row["speedup_goal_met"] = row["speedup"] >= row["goal_speedup"]
            row["verified"] = not row["sharded_wrong"] and not row["broadcast_wrong"]
            if unshaped is not None:
                if (t, tp) in unshaped["sharded"]:
                    u = min(unshaped["sharded"][(t, tp)]["t0"]["times"])
                    row["unshaped_sharded_s"] = u
                    row["sharded_cpu_headroom"] = sharded_s / u
                if tp in unshaped["broadcast"]:
                    u = min(unshaped["broadcast"][tp]["t0"]["times"])
                    row["unshaped_broadcast_s"] = u
                    row["broadcast_cpu_headroom"] = bcast_s / u
            rows.append(row)
    return rows


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _print_tables(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'T':>2} {'TP':>2} {'rx MB':>7} {'tx MB':>7} {'limit s':>8} {'sharded s':>9} "
        f"{'/limit':>7} {'<=1.2':>5} {'bcast s':>8} {'/limit':>7} {'speed-up':>8} "
        f"{'goal':>5} {'links':>5} {'met':>4}"
    )
    for r in rows:
        print(
            f"{r['T']:>2} {r['TP']:>2} {max(r['plan_receiver_bytes']) / MB:>7.1f} "
            f"{max(r['plan_sender_bytes']) / MB:>7.1f} {r['link_limit_s']:>8.3f} "
            f"{r['sharded_s']:>9.3f} {r['sharded_over_limit']:>6.2f}x "
            f"{_yes(r['limit_goal_met']):>5} {r['broadcast_s']:>8.3f} "
            f"{r['broadcast_over_limit']:>6.2f}x {r['speedup']:>7.2f}x "
            f"{r['goal_speedup']:>5.1f} {r['link_bound_speedup']:>5.1f} "
            f"{_yes(r['speedup_goal_met']):>4}"
        )
    print(
        "rx/tx MB: the busiest worker's download / trainer's upload (the plan's bytes); "
        "limit: the busier of the two over the link rate; bcast /limit: over rank 0's upload "
        "(ceil(log2(TP+1)) x the manifest); goal: 0.8 x T x TP; links: the most speed-up "
        "the links allow (bcast limit / limit)"
    )
    checked = [r for r in rows if "unshaped_sharded_s" in r or "unshaped_broadcast_s" in r]
    if checked:
        print("CPU check: the same runs unshaped (the links at CPU speed)")
        print(
            f"{'T':>2} {'TP':>2} {'sharded s':>9} {'unshaped':>8} {'headroom':>8} "
            f"{'bcast s':>8} {'unshaped':>8} {'headroom':>8}"
        )
        for r in checked:
            cells = [f"{r['T']:>2} {r['TP']:>2}"]
            for key in ("sharded", "broadcast"):
                if f"unshaped_{key}_s" in r:
                    cells.append(
                        f"{r[f'{key}_s']:>9.3f} {r[f'unshaped_{key}_s']:>8.3f} "
                        f"{r[f'{key}_cpu_headroom']:>7.1f}x"
                    )
                else:
                    cells.append(f"{'-':>9} {'-':>8} {'-':>8}")
            print(" ".join(cells))


def _print_findings(rows: list[dict[str, Any]]) -> None:
    limit_missed = [r for r in rows if not r["limit_goal_met"]]
    speed_missed = [r for r in rows if not r["speedup_goal_met"]]
    unreachable = [r for r in speed_missed if r["link_bound_speedup"] < r["goal_speedup"]]
    print(
        "goal sharded <= 1.2 x link limit: "
        + ("met in every row" if not limit_missed else "missed at " + _at(limit_missed))
    )
    print(
        "goal speed-up >= 0.8 x T x TP: "
        + ("met in every row" if not speed_missed else "missed at " + _at(speed_missed))
    )
    if unreachable:
        print(
            f"  out of reach on these links at {_at(unreachable)}: each worker must download "
            "its TP part (manifest / TP) whatever T is, and the broadcast is already bound by "
            "rank 0 uploading the manifest ceil(log2(TP+1)) times, so no plan beats "
            "ceil(log2(TP+1)) x min(T, TP); more senders than workers only split each "
            "worker's bytes over more uploads"
        )
    if not all(r["verified"] for r in rows):
        bad = [r for r in rows if not r["verified"]]
        print(f"WRONG BYTES on a worker at {_at(bad)} (see the JSON)")
    headrooms = [
        r[k] for r in rows for k in ("sharded_cpu_headroom", "broadcast_cpu_headroom") if k in r
    ]
    if headrooms:
        print(
            f"CPU check: unshaped runs {min(headrooms):.1f}x-{max(headrooms):.1f}x faster than "
            "shaped ones"
            + (
                ": the links are the bound"
                if min(headrooms) >= 2
                else ": under 2x somewhere, so the CPUs bind too (a lower --rate-mbit helps)"
            )
        )


def _at(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"T={r['T']} TP={r['TP']}" for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small manifest, T in {1,2} (<1 min)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--rate-mbit", type=int, default=None, help="link rate each way, Mbit/s")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (6; 1 quick)")
    parser.add_argument("--vocab", type=int, default=None, help="vocab rows (151936; 8192 quick)")
    parser.add_argument("--trainers", type=int, nargs="*", help="T values (1 2 4; 1 2 quick)")
    parser.add_argument("--tp", type=int, nargs="*", help="TP values (1 2)")
    parser.add_argument("--bucket-mb", type=int, default=32, help="bucket size, MiB (both)")
    parser.add_argument("--repeat", type=int, default=None, help="timed repeats (best; >= 3)")
    parser.add_argument(
        "--unshaped",
        choices=("all", "largest", "none"),
        default=None,
        help="CPU check without limits: every configuration (default), the largest (quick)",
    )
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of every link, bytes")
    parser.add_argument("--subnet", default="10.77.0", help="the hosts' /24 (first 3 octets)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="limit of each wait")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    try:
        if not ipaddress.ip_network(f"{args.subnet}.0/24").is_private:
            parser.error(f"--subnet {args.subnet}: not a private range")
    except ValueError as exc:
        parser.error(f"--subnet {args.subnet}: {exc}")
    args.repeat = repeats_for(args.quick, args.repeat)
    args.rate_mbit = args.rate_mbit or (500 if args.quick else 1000)
    args.unshaped = args.unshaped or ("largest" if args.quick else "all")
    machine = Machine(args.repeat)
    label, manifest = manifest_for(args.quick, args.layers, args.vocab)
    total = sum(nbytes_of(s, d) for s, d in manifest.values())
    ts, tps = _configs(args)
    rate_bps = args.rate_mbit * 1e6 / 8
    print(
        f"many senders (issue 27): sharded plan vs rank-0 broadcast over shaped links; "
        f"{label}: {len(manifest)} tensors, {total / MB:.1f} MB bf16; T in {ts}, TP in {tps}"
    )
    print(
        f"load at start {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15-min); "
        f"links: tbf {args.rate_mbit} Mbit/s each way ({rate_bps / MB:.1f} MB/s), "
        f"MTU {args.mtu}; bucket {args.bucket_mb} MiB; gloo, one process per host"
    )
    sys.stdout.flush()
    reason = _netns.unavailable_reason()
    if reason is not None:
        return _skip(reason, args, machine)
    tp_layouts(manifest, max(tps))  # a TP that does not divide the dims fails here, not on a host
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    names = [*(f"t{i}" for i in range(max(ts))), *(f"w{j}" for j in range(max(tps)))]
    net = _netns.Network(names, subnet=args.subnet, mtu=args.mtu)
    try:
        net.open()
        net.shape(f"{args.rate_mbit}mbit")
    except _netns.Unavailable as exc:
        net.close()
        return _skip(str(exc), args, machine)
    qdiscs = net.qdiscs()
    bucket_bytes = args.bucket_mb << 20
    limit_s = broadcast_root_sends(max(tps)) * total / rate_bps
    pool: _Pool | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="aiosync-many-senders-") as logs:
            pool = _Pool(net, names, Path(logs))
            init = {
                "op": "init",
                "master": net.hosts["t0"].address,
                "timeout_s": args.timeout_s,
                "bucket_bytes": bucket_bytes,
                "repeats": args.repeat,
                "quick": args.quick,
                "layers": args.layers,
                "vocab": args.vocab,
            }
            print(f"  starting {len(names)} hosts", file=sys.stderr, flush=True)
            pool.ask(
                {
                    n: {**init, "role": "trainer" if n[0] == "t" else "worker", "index": int(n[1:])}
                    for n in names
                },
                args.timeout_s + 120,
            )
            shaped = _measure(pool, args, ts, tps, limit_s, "shaped")
            unshaped = None
            if args.unshaped != "none":
                net.unshape()
                unshaped = _measure(pool, args, ts, tps, limit_s, "unshaped")
            pool.close()
            pool = None
    except HostFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: killing the hosts, removing the namespaces", file=sys.stderr)
        return 130
    except SystemExit:
        print("terminated: killing the hosts, removing the namespaces", file=sys.stderr)
        raise
    finally:
        if pool is not None:
            pool.close(graceful=False)
        net.close()
    machine.finish()
    rows = _rows(manifest, ts, tps, shaped, unshaped, rate_bps, bucket_bytes)
    print(
        "(a) broadcast: collective _loops.send_buckets/receive_buckets, trainer rank 0 -> TP "
        "workers (trainer ranks 1..T-1 idle; measured once per TP); (b) sharded: make_plan "
        "FSDP dim-0 chunks -> Megatron TP parts, run_plan over create_sync_group"
        "(every_rank_sends=True).data"
    )
    _print_tables(rows)
    _print_findings(rows)
    machine.report()
    if args.json:
        results = {
            "config": {
                "manifest": label,
                "tensors": len(manifest),
                "manifest_bytes": total,
                "rate_mbit": args.rate_mbit,
                "rate_bytes_per_s": rate_bps,
                "mtu": args.mtu,
                "bucket_bytes": bucket_bytes,
                "trainers": ts,
                "tp": tps,
                "quick": args.quick,
                "unshaped": args.unshaped,
                "qdiscs": qdiscs,
            },
            "rows": rows,
            **machine.fields(),
        }
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
