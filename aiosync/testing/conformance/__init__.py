"""The conformance kit: one contract, checked on every transport (``docs/capabilities.md``).

A :class:`TransportCase` says how to build one transport's synchronizer on CPU against a
real engine (the embedded engine's worker processes, or the SGLang contract test server
:mod:`aiosync.testing.sglang_server`); the ``check_*`` functions take a case, a started
:class:`KitEngine` and the case's trainer (a :class:`KitTrainer`, or for the LoRA
adapter refit a :class:`LoRAKitTrainer`, whose "tensors" are the adapter's and whose
engine must keep its base weights) and assert one cell of the contract:

- ``plain``: after a sync every worker holds exactly the trainer's tensors (its
  tensor-parallel slices), the synchronizer is at version 1 and not stale, and the engine
  generates the trainer's greedy tokens under version 1.
- ``verify_true``/``verify_sample``, ``delta``, ``trace``: a declared option is honoured
  (and lands bit-exact); an undeclared one is refused at construction
  (:class:`~aiosync.UnsupportedOptionError`), never silently dropped.
- ``kv_scales``: declared, the scales reach every worker; undeclared, ``sync_weights``
  raises ``NotImplementedError`` (the transport's ``kv_scales_refusal``) before any byte.
- ``verify_engine``: the engine's weights hash as the trainer's, and a trainer that moved
  on is named (:class:`~aiosync.RefitVerificationError`) and makes the synchronizer stale.
- ``cancel``: a sync cancelled mid-stream leaves ``is_stale`` True, the version unchanged,
  and the engine refusing to generate or still serving the previous version exactly; the
  next sync heals it.
- ``killed_worker`` (engines that respawn workers): a worker SIGKILLed mid-sync fails it
  typed, the version unchanged and stale; the respawned engine is healed by the next sync.
- ``bad_manifest``: a source whose manifest names a tensor the engine lacks is refused
  (:class:`~aiosync.RefitMismatchError`) before any byte: the engine keeps its weights.
- ``second_owner``: a second synchronizer on an engine the first owns is refused
  (:class:`~aiosync.OwnershipError`) where it could break the first's sync, and the
  engine's version labels follow whichever owns it (case C27).
- ``elastic`` (where declared): a quarantining fleet sets a killed engine aside, named,
  and commits to the other; revived, it joins with the next sync; one killed while
  serving fails the fleet's generate, named (C29, C36, C40).
- ``in_flight_wait``/``_abort``/``_keep``: a request running through a sync ends as its
  policy says, its tokens and version labels exact, never a silent mix (C13).
- ``sharded_trainer`` (where declared): a trainer of several ranks ends every sync
  with the same versions on every rank, the engine holding the trainer's tensors, or
  with the same error on every rank (one rank's source drifting from its manifest);
  the next sync heals.

Which cells a transport runs follows from its declared
:class:`~aiosync.TransportCapabilities` (:func:`cells`); :func:`capability_table` renders
the same declarations as the docs' table. ``tests/conformance/test_kit.py`` runs the kit.

The package's modules, by role: :mod:`.trainers` (the trainers and the model),
:mod:`.engines` (the kit engines), :mod:`.cases` (the cases, the cells and which run
where), :mod:`.table` (the docs' table), and the checks grouped by capability:
:mod:`.sync_checks` (a sync and its options), :mod:`.fault_checks` (syncs that do not
complete), :mod:`.fleet_checks` (``elastic``), :mod:`.inflight_checks`,
:mod:`.rank_checks` (``sharded_trainer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiosync.options import (
    TRANSPORT_OPTIONS,
    CollectiveOptions,
    HTTPOptions,
    IPCOptions,
    LoRAOptions,
    SGLangCollectiveOptions,
    ShardedOptions,
    TransportCapabilities,
    TransportOptions,
)

from .cases import (
    CASES,
    CELLS,
    DECLARED_ONLY,
    IN_PROCESS_RANKS,
    RESPAWNING,
    TransportCase,
    capabilities_of,
    cells,
    declares,
    runs,
)
from .engines import (
    EmbeddedKitEngine,
    FleetKitEngine,
    KitEngine,
    LoRAKitEngine,
    ServerKitEngine,
    embedded_engine,
    lora_engine,
    sglang_test_server,
    start_engine,
)
from .engines import (
    _test_server as _test_server,
)
from .fault_checks import (
    _assert_refuses_or_serves as _assert_refuses_or_serves,
)
from .fault_checks import (
    _cancel_at as _cancel_at,
)
from .fault_checks import (
    check_bad_manifest,
    check_cancel,
    check_killed_worker,
    check_second_owner,
)
from .fleet_checks import (
    _committed_without as _committed_without,
)
from .fleet_checks import (
    _events_until as _events_until,
)
from .fleet_checks import (
    _once_at as _once_at,
)
from .fleet_checks import (
    check_elastic,
)
from .inflight_checks import (
    _sync_during_request as _sync_during_request,
)
from .inflight_checks import (
    check_in_flight_abort,
    check_in_flight_keep,
    check_in_flight_wait,
)
from .rank_checks import RANKS, check_sharded_trainer, on_every_rank
from .sync_checks import (
    _assert_serves as _assert_serves,
)
from .sync_checks import (
    _check_option as _check_option,
)
from .sync_checks import (
    _sync as _sync,
)
from .sync_checks import (
    check_bad_verify,
    check_delta,
    check_kv_scales,
    check_plain,
    check_trace,
    check_verify_engine,
    check_verify_sample,
    check_verify_true,
)
from .table import CAPABILITY_COLUMNS, capability_table
from .table import _yes as _yes
from .trainers import (
    BUCKET_BYTES,
    CORRUPTED,
    DTYPE,
    ENGINE_SEED,
    KV_SCALES,
    LONG,
    LONG_PROMPT,
    LORA_DTYPE,
    PROMPTS,
    RENAMED,
    STARTED,
    KitTrainer,
    LoRAKitTrainer,
    box_patch_bytes,
    patch_bytes,
)
from .trainers import (
    _bits as _bits,
)
from .trainers import (
    _free_port as _free_port,
)
from .trainers import (
    _tiny_config as _tiny_config,
)

__all__ = [
    "BUCKET_BYTES",
    "CAPABILITY_COLUMNS",
    "CASES",
    "CELLS",
    "CORRUPTED",
    "DECLARED_ONLY",
    "DTYPE",
    "ENGINE_SEED",
    "IN_PROCESS_RANKS",
    "KV_SCALES",
    "LONG",
    "LONG_PROMPT",
    "LORA_DTYPE",
    "PROMPTS",
    "RANKS",
    "RENAMED",
    "RESPAWNING",
    "STARTED",
    "TRANSPORT_OPTIONS",
    "CollectiveOptions",
    "EmbeddedKitEngine",
    "FleetKitEngine",
    "HTTPOptions",
    "IPCOptions",
    "KitEngine",
    "KitTrainer",
    "LoRAKitEngine",
    "LoRAKitTrainer",
    "LoRAOptions",
    "SGLangCollectiveOptions",
    "ServerKitEngine",
    "ShardedOptions",
    "TransportCapabilities",
    "TransportCase",
    "TransportOptions",
    "box_patch_bytes",
    "capabilities_of",
    "capability_table",
    "cells",
    "check_bad_manifest",
    "check_bad_verify",
    "check_cancel",
    "check_delta",
    "check_elastic",
    "check_in_flight_abort",
    "check_in_flight_keep",
    "check_in_flight_wait",
    "check_killed_worker",
    "check_kv_scales",
    "check_plain",
    "check_second_owner",
    "check_sharded_trainer",
    "check_trace",
    "check_verify_engine",
    "check_verify_sample",
    "check_verify_true",
    "declares",
    "embedded_engine",
    "lora_engine",
    "on_every_rank",
    "patch_bytes",
    "run_cell",
    "runs",
    "sglang_test_server",
    "start_engine",
]

_CHECKS: dict[str, Callable[[TransportCase, KitEngine, Any], Any]] = {
    "plain": check_plain,
    "verify_true": check_verify_true,
    "verify_sample": check_verify_sample,
    "bad_verify": check_bad_verify,
    "delta": check_delta,
    "kv_scales": check_kv_scales,
    "trace": check_trace,
    "verify_engine": check_verify_engine,
    "cancel": check_cancel,
    "killed_worker": check_killed_worker,
    "bad_manifest": check_bad_manifest,
    "second_owner": check_second_owner,
    "elastic": check_elastic,
    "in_flight_wait": check_in_flight_wait,
    "in_flight_abort": check_in_flight_abort,
    "in_flight_keep": check_in_flight_keep,
    "sharded_trainer": check_sharded_trainer,
}
assert tuple(_CHECKS) == CELLS


async def run_cell(case: TransportCase, cell: str, engine: KitEngine, *, seed: int) -> None:
    """Run one cell of the kit against a started engine, with a fresh trainer of the
    case's (``seed`` differs from the engine's, so every sync changes every tensor)."""
    await _CHECKS[cell](case, engine, case.trainer(seed))
