"""The SGLang test server's disaggregated weight-update routes (SGLang 0.5.23's
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``), against a real trainer rank 0 in this process.

Servers run in this process (:func:`make_server`), so every simulated TP rank's
weights are read straight from ``ServerState.ranks``; the trainer hosts the group's
``TCPStore`` and broadcasts over gloo, all on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
import torch
from safetensors.torch import load as safetensors_load

from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.testing.sglang_server import ServerState, make_server, serve_in_subprocess
from aiosync.transports.collective._custom_group import CustomGroup, join_custom_group
from aiosync.transports.collective._group import open_store

pytestmark = pytest.mark.slow

GROUP = "weight_update_group"
#: Formation and broadcast limit of the trainer and the healthy servers, seconds.
TIMEOUT_S = 30.0
#: The server whose broadcasts are meant to time out gives up after this long.
SHORT_TIMEOUT_S = 1.5
# SGLang 0.5.23's texts (weight_updater.py, http_server.py).
INIT_OK = {"success": True, "message": "Succeeded to initialize custom process group."}
UPDATE_OK = {"success": True, "message": "Succeeded to update parameter online."}
DESTROY_OK = {"success": True, "message": "Succeeded to destroy custom process group."}
OUTSIDE_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
PARTIAL = (
    "The full weights of the ModelRunner are partially updated. Please discard the whole weights."
)
#: Sent tensors: bf16 parameters and a float32 () KV-cache scale (mixed dtypes in a bucket).
SENT = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_scale",
    "model.norm.weight",
)
UNTOUCHED = "model.layers.1.mlp.down_proj.weight"


@dataclass
class Served:
    url: str
    state: ServerState


@pytest.fixture(scope="module", autouse=True)
def gloo_on_loopback() -> Iterator[None]:
    # Gloo otherwise binds the address the host name resolves to.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLOO_SOCKET_IFNAME", "lo")
        yield


@contextlib.contextmanager
def _serving(tp_size: int, timeout_s: float = TIMEOUT_S, **options: Any) -> Iterator[Served]:
    runner = HFModelRunner.from_config(TINY_QWEN3, seed=1, dtype=torch.bfloat16)
    state = ServerState(
        runner=runner, tp_size=tp_size, weights_update_timeout_s=timeout_s, **options
    )
    server = make_server(state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Served(f"http://127.0.0.1:{server.server_address[1]}", state)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _cleaned(served: Served) -> Iterator[Served]:
    try:
        yield served
    finally:
        # What a test left (a group, a session, a fault) never reaches the next one.
        served.state.close_weight_groups()
        httpx.post(f"{served.url}/_aiosync/reset").raise_for_status()


@pytest.fixture(scope="module")
def tp2_proc() -> Iterator[Served]:
    with _serving(2) as served:
        yield served


@pytest.fixture(scope="module")
def other_tp2_proc() -> Iterator[Served]:
    with _serving(2) as served:
        yield served


@pytest.fixture
def tp2(tp2_proc: Served) -> Iterator[Served]:
    yield from _cleaned(tp2_proc)


@pytest.fixture
def other_tp2(other_tp2_proc: Served) -> Iterator[Served]:
    yield from _cleaned(other_tp2_proc)


@pytest.fixture
def impatient() -> Iterator[Served]:
    """TP 1, broadcasts time out after :data:`SHORT_TIMEOUT_S`, memory saver on."""
    with _serving(1, SHORT_TIMEOUT_S, enable_memory_saver=True, weights_cpu_backup=True) as served:
        yield from _cleaned(served)


def _new_values(runner: HFModelRunner, seed: int) -> dict[str, torch.Tensor]:
    """Fresh values for :data:`SENT`, in the model's shapes and dtypes."""
    manifest = runner.expected_manifest()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in SENT:
        if name.endswith("k_scale"):
            out[name] = torch.rand((), generator=gen) + 0.5
        else:
            shape, dtype = manifest[name]
            out[name] = torch.randn(shape, generator=gen).to(dtype)
    return out


