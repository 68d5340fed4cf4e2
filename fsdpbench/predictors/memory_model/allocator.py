"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, torch 2.11): replay
one step's allocation stream and get what the allocator would report — peak allocated, peak reserved,
fragmentation — and, under a memory limit, whether and where it runs out of memory.

Pure Python, no torch: a stream of ``Malloc``/``Free`` events (``alloc_stream.py`` builds them) goes through
``CachingAllocator``, which keeps the same state the C++ allocator keeps:

- sizes round up to 512 B (``kMinBlockSize``; ``roundup_power2_divisions`` rounds to power-of-two
  divisions instead, off by default);
- requests ≤ 1 MiB (``kSmallSize``) come from the small pool, carved out of 2 MiB segments
  (``kSmallBuffer``); larger ones from the large pool: a request under 10 MiB (``kMinLargeAlloc``) opens a
  20 MiB segment (``kLargeBuffer``), a larger one a segment of its size rounded up to 2 MiB (``kRoundLarge``);
- free blocks are kept per pool, ordered by (stream, size, address); a request takes the smallest free
  block of its own stream that fits (best fit; a block freed on one stream is never reused by another);
- the block found is split when what is left is a block worth keeping: ≥ 512 B in the small pool (and in
  expandable segments), > 1 MiB in the large pool, and never for blocks ≥ ``max_split_size_mb`` (such
  oversize blocks only serve requests within 20 MiB of their size); a freed block merges with free
  neighbours of its segment;
- when no cached block fits, a new segment is reserved (``cudaMalloc``); under a limit that fails once
  reserved + the segment would pass the limit; the allocator then frees oversize cached blocks
  (``release_available_cached_blocks``, with ``max_split_size_mb`` only), then every cached segment that
  is wholly free (``release_cached_blocks``) and retries once; failing that, it is an out-of-memory error;
- ``expandable_segments:True``: one segment per stream and pool that grows by mapping pages (2 MiB small,
  20 MiB large) at its end and unmaps wholly free pages before an out-of-memory error; every split is kept;
- ``garbage_collection_threshold:t`` (with a memory fraction set, as PyTorch requires): before reserving a
  segment beyond t × the limit, free the cached whole segments that have waited longest first;
- a block freed while recorded on another stream (``record_stream``) goes back to its pool only when that
  stream's work is done: here, at the next allocation (the GPU assumed caught up with the CPU by then).

What it does not model: CUDA graphs' private pools, IPC, the free-memory callbacks, and the driver's own
memory (the CUDA context, NCCL's buffers: ``nvml.py``). ``max_memory_allocated`` counts block sizes (a
request the allocator does not split counts its whole block), as the allocator's stats do.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

# kMinBlockSize: every allocation rounds up to this, and PyTorch's trackers count a CUDA storage so too
CUDA_BLOCK_BYTES = 512


def cuda_storage_bytes(nbytes: int) -> int:
    """What a CUDA storage of ``nbytes`` occupies: whole 512-byte blocks (none for an empty one)."""
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


KSMALL_SIZE = 1 << 20  # kSmallSize: the largest "small" request
KSMALL_BUFFER = 2 << 20  # kSmallBuffer: small requests are packed in 2 MiB segments
KMIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests under 10 MiB may share a kLargeBuffer segment
KLARGE_BUFFER = 20 << 20  # kLargeBuffer
KROUND_LARGE = 2 << 20  # kRoundLarge: larger segments round up to 2 MiB
UNLIMITED = 1 << 62  # max_split_size's default (SIZE_MAX): no block is "oversize"


# ---- settings ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AllocConf:
    """``PYTORCH_CUDA_ALLOC_CONF``'s settings that shape memory (torch's defaults)."""

    max_split_size: int = UNLIMITED  # bytes (max_split_size_mb)
    roundup_power2_divisions: int = 0  # one value for every size (the per-interval list is not modelled)
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False

    def describe(self) -> str:
        """The settings as PYTORCH_CUDA_ALLOC_CONF spells them ("" for the defaults)."""
        parts = []
        if self.max_split_size != UNLIMITED:
            parts.append(f"max_split_size_mb:{self.max_split_size >> 20}")
        if self.roundup_power2_divisions:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        return ",".join(parts)


