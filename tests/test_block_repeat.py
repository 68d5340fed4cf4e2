"""A deep decoder's traced step built from traces of shallow copies (predictors/block_repeat.py) is the
whole trace: the same allocation stream event for event (what the allocator sees: sizes, streams,
categories, which allocation each free releases), the same tracker peak and categories, the same model
states; and where the construction cannot reproduce its own deeper traces it is not used."""

from __future__ import annotations

import pytest

from fsdpbench.core.case import Case
from fsdpbench.predictors.block_repeat import repeat_blocks, shallow_depths, stream_peak
from fsdpbench.predictors.device_fit import DeviceModel
from fsdpbench.predictors.memory_model.allocator import AllocConf, Free, Malloc
from fsdpbench.predictors.traced import estimate

RECIPE = dict(
    model="llama3-tiny",
    world_size=8,
    precision="bf16",
    batch_size=2,
    seq_len=64,
    activation_checkpointing=True,
    activation_checkpointing_policy="op",
    optimizer_impl="foreach",
    max_norm=1.0,
    device="cuda",
    backend="nccl",
)


def _allocator_view(stream) -> list[tuple]:  # noqa: ANN001 — an AllocStream
    """The stream with keys renamed in order of allocation and without labels: what the allocator sees."""
    names: dict[str, int] = {}
    out: list[tuple] = []
    for part in ("resident", "lazy", "step"):
        for ev in getattr(stream, part):
            if isinstance(ev, Malloc):
                names[ev.key] = len(names)
                out.append((part, names[ev.key], ev.nbytes, ev.stream, ev.category))
            elif isinstance(ev, Free):
                out.append((part, "free", names[ev.key], ev.recorded_on))
            else:
                out.append((part, ev.label))
    return out


def _trace(case: Case):  # noqa: ANN202 — a TracedEstimate
    return estimate(case, record_stream=True)


@pytest.mark.parametrize(
    ("fields", "blocks"),
    [
        ({"strategy": "zero3"}, 8),  # torchtitan's recipe (the op policy, foreach, clipping)
        ({"strategy": "zero3", "activation_checkpointing_policy": "every:2"}, 10),  # a period of 2
        ({"strategy": "hsdp", "shard_size": 4, "activation_checkpointing": False}, 7),
        ({"strategy": "zero3", "strategy_args": {"reshard_after_forward": "except_last"}}, 7),
        # gradients kept unsharded until the optimizer and freed among each other's: runs slid into place
        ({"strategy": "zero2"}, 7),
        # DDP's one bucket as traced (its size grows with the blocks) and its rebuilt buckets, a block's
        # worth each period where a block's tensors fill buckets of their own (not llama3-tiny's)
        ({"strategy": "ddp", "model": "llama-7b", "precision": "fp32", "max_norm": None}, 9),
    ],
)
def test_repeated_blocks_are_the_whole_trace(fields: dict, blocks: int) -> None:
    case = Case(**{**RECIPE, **fields, "model_args": {"n_layers": blocks}})
    built = repeat_blocks(case, _trace)
    whole = _trace(case)
    assert built is not None
    repeated = built[0]
    assert _allocator_view(repeated.alloc_stream) == _allocator_view(whole.alloc_stream)
    assert repeated.peak_bytes == whole.peak_bytes == stream_peak(whole.alloc_stream)
    assert repeated.peak_by_category == whole.peak_by_category
    assert repeated.states_by_category == whole.states_by_category
    assert (repeated.params, repeated.model_states_bytes) == (whole.params, whole.model_states_bytes)
    a, b = repeated.alloc_stream.replay(AllocConf()), whole.alloc_stream.replay(AllocConf())
    assert (a.peak_allocated, a.peak_reserved) == (b.peak_allocated, b.peak_reserved)
    assert "blocks and each block's events repeated" in repeated.notes[-1]


def test_depths_keep_the_block_pattern_and_stay_shallower() -> None:
    assert shallow_depths(32, 1) == [2, 3, 4, 5]
    assert shallow_depths(32, 2) == [2, 4, 6, 8]
    assert shallow_depths(33, 2) == [3, 5, 7, 9]  # every:2 of 33 blocks: an odd count throughout
    assert shallow_depths(5, 1) is None  # no fewer blocks to trace than the model has


def test_a_construction_that_misses_its_own_deeper_traces_is_not_used() -> None:
    """Told that the stream of 4 blocks is the one of 5 (a trace that did not grow), the construction
    cannot reproduce its deeper traces and answers None; the device model repeats blocks unless told not
    to, and then traces the case whole."""
    case = Case(**{**RECIPE, "strategy": "zero3", "model_args": {"n_layers": 8}})
    stuck = _trace(case.replace(model_args={"n_layers": 4}))
    assert repeat_blocks(case, lambda c: stuck if c.model_args["n_layers"] == 5 else _trace(c)) is None
    repeated, whole = DeviceModel().estimate(case), DeviceModel(repeat_blocks=False).estimate(case)
    assert "repeated" in repeated.notes[-1] and not any("repeated" in n for n in whole.notes)
    assert repeated.peak_bytes == whole.peak_bytes


