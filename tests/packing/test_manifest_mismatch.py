"""Manifest mismatches (renamed, reshaped, re-typed, reordered) raise before any data moves."""

from __future__ import annotations

import pytest
import torch

from aiosync import RefitMismatchError
from aiosync.transports._verify import bucket_digest
from aiosync.transports.packing import (
    BucketPlan,
    compare_manifests,
    dtype_from_name,
    group_by_bucket,
    pack,
    plan_buckets,
    unpack,
)

Manifest = dict[str, tuple[tuple[int, ...], torch.dtype]]

BASE: Manifest = {
    "model.embed_tokens.weight": ((128, 64), torch.bfloat16),
    "model.layers.0.self_attn.q_proj.weight": ((128, 64), torch.bfloat16),
    "model.layers.0.input_layernorm.weight": ((64,), torch.float32),
    "model.norm.weight": ((64,), torch.float32),
}


def _renamed() -> Manifest:
    m = dict(BASE)
    m["model.layers.0.self_attn.qkv_proj.weight"] = m.pop("model.layers.0.self_attn.q_proj.weight")
    return m


def _reshaped() -> Manifest:
    return {**BASE, "model.norm.weight": ((32,), torch.float32)}


def _retyped() -> Manifest:
    return {**BASE, "model.norm.weight": ((64,), torch.bfloat16)}


def _reordered() -> Manifest:
    names = list(BASE)
    names[1], names[2] = names[2], names[1]
    return {n: BASE[n] for n in names}