def _assert_holds(state: ServerState, sent: dict[str, torch.Tensor]) -> None:
    """Every TP rank holds exactly ``sent``."""
    for rank, runner in enumerate(state.ranks):
        weights = runner.hf_state_dict()
        for name, tensor in sent.items():
            if name.endswith("k_scale"):
                assert runner.kv_scales[name] == tensor.item(), (rank, name)
            else:
                assert weights[name].dtype == tensor.dtype, (rank, name)
                assert torch.equal(weights[name], tensor), (rank, name)


def _snapshot(state: ServerState) -> list[dict[str, torch.Tensor]]:
    return [runner.hf_state_dict() for runner in state.ranks]


def _assert_unchanged(state: ServerState, before: list[dict[str, torch.Tensor]]) -> None:
    for rank, (runner, old) in enumerate(zip(state.ranks, before, strict=True)):
        for name, tensor in runner.hf_state_dict().items():
            assert torch.equal(tensor, old[name]), (rank, name)


class Trainer:
    """Rank 0 of weight-update groups: hosts their store and broadcasts into them."""

    def __init__(self) -> None:
        self.store = open_store("127.0.0.1", 0, is_master=True, timeout_s=TIMEOUT_S)
        self.port = int(self.store.port)

    async def form(
        self,
        client: httpx.AsyncClient,
        servers: Sequence[tuple[str, int]],
        world_size: int,
        group_name: str = GROUP,
    ) -> tuple[CustomGroup, list[httpx.Response]]:
        """Join as rank 0 while each ``(server URL, rank_offset)`` is asked to join."""
        responses: list[httpx.Response | None] = [None] * len(servers)
        joined: list[CustomGroup] = []

        def join() -> None:
            joined.append(
                join_custom_group(
                    self.store,
                    group_name=group_name,
                    rank=0,
                    world_size=world_size,
                    backend="gloo",
                    timeout_s=TIMEOUT_S,
                )
            )

        async def ask(index: int, url: str, offset: int) -> None:
            body = {
                "master_address": "127.0.0.1",
                "master_port": self.port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": "gloo",
            }
            responses[index] = await client.post(f"{url}/init_weights_update_group", json=body)

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, join)
            for index, (url, offset) in enumerate(servers):
                tg.start_soon(ask, index, url, offset)
        return joined[0], [r for r in responses if r is not None]


async def _update(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    group: CustomGroup | None,
    tensors: dict[str, torch.Tensor],
    *,
    bucketed: bool = True,
    **extra: Any,
) -> list[httpx.Response]:
    """POST the update to every server in ``urls`` while ``group`` (None: nothing is sent)
    broadcasts ``tensors``: one flattened bucket, or one broadcast per tensor."""
    body = {
        "names": list(tensors),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": GROUP,
        "load_format": "flattened_bucket" if bucketed else None,
        **extra,
    }
    responses: list[httpx.Response | None] = [None] * len(urls)

    def send() -> None:
        assert group is not None
        if bucketed:
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()])
            group.broadcast(flat, what="the bucket")
        else:
            for name, tensor in tensors.items():
                group.broadcast(tensor.contiguous(), what=name)

    async def post(index: int, url: str) -> None:
        responses[index] = await client.post(f"{url}/update_weights_from_distributed", json=body)

    async with anyio.create_task_group() as tg:
        if group is not None:
            tg.start_soon(anyio.to_thread.run_sync, send)
        for index, url in enumerate(urls):
            tg.start_soon(post, index, url)
    return [r for r in responses if r is not None]


async def _session(client: httpx.AsyncClient, url: str, route: str) -> None:
    response = await client.post(f"{url}/{route}_weight_update", json={})
    assert response.status_code == 200, response.text


