"""The contract checked against SGLang's own code, not our reading of it.

Runs only where ``sglang`` is importable (skipped otherwise). Set up the venv
once (SGLang itself without its GPU dependencies; the main venv's packages are
shared through a ``.pth`` file)::

    python -m venv .venv-sglang
    echo "$PWD/.venv/lib/python3.11/site-packages" > \\
        .venv-sglang/lib/python3.11/site-packages/_main_venv.pth
    .venv-sglang/bin/pip install --no-deps sglang orjson pybase64 requests urllib3 \\
        triton starlette msgspec IPython traitlets aiohttp multidict attrs yarl \\
        propcache aiohappyeyeballs aiosignal frozenlist dill apache-tvm-ffi \\
        sentencepiece compressed_tensors loguru gguf openai sniffio partial_json_parser
    .venv-sglang/bin/python -m pytest tests/http/test_sglang_contract.py

torchvision's PyPI wheel needs CUDA torch; on a CPU box the three torchvision
modules SGLang's multimodal configs import at module level are stubbed (never
called by anything tested here).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from aiosync import SGLangHTTPBackend
from aiosync.transports.http import HTTPWeightSynchronizer
from aiosync.transports.http import _wire as wire
from tests._support.steps import first_sync


def _stub_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return

    class _Anything(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything(f"{self.__name__}.{name}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _Anything(f"{self.__name__}()")

    import transformers  # noqa: F401  (decides "torchvision absent" before the stub exists)

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    for name in names:
        module = _Anything(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        sys.modules.setdefault(name, module)


def _sglang() -> types.SimpleNamespace:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (run in .venv-sglang, see the module docstring)")
    try:
        _stub_torchvision()
        from pydantic import TypeAdapter
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import (
            FlattenedTensorBucket,
            FlattenedTensorMetadata,
        )
    except Exception as exc:  # an SGLang whose imports need what this box lacks
        pytest.skip(f"sglang does not import here: {exc!r}")
    return types.SimpleNamespace(
        io=io_struct,
        TypeAdapter=TypeAdapter,
        Serializer=MultiprocessingSerializer,
        Bucket=FlattenedTensorBucket,
        Metadata=FlattenedTensorMetadata,
    )


MIXED = {
    "a.weight": ((8, 4), torch.bfloat16),
    "b.weight": ((5,), torch.float32),
    "c.weight": ((4, 4), torch.bfloat16),
    "d.step": ((2,), torch.int64),
}


def _mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, (shape, dtype) in MIXED.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=gen).to(dtype)
        else:
            out[name] = torch.randint(0, 99, shape, generator=gen, dtype=dtype)
    return out


def test_our_payloads_rebuild_bit_exact_with_sglangs_reader() -> None:
    """SGLang's SafeUnpickler + ``_update_weights_from_flattened_bucket``'s rebuild."""
    sg = _sglang()
    sent = _mixed_tensors()
    plan = wire.plan_flat_buckets(MIXED, bucket_bytes=64)
    received: dict[str, torch.Tensor] = {}
    for bucket, group in wire.group_flat(iter(sent.items()), plan, MIXED):
        flat = wire.allocate_flat(bucket, torch.device("cpu"))
        wire.pack_flat(bucket, group, flat.tensor)
        data = sg.Serializer.deserialize(wire.serialize_flat(bucket, flat))
        metadata = [
            sg.Metadata(
                name=m.name,
                shape=m.shape,
                dtype=m.dtype,
                start_idx=m.start_idx,
                end_idx=m.end_idx,
                numel=m.numel,
            )
            for m in data["metadata"]
        ]
        rebuilt = sg.Bucket(flattened_tensor=data["flattened_tensor"], metadata=metadata)
        for name, tensor in rebuilt.reconstruct_tensors():
            received[name] = tensor.clone()
        flat.release()
    assert set(received) == set(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)


def test_sglangs_own_payloads_are_accepted_by_the_test_servers_decoder() -> None:
    """What verl/slime send (SGLang's FlattenedTensorBucket) decodes on our server."""
    sg = _sglang()
    wire.use_file_system_sharing()
    sent = {n: t for n, t in _mixed_tensors().items() if t.dtype == torch.bfloat16}
    bucket = sg.Bucket(named_tensors=list(sent.items()))
    payload = sg.Serializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()},
        output_str=True,
    )
    received = {n: t.clone() for n, t in wire.decode_flattened_bucket(payload)}
    assert set(received) == set(sent)
    for name, tensor in sent.items():
        assert torch.equal(received[name], tensor)


class _Tap(httpx.AsyncHTTPTransport):
    """Forwards every request unchanged and keeps ``(method, path, json body)``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.seen.append((request.method, request.url.path, body))
        return await super().handle_async_request(request)


@pytest.fixture
def server(saver_server: Any) -> Iterator[Any]:
    saver_server.reset()
    yield saver_server


async def test_every_body_the_transport_sends_builds_sglangs_request_objects(
    server: Any, make_trainer: Any, prompts: list[list[int]]
) -> None:
    sg = _sglang()
    tap = _Tap()
    trainer = make_trainer(seed=41)
    async with SGLangHTTPBackend(server.url, enable_memory_saver=True, transport=tap) as backend:
        sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=64 * 1024)
        await first_sync(sync)
        await backend.generate(prompts, max_new_tokens=2)
        await backend.finish_generation()
        await sync.mark_stale()
        await sync.sync_weights()
        await backend.prepare_for_generation()
    classes = {
        "/update_weights_from_tensor": sg.io.UpdateWeightsFromTensorReqInput,
        "/release_memory_occupation": sg.io.ReleaseMemoryOccupationReqInput,
        "/resume_memory_occupation": sg.io.ResumeMemoryOccupationReqInput,
        "/generate": sg.io.GenerateReqInput,
        "/update_weight_version": sg.io.UpdateWeightVersionReqInput,
    }
    checked: set[str] = set()
    for method, path, body in tap.seen:
        if body is None:
            assert path in {"/flush_cache", "/get_server_info"}, path
            continue
        assert method == "POST"
        # What FastAPI does with the JSON body of SGLang's endpoint.
        request = sg.TypeAdapter(classes[path]).validate_python(body)
        checked.add(path)
        if path == "/update_weights_from_tensor":
            assert request.load_format == "flattened_bucket"
            assert request.flush_cache is False and request.abort_all_requests is False
            assert len(request.serialized_named_tensors) == 1
            assert isinstance(request.serialized_named_tensors[0], bytes)
            assert request.weight_version is None  # set after the flush instead
        elif path == "/update_weight_version":
            assert request.new_version in ("1", "2") and request.abort_all_requests is False
        elif path == "/generate":
            assert request.input_ids == prompts
            assert request.sampling_params == {"max_new_tokens": 2, "temperature": 0.0}
        else:
            assert request.tags in (["weights", "kv_cache"], ["weights"], ["kv_cache"])
    assert checked == set(classes)
