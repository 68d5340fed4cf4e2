"""FSDP2 takes its rank's shard of every parameter by splitting the parameter into world-size chunks
(``_fsdp_common._chunk_with_empty``: ``torch.chunk``, one view per rank). A traced rank of a large world
pays for views it never reads: llama-70b on 1,024 ranks splits 723 parameters twice into 1,024 views,
about 1 s of a 10 s trace. ``rank_chunks_only`` swaps in a sequence that makes a chunk only when FSDP2
indexes it: the same views (``torch.chunk`` narrows each chunk from the same start), the same padding
with empty tensors past the last chunk, the same length (tests/test_rank_chunks.py compares them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch


class RankChunks(Sequence):
    """``torch.chunk(tensor, num_chunks, dim)`` padded to ``num_chunks`` with empty tensors, made lazily."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self._tensor, self._num_chunks, self._dim = tensor, num_chunks, dim
        self._size = tensor.size(dim)
        self._chunk_size = math.ceil(self._size / num_chunks)  # what torch.chunk uses
        self._real_chunks = math.ceil(self._size / self._chunk_size)

    def __len__(self) -> int:
        return self._num_chunks

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._num_chunks))]
        if index < 0:
            index += self._num_chunks
        if not 0 <= index < self._num_chunks:
            raise IndexError(f"chunk {index} of {self._num_chunks}")
        if index >= self._real_chunks:
            return self[0].new_empty(0)  # as _chunk_with_empty pads
        start = index * self._chunk_size
        return self._tensor.narrow(self._dim, start, min(self._chunk_size, self._size - start))


def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
    """A drop-in for FSDP2's ``_chunk_with_empty``; a dimension of size 0 (torch.chunk then returns
    ``num_chunks`` empty views) goes to torch.chunk itself."""
    if tensor.size(dim) == 0:
        chunks = list(torch.chunk(tensor, num_chunks, dim=dim))
        while len(chunks) < num_chunks:
            chunks.append(chunks[0].new_empty(0))
        return chunks
    return RankChunks(tensor, num_chunks, dim)


@contextlib.contextmanager
def rank_chunks_only() -> Iterator[None]:
    """FSDP2's parameters split with ``chunk_with_empty`` inside the block (where this torch has the hook:
    otherwise nothing changes)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = chunk_with_empty  # type: ignore[assignment]  # indexed only, never mutated
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original