VARIANTS = {
    "renamed": (_renamed, "model.layers.0.self_attn.qkv_proj.weight"),
    "reshaped": (_reshaped, "model.norm.weight"),
    "retyped": (_retyped, "model.norm.weight"),
    "reordered": (_reordered, "model.layers.0.input_layernorm.weight"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compare_manifests_names_the_first_difference(variant: str) -> None:
    make, culprit = VARIANTS[variant]
    with pytest.raises(RefitMismatchError, match=culprit.replace(".", r"\.")):
        compare_manifests(BASE, make())
    with pytest.raises(RefitMismatchError):
        compare_manifests(make(), BASE)


def test_compare_manifests_reports_both_sides_of_a_rename() -> None:
    with pytest.raises(RefitMismatchError) as info:
        compare_manifests(BASE, _renamed(), local_label="trainer", remote_label="engine")
    message = str(info.value)
    assert "unknown to the engine" in message and "q_proj" in message
    assert "missing from the trainer" in message and "qkv_proj" in message


def test_identical_manifests_compare_equal() -> None:
    compare_manifests(BASE, dict(BASE))
    assert plan_buckets(BASE, 4096).digest == plan_buckets(dict(BASE), 4096).digest


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bucket_plan_digest_differs_and_from_json_refuses(variant: str) -> None:
    make, _ = VARIANTS[variant]
    ours = plan_buckets(BASE, 16 * 1024)
    theirs = plan_buckets(make(), 16 * 1024)
    assert ours.digest != theirs.digest
    # The engine re-derives the plan from what the trainer sent plus the trainer's
    # digest: a different manifest under the trainer's digest is refused.
    forged = {**theirs.to_json(), "digest": ours.digest}
    with pytest.raises(RefitMismatchError, match="digest mismatch"):
        BucketPlan.from_json(forged)


def test_bucket_size_is_part_of_the_digest() -> None:
    assert plan_buckets(BASE, 16 * 1024).digest != plan_buckets(BASE, 32 * 1024).digest


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stream_that_differs_from_the_plan_raises_before_its_bucket_is_packed(
    variant: str,
) -> None:
    make, _ = VARIANTS[variant]
    plan = plan_buckets(BASE, 1 << 20)  # one bucket: nothing may be yielded
    stream = [(n, torch.zeros(s, dtype=d)) for n, (s, d) in make().items()]
    packed: list[int] = []
    with pytest.raises(RefitMismatchError):
        for bucket, group in group_by_bucket(stream, plan):
            packed.append(pack(bucket, group).numel())
    assert packed == []


def test_source_shorter_or_longer_than_the_plan_raises() -> None:
    plan = plan_buckets(BASE, 1 << 20)
    full = [(n, torch.zeros(s, dtype=d)) for n, (s, d) in BASE.items()]
    with pytest.raises(RefitMismatchError, match="ended before"):
        list(group_by_bucket(full[:-1], plan))
    with pytest.raises(RefitMismatchError, match="not in the manifest"):
        list(group_by_bucket([*full, ("extra", torch.zeros(1))], plan))


def test_malformed_plans_and_buffers_raise_mismatch() -> None:
    plan = plan_buckets(BASE, 1 << 20)
    with pytest.raises(RefitMismatchError, match="malformed"):
        BucketPlan.from_json({"manifest": [], "digest": plan.digest})
    with pytest.raises(RefitMismatchError, match="unknown dtype"):
        dtype_from_name("float3")
    bucket = plan.buckets[0]
    with pytest.raises(RefitMismatchError):
        next(unpack(torch.zeros(bucket.nbytes - 1, dtype=torch.uint8), bucket))
    with pytest.raises(RefitMismatchError):
        next(unpack(torch.zeros(bucket.nbytes, dtype=torch.int8), bucket))


def test_pack_refuses_a_short_out_buffer_before_copying() -> None:
    plan = plan_buckets(BASE, 1 << 20)
    bucket = plan.buckets[0]
    group = [(n, torch.ones(s, dtype=d)) for n, (s, d) in BASE.items()]
    out = torch.zeros(bucket.nbytes - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        pack(bucket, group, out=out)
    assert int(out.sum()) == 0


def test_full_digest_sees_a_changed_or_moved_byte() -> None:
    buffer = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    base = bucket_digest(buffer, True)
    changed = buffer.clone()
    changed[100] += 1
    swapped = buffer.clone()
    swapped[[1, 2]] = swapped[[2, 1]]
    assert bucket_digest(buffer.clone(), True) == base
    assert bucket_digest(changed, True) != base
    assert bucket_digest(swapped, True) != base
    # The same bytes but one fewer: another digest.
    assert bucket_digest(buffer[:-1], True) != base


def test_a_dtype_only_mismatch_names_both_dtypes_and_the_fix() -> None:
    trainer = {"model.w": ((2,), torch.float32), "lm_head.weight": ((2,), torch.float32)}
    engine = {name: (shape, torch.bfloat16) for name, (shape, _) in trainer.items()}
    with pytest.raises(RefitMismatchError) as info:
        compare_manifests(trainer, engine)
    assert str(info.value).endswith(
        "hint: every differing tensor is float32 on the trainer and bfloat16 on the engine: "
        "make them agree, on the trainer with DTensorRefitSource(model, dtype=torch.<engine "
        "dtype>) or with the engine's dtype"
    )


def test_names_that_differ_by_a_common_prefix_say_which_prefix() -> None:
    engine = {"model.w": ((2,), torch.float32), "lm_head.weight": ((2,), torch.float32)}
    trainer = {f"lm.{name}": spec for name, spec in engine.items()}
    with pytest.raises(RefitMismatchError, match=r"differs only by the prefix 'lm\.'"):
        compare_manifests(trainer, engine)
    # A rename that is not a prefix gets no prefix hint.
    renamed = {"model.v": ((2,), torch.float32), "lm_head.weight": ((2,), torch.float32)}
    with pytest.raises(RefitMismatchError) as info:
        compare_manifests(renamed, engine)
    assert "prefix" not in str(info.value)


def test_a_head_only_the_trainer_has_says_the_tie_is_broken() -> None:
    tied_engine = dict(BASE)
    trainer = {**BASE, "lm_head.weight": ((128, 64), torch.bfloat16)}
    with pytest.raises(RefitMismatchError) as info:
        compare_manifests(trainer, tied_engine)
    assert str(info.value) == (
        "refit manifest mismatch: 1 name(s) unknown to the engine, first: ['lm_head.weight']; "
        "hint: the trainer has lm_head.weight as a tensor of its own, the engine ties it to the "
        "input embedding (tie_word_embeddings=True): the tie is broken (lm_head replaced or "
        "re-wrapped after tie_weights(), see DTensorRefitSource.broken_ties) or the configs "
        "disagree. Its values are not dropped silently: re-tie it (model.tie_weights()) or set "
        "tie_word_embeddings=False on both sides"
    )


def test_a_head_only_the_engine_has_says_to_match_the_tie_setting() -> None:
    engine = {**BASE, "language_model.lm_head.weight": ((128, 64), torch.bfloat16)}
    with pytest.raises(RefitMismatchError) as info:
        compare_manifests(BASE, engine)
    assert str(info.value).endswith(
        "hint: the engine has language_model.lm_head.weight of its own, the trainer ties it to "
        "the input embedding and sends that once: set tie_word_embeddings the same on both sides"
    )
    # A head among other renames is no tie question.
    renamed = {**_renamed(), "lm_head.weight": ((128, 64), torch.bfloat16)}
    with pytest.raises(RefitMismatchError) as info:
        compare_manifests(BASE, renamed)
    assert "tie" not in str(info.value)