def _failure(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["success"] is False and set(body) == {"success", "message"}
    return str(body["message"])


async def test_a_flattened_bucket_reaches_every_tp_rank_exactly(tp2: Served) -> None:
    trainer = Trainer()
    sent = _new_values(tp2.state.runner, seed=11)
    untouched = tp2.state.runner.hf_state_dict()[UNTOUCHED]
    async with httpx.AsyncClient(timeout=60) as client:
        group, (init,) = await trainer.form(client, [(tp2.url, 1)], world_size=3)
        assert (init.status_code, init.json()) == (200, INIT_OK)
        assert [m.rank for m in tp2.state.weight_groups[GROUP]] == [1, 2]
        await _session(client, tp2.url, "begin")
        (answer,) = await _update(client, [tp2.url], group, sent, weight_version="v7")
        assert answer.status_code == 200
        assert answer.json() == {
            "success": True,
            "message": "Succeeded to update parameter online. Weight version updated to v7.",
        }
        _assert_holds(tp2.state, sent)
        for runner in tp2.state.ranks:
            assert torch.equal(runner.hf_state_dict()[UNTOUCHED], untouched)
        # Inside a session the version waits for its end, as with the tensor route.
        assert tp2.state.pending_version == "v7"
        await _session(client, tp2.url, "end")
        assert tp2.state.weight_version == "v7"
        entry = [e for e in tp2.state.log if e["path"] == "/update_weights_from_distributed"][-1]
        assert entry["tensors"] == len(SENT) and entry["load_format"] == "flattened_bucket"
        assert {"received", "loaded"} <= set(entry["times"])
        destroyed = await client.post(
            f"{tp2.url}/destroy_weights_update_group", json={"group_name": GROUP}
        )
        assert (destroyed.status_code, destroyed.json()) == (200, DESTROY_OK)
        assert tp2.state.weight_groups == {}
    group.close()


@contextlib.asynccontextmanager
async def _formed(
    served: Served, seed: int
) -> AsyncIterator[tuple[Trainer, httpx.AsyncClient, Any, dict[str, torch.Tensor]]]:
    """A trainer, a client, the trainer's weight-update group formed with ``served`` (two
    tensor-parallel ranks from rank 1: a world of 3), and new values (``seed``) to send;
    the group closed after."""
    trainer = Trainer()
    sent = _new_values(served.state.runner, seed=seed)
    async with httpx.AsyncClient(timeout=60) as client:
        group, _ = await trainer.form(client, [(served.url, 1)], world_size=3)
        yield trainer, client, group, sent
    group.close()


async def test_one_broadcast_per_tensor_without_a_load_format(tp2: Served) -> None:
    async with _formed(tp2, seed=12) as (_trainer, client, group, sent):
        await _session(client, tp2.url, "begin")
        (answer,) = await _update(client, [tp2.url], group, sent, bucketed=False)
        assert (answer.status_code, answer.json()) == (200, UPDATE_OK)
        _assert_holds(tp2.state, sent)
        await _session(client, tp2.url, "end")


async def test_refusals_load_nothing_and_leave_the_group_usable(tp2: Served) -> None:
    before = _snapshot(tp2.state)
    async with _formed(tp2, seed=13) as (trainer, client, group, sent):
        # None of these reaches a broadcast, so the trainer sends nothing.
        (outside,) = await _update(client, [tp2.url], None, sent)
        assert _failure(outside) == OUTSIDE_SESSION
        await _session(client, tp2.url, "begin")
        body = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]]}
        unknown = await client.post(
            f"{tp2.url}/update_weights_from_distributed", json={**body, "group_name": "nope"}
        )
        assert _failure(unknown) == (
            "Group nope not in ['weight_update_group']. "
            "Please call `init_weights_update_group` first."
        )
        bad_dtype = await client.post(
            f"{tp2.url}/update_weights_from_distributed", json={**body, "dtypes": ["float7"]}
        )
        assert _failure(bad_dtype) == (
            f"Failed to update parameter online: dtype 'float7' is not a torch dtype. {PARTIAL}"
        )
        init = {"master_address": "127.0.0.1", "master_port": trainer.port}
        init |= {"rank_offset": 1, "world_size": 3, "backend": "gloo"}
        again = await client.post(f"{tp2.url}/init_weights_update_group", json=init)
        assert _failure(again) == (
            "Failed to initialize custom process group: The specified group name has already "
            "been created, please use a different group name."
        )
        nccl = await client.post(
            f"{tp2.url}/init_weights_update_group",
            json={**init, "group_name": "other", "backend": "nccl"},
        )
        assert _failure(nccl).startswith(
            "Failed to initialize custom process group: backend 'nccl' needs CUDA"
        )
        too_small = await client.post(
            f"{tp2.url}/init_weights_update_group",
            json={**init, "group_name": "other", "world_size": 2},
        )
        assert _failure(too_small) == (
            "Failed to initialize custom process group: rank 2 is outside a group of 2 ranks."
        )
        # Received whole, then refused by the model: the broadcast ran, the group stays usable.
        unknown_name = {"nope.weight": torch.zeros(4, dtype=torch.bfloat16)}
        (refused,) = await _update(client, [tp2.url], group, unknown_name)
        assert _failure(refused) == (
            f"Failed to update parameter online: 'nope.weight' is not a parameter of this "
            f"model. {PARTIAL}"
        )
        _assert_unchanged(tp2.state, before)
        assert list(tp2.state.weight_groups) == [GROUP]
        # No refusal took part in a broadcast: the next update is received whole.
        (answer,) = await _update(client, [tp2.url], group, sent)
        assert (answer.status_code, answer.json()) == (200, UPDATE_OK)
        _assert_holds(tp2.state, sent)
        destroyed = await client.post(f"{tp2.url}/destroy_weights_update_group", json={})
        assert (destroyed.status_code, destroyed.json()) == (200, DESTROY_OK)
        twice = await client.post(f"{tp2.url}/destroy_weights_update_group", json={})
        assert _failure(twice) == "The group to be destroyed does not exist."
        (after,) = await _update(client, [tp2.url], None, sent)
        assert _failure(after) == (
            "Group weight_update_group not in []. Please call `init_weights_update_group` first."
        )
        await _session(client, tp2.url, "end")


