"""The traced predictor's lazy chunks (fsdpbench/predictors/rank_chunks.py) are FSDP2's chunks: the same
views (shape, strides, storage offset), the same empty padding, the same length."""

from __future__ import annotations

import itertools

import pytest
import torch

from fsdpbench.predictors.rank_chunks import chunk_with_empty, rank_chunks_only

fsdp_common = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")


def _view(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_every_chunk_is_the_view_torch_chunk_makes(device: str) -> None:
    compared = 0
    for dim0, dim1, num_chunks, dim in itertools.product(
        [0, 1, 2, 3, 7, 8, 64, 100, 1023, 1024, 1025, 5000], [0, 1, 3], [1, 2, 3, 4, 7, 8, 64, 1024], [0, 1]
    ):
        tensor = torch.empty(dim0, dim1, device=device)
        expected = fsdp_common._chunk_with_empty(tensor, num_chunks, dim)
        got = chunk_with_empty(tensor, num_chunks, dim)
        assert len(got) == len(expected) == num_chunks
        assert [_view(c) for c in got] == [_view(c) for c in expected], (dim0, dim1, num_chunks, dim)
        assert [_view(c) for c in got[-3:]] == [_view(c) for c in expected[-3:]]
        compared += num_chunks
    assert compared > 10_000


def test_a_chunk_past_the_end_is_an_index_error() -> None:
    chunks = chunk_with_empty(torch.empty(10, device="meta"), 4, 0)
    with pytest.raises(IndexError):
        chunks[4]
    assert _view(chunks[-1]) == _view(chunks[3]) == ((1,), (1,), 9, torch.float32, torch.device("meta"))


def test_fsdp2_splits_with_the_lazy_chunks_only_inside_the_block() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param._chunk_with_empty
    with rank_chunks_only():
        assert _fsdp_param._chunk_with_empty is chunk_with_empty
    assert _fsdp_param._chunk_with_empty is original
