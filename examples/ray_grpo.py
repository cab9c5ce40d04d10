"""Async GRPO with the trainer and the engines as Ray actors, refit through aiosync.

The same task, model, loss and summary as ``examples/async_grpo.py`` (imported
from it), laid out as a Ray job: the driver (this process) starts

* the engine actor(s) (:func:`aiosync.ray.launch_engine`: the embedded engine,
  built inside the actor, its worker processes the actor's children), and
* one trainer actor, which holds the policy, wraps the engine actors' handles in
  :class:`aiosync.ray.RayEngine` objects (an :class:`aiosync.EngineFleet` of
  them with ``--engines N``) and runs the loop: rollouts for batch k+1 while
  batch k trains, every optimizer step inside ``sync.policy_update()``,
  ``refit_if_stale()`` before generating, a ``VersionedReplayBuffer``.

``--colocated`` (default): trainer and engine share a node (a placement group
with one bundle holds both actors) and the factory picks IPC over shared
memory. ``--no-colocated``: the engine actors go anywhere in the cluster and
the factory picks the collective broadcast, whose group meets at the trainer
actor's node IP and a port it chose (:func:`aiosync.ray.sync_group_address`).

The same code runs on a multi-node cluster: ``ray start --head`` on one node,
``ray start --address=HEAD:6379`` on the others (aiosync installed on every
node), then ``python examples/ray_grpo.py --no-colocated --address HEAD:6379``
(or ``--address auto`` on a node of the cluster). See ``docs/ray.md``.

Run::

    python examples/ray_grpo.py                  # colocated: IPC into an engine actor
    python examples/ray_grpo.py --no-colocated   # gloo broadcast into engine actors
    python examples/ray_grpo.py --quick --json-report report.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import ray
import ray.cloudpickle
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import async_grpo as grpo

from aiosync import (
    EngineFleet,
    Generation,
    VersionEventKind,
    create_weight_synchronizer,
    refit_if_stale,
)
from aiosync.ray import EngineSpec, RayEngine, launch_engine, sync_group_address
from aiosync.replay import VersionedReplayBuffer

# The actors run this file's code and async_grpo's: Ray ships both by value, so no
# node but this one needs the examples folder (every node needs aiosync installed).
ray.cloudpickle.register_pickle_by_value(grpo)

#: A local cluster for this machine (no --address): 2 CPUs, an 80 MB object store.
LOCAL_CLUSTER: dict[str, Any] = {
    "num_cpus": 2,
    "object_store_memory": 80 * 1024 * 1024,
    "include_dashboard": False,
}


#: How often the driver asks the trainer actor for the steps it finished (seconds).
STEP_POLL_S = 0.5


class TrainerActor:
    """The trainer as a Ray actor: policy, optimizer, synchronizer and the GRPO loop."""

    def __init__(self) -> None:
        #: One line per training step done (:func:`async_grpo.step_info`), for the driver.
        self.steps: list[str] = []

    async def progress(self, since: int) -> list[str]:
        """The lines of the steps done after the first ``since``. An async actor answers
        this while ``train`` runs: its heavy work runs in threads."""
        return self.steps[since:]

    async def train(
        self, args: argparse.Namespace, engines: list[Any]
    ) -> tuple[dict[str, Any], str]:
        """Run ``args.steps`` batches against the engine actors ``engines`` (handles);
        returns the :class:`async_grpo.RunReport` (as a dict) and the staleness histogram."""
        from aiosync.refit import DTensorRefitSource

        torch.manual_seed(args.seed)
        torch.set_num_threads(args.threads)
        config = grpo.policy_config(args)
        model = grpo.build_policy(config, args.seed)
        trainer = grpo.GRPOTrainer(
            model, lr=args.lr, clip_eps=args.clip_eps, kl_coef=args.kl_coef, is_cap=args.is_cap
        )
        source = DTensorRefitSource(model, optimizer=trainer.optimizer)
        members = [await RayEngine(handle).start() for handle in engines]
        engine: Any = members[0] if len(members) == 1 else EngineFleet(members)
        topology: dict[str, Any] = {}
        if not args.colocated:  # the sync group meets on this actor's node
            address = sync_group_address()
            topology = {
                "train_cluster": address.train_cluster(rank=0, world_size=1),
                "inference_world_size": sum(m.world_size or 0 for m in members),
            }
        sync = create_weight_synchronizer(
            source, engine, colocated=args.colocated, backend="embedded", **topology
        )
        report = grpo.RunReport(
            backend="embedded, Ray actors",
            colocated=args.colocated,
            synchronizer=type(sync).__name__,
            steps=args.steps,
            max_staleness=args.max_staleness,
            trainable_params=sum(p.numel() for p in model.parameters()),
            is_cap=args.is_cap,
            full_nbytes=grpo.manifest_nbytes(source),
        )
        verify = grpo.make_verifier(engine, model, args.verify, adapter_only=False)
        P, G, L = args.prompts_per_step, args.group_size, args.digits
        eval_prompts = grpo.make_prompts(random.Random(args.seed + 1), args.eval_prompts, L)

        async def check_engine() -> None:
            equal = await verify(sync.weight_version)
            if equal is not None:
                report.verified.append((sync.weight_version, equal))

        async def evaluate() -> float:
            outs = await engine.generate(eval_prompts, max_new_tokens=L, ignore_eos=True)
            return sum(map(grpo.reward, eval_prompts, outs)) / len(outs)

        async with sync:
            await engine.prepare_for_generation()
            buffer: VersionedReplayBuffer[grpo.Group] = VersionedReplayBuffer(
                sync, max_staleness=args.max_staleness
            )
            refit_events = sync.subscribe()
            weights_lock = anyio.Lock()
            last = {"gbps": 0.0, "seconds": 0.0}
            gaps = grpo._LogprobGaps()
            loss_stats: list[dict[str, float]] = []
            await check_engine()
            report.eval_start = await evaluate()

            async def follow_refits() -> None:
                async for ev in refit_events:
                    if ev.kind is VersionEventKind.COMMITTED:
                        gbps = ev.nbytes / ev.duration_s / 1e9 if ev.duration_s else 0.0
                        report.refits.append(
                            {
                                "version": ev.version,
                                "nbytes": ev.nbytes,
                                "seconds": ev.duration_s,
                                "gbps": gbps,
                                "delta": int(ev.delta),
                            }
                        )
                        last.update(gbps=gbps, seconds=ev.duration_s)
                    elif ev.kind is VersionEventKind.FAILED:
                        report.refit_failures += 1

            async def rollouts() -> None:
                rng = random.Random(args.seed)
                for batch_index in range(sys.maxsize):
                    await buffer.wait_below(P)  # at most one batch ahead
                    async with weights_lock:
                        if await refit_if_stale(sync, engine):
                            await check_engine()
                    prompts = grpo.make_prompts(rng, P, L)
                    outs: list[Generation] = await engine.generate_with_meta(
                        [p for p in prompts for _ in range(G)],
                        max_new_tokens=L,
                        temperature=1.0,
                        seed=args.seed * 100_003 + batch_index,
                        ignore_eos=True,
                        logprobs=True,  # the behaviour policy, for the off-policy correction
                    )
                    for i, prompt in enumerate(prompts):
                        gens = outs[i * G : (i + 1) * G]
                        completions = [g.token_ids for g in gens]
                        rewards = [grpo.reward(prompt, c) for c in completions]
                        behaviour = [grpo.behaviour_logprobs(g) for g in gens]
                        versions = [v for g in gens for v in (g.first_version, g.last_version)]
                        group = grpo.Group(prompt, completions, rewards, behaviour)
                        buffer.add(group, versions=versions)

            async with buffer, anyio.create_task_group() as tg:
                tg.start_soon(follow_refits)
                tg.start_soon(rollouts)
                for _ in range(args.steps):
                    batch = await buffer.pop_batch(P)
                    onpolicy = [s.staleness == 0 and s.other_weight_version is None for s in batch]
                    for s in batch:
                        report.samples.append(
                            (s.target_weight_version, sync.policy_version, s.staleness)
                        )
                        report.sample_versions.append(
                            (s.target_weight_version, s.target_weight_version)
                        )
                    groups = [s.item for s in batch]
                    report.rewards.append(sum(r for g in groups for r in g.rewards) / (P * G))
                    seqs, adv, behaviour, plen = trainer.tensors(groups)
                    proximal, ref = await anyio.to_thread.run_sync(trainer.old_logprobs, seqs, plen)
                    gaps.add(proximal, behaviour, onpolicy, G)
                    for _ in range(args.ppo_epochs):
                        stats = await anyio.to_thread.run_sync(
                            trainer.backward, seqs, adv, plen, proximal, behaviour, ref
                        )
                        loss_stats.append(stats)
                        async with weights_lock, sync.policy_update():
                            await anyio.to_thread.run_sync(trainer.step)
                    self.steps.append(
                        grpo.step_info(report.rewards[-1], sync, args.ppo_epochs, last, stats)
                    )
                # The final policy goes to the engine too, then a greedy evaluation.
                async with weights_lock:
                    if await refit_if_stale(sync, engine):
                        await check_engine()
                report.eval_end = await evaluate()
                with anyio.fail_after(30):  # let follow_refits record the last commit
                    while sync.weight_version > max(
                        (r["version"] for r in report.refits), default=0
                    ):
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
            report.staleness_histogram = buffer.histogram()
            report.dropped_stale = sum(buffer.stats.dropped.values())
            report.final_policy_version = sync.policy_version
            report.final_weight_version = sync.weight_version
            histogram = buffer.format_histogram()
            gaps.fill(report)
            if loss_stats:
                report.clip_frac = sum(s["clip_frac"] for s in loss_stats) / len(loss_stats)
                report.is_truncated_frac = sum(s["is_truncated_frac"] for s in loss_stats) / len(
                    loss_stats
                )
        k = max(1, len(report.rewards) // 5)
        report.start_reward = sum(report.rewards[:k]) / k
        report.end_reward = sum(report.rewards[-k:]) / k
        return asdict(report), histogram


async def run(args: argparse.Namespace) -> grpo.RunReport:
    """Start the actors, train, stop them; returns the run's :class:`async_grpo.RunReport`."""
    started = time.perf_counter()
    config = grpo.policy_config(args)
    spec = EngineSpec.embedded(config, seed=args.seed, threads_per_worker=1)
    group = None
    trainer_options: dict[str, Any] = {"num_cpus": args.actor_cpus}
    if args.colocated:
        # One bundle holds the trainer and its engine: the same node, as IPC needs.
        group = placement_group([{"CPU": 2 * args.actor_cpus}], strategy="STRICT_PACK")
        with anyio.fail_after(120):
            await group.ready()
        trainer_options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0
        )
    console = grpo.make_console(args.quiet)
    engines: list[RayEngine] = []
    trainer: Any = None
    where = "colocated" if args.colocated else "anywhere in the cluster"
    console.print(f"starting {args.engines} engine actor(s) and the trainer actor ({where})")
    try:
        for _ in range(args.engines):
            engines.append(
                await launch_engine(
                    spec,
                    colocated=args.colocated,
                    num_gpus=0,  # the embedded engine computes on CPU
                    num_cpus=args.actor_cpus / args.engines,
                    placement_group=group,
                    bundle_index=0,
                )
            )
        trainer = ray.remote(TrainerActor).options(**trainer_options).remote()
        train = trainer.train.remote(args, [e.actor for e in engines])
        with grpo.StepLog(console, args.steps) as log:
            while True:  # the trainer's steps as they finish, until train() returns
                ready, _ = await anyio.to_thread.run_sync(
                    lambda: ray.wait([train], timeout=STEP_POLL_S)
                )
                for line in await trainer.progress.remote(log.done):
                    log.step(line)
                if ready:
                    break
        data, histogram = await train
    finally:
        if trainer is not None:
            ray.kill(trainer)
        for engine in engines:
            await engine.shutdown()
        if group is not None:
            remove_placement_group(group)
    report = grpo.RunReport(**data)
    report.seconds = time.perf_counter() - started
    grpo._print_summary(console, report, histogram)
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (a subset of ``async_grpo.py``'s, plus the cluster's)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=None, help="a running Ray cluster (HEAD:6379, 'auto')")
    p.add_argument("--steps", type=int, default=60, help="training batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a few small steps (tests)")
    p.add_argument(
        "--colocated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engine on the trainer's node (IPC; default) or anywhere (the collective broadcast)",
    )
    p.add_argument("--engines", type=int, default=1, help="engine actors (a fleet when > 1)")
    p.add_argument(
        "--actor-cpus", type=float, default=1.0, help="CPUs per actor (trainer, engines)"
    )
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--digits", type=int, default=3, help="digits to copy")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL to the initial policy")
    p.add_argument("--is-cap", type=float, default=2.0, help="truncate the importance weight")
    p.add_argument("--ppo-epochs", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--max-staleness", type=int, default=4, help="in optimizer steps")
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="trainer torch threads")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json-report", default=None, help="write the RunReport here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.engines < 1:
        p.error(f"--engines must be >= 1, got {args.engines}")
    if not args.actor_cpus > 0:
        p.error(f"--actor-cpus must be > 0, got {args.actor_cpus}")
    if args.quick:
        args.steps = min(args.steps, 4)
        args.prompts_per_step, args.group_size, args.eval_prompts = 4, 4, 8
    return args


def main(argv: Sequence[str] | None = None) -> grpo.RunReport:
    args = parse_args(argv)
    if args.address is not None:
        ray.init(address=args.address)
    else:
        ray.init(**LOCAL_CLUSTER)
    try:
        report = anyio.run(run, args)
    finally:
        ray.shutdown()
    if args.json_report:
        with open(args.json_report, "w") as f:
            json.dump(asdict(report), f, indent=1)
    return report


if __name__ == "__main__":
    main()