async def test_faults_on_the_update_route_act_as_on_every_route(tp2: Served) -> None:
    before = _snapshot(tp2.state)
    async with _formed(tp2, seed=14) as (_trainer, client, group, sent):
        await _session(client, tp2.url, "begin")
        path = "/update_weights_from_distributed"
        fault = {"path": path, "mode": "error", "count": 1}
        (await client.post(f"{tp2.url}/_aiosync/faults", json=fault)).raise_for_status()
        (errored,) = await _update(client, [tp2.url], None, sent)
        assert errored.status_code == 500
        assert errored.json() == {"error": {"message": f"injected fault on {path}"}}

        fault = {"path": path, "mode": "hang", "count": 1}
        (await client.post(f"{tp2.url}/_aiosync/faults", json=fault)).raise_for_status()
        hung: list[httpx.Response] = []

        async def hang() -> None:
            hung.extend(await _update(client, [tp2.url], None, sent))

        async with anyio.create_task_group() as tg:
            tg.start_soon(hang)
            with anyio.fail_after(10):
                while not any(e.get("status") == "hung" for e in tp2.state.log):
                    await anyio.sleep(0.02)
            # The reset releases the hung request; it opens no session, so end it after.
            (await client.post(f"{tp2.url}/_aiosync/reset")).raise_for_status()
        assert hung[0].status_code == 503
        assert hung[0].json() == {"error": {"message": "hung request released"}}
        _assert_unchanged(tp2.state, before)
        # Neither reached the group: it still works.
        await _session(client, tp2.url, "begin")
        (answer,) = await _update(client, [tp2.url], group, sent)
        assert (answer.status_code, answer.json()) == (200, UPDATE_OK)
        _assert_holds(tp2.state, sent)
        await _session(client, tp2.url, "end")


async def test_two_servers_share_one_group_with_rank_offsets(
    tp2: Served, other_tp2: Served
) -> None:
    trainer = Trainer()
    sent = _new_values(tp2.state.runner, seed=15)
    async with httpx.AsyncClient(timeout=60) as client:
        group, answers = await trainer.form(
            client, [(tp2.url, 1), (other_tp2.url, 3)], world_size=5
        )
        assert [(a.status_code, a.json()) for a in answers] == [(200, INIT_OK)] * 2
        assert [m.rank for m in other_tp2.state.weight_groups[GROUP]] == [3, 4]
        for served in (tp2, other_tp2):
            await _session(client, served.url, "begin")
        answers = await _update(client, [tp2.url, other_tp2.url], group, sent)
        assert [(a.status_code, a.json()) for a in answers] == [(200, UPDATE_OK)] * 2
        for served in (tp2, other_tp2):
            _assert_holds(served.state, sent)
            await _session(client, served.url, "end")
    group.close()


