"""The CUDA caching allocator model (fsdpbench/predictors/memory_model/allocator.py): each rule of
c10/cuda/CUDACachingAllocator.cpp on a stream small enough to work out by hand."""

from __future__ import annotations

import pytest

from fsdpbench.core.numbers import MiB
from fsdpbench.predictors.memory_model.allocator import (
    AllocConf,
    CachingAllocator,
    Free,
    Malloc,
    Mark,
    parse_alloc_conf,
    replay,
)


def test_small_requests_round_to_512_bytes_and_share_a_2mib_segment():
    a = CachingAllocator()
    a.malloc("x", 1)
    a.malloc("y", 600_000)
    assert a.allocated == 512 + 600_064
    assert a.reserved == 2 * MiB and a.segments == 1


def test_a_request_under_10mib_opens_a_20mib_segment_that_later_ones_split():
    a = CachingAllocator()
    a.malloc("x", 3 * MiB)
    a.malloc("y", 5 * MiB)
    assert a.reserved == 20 * MiB and a.segments == 1
    a.malloc("z", 12 * MiB + 1)  # ≥ 10 MiB: a segment of its own, rounded up to 2 MiB
    assert a.reserved == 20 * MiB + 14 * MiB


def test_the_large_pool_keeps_a_remainder_only_above_1mib():
    a = CachingAllocator()
    a.malloc("x", 20 * MiB)
    a.free("x")
    a.malloc("y", 19 * MiB + 512)  # 1 MiB - 512 left: not split, the whole block is counted
    assert a.allocated == 20 * MiB
    a.free("y")
    a.malloc("z", 18 * MiB)  # 2 MiB left: split, the rest stays cached
    assert a.allocated == 18 * MiB and a.reserved == 20 * MiB


def test_best_fit_takes_the_smallest_cached_block_and_freed_neighbours_merge():
    a = CachingAllocator()
    for key, size in (("a", 40 * MiB), ("b", 30 * MiB)):
        a.malloc(key, size)
    b_ptr = a.live["b"].ptr
    a.free("a")
    a.free("b")
    a.malloc("c", 25 * MiB)  # the 30 MiB block, not the 40
    assert a.live["c"].ptr == b_ptr and a.reserved == 70 * MiB
    a.free("c")
    a.malloc("d", 12 * MiB)
    a.malloc("e", 12 * MiB)  # split of the 30 MiB block: 12 + 12 + 6 left
    a.free("d")
    a.free("e")  # merges back into one 30 MiB block
    a.malloc("f", 30 * MiB)
    assert a.reserved == 70 * MiB


def test_a_block_freed_on_one_stream_is_not_reused_by_another():
    a = CachingAllocator()
    a.malloc("x", 50 * MiB, stream="all_gather_copy_in")
    a.free("x")
    a.malloc("y", 50 * MiB)
    assert a.reserved == 100 * MiB
    assert a.reserved_by_stream() == {"all_gather_copy_in": 50 * MiB, "default": 50 * MiB}


def test_a_record_streamed_block_waits_for_the_next_allocation():
    a = CachingAllocator()
    a.malloc("x", 50 * MiB)
    a.free("x", recorded_on=("reduce_scatter",))
    assert a.pending and a.allocated == 0
    a.malloc("y", 50 * MiB)  # the event has completed by now: the block is reused
    assert a.reserved == 50 * MiB


def test_under_a_limit_cached_segments_are_released_before_an_out_of_memory_error():
    a = CachingAllocator(limit=100 * MiB)
    a.malloc("x", 60 * MiB)
    a.free("x")
    assert a.malloc("y", 70 * MiB)  # 60 cached + 70 > 100: the cached segment is freed, then retried
    assert a.reserved == 70 * MiB and a.stats.num_alloc_retries == 1
    assert not a.malloc("z", 40 * MiB, where="backward: block3")
    oom = a.stats.oom
    assert (oom.key, oom.nbytes, oom.where, oom.reserved) == ("z", 40 * MiB, "backward: block3", 70 * MiB)


def test_max_split_size_keeps_oversize_blocks_whole():
    a = CachingAllocator(AllocConf(max_split_size=64 * MiB))
    a.malloc("x", 100 * MiB)
    a.free("x")
    a.malloc("y", 30 * MiB)  # an oversize block does not serve a smaller request
    assert a.reserved == 130 * MiB
    a.malloc("z", 90 * MiB)  # within 20 MiB of its size: it does
    assert a.reserved == 130 * MiB and a.allocated == 130 * MiB


def test_expandable_segments_grow_in_20mib_pages_and_reuse_their_free_tail():
    plain, grown = CachingAllocator(), CachingAllocator(AllocConf(expandable_segments=True))
    for a in (plain, grown):
        a.malloc("x", 30 * MiB)
        a.free("x")
        a.malloc("y", 35 * MiB)
    assert plain.reserved == 30 * MiB + 36 * MiB
    assert grown.reserved == 40 * MiB  # 30 MiB mapped as 40; 35 fits in the freed 40


def test_roundup_power2_divisions():
    a = CachingAllocator(AllocConf(roundup_power2_divisions=4))
    assert a.round_size(1200) == 1536  # below 512 × 4: plain 512 B rounding
    assert a.round_size(5000) == 5120  # 4096 + one quarter of 4096
    assert a.round_size(4096) == 4096


def test_garbage_collection_frees_the_oldest_whole_segments_past_the_threshold():
    a = CachingAllocator(AllocConf(garbage_collection_threshold=0.5), limit=200 * MiB, fraction_set=True)
    a.malloc("x", 60 * MiB)
    a.free("x")
    a.malloc("y", 70 * MiB)  # reserved 60 ≤ 100 when it looked: no collection
    a.free("y")
    a.malloc("z", 80 * MiB)  # 130 > 100: the older cached segment (60) goes, then 80 is reserved
    assert a.reserved == 150 * MiB and a.stats.num_alloc_retries == 0
    b = CachingAllocator(limit=200 * MiB)  # no threshold: 210 > 200 fails, everything cached is freed
    for key in ("x", "y"):
        b.malloc(key, 60 * MiB if key == "x" else 70 * MiB)
        b.free(key)
    b.malloc("z", 80 * MiB)
    assert b.reserved == 80 * MiB and b.stats.num_alloc_retries == 1


def test_replay_reports_the_last_steps_peaks():
    step = [Malloc("act", 100 * MiB), Malloc("tmp", 50 * MiB), Free("tmp"), Free("act")]
    stats = replay([Malloc("params", 10 * MiB), *step, Mark("step"), *step])
    assert stats.peak_allocated == 160 * MiB
    assert stats.peak_reserved == 160 * MiB
    assert stats.fragmentation == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", AllocConf()),
        ("expandable_segments:True", AllocConf(expandable_segments=True)),
        (
            "max_split_size_mb:128, garbage_collection_threshold:0.6",
            AllocConf(max_split_size=128 * MiB, garbage_collection_threshold=0.6),
        ),
        ("backend:native,roundup_power2_divisions:8", AllocConf(roundup_power2_divisions=8)),
    ],
)
def test_parse_alloc_conf(text, expected):
    assert parse_alloc_conf(text) == expected
    assert parse_alloc_conf(expected.describe()) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("expandable_segments", "key:value"),
        ("expandable_segments:yes", "True or False"),
        ("max_split_size_mb:10", "> 20"),
        ("garbage_collection_threshold:1.5", "(0, 1)"),
        ("roundup_power2_divisions:3", "power of two"),
        ("huge_pages:True", "unknown allocator setting"),
    ],
)
def test_parse_alloc_conf_rejects_bad_settings(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_alloc_conf(text)
