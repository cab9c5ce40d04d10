"""The per-bucket digests of ``verify=`` (``transports/_verify.py``, ``aiosync/_digest.py``):
what the sample always catches, what the full digest (the default) catches for certain
(any single flipped bit), that packing and loading digest alike, and the options refused."""

from __future__ import annotations

import pytest
import torch
import xxhash

from aiosync._digest import BlockDigest
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
from aiosync.transports.packing import pack, plan_buckets, unpack

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
    # Every byte, without drawing positions: XXH3 of the whole bucket.
    whole = xxhash.xxh3_64_intdigest(buffer.numpy().data, seed=nbytes)
    assert digest == (whole - (1 << 64) if whole >> 63 else whole)
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


# -- verify=True: the block-sum digest (aiosync/_digest.py) ----------------------------

#: A bucket as packing lays it out: 512-byte aligned slots, one ending mid-word, one
#: starting mid-block, an empty one, padding between them (never read).
BLOCK_SLOTS = [(0, 1000), (1024, 0), (1536, 9000 + 13), (11264, 4096 * 3), (24064, 6)]
BLOCK_NBYTES = 24064 + 6


def _reference(buffer: torch.Tensor, slots: list[tuple[int, int]]) -> int:
    """The digest by its definition, in Python integers: each slot cut at multiples of
    4096 into pieces; a piece at byte ``a`` weighs ``a / 4 + 1`` times the sum of its
    little-endian 64-bit words (the slot's last one zero-padded), modulo 2**64."""
    raw = bytes(buffer.tolist())
    total = 0
    for offset, nbytes in slots:
        start = offset
        while start < offset + nbytes:
            stop = min(offset + nbytes, (start // 4096 + 1) * 4096)
            piece = raw[start:stop] + bytes(-(stop - start) % 8)
            words = sum(int.from_bytes(piece[i : i + 8], "little") for i in range(0, len(piece), 8))
            total += (start // 4 + 1) * words
            start = stop
    total %= 1 << 64
    return total - (1 << 64) if total >> 63 else total


def test_the_full_digest_is_its_definition_over_the_slots_only() -> None:
    buffer = _bucket(11)[:BLOCK_NBYTES]
    digest = bucket_digest(buffer, True, slots=BLOCK_SLOTS)
    assert digest == _reference(buffer, BLOCK_SLOTS)
    padding = buffer.clone()
    padding[1000:1024] ^= 0xFF  # between slots: not a tensor's byte
    assert bucket_digest(padding, True, slots=BLOCK_SLOTS) == digest


def test_the_full_digest_catches_every_single_flipped_bit() -> None:
    buffer = _bucket(12)[:BLOCK_NBYTES]
    base = bucket_digest(buffer, True, slots=BLOCK_SLOTS)
    # Every bit of: every byte of the first tensor (it ends mid-word), each tensor's
    # first and last 16 bytes, 16 bytes either side of each block boundary, and a
    # sweep through the rest. No single flip goes unseen.
    bytes_ = set(range(1000))
    for offset, n in BLOCK_SLOTS[2:]:
        bytes_ |= set(range(offset, offset + min(n, 16))) | set(
            range(max(offset, offset + n - 16), offset + n)
        )
        bytes_ |= set(range(offset, offset + n, 61))
        for edge in range(-(-offset // 4096) * 4096, offset + n, 4096):
            bytes_ |= set(range(max(offset, edge - 16), min(offset + n, edge + 16)))
    for byte in sorted(bytes_):
        for bit in range(8):
            flipped = buffer.clone()
            flipped[byte] ^= 1 << bit
            assert bucket_digest(flipped, True, slots=BLOCK_SLOTS) != base, (byte, bit)


def test_the_full_digest_catches_swapped_shifted_and_stale_tensors() -> None:
    buffer = _bucket(13)[:BLOCK_NBYTES]
    slots = [(0, 4096), (4096, 4096), (8192, 8192)]
    base = bucket_digest(buffer, True, slots=slots)
    swapped = torch.cat([buffer[4096:8192], buffer[:4096], buffer[8192:]])
    shifted = torch.roll(buffer, 8)
    pages = buffer.clone()
    pages[8192:12288], pages[12288:16384] = buffer[12288:16384], buffer[8192:12288]
    stale = _bucket(14)[:BLOCK_NBYTES]
    for faulty in (swapped, shifted, pages, stale, torch.zeros_like(buffer)):
        assert bucket_digest(faulty, True, slots=slots) != base


def test_packing_chunk_by_chunk_and_loading_tensor_by_tensor_digest_alike() -> None:
    manifest = {
        "a": ((1000,), torch.uint8),
        "b": ((300, 1001), torch.bfloat16),  # 600,600 bytes: several chunks, a mid-block end
        "c": ((7,), torch.float32),
        "d": ((513, 1024), torch.bfloat16),
    }
    plan = plan_buckets(manifest, 1 << 20)
    gen = torch.Generator().manual_seed(15)
    tensors = {n: torch.randn(s, generator=gen).to(d) for n, (s, d) in manifest.items()}
    for bucket in plan.buckets:
        group = [(s.name, tensors[s.name]) for s in bucket.slots]
        packed = BlockDigest()
        buffer = pack(
            bucket, group, out=torch.zeros(bucket.nbytes, dtype=torch.uint8), digest=packed
        )
        loaded = BlockDigest()
        assert [n for n, _ in unpack(buffer, bucket, digest=loaded)] == [n for n, _ in group]
        assert loaded.pieces == len(bucket.slots)
        slots = [(s.offset, s.nbytes) for s in bucket.slots]
        assert packed.value() == loaded.value() == bucket_digest(buffer, True, slots=slots)
        views = [t.reshape(-1).view(torch.uint8) for _, t in group]
        offsets = [s.offset for s in bucket.slots]
        assert views_digest(views, True, offsets=offsets) == packed.value()
        assert packed.value() == _reference(buffer, slots)


def test_the_transit_fault_can_flip_a_single_bit() -> None:
    buffer = _bucket()
    original = buffer.clone()
    arm_transit_fault(0, 9, 0x40)
    transit_fault(buffer, 0)
    assert (buffer != original).nonzero().flatten().tolist() == [9]
    assert int(buffer[9]) == int(original[9]) ^ 0x40
    with pytest.raises(ValueError, match="mask must flip 1 to 8 bits"):
        arm_transit_fault(0, 9, 0x100)


def test_the_device_path_weighs_the_same_sums() -> None:
    # What a GPU runs (torch kernels, sums kept on the device, weighed once in value()),
    # exercised on host tensors: the same digest as the host path and the definition.
    buffer = _bucket(16)[:BLOCK_NBYTES]
    digest = BlockDigest()
    for offset, nbytes in BLOCK_SLOTS:
        digest._add_device_bytes(offset, buffer[offset : offset + nbytes])
    assert digest.value() == bucket_digest(buffer, True, slots=BLOCK_SLOTS)
    assert digest.value() == _reference(buffer, BLOCK_SLOTS)
