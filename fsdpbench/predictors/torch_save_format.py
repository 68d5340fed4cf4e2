"""The bytes ``torch.save`` writes, as the installed torch (2.13) lays them out, without torch.

A ``torch.save`` file is a zip archive (``caffe2/serialize/inline_container.cc``, miniz, stored, not
compressed) of these records, in this order: ``data.pkl`` (the pickled object, tensors as persistent ids
of their storages), ``.format_version`` ("1"), ``.storage_alignment`` ("64"), ``byteorder`` ("little"),
``data/<key>`` (one per storage, its bytes), ``version`` ("3\\n"), ``.data/serialization_id`` (40 digits).
Each record's name is prefixed by the archive name (the file's stem, or "archive" for a stream).

Per record: a 30-byte local header + the name + an extra field "FB" (4 bytes + padding) that aligns
the data to 64 bytes, the data, and a 16-byte data descriptor (miniz streams the sizes after the data).
Then the central directory (46 bytes + the name per record), the zip64 end of central directory (56),
its locator (20) and the end of central directory (22). Files or offsets past 4 GiB add zip64 fields.

``pickled_size`` pickles a stand-in of the saved object with the same opcodes torch's pickler emits
(protocol 2; ``torch._utils._rebuild_tensor_v2`` per tensor, each storage a persistent id).
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALIGNMENT = 64  # kFieldAlignment
LOCAL_HEADER = 30
DATA_DESCRIPTOR = 16
DATA_DESCRIPTOR_ZIP64 = 24
CENTRAL_HEADER = 46
END_RECORDS = 56 + 20 + 22  # zip64 end of central directory, its locator, end of central directory
ZIP32_MAX = 0xFFFFFFFF
SERIALIZATION_ID_CHARS = 40
PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL

# numpy-style dtype name -> (torch's legacy storage class, bytes per element)
STORAGE_CLASSES = {
    "float32": ("FloatStorage", 4),
    "float64": ("DoubleStorage", 8),
    "float16": ("HalfStorage", 2),
    "bfloat16": ("BFloat16Storage", 2),
    "int64": ("LongStorage", 8),
    "int32": ("IntStorage", 4),
    "bool": ("BoolStorage", 1),
    "uint8": ("ByteStorage", 1),
}


def zip_bytes(records: list[tuple[str, int]]) -> int:
    """Size of a torch.save zip archive of (name, data bytes) records, in order."""
    cursor = 0
    central = 0
    for name, size in records:
        name_len = len(name.encode())
        start = cursor + LOCAL_HEADER + name_len + 4  # the "FB" extra field's own header
        big = size >= ZIP32_MAX or cursor >= ZIP32_MAX
        if big:  # zip64 extended information in the local header
            start += 4 + (16 if size >= ZIP32_MAX else 0) + (8 if cursor >= ZIP32_MAX else 0)
        start += (-start) % ALIGNMENT
        cursor = start + size + (DATA_DESCRIPTOR_ZIP64 if big else DATA_DESCRIPTOR)
        central += CENTRAL_HEADER + name_len + (4 + 8 * 3 if big else 0)
    return cursor + central + END_RECORDS


def archive_records(archive: str, pickle_bytes: int, storage_bytes: list[int]) -> list[tuple[str, int]]:
    """The records of one torch.save archive, in the order torch writes them."""
    records = [
        (f"{archive}/data.pkl", pickle_bytes),
        (f"{archive}/.format_version", 1),
        (f"{archive}/.storage_alignment", 2),
        (f"{archive}/byteorder", len("little")),
    ]
    records += [(f"{archive}/data/{key}", size) for key, size in enumerate(storage_bytes)]
    records += [(f"{archive}/version", 2), (f"{archive}/.data/serialization_id", SERIALIZATION_ID_CHARS)]
    return records


# ---- stand-ins pickled the way torch pickles the real objects -----------------------------------------


@dataclass(frozen=True)
class Global:
    """A module-level name the pickle refers to (GLOBAL opcode), without importing it."""

    module: str
    name: str

    def __call__(self, *args: Any) -> Any:  # a pickled reduce needs a callable; never called
        raise TypeError(f"{self.module}.{self.name} is a stand-in")


REBUILD_TENSOR = Global("torch._utils", "_rebuild_tensor_v2")
REBUILD_FROM_TYPE = Global("torch._tensor", "_rebuild_from_type_v2")
TORCH_TENSOR = Global("torch", "Tensor")
TORCH_SIZE = Global("torch", "Size")


class Storage:
    """A tensor's storage: saved once, as a persistent id, however many tensors view it."""

    def __init__(self, dtype: str, numel: int) -> None:
        self.dtype, self.numel = dtype, numel

    @property
    def nbytes(self) -> int:
        return self.numel * STORAGE_CLASSES[self.dtype][1]


class Tensor:
    """A contiguous tensor of ``shape`` viewing ``storage`` (its own, of exactly its size, by default) from
    element ``offset``; ``requires_grad`` as the saved tensor has it (a leaf that requires grad)."""

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        storage: Storage | None = None,
        offset: int = 0,
        requires_grad: bool = False,
    ) -> None:
        numel = 1
        for d in shape:
            numel *= d
        self.dtype, self.shape = dtype, tuple(shape)
        self.storage = storage or Storage(dtype, numel)
        self.offset, self.requires_grad = offset, requires_grad

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def stride(self) -> tuple[int, ...]:
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Tensor._reduce_ex_internal: storage, offset, size, stride, requires_grad, backward hooks
        hooks: collections.OrderedDict[str, Any] = collections.OrderedDict()
        # a new size tuple per tensor, as tuple(tensor.size()) is: never memoised across tensors
        size = tuple(list(self.shape))
        return (REBUILD_TENSOR, (self.storage, self.offset, size, self.stride(), self.requires_grad, hooks))


