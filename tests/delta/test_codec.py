"""The delta codec: bitwise change detection, the smallest encoding per tensor, patches
applied in full-tensor coordinates into whole tensors and tensor-parallel slices, the
transactional baseline and the wire form."""

from __future__ import annotations

import pytest
import torch

from aiosync.delta import (
    DeltaBaseline,
    WeightPatch,
    apply_patch,
    encode_patch,
    pack_bitmap,
    patch_from_wire,
    patch_to_wire,
    unpack_bitmap,
    wire_manifest,
)
from aiosync.errors import RefitMismatchError
from aiosync.layout import Part, box_of


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def _changed(base: torch.Tensor, count: int, seed: int = 0) -> torch.Tensor:
    """``base`` with ``count`` elements (chosen by ``seed``) one ulp away: their lowest
    mantissa bit flipped, as a small optimizer step moves a bf16 weight."""
    gen = torch.Generator().manual_seed(seed)
    new = base.clone()
    bits = _bits(new)
    idx = torch.randperm(bits.numel(), generator=gen)[:count]
    bits[idx] ^= 1
    return new


@pytest.mark.parametrize(
    ("changed", "encoding", "nbytes"),
    [
        (5, "indices", 5 * (4 + 2)),  # few: int32 index + bf16 value each
        (1000, "bitmap", 4096 // 8 + 1000 * 2),  # a quarter: one bit each + values
        (3900, "dense", 4096 * 2),  # nearly all: the tensor itself
    ],
)
def test_each_tensor_takes_its_smallest_encoding(changed: int, encoding: str, nbytes: int) -> None:
    base = torch.randn(64, 64).to(torch.bfloat16)
    new = _changed(base, changed)
    assert int((_bits(new) != _bits(base)).sum()) == changed
    patch = encode_patch("w", 7, _bits(base), new)
    assert patch is not None
    assert (patch.encoding, patch.nbytes, patch.base) == (encoding, nbytes, 7)
    live = base.clone()
    assert apply_patch(live, Part.whole(base.shape), patch) == (
        4096 if encoding == "dense" else changed
    )
    assert torch.equal(_bits(live), _bits(new))


def test_an_unchanged_tensor_sends_nothing_and_sign_and_nan_bits_count() -> None:
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    assert encode_patch("w", 0, _bits(base), base.clone()) is None
    new = base.clone()
    new[0] = -0.0  # == 0.0, other bits
    new[2] = -new[2]  # another NaN
    patch = encode_patch("w", 0, _bits(base), new)
    assert patch is not None and patch.flat_indices().tolist() == [0, 2]
    live = base.clone()
    apply_patch(live, Part.whole((4,)), patch)
    assert torch.equal(_bits(live), _bits(new))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("changed", [7, 2000])
def test_a_slice_takes_its_share_of_a_full_tensor_patch(dim: int, changed: int) -> None:
    base = torch.randn(6, 8, 10)
    new = _changed(base, changed, seed=dim)
    patch = encode_patch("w", 3, _bits(base), new)
    assert patch is not None
    for start, length in [(0, 2), (2, 2), (4, 2)] if dim == 0 else [(0, 4), (4, 4)]:
        held = Part(tuple(base.shape), dim, start, length)
        live = base.narrow(dim, start, length).contiguous()
        apply_patch(live, held, patch)
        assert torch.equal(live, new.narrow(dim, start, length)), held
        box = box_of(held)
        assert all(hi - lo == n for (lo, hi), n in zip(box, live.shape, strict=True))


def test_a_patch_is_checked_before_anything_is_written() -> None:
    base = torch.zeros(4, 4)
    patch = encode_patch("w", 0, _bits(base), torch.ones(4, 4))
    assert patch is not None
    live = torch.zeros(4, 4, dtype=torch.float64)
    with pytest.raises(RefitMismatchError, match=r"patch torch\.float32, model torch\.float64"):
        apply_patch(live, Part.whole((4, 4)), patch)
    with pytest.raises(RefitMismatchError, match=r"patch of \(4, 4\), model holds"):
        apply_patch(torch.zeros(2, 4), Part((2, 4), 0, 0, 2), patch)
    assert not live.any()


def test_bitmaps_round_trip_little_endian_per_byte() -> None:
    mask = torch.tensor([True, False, False, True] + [False] * 5 + [True])
    packed = pack_bitmap(mask)
    assert packed.tolist() == [0b1001, 0b10]
    assert torch.equal(unpack_bitmap(packed, 10), mask)


def test_the_baseline_advances_only_on_commit() -> None:
    weights = {"a": torch.randn(1024).to(torch.bfloat16), "b": torch.randn(4, 4)}
    baseline = DeltaBaseline()
    with pytest.raises(RefitMismatchError, match="no committed baseline"):
        list(baseline.diff(weights.items()))
    assert list(baseline.stage_full(1, weights.items())) == list(weights.items())
    assert baseline.version is None  # staged, not committed
    baseline.commit()
    assert baseline.version == 1
    step = {"a": _changed(weights["a"], 3), "b": weights["b"].clone()}
    patches = list(baseline.diff(step.items()))
    assert [(p.name, p.base, p.encoding) for p in patches] == [("a", 1, "indices")]
    baseline.stage(2, patches)
    # Not committed (a failed sync): the next diff is still against version 1.
    assert [p.base for p in baseline.diff(step.items())] == [1]
    baseline.commit()
    assert baseline.version == 2 and list(baseline.diff(step.items())) == []
    with pytest.raises(RefitMismatchError, match="1 of the baseline's 2 tensors"):
        list(baseline.diff([("a", step["a"])]))
    baseline.invalidate()
    assert baseline.version is None


@pytest.mark.parametrize("changed", [3, 100, 250])
def test_the_wire_form_round_trips(changed: int) -> None:
    base = torch.randn(16, 16)
    patch = encode_patch("m.w", 4, _bits(base), _changed(base, changed))
    assert patch is not None
    meta, tensors = patch_to_wire(patch)
    shapes = wire_manifest([meta], {"m.w": ((16, 16), torch.float32)})
    assert shapes == {n: (tuple(t.shape), t.dtype) for n, t in tensors}
    back = patch_from_wire(meta, dict(tensors))
    assert isinstance(back, WeightPatch)
    assert (back.name, back.base, back.shape, back.encoding) == ("m.w", 4, (16, 16), patch.encoding)
    assert torch.equal(back.values, patch.values)