async def test_a_broadcast_that_times_out_breaks_the_group_until_formed_again(
    impatient: Served,
) -> None:
    trainer = Trainer()
    before = _snapshot(impatient.state)
    sent = _new_values(impatient.state.runner, seed=16)
    async with httpx.AsyncClient(timeout=60) as client:
        group, _ = await trainer.form(client, [(impatient.url, 1)], world_size=2)
        await _session(client, impatient.url, "begin")
        # The trainer never sends: the server's receive times out.
        (timed_out,) = await _update(client, [impatient.url], None, sent)
        message = _failure(timed_out)
        assert message.startswith("Failed to update parameter online: receiving a bucket of 4")
        assert "Timed out" in message and message.endswith(PARTIAL)
        (broken,) = await _update(client, [impatient.url], None, sent)
        assert "the weight-update group is broken; form it again" in _failure(broken)
        _assert_unchanged(impatient.state, before)
        destroyed = await client.post(f"{impatient.url}/destroy_weights_update_group", json={})
        assert (destroyed.status_code, destroyed.json()) == (200, DESTROY_OK)
        group.close()

        # A fresh store, as SGLang trainers form each group over a new tcp:// store: the
        # group's keys carry no generation, so the old store still holds the old ranks'.
        group, (init,) = await Trainer().form(client, [(impatient.url, 1)], world_size=2)
        assert (init.status_code, init.json()) == (200, INIT_OK)
        released = await client.post(
            f"{impatient.url}/release_memory_occupation", json={"tags": ["weights"]}
        )
        assert released.status_code == 200
        (refused,) = await _update(client, [impatient.url], None, sent)
        assert _failure(refused) == "weights are released; resume them first"
        resumed = await client.post(
            f"{impatient.url}/resume_memory_occupation", json={"tags": ["weights"]}
        )
        assert resumed.status_code == 200
        (answer,) = await _update(client, [impatient.url], group, sent)
        assert (answer.status_code, answer.json()) == (200, UPDATE_OK)
        _assert_holds(impatient.state, sent)
        await _session(client, impatient.url, "end")
    group.close()


async def test_closing_the_server_closes_its_groups_and_leaves_no_rank_thread() -> None:
    trainer = Trainer()
    with _serving(2) as served:
        async with httpx.AsyncClient(timeout=60) as client:
            group, _ = await trainer.form(client, [(served.url, 1)], world_size=3)
        members = served.state.weight_groups[GROUP]
    assert all(m.pg is None for m in members)
    assert served.state.weight_groups == {}
    assert not [t for t in threading.enumerate() if t.name.startswith("aiosync-sglang-tp")]
    group.close()


async def test_a_server_process_with_two_tp_ranks_receives_over_the_cli() -> None:
    """The real command line (``--tp-size``, ``--weights-update-timeout-s``) in its own
    process; each rank's weights read back through ``/_aiosync/state_dict?rank=r``."""
    trainer = Trainer()
    args = ["--tp-size", "2", "--weights-update-timeout-s", "20"]
    async with (
        serve_in_subprocess(TINY_QWEN3, seed=1, dtype="bfloat16", args=args) as url,
        httpx.AsyncClient(timeout=60) as client,
    ):
        runner = HFModelRunner.from_config(TINY_QWEN3, seed=1, dtype=torch.bfloat16)
        sent = _new_values(runner, seed=17)
        group, (init,) = await trainer.form(client, [(url, 1)], world_size=3)
        assert (init.status_code, init.json()) == (200, INIT_OK)
        await _session(client, url, "begin")
        (answer,) = await _update(client, [url], group, sent)
        assert (answer.status_code, answer.json()) == (200, UPDATE_OK)
        await _session(client, url, "end")
        scales = (await client.get(f"{url}/_aiosync/kv_scales")).json()
        for rank in (0, 1):
            response = await client.get(f"{url}/_aiosync/state_dict", params={"rank": rank})
            weights = safetensors_load(response.content)
            for name, tensor in sent.items():
                if name.endswith("k_scale"):
                    assert scales[rank][name] == tensor.item()
                else:
                    assert torch.equal(weights[name], tensor), (rank, name)
    group.close()