class TypedTensor(Tensor):
    """A tensor carrying Python attributes (``state``, e.g. DeepSpeed's ``ds_id``): ``Tensor.__reduce_ex__``
    wraps its rebuild in ``torch._tensor._rebuild_from_type_v2(func, type, args, state)``."""

    def __init__(self, dtype: str, shape: tuple[int, ...], state: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(dtype, shape, **kwargs)
        self.state = state

    def __reduce_ex__(self, protocol: Any) -> Any:
        func, args = super().__reduce_ex__(protocol)
        return (REBUILD_FROM_TYPE, (func, TORCH_TENSOR, args, self.state))


class Reduced:
    """An object pickled as ``callable(*args)`` (REDUCE): ``torch.Size``, an enum member."""

    def __init__(self, func: Global, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (self.func, self.args)


class Instance:
    """An instance of a plain class pickled by protocol 2's default: NEWOBJ of the class, then BUILD of
    its ``__dict__`` (a dataclass, a loss scaler)."""

    def __init__(self, cls: Global, state: dict[str, Any]) -> None:
        self.cls, self.state = cls, state


def torch_size(shape: tuple[int, ...]) -> Reduced:
    """``torch.Size(shape)`` as pickled: ``torch.Size((d0, d1, ...))``."""
    return Reduced(TORCH_SIZE, (tuple(list(shape)),))


# torch.save's persistent id strings are literals in torch/serialization.py: one object each, so the
# pickler memoises them after their first use, as it does these
_STORAGE_TAG = "storage"
_LOCATION = "cpu"


class _StandInPickler(pickle._Pickler):  # the pure-Python pickler: its save() can be extended
    # its internals, which typeshed does not declare
    memo: dict[int, tuple[int, Any]]
    write: Callable[[bytes], Any]
    get: Callable[[int], bytes]
    memoize: Callable[[Any], None]

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.storages: list[Storage] = []
        self._keys: dict[int, str] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, Storage):
            return None
        key = self._keys.get(id(obj))
        if key is None:
            key = self._keys[id(obj)] = str(len(self._keys))
            self.storages.append(obj)
        storage_class = Global("torch", STORAGE_CLASSES[obj.dtype][0])
        return (_STORAGE_TAG, self._global(storage_class), key, _LOCATION, obj.numel)

    _globals: dict[Global, Global]

    def _global(self, g: Global) -> Global:
        # one object per name, as the real classes are one object each (memoised after first use)
        cache = self.__dict__.setdefault("_globals", {})
        return cache.setdefault(g, g)

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, Global):
            obj = self._global(obj)
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
                return
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.memoize(obj)
            return
        if isinstance(obj, Instance):  # save_reduce of copyreg.__newobj__: class, (), NEWOBJ, state, BUILD
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
                return
            self.save(obj.cls)
            self.save(())
            self.write(pickle.NEWOBJ)
            self.memoize(obj)
            self.save(obj.state)
            self.write(pickle.BUILD)
            return
        super().save(obj, save_persistent_id)  # type: ignore[misc]  # _Pickler.save: undeclared in typeshed


def pickled(obj: Any) -> tuple[int, list[Storage]]:
    """(bytes of data.pkl, the storages in key order) for a stand-in object graph."""
    buffer = io.BytesIO()
    pickler = _StandInPickler(buffer)
    pickler.dump(obj)
    return len(buffer.getvalue()), pickler.storages


def torch_save_bytes(obj: Any, archive: str = "archive") -> int:
    """Bytes of ``torch.save(obj, f)`` for a stand-in graph; ``archive``: the file's stem ("archive"
    when saved to a stream)."""
    if type(obj) is Tensor and not obj.offset and not obj.requires_grad:  # one tensor alone (a DCP item)
        return _tensor_archive_bytes(obj.dtype, obj.shape, obj.storage.numel, archive)
    pickle_bytes, storages = pickled(obj)
    return zip_bytes(archive_records(archive, pickle_bytes, [s.nbytes for s in storages]))


@functools.lru_cache(maxsize=4096)
def _tensor_archive_bytes(dtype: str, shape: tuple[int, ...], storage_numel: int, archive: str) -> int:
    pickle_bytes, storages = pickled(Tensor(dtype, shape, Storage(dtype, storage_numel)))
    return zip_bytes(archive_records(archive, pickle_bytes, [s.nbytes for s in storages]))


def payload_bytes(graph: Any, seen: set[int] | None = None) -> int:
    """The bytes of the storages a state dict's stand-in holds, each storage once: what ``torch.save``
    writes of them, and what they occupy in memory, however many tensors view one."""
    seen = set() if seen is None else seen
    if isinstance(graph, dict):
        return sum(payload_bytes(v, seen) for v in graph.values())
    if isinstance(graph, list):
        return sum(payload_bytes(v, seen) for v in graph)
    if isinstance(graph, Tensor) and id(graph.storage) not in seen:
        seen.add(id(graph.storage))
        return graph.storage.nbytes
    return 0
