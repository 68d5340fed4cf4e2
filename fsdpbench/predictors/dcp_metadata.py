"""The bytes of DCP's ``.metadata`` file (rank 0), built as torch 2.13 builds it and pickled.

``FileSystemWriter.finish`` pickles (``pickle.dump``, the default protocol) one
``torch.distributed.checkpoint.metadata.Metadata``:

- ``state_dict_metadata``: per flattened key, in the global plan's order (rank 0's items after
  ``dedup_save_plans``, then each next rank's new ones), a ``TensorStorageMetadata`` (the tensor's
  properties, its global size and one ``ChunkStorageMetadata`` per rank that writes a piece of it) or a
  ``BytesStorageMetadata`` (a pickled object);
- ``planner_data``: every key's path in the state dict (``flatten_state_dict``'s mapping), merged over the
  ranks' plans through a ``ChainMap`` (the last rank's order);
- ``storage_data``: per written item, rank by rank in write order, its ``MetadataIndex`` (key, chunk
  offsets, chunk index) and ``_StorageInfo`` (file, offset, length in the rank's ``.distcp`` file);
- ``storage_meta``: ``StorageMeta(checkpoint_id=<the directory as a Path>, save_id=<a uuid4 string>)``;
- ``version``: ``CURRENT_DCP_VERSION``.

The objects are torch's own dataclasses and the pickle is the real one. Object identity matters (the
pickler writes a string it has seen as a 2-byte reference): the ranks' plans and write results reach the
coordinator through separate ``gather_object`` calls, so the keys of ``state_dict_metadata`` (rank 0's
plan), of ``planner_data`` (the last rank's, through the ``ChainMap``) and the ``MetadataIndex`` keys
(the write results) are distinct strings, and a parameter's name is its own string in the model's and in
the optimizer's paths; each file's name is one string per rank. Imports torch when called.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UUID4_CHARS = 36  # str(uuid.uuid4())


@dataclass(frozen=True)
class Item:
    """One item a rank writes: a tensor chunk (``offsets``/``local`` set) or a pickled object."""

    fqn: str
    path: tuple[str | int, ...]
    global_shape: tuple[int, ...] | None  # None: a pickled object (BytesStorageMetadata)
    offsets: tuple[int, ...] = ()
    local: tuple[int, ...] = ()
    length: int = 0  # its bytes in the .distcp file


def _fresh(text: str) -> str:
    """An equal string that is a new object (the pickler memoises by identity)."""
    return (text + ".")[:-1]


def metadata_bytes(
    items_by_rank: list[list[Item]], paths: list[tuple[str, tuple[str | int, ...]]], directory: Path
) -> int:
    """Bytes of ``.metadata`` for the items each rank writes (in its write order) and every key's path
    (``paths``: the parameters' names in it are new strings per path, as the state dicts' keys are)."""
    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for rank, items in enumerate(items_by_rank):
        relative_path = f"__{rank}_0.distcp"
        offset = 0
        for item in items:
            if item.global_shape is None:
                md[_fresh(item.fqn)] = BytesStorageMetadata()
                index = MetadataIndex(_fresh(item.fqn))
            else:
                tensor_md = md.get(item.fqn) or md.setdefault(
                    _fresh(item.fqn),
                    TensorStorageMetadata(
                        properties=TensorProperties(dtype=torch.float32),
                        size=torch.Size(item.global_shape),
                        chunks=[],
                    ),
                )
                index = MetadataIndex(_fresh(item.fqn), torch.Size(item.offsets), len(tensor_md.chunks))
                tensor_md.chunks.append(
                    ChunkStorageMetadata(offsets=torch.Size(item.offsets), sizes=torch.Size(item.local))
                )
            storage[index] = _StorageInfo(relative_path=relative_path, offset=offset, length=item.length)
            offset += item.length
    metadata = Metadata(
        state_dict_metadata=md,
        planner_data={_fresh(fqn): path for fqn, path in paths},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=directory, save_id="0" * UUID4_CHARS),
        version=CURRENT_DCP_VERSION,
    )
    return len(pickle.dumps(metadata))
