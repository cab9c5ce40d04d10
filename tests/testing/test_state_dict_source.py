"""``aiosync.testing.StateDictSource``: a dict of tensors as a refit source, exactly."""

from __future__ import annotations

import pytest
import torch

from aiosync import RefitMismatchError, RefitSource
from aiosync.testing import StateDictSource


def test_the_manifest_is_the_dicts_order_shapes_and_dtypes() -> None:
    source = StateDictSource(
        {"b": torch.zeros(2, dtype=torch.bfloat16), "a.weight": torch.ones(3, 4)}
    )
    assert isinstance(source, RefitSource)
    assert list(source.prepare_refit_info().items()) == [
        ("b", ((2,), torch.bfloat16)),
        ("a.weight", ((3, 4), torch.float32)),
    ]


def test_the_stream_is_the_held_tensors_so_an_in_place_step_is_what_syncs_next() -> None:
    w = torch.zeros(4)
    source = StateDictSource({"w": w})
    w.add_(2.0)
    ((name, sent),) = list(source.iter_weights())
    assert name == "w" and sent is w
    assert torch.equal(sent, torch.full((4,), 2.0))


def test_update_swaps_a_tensor_and_refuses_another_shape_or_dtype() -> None:
    source = StateDictSource({"w": torch.zeros(2, 3)})
    new = torch.ones(2, 3)
    source.update("w", new)
    assert dict(source.iter_weights())["w"] is new
    with pytest.raises(RefitMismatchError, match=r"'w': the manifest says \(2, 3\) torch.float32"):
        source.update("w", torch.ones(3, 2))
    with pytest.raises(RefitMismatchError, match=r"got \(2, 3\) torch.float16"):
        source.update("w", torch.ones(2, 3, dtype=torch.float16))
    with pytest.raises(KeyError, match="missing"):
        source.update("missing", new)
    assert source.prepare_refit_info() == {"w": ((2, 3), torch.float32)}


def test_the_state_dict_view_is_read_only() -> None:
    source = StateDictSource({"w": torch.zeros(1)})
    with pytest.raises(TypeError):
        source.state_dict["w"] = torch.ones(1)  # type: ignore[index]


def test_what_is_not_a_tensor_in_checkpoint_names_is_refused() -> None:
    with pytest.raises(TypeError, match=r"'w': expected a torch.Tensor, got list"):
        StateDictSource({"w": [1.0]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="names must be str, got 0"):
        StateDictSource({0: torch.zeros(1)})  # type: ignore[dict-item]


def test_random_gives_the_manifest_and_the_same_bytes_for_the_same_seed() -> None:
    manifest = {"e": ((5, 3), torch.bfloat16), "n": ((3,), torch.float32)}
    first = StateDictSource.random(manifest, seed=7)
    assert first.prepare_refit_info() == manifest
    again, other = StateDictSource.random(manifest, seed=7), StateDictSource.random(manifest)
    for name in manifest:
        assert torch.equal(first.state_dict[name], again.state_dict[name])
        assert not torch.equal(first.state_dict[name], other.state_dict[name])
    gen = torch.Generator().manual_seed(7)
    expected_e = torch.randn((5, 3), generator=gen).to(torch.bfloat16)
    assert torch.equal(first.state_dict["e"], expected_e)


def test_an_empty_dict_is_a_source_of_nothing() -> None:
    source = StateDictSource({})
    assert source.prepare_refit_info() == {}
    assert list(source.iter_weights()) == []