def test_ddp_buckets_of_blocks_packed_together_are_traced_whole() -> None:
    """llama3-tiny's blocks share DDP buckets (1 MiB, then 25 MiB): the buckets do not repeat per block, so
    the construction answers None and the case is traced whole."""
    case = Case(
        **{**RECIPE, "strategy": "ddp", "activation_checkpointing": False, "model_args": {"n_layers": 7}}
    )
    assert repeat_blocks(case, _trace) is None


@pytest.mark.parametrize(
    ("fields", "searched"),
    [
        ({"strategy": "zero3"}, {"world_size": 2}),  # the smallest-world-size search's cases
        ({"strategy": "zero3", "activation_checkpointing": False}, {"world_size": 16}),
        ({"strategy": "zero2", "activation_checkpointing": False}, {"world_size": 4}),
    ],
)
def test_a_search_case_follows_the_construction_of_the_case_asked(fields: dict, searched: dict) -> None:
    """A case that differs from the case asked only in its world size is built from three depths,
    following the runs and rules read off the asked case's four: still the whole trace."""
    asked = Case(**{**RECIPE, **fields, "model_args": {"n_layers": 7}})
    _, learnt = repeat_blocks(asked, _trace)
    case = asked.replace(**searched)
    built = repeat_blocks(case, _trace, depths=3, learnt=learnt)
    whole = _trace(case)
    assert built is not None and "2, 3, 4 blocks" in built[0].notes[-1]
    repeated = built[0]
    assert _allocator_view(repeated.alloc_stream) == _allocator_view(whole.alloc_stream)
    assert repeated.peak_bytes == whole.peak_bytes
    assert repeated.peak_by_category == whole.peak_by_category
    assert repeated.states_by_category == whole.states_by_category


def test_a_search_case_with_inputs_of_its_own_follows_the_construction() -> None:
    """zero3 with a batch of 3 has two more events than with 2 before the first block (its inputs staged
    and freed): the asked case's construction moved past them, from three depths: the whole trace."""
    asked = Case(**{**RECIPE, "strategy": "zero3", "model_args": {"n_layers": 7}})
    _, learnt = repeat_blocks(asked, _trace)
    case = asked.replace(batch_size=3)
    built = repeat_blocks(case, _trace, depths=3, learnt=learnt)
    assert built is not None and "2, 3, 4 blocks" in built[0].notes[-1] and "followed" in built[0].notes[-1]
    assert sum(map(len, built[1].shape.values())) == sum(map(len, learnt.shape.values())) + 2
    whole = _trace(case)
    assert _allocator_view(built[0].alloc_stream) == _allocator_view(whole.alloc_stream)
    assert built[0].peak_bytes == whole.peak_bytes
    assert built[0].peak_by_category == whole.peak_by_category


def test_a_search_case_with_other_events_reads_its_own_construction() -> None:
    """A construction whose events the case does not have (zero2's, for a zero3 case): the fourth depth
    is traced and the case's own construction read off: the whole trace."""
    zero2 = Case(**{**RECIPE, "strategy": "zero2", "model_args": {"n_layers": 7}})
    _, learnt = repeat_blocks(zero2, _trace)
    case = zero2.replace(strategy="zero3")
    built = repeat_blocks(case, _trace, depths=3, learnt=learnt)
    assert built is not None and built[1] is not learnt and "2, 3, 4, 5 blocks" in built[0].notes[-1]
    assert "followed" not in built[0].notes[-1]
    assert _allocator_view(built[0].alloc_stream) == _allocator_view(_trace(case).alloc_stream)


def test_the_device_model_traces_its_search_cases_one_depth_shallower(monkeypatch) -> None:  # noqa: ANN001
    import fsdpbench.predictors.traced as traced_module

    traced: list[int] = []
    original = traced_module.estimate

    def counting(c: Case, **kwargs):  # noqa: ANN003, ANN202 — estimate's keywords; a TracedEstimate
        traced.append(c.model_args["n_layers"])
        return original(c, **kwargs)

    monkeypatch.setattr(traced_module, "estimate", counting)
    model = DeviceModel()
    case = Case(**{**RECIPE, "strategy": "zero3", "model_args": {"n_layers": 8}})
    model.estimate(case)
    model.estimate(case.replace(world_size=4))
    assert traced == [2, 3, 4, 5, 2, 3, 4]