# what each key accepts, as CUDAAllocatorConfig parses it
ALLOC_CONF_KEYS = (
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
)


# PyTorch's keys that do not change device memory: accepted, ignored
_IGNORED_KEYS = (
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
)


def parse_alloc_conf(text: str | None) -> AllocConf:
    """``"expandable_segments:True,max_split_size_mb:128"`` → AllocConf; ValueError naming the bad part.

    Keys are those of CUDAAllocatorConfig: max_split_size_mb (> 20, as PyTorch requires),
    roundup_power2_divisions (a power of two), garbage_collection_threshold (in (0, 1)),
    expandable_segments (True/False). Other PyTorch keys (backend, pinned_*, release_lock_on_cudamalloc)
    do not change device memory and are accepted and ignored."""
    conf = AllocConf()
    if not text:
        return conf
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"{part!r}: expected key:value, e.g. expandable_segments:True")
        if key == "max_split_size_mb":
            mb = int(_number(key, value, int))
            if mb <= KLARGE_BUFFER >> 20:
                raise ValueError(
                    f"max_split_size_mb:{value}: must be > {KLARGE_BUFFER >> 20} (PyTorch's minimum)"
                )
            conf = replace(conf, max_split_size=mb << 20)
        elif key == "roundup_power2_divisions":
            n = int(_number(key, value, int))
            if n < 0 or (n and n & (n - 1)):
                raise ValueError(f"roundup_power2_divisions:{value}: must be a power of two (or 0: off)")
            conf = replace(conf, roundup_power2_divisions=n)
        elif key == "garbage_collection_threshold":
            t = _number(key, value, float)
            if not 0 < t < 1:
                raise ValueError(f"garbage_collection_threshold:{value}: must be in (0, 1)")
            conf = replace(conf, garbage_collection_threshold=t)
        elif key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"expandable_segments:{value}: must be True or False")
            conf = replace(conf, expandable_segments=value == "True")
        elif key in _IGNORED_KEYS:
            continue
        else:
            raise ValueError(f"{key!r}: unknown allocator setting; allowed: {', '.join(ALLOC_CONF_KEYS)}")
    return conf


def _number(key: str, value: str, kind: type) -> float:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{key}:{value}: not a number") from None


# ---- the stream -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Malloc:
    """A device allocation of ``nbytes`` on ``stream`` (a later ``Free`` names ``key``)."""

    key: str
    nbytes: int
    stream: str = "default"
    category: str = ""
    where: str = ""  # the point of the step (for "where it ran out")


@dataclass(frozen=True, slots=True)
class Free:
    key: str
    recorded_on: tuple[str, ...] = ()  # streams it was record_stream'ed on: freed when they catch up


@dataclass(frozen=True, slots=True)
class Mark:
    """A point of the step; ``"step"`` starts a measured step (peaks reset: reset_peak_memory_stats)."""

    label: str


AllocEvent = Malloc | Free | Mark


# ---- the allocator ----------------------------------------------------------------------------------
class _Block:
    __slots__ = (
        "age",
        "allocated",
        "mapped",
        "next",
        "pending",
        "pool",
        "prev",
        "ptr",
        "seg_start",
        "size",
        "stream",
    )

    def __init__(self, stream: str, pool: _Pool, ptr: int, size: int, *, mapped: bool = True) -> None:
        self.stream, self.pool, self.ptr, self.size = stream, pool, ptr, size
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.pending = False  # freed, waiting for a recorded stream
        self.age = 0  # garbage collection: free-block searches since it was cached
        self.seg_start: int | None = None  # an expandable segment's first address (None: a cudaMalloc'd one)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Cached free blocks of one pool (small or large), per stream, ordered by (size, address)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: dict[str, list[tuple[int, int, _Block]]] = {}
        self.searches = 0  # get_free_blocks_call_count

    def insert(self, b: _Block) -> None:
        b.age = self.searches
        bisect.insort(self.free.setdefault(b.stream, []), (b.size, b.ptr, b))

    def remove(self, b: _Block) -> None:
        blocks = self.free[b.stream]
        i = bisect.bisect_left(blocks, (b.size, b.ptr))
        assert blocks[i][2] is b
        del blocks[i]

    def blocks(self) -> Iterable[_Block]:
        for blocks in self.free.values():
            yield from (b for _, _, b in blocks)


