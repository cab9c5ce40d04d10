"""The conformance kit (:mod:`aiosync.testing.conformance`): every transport x every cell.

A cell the transport declares asserts the capability works (exact tensors, versions,
the engine's generations); one it does not declare asserts the typed refusal. The cells
follow from the declared :class:`~aiosync.TransportCapabilities`, and the docs' table is
generated from the same declarations (``docs/capabilities.md``).

Engines are module-scoped (one embedded worker for IPC and the collective, one TP=2
replica for the shard-aware transport, one SGLang contract test server for HTTP and
SGLang's collective, two fp32 replicas serving LoRA adapters for the LoRA adapter
refit); every cell syncs before it asserts.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aiosync.testing import conformance as kit

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "capabilities.md"
CASES = {case.name: case for case in kit.CASES}


class Engines:
    """The module's kit engines, each started on first use (``TransportCase.engine``)."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self.stack = stack
        self.started: dict[str, kit.KitEngine] = {}

    async def get(self, kind: str) -> kit.KitEngine:
        if kind not in self.started:
            self.started[kind] = await kit.start_engine(kind, self.stack)
        return self.started[kind]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[Engines]:
    async with contextlib.AsyncExitStack() as stack:
        yield Engines(stack)


#: Cells a transport fails today, each with the bug it shows (strict: a fix turns it into a
#: failure here, so the mark is removed with the fix).
KNOWN_FAILURES = {
    ("sharded", "cancel"): pytest.mark.xfail(
        strict=False,  # it depends on where the workers are when the cancel lands
        reason="a cancelled shard-aware sync leaves the workers in the receive of bucket 0 "
        "(LinkTimeout after collective_s); the next sync's handshake fails with LinkLost "
        "instead of healing",
    ),
}


@pytest.mark.parametrize(
    ("case", "cell"),
    [pytest.param(*cell, marks=KNOWN_FAILURES.get(cell, ())) for cell in kit.cells()],
)
@pytest.mark.asyncio(loop_scope="module")
async def test_kit(engines: Engines, case: str, cell: str) -> None:
    transport = CASES[case]
    engine = await engines.get(transport.engine)
    if isinstance(engine, kit.ServerKitEngine):
        await engine.reset()
    await kit.run_cell(transport, cell, engine, seed=100 + kit.CELLS.index(cell))


def test_the_docs_table_is_the_generated_one() -> None:
    text = DOCS.read_text()
    match = re.search(
        r"<!-- capability-table:start -->\n(.*?)<!-- capability-table:end -->", text, re.S
    )
    assert match is not None, "docs/capabilities.md lost its table markers"
    assert match.group(1) == kit.capability_table()


def test_every_declared_capability_has_a_kit_cell() -> None:
    # The parametrization above is kit.cells(): every case runs every cell, and a cell
    # runs the capability's own check exactly when the case's class declares it.
    run = set(kit.cells())
    repo = DOCS.parents[1]
    for case in kit.CASES:
        caps = case.capabilities
        declared = {cell for cell in kit.CELLS if kit.declares(caps, cell)}
        assert {"plain", "cancel", "bad_manifest"} <= declared
        hosted = set(kit.CELLS) - (kit.RESPAWNING if case.engine == "server" else set())
        hosted -= {cell for cell in kit.DECLARED_ONLY if cell not in declared}
        if case.rank_processes:
            # Its ranks need a process each: the suite it names runs its sharded trainer.
            assert caps.sharded_trainer, case.name
            assert (repo / case.rank_processes).is_file(), case.rank_processes
            hosted -= kit.IN_PROCESS_RANKS
        assert {cell for (name, cell) in run if name == case.name} == hosted
        assert ("verify_true" in declared) == (True in caps.verify)
        assert ("verify_sample" in declared) == ("sample" in caps.verify)
        for flag in ("delta", "kv_scales", "trace", "verify_engine", "elastic", "sharded_trainer"):
            assert (flag in declared) == getattr(caps, flag), (case.name, flag)
    # Every transport of the table is a kit case, and the sharded trainer runs here on one.
    assert {c.options for c in kit.CASES} == set(kit.TRANSPORT_OPTIONS)
    assert {name for (name, cell) in run if cell == "sharded_trainer"} == {"collective"}
