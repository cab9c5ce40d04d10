"""The per-bucket digests of ``verify=`` (``transports/_verify.py``): what the default
sample always catches, what only the full digest does, and the options refused."""

from __future__ import annotations

import pytest
import torch

from aiosync.transports._verify import (
    SAMPLE_BYTES,
    arm_transit_fault,
    bucket_digest,
    check_verify,
    sample_key,
    sample_positions,
    transit_fault,
    views_digest,
)

SLOTS = [(0, 4096), (4096, 0), (4160, 1 << 20)]  # a 64-byte gap: packing's alignment
NBYTES = 4160 + (1 << 20)


def _bucket(seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _flipped(buffer: torch.Tensor, byte: int) -> torch.Tensor:
    out = buffer.clone()
    out[byte] ^= 0xFF
    return out


def test_the_sample_holds_every_slot_end_and_a_fresh_draw_per_key() -> None:
    positions = sample_positions(NBYTES, sample_key(3, 1), SLOTS)
    assert {0, 4095, 4160, NBYTES - 1} <= set(positions.tolist())
    assert positions.numel() <= SAMPLE_BYTES + 4
    assert torch.equal(positions, positions.sort().values)
    other = sample_positions(NBYTES, sample_key(4, 1), SLOTS)
    assert not torch.equal(positions, other)


@pytest.mark.parametrize("byte", [0, 4095, 4160, NBYTES - 1])
def test_the_sample_catches_a_flip_at_any_tensor_end(byte: int) -> None:
    buffer = _bucket()
    key = sample_key(2, 0)
    assert bucket_digest(buffer.clone(), "sample", key=key, slots=SLOTS) == bucket_digest(
        buffer, "sample", key=key, slots=SLOTS
    )
    assert bucket_digest(_flipped(buffer, byte), "sample", key=key, slots=SLOTS) != (
        bucket_digest(buffer, "sample", key=key, slots=SLOTS)
    )


def test_the_sample_catches_bulk_faults_and_the_full_digest_a_lone_byte() -> None:
    buffer = _bucket()
    key = sample_key(5, 2)
    base = bucket_digest(buffer, "sample", key=key, slots=SLOTS)
    zeroed = buffer.clone()
    zeroed[4160 + 1000 : 4160 + 200_000] = 0  # part of a tensor zeroed (a stale page)
    shifted = torch.roll(buffer, 64)  # tensors at the wrong offsets
    assert bucket_digest(zeroed, "sample", key=key, slots=SLOTS) != base
    assert bucket_digest(shifted, "sample", key=key, slots=SLOTS) != base
    # A byte the sample does not hold: only the full digest sees it.
    held = set(sample_positions(NBYTES, key, SLOTS).tolist())
    lone = next(b for b in range(4160 + 10, NBYTES) if b not in held)
    assert bucket_digest(_flipped(buffer, lone), "sample", key=key, slots=SLOTS) == base
    assert bucket_digest(_flipped(buffer, lone), True) != bucket_digest(buffer, True)


@pytest.mark.parametrize("verify", ["sample", True])
def test_unpacked_views_digest_as_their_packed_bucket(verify: bool | str) -> None:
    a, b = _bucket(1)[:1000], _bucket(2)[:5000]
    empty = torch.empty(0, dtype=torch.uint8)
    packed = torch.cat([a, empty, b])
    slots = [(0, 1000), (1000, 0), (1000, 5000)]
    assert views_digest([a, empty, b], verify, key=9) == bucket_digest(  # type: ignore[arg-type]
        packed,
        verify,  # type: ignore[arg-type]
        key=9,
        slots=slots,
    )
    assert views_digest([a, empty, _flipped(b, 0)], verify, key=9) != views_digest(  # type: ignore[arg-type]
        [a, empty, b],
        verify,  # type: ignore[arg-type]
        key=9,
    )


@pytest.mark.parametrize("nbytes", [1, 100, SAMPLE_BYTES])
def test_a_bucket_of_at_most_the_sample_size_samples_and_digests_every_byte(nbytes: int) -> None:
    buffer = _bucket(3)[:nbytes]
    slots = [(0, nbytes)]
    key = sample_key(7, 0)
    assert sample_positions(nbytes, key, slots).tolist() == list(range(nbytes))
    digest = bucket_digest(buffer, "sample", key=key, slots=slots)
    assert digest == bucket_digest(buffer, True)
    assert views_digest([buffer[: nbytes // 2], buffer[nbytes // 2 :]], "sample", key=key) == digest
    assert bucket_digest(_flipped(buffer, nbytes // 2), "sample", key=key, slots=slots) != digest


def test_the_transit_fault_flips_one_byte_once() -> None:
    buffer = _bucket()
    original = buffer.clone()
    arm_transit_fault(3, 17)
    transit_fault(buffer, 2)  # another bucket: untouched
    assert torch.equal(buffer, original)
    transit_fault(buffer, 3)
    assert (buffer != original).nonzero().flatten().tolist() == [17]
    assert int(buffer[17]) == int(original[17]) ^ 0xFF
    transit_fault(buffer, 3)  # one-shot
    assert (buffer != original).nonzero().flatten().tolist() == [17]


@pytest.mark.parametrize("bad", ["full", 1, 0, None, "True"])
def test_only_true_false_and_sample_are_options(bad: object) -> None:
    with pytest.raises(ValueError, match="verify must be True, False or 'sample'"):
        check_verify(bad)
    assert [check_verify(v) for v in (True, False, "sample")] == [True, False, "sample"]