@dataclass(slots=True)
class OutOfMemory:
    """Where an allocation failed under the limit, and the allocator's state then (bytes)."""

    key: str
    nbytes: int
    where: str
    allocated: int
    reserved: int
    limit: int


@dataclass(slots=True)
class AllocatorStats:
    """What a replay ends with: peaks over the last step (as ``max_memory_allocated``/``reserved`` after a
    ``reset_peak_memory_stats`` at its start), and the first out-of-memory error, if any."""

    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_requested: int = 0  # the requests themselves, before rounding: the trackers' view
    reserved_at_peak_allocated: int = 0
    segments: int = 0
    num_alloc_retries: int = 0
    num_device_alloc: int = 0
    oom: OutOfMemory | None = None
    peak_reserved_where: str = ""
    peak_allocated_where: str = ""
    reserved_by_stream: dict[str, int] = field(default_factory=dict)  # at the peak of reserved

    @property
    def fragmentation(self) -> float:
        """When the most is allocated: the share of reserved memory that is cached but free."""
        if not self.reserved_at_peak_allocated:
            return 0.0
        return 1 - self.peak_allocated / self.reserved_at_peak_allocated


class CachingAllocator:
    """The device allocator's state; ``malloc``/``free`` follow DeviceCachingAllocator's."""

    def __init__(
        self, conf: AllocConf | None = None, *, limit: int | None = None, fraction_set: bool = False
    ):
        self.conf = conf or AllocConf()
        self.limit = limit  # bytes cudaMalloc may reserve in all (None: unlimited)
        self.fraction_set = fraction_set  # set_per_process_memory_fraction: garbage collection may run
        self.small, self.large = _Pool(True), _Pool(False)
        self.live: dict[str, _Block] = {}
        self.requested: dict[str, int] = {}
        self.pending: list[_Block] = []
        self.allocated = 0
        self.requested_now = 0
        self.reserved = 0
        self.reserved_stream: dict[str, int] = {}  # reserved bytes by the stream that owns them
        self.segments = 0
        self.next_ptr = 1 << 40  # virtual addresses of new segments, increasing
        self.expandable: dict[tuple[str, bool], _Block] = {}  # (stream, small) → its segment's first block
        self.stats = AllocatorStats()

    # ---- the public calls ---------------------------------------------------------------------------
    def malloc(self, key: str, nbytes: int, stream: str = "default", where: str = "") -> bool:
        """Allocate; False (and ``stats.oom`` set) when it would run out of memory under the limit."""
        if key in self.live:
            raise ValueError(f"allocation {key!r} made twice without a free")
        self._process_pending()
        size = self.round_size(nbytes)
        pool = self.small if size <= KSMALL_SIZE else self.large
        block = self._get_free_block(pool, stream, size)
        peak_reserved = self.stats.peak_reserved
        if block is None:
            if self.fraction_set and self.conf.garbage_collection_threshold > 0 and self.limit:
                self._garbage_collect()
            block = self._alloc_block(pool, stream, size)
            if block is None and self._release_available_cached_blocks(pool, stream, size):
                block = self._alloc_block(pool, stream, size)
            if block is None:
                self._release_cached_blocks()
                self.stats.num_alloc_retries += 1
                block = self._alloc_block(pool, stream, size)
            if block is None:
                if self.stats.oom is None:
                    self.stats.oom = OutOfMemory(
                        key, nbytes, where, self.allocated, self.reserved, self.limit or 0
                    )
                return False
        if self.stats.peak_reserved > peak_reserved:
            self.stats.peak_reserved_where = where
        if self._should_split(block, size):
            block = self._split(block, size)
        block.allocated = True
        self.live[key] = block
        self.requested[key] = nbytes
        self.allocated += block.size
        self.requested_now += nbytes
        st = self.stats
        if self.allocated > st.peak_allocated:
            st.peak_allocated, st.peak_allocated_where = self.allocated, where
            st.reserved_at_peak_allocated = self.reserved
        st.peak_requested = max(st.peak_requested, self.requested_now)
        return True

    def free(self, key: str, recorded_on: tuple[str, ...] = ()) -> None:
        block = self.live.pop(key, None)
        if block is None:  # its allocation failed (out of memory): nothing to free
            return
        self.allocated -= block.size
        self.requested_now -= self.requested.pop(key)
        block.allocated = False
        if any(s != block.stream for s in recorded_on):
            block.pending = True
            self.pending.append(block)
        else:
            self._free_block(block)

    def reset_peaks(self, where: str = "") -> None:
        """torch.cuda.reset_peak_memory_stats: the peaks restart from the current values."""
        st = self.stats
        st.peak_allocated, st.peak_allocated_where = self.allocated, where
        st.reserved_at_peak_allocated = self.reserved
        st.peak_requested = self.requested_now
        st.peak_reserved, st.peak_reserved_where = self.reserved, where
        st.reserved_by_stream = self.reserved_by_stream()

    def reserved_by_stream(self) -> dict[str, int]:
        return {s: n for s, n in self.reserved_stream.items() if n}

    def _reserve(self, stream: str, nbytes: int) -> None:
        """Bytes the allocator takes from (positive) or returns to (negative) the device for ``stream``."""
        self.reserved += nbytes
        self.reserved_stream[stream] = self.reserved_stream.get(stream, 0) + nbytes

    # ---- sizes --------------------------------------------------------------------------------------
    def round_size(self, nbytes: int) -> int:
        if nbytes < CUDA_BLOCK_BYTES:
            return CUDA_BLOCK_BYTES
        div = self.conf.roundup_power2_divisions
        if div > 1 and nbytes > CUDA_BLOCK_BYTES * div:
            if nbytes & (nbytes - 1) == 0:
                return nbytes
            floor = 1 << (nbytes.bit_length() - 1)
            step = floor >> (div.bit_length() - 1)
            if step == 0:
                return floor << 1
            rounded = nbytes & ~(step - 1)
            return nbytes if rounded == nbytes else rounded + step
        return cuda_storage_bytes(nbytes)

    @staticmethod
    def allocation_size(size: int) -> int:
        """The segment a request opens when no cached block fits."""
        if size <= KSMALL_SIZE:
            return KSMALL_BUFFER
        if size < KMIN_LARGE_ALLOC:
            return KLARGE_BUFFER
        return -(-size // KROUND_LARGE) * KROUND_LARGE

    # ---- finding, splitting, merging ----------------------------------------------------------------
    def _get_free_block(self, pool: _Pool, stream: str, size: int) -> _Block | None:
        pool.searches += 1
        blocks = pool.free.get(stream)
        if not blocks:
            return None
        i = bisect.bisect_left(blocks, (size, -1))
        if i == len(blocks):
            return None
        block = blocks[i][2]
        if self.conf.expandable_segments and block.pool is pool and self._expandable(block):
            # best fit over what a block can grow to: prefer a smaller grown size among the next ones
            j = i
            while j + 1 < len(blocks) and self._grown(blocks[j + 1][2]) < self._grown(blocks[j][2]):
                j += 1
            block = blocks[j][2]
        cap = self.conf.max_split_size
        if size < cap and block.size >= cap:
            return None  # an oversize block does not serve a request it would have to split
        if size >= cap and block.size >= size + KLARGE_BUFFER:
            return None
        pool.remove(block)
        return block

    @staticmethod
    def _expandable(b: _Block) -> bool:
        return b.seg_start is not None

    @staticmethod
    def _grown(b: _Block) -> int:
        return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.conf.expandable_segments:
            return remaining >= CUDA_BLOCK_BYTES
        return size < self.conf.max_split_size and remaining > KSMALL_SIZE

    def _split(self, block: _Block, size: int) -> _Block:
        """The front ``size`` bytes become the allocation; the rest stays cached."""
        front = _Block(block.stream, block.pool, block.ptr, size)
        front.seg_start = block.seg_start
        front.prev, front.next = block.prev, block
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.ptr += size
        block.size -= size
        block.pool.insert(block)
        if self.expandable.get((block.stream, block.pool.small)) is block:
            self.expandable[(block.stream, block.pool.small)] = front
        return front

    def _free_block(self, block: _Block) -> None:
        pool = block.pool
        for other in (block.prev, block.next):
            self._merge(block, other)
        pool.insert(block)

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        if src is None or src.allocated or src.pending or src.mapped != dst.mapped:
            return
        if src.mapped:
            dst.pool.remove(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            key = (src.stream, src.pool.small)
            if self.expandable.get(key) is src:
                self.expandable[key] = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _process_pending(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, []
            for b in pending:
                b.pending = False
                self._free_block(b)

    # ---- reserving and releasing segments -----------------------------------------------------------
    def _alloc_block(self, pool: _Pool, stream: str, size: int) -> _Block | None:
        if self.conf.expandable_segments:
            return self._grow_expandable(pool, stream, size)
        seg = self.allocation_size(size)
        if self.limit is not None and self.reserved + seg > self.limit:
            return None
        block = _Block(stream, pool, self.next_ptr, seg)
        self.next_ptr += seg + KROUND_LARGE
        self._reserve(stream, seg)
        self.segments += 1
        self.stats.num_device_alloc += 1
        self._note_reserved()
        return block

    def _note_reserved(self) -> None:
        st = self.stats
        if self.reserved > st.peak_reserved:
            st.peak_reserved = self.reserved
            st.reserved_by_stream = self.reserved_by_stream()
        st.segments = max(st.segments, self.segments)

    def _release_available_cached_blocks(self, pool: _Pool, stream: str, size: int) -> bool:
        """With max_split_size: free the smallest oversize block that covers the request, else the
        largest oversize blocks until enough is freed."""
        cap = self.conf.max_split_size
        if cap == UNLIMITED or self.conf.expandable_segments:
            return False
        blocks = [b for _, _, b in pool.free.get(stream, [])]
        key = max(size, cap)
        fits = [b for b in blocks if b.size >= key and not b.is_split()]
        if fits:
            self._release_segment(fits[0])
            return True
        released = 0
        for b in reversed(blocks):
            if released >= key or b.size < cap:
                break
            if not b.is_split():
                released += b.size
                self._release_segment(b)
        return released >= key

    def _release_cached_blocks(self) -> None:
        """Free every cached segment that is wholly free (expandable: unmap every wholly free page)."""
        self._process_pending()
        for pool in (self.large, self.small):
            for b in list(pool.blocks()):
                if self.conf.expandable_segments:
                    self._unmap(b)
                elif not b.is_split():
                    self._release_segment(b)

    def _release_segment(self, b: _Block) -> None:
        b.pool.remove(b)
        self._reserve(b.stream, -b.size)
        self.segments -= 1

    def _garbage_collect(self) -> None:
        """Free whole cached large-pool segments, oldest first, until reserved is under the threshold."""
        threshold = int(self.conf.garbage_collection_threshold * (self.limit or 0))
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.large
        candidates = [b for b in pool.blocks() if not b.is_split()]
        reclaimed = 0
        while candidates and reclaimed < target:
            ages = [pool.searches - b.age for b in candidates]
            mean = sum(ages) / len(ages)
            keep = []
            freed = False
            for b, age in zip(candidates, ages, strict=True):
                if age >= mean:
                    reclaimed += b.size
                    self._release_segment(b)
                    freed = True
                else:
                    keep.append(b)
            candidates = keep
            if not freed:
                break

    # ---- expandable segments ------------------------------------------------------------------------
    def _grow_expandable(self, pool: _Pool, stream: str, size: int) -> _Block | None:
        """Map pages at the end of the stream's segment (after its free tail, if any) to fit ``size``."""
        page = KSMALL_BUFFER if pool.small else KLARGE_BUFFER
        key = (stream, pool.small)
        head = self.expandable.get(key)
        if head is None:
            head = _Block(stream, pool, self.next_ptr, 0)
            head.seg_start = head.ptr
            self.next_ptr += 1 << 44
            self.expandable[key] = head
            tail = head
            head_is_placeholder = True
        else:
            tail = head
            while tail.next is not None:
                tail = tail.next
            head_is_placeholder = False
        free_tail = 0 if head_is_placeholder or tail.allocated or tail.pending else tail.size
        need = -(-(size - free_tail) // page) * page
        if self.limit is not None and self.reserved + need > self.limit:
            if head_is_placeholder:
                del self.expandable[key]
            return None
        self._reserve(stream, need)
        self.stats.num_device_alloc += 1
        if head_is_placeholder:
            head.size = need
            block = head
            self.segments += 1
        elif free_tail:
            pool.remove(tail)
            tail.size += need
            block = tail
        else:
            block = _Block(stream, pool, tail.ptr + tail.size, need)
            block.seg_start = tail.seg_start
            block.prev, tail.next = tail, block
        self._note_reserved()
        return block

    def _unmap(self, b: _Block) -> None:
        """Return the wholly free pages of a free block in an expandable segment."""
        page = KSMALL_BUFFER if b.pool.small else KLARGE_BUFFER
        seg_start = b.seg_start or b.ptr
        lo = seg_start + -(-(b.ptr - seg_start) // page) * page
        hi = seg_start + (b.ptr + b.size - seg_start) // page * page
        if hi <= lo:
            return
        b.pool.remove(b)
        released = hi - lo
        self._reserve(b.stream, -released)
        before, after = lo - b.ptr, b.ptr + b.size - hi
        if b.next is None:  # the tail: the segment ends where the mapped pages end
            b.size = before
            if before:
                b.pool.insert(b)
            else:
                self._drop_tail(b)
        else:  # a hole inside the segment: model it as a gap that stays (an unmapped block)
            b.size = before
            hole = _Block(b.stream, b.pool, lo, released, mapped=False)
            hole.seg_start = b.seg_start
            hole.prev, hole.next = b, b.next
            b.next.prev = hole
            b.next = hole
            if after:
                rest = _Block(b.stream, b.pool, hi, after)
                rest.seg_start = b.seg_start
                rest.prev, rest.next = hole, hole.next
                hole.next.prev = rest
                hole.next = rest
                b.pool.insert(rest)
            if before:
                b.pool.insert(b)
            else:
                self._unlink(b)

    def _drop_tail(self, b: _Block) -> None:
        key = (b.stream, b.pool.small)
        if b.prev is None:
            self.expandable.pop(key, None)
            self.segments -= 1
        else:
            b.prev.next = None

    def _unlink(self, b: _Block) -> None:
        key = (b.stream, b.pool.small)
        if b.prev is not None:
            b.prev.next = b.next
        elif self.expandable.get(key) is b and b.next is not None:
            self.expandable[key] = b.next
        if b.next is not None:
            b.next.prev = b.prev


# ---- replaying a stream -----------------------------------------------------------------------------
def replay(
    events: Iterable[AllocEvent],
    conf: AllocConf | None = None,
    *,
    limit: int | None = None,
    fraction_set: bool = False,
    allocator: CachingAllocator | None = None,
) -> AllocatorStats:
    """Replay ``events`` (steps separated by ``Mark("step")``: peaks are those of the last step) and stop at
    the first out-of-memory error."""
    alloc = allocator or CachingAllocator(conf, limit=limit, fraction_set=fraction_set)
    where = ""
    for ev in events:
        if isinstance(ev, Malloc):
            if not alloc.malloc(ev.key, ev.nbytes, ev.stream, ev.where or where):
                break
        elif isinstance(ev, Free):
            alloc.free(ev.key, ev.recorded_on)
        else:
            where = ev.label
            if ev.label == "step":
                alloc.reset_peaks(where)
    return alloc.stats


__all__ = [
    "AllocConf",
    "AllocEvent",
    "AllocatorStats",
    "CachingAllocator",
    "Free",
    "Malloc",
    "Mark",
    "OutOfMemory",
    "parse_alloc_conf",
    "replay",
]
