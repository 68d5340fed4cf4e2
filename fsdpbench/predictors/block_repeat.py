"""A deep decoder's traced step from traces of shallow copies of it: identical blocks traced once.

A decoder's blocks are identical, so one rank's allocation stream for ``L`` blocks is that of fewer
blocks with each block's share repeated: its forward, its backward, its FSDP all-gathers and
reduce-scatters, its parameters' part of gradient clipping and of the optimizer's update. Which events
those are is read off traces, not assumed. The case is traced with ``a``, ``a + p``, ``a + 2p`` and
``a + 3p`` blocks (``p``: the period of the block pattern: ``N`` for ``every:N`` checkpointing, else 1;
``a ≡ L`` modulo ``p``). The events the ``a + p`` stream has beyond the ``a`` stream must be runs inserted
into it and nothing else (each event taken as what the allocator sees: size, stream, category; a free
as the kind it frees); the stream of ``a + k·p`` blocks is then the ``a + p`` stream with each run present
``k`` times, which the ``a + 2p`` and ``a + 3p`` streams must be, event for event. Which allocation each
free of a copy releases — its own copy's, the neighbouring copy's (FSDP's all-gather of the next block),
the mirror copy's (backward runs the blocks in reverse), or one outside the runs once the copies run
out — is a rule read off the three deeper traces per free and required to hold in all of them. Where the
inserted run sits among events equal to it (the gradients freed one after another at the end), each run
is also tried slid as far as it goes either way (``_placed``). An allocation of the whole model at once
(DDP's one bucket as a trace keeps it) is one event at every depth whose size grows by the same amount
per period (``SIZED_BY_DEPTH``). The tracked peak is the stream's (checked equal to the tracker's on
every shallow trace; DDP's rebuilt buckets, which no tracker sees, left out); parameter counts and model
states grow by a block's worth per period (checked on all four). Anything that does not hold
answers None, and the case is traced whole; so does a strategy that declares a rank's share of a block
not the same for every block (``Strategy.blocks_repeat``: ZeRO-1's greedy partition, which shallow
traces could show repeating while the deep model's differs). ``tests/test_block_repeat.py``
compares the result with whole traces.
"""

from __future__ import annotations

import difflib
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fsdpbench.core.case import Case, ac_every
from fsdpbench.predictors.memory_model.alloc_stream import DDP_BUCKET, UNREBUILT_BUCKET, AllocStream
from fsdpbench.predictors.memory_model.allocator import AllocEvent, Free, Malloc
from fsdpbench.predictors.traced import TracedEstimate

PARTS = ("resident", "lazy", "step")
LAYER_INDEX = re.compile(r"(layers\.)(\d+)")
SHALLOWEST = 2  # blocks of the shallowest trace: a first and a last block that differ from the rest
DEPTHS = 4  # shallow traces: the construction is read off the first two and checked on all
COPY_SHIFTS = (0, -1, 1)  # a free's copy: its own, the previous one's, the next one's (or mirrored)

Slot = tuple[str, int, int]  # (part, index in the a + p stream, copy)
# allocations of the whole model at once (DDP's bucket as a trace keeps it): one event at every depth, its
# size growing by the same amount per period
SIZED_BY_DEPTH = (UNREBUILT_BUCKET,)


def blocks_and_period(case: Case) -> tuple[int, int] | None:
    """The case's number of identical blocks and the period of its block pattern; None for a model
    without ``n_layers``."""
    from fsdpbench.models.registry import resolve_model

    try:
        _, args = resolve_model(case.model, case.model_args)
    except KeyError:
        return None
    blocks = args.get("n_layers")
    if not isinstance(blocks, int) or isinstance(blocks, bool):
        return None
    every = ac_every(case.activation_checkpointing_policy) if case.activation_checkpointing else None
    return blocks, every or 1


def shallow_depths(blocks: int, period: int, count: int = DEPTHS) -> list[int] | None:
    """The ``count`` depths traced (``a`` … ``a + 3p`` for four); None where they are not fewer than the
    blocks."""
    a = SHALLOWEST + (blocks - SHALLOWEST) % period
    depths = [a + k * period for k in range(count)]
    return depths if depths[-1] < blocks else None


@dataclass(frozen=True)
class Construction:
    """What a case's shallow traces taught: the runs each extra period inserts into the ``a + p`` stream,
    the rule of each free, the block index of each labelled allocation, and the ``a + p`` stream's events
    with their sizes left out (``_shape``), which a case built from it must have."""

    runs: dict[str, list[tuple[int, int]]]
    rules: dict[tuple[str, int], tuple]
    indices: dict[tuple[str, int], tuple[int, int, int]]
    shape: dict[str, list[tuple]]


def repeat_blocks(
    case: Case,
    trace: Callable[[Case], TracedEstimate],
    *,
    depths: int = DEPTHS,
    learnt: Construction | None = None,
) -> tuple[TracedEstimate, Construction] | None:
    """The traced estimate of ``case`` from ``trace`` of four shallow copies of it, and the construction
    read off them; None (see above). With ``learnt`` (the construction of a case that differs from this
    one only in what the searches vary: its batch, its world size) and ``depths=3``: the deepest copy is
    not traced, and ``learnt``'s runs and rules are used where this case's ``a + p`` stream has
    ``learnt``'s events (sizes aside) and its three traces follow them event for event and free for free:
    which events repeat and which allocation each free releases is the step's code path, which batch
    and world size do not change. Events of its own outside the runs (a larger batch's inputs staged
    before the first block) are taken as they are, each free of them releasing the same allocation of
    them at every depth; where the events differ otherwise, the fourth depth is traced and the case's
    own construction read off."""
    from fsdpbench.strategies import get_strategy

    shape = blocks_and_period(case)
    traced = shallow_depths(*shape, depths) if shape else None
    if shape is None or traced is None or not get_strategy(case.strategy).blocks_repeat:
        return None
    blocks, period = shape
    shallow = [_tracked(trace, case, d) for d in traced]
    construction = _followed(learnt, _streams(shallow)) if learnt is not None and all(shallow) else None
    followed = construction is not None
    if construction is None and learnt is not None:  # not the same events: read its own, one depth more
        deeper = traced[-1] + period
        if deeper >= blocks:
            return None
        traced = [*traced, deeper]
        shallow.append(_tracked(trace, case, deeper))
    if not all(shallow):
        return None
    construction = construction or learn(_streams(shallow))
    built = _built(shallow, construction, (blocks - traced[0]) // period) if construction else None
    if construction is None or built is None:
        return None
    note = repeated_note(traced, blocks, followed)
    return replace(built, case_id=case.case_id, notes=(*built.notes, note)), construction


def _tracked(trace: Callable[[Case], TracedEstimate], case: Case, blocks: int) -> TracedEstimate | None:
    """The case traced with ``blocks`` blocks; None unless its stream holds what its tracker counts."""
    est = trace(case.replace(model_args={**case.model_args, "n_layers": blocks}))
    stream = est.alloc_stream
    return est if stream is not None and stream_peak(stream) == est.peak_bytes else None


def _streams(shallow: Sequence[TracedEstimate | None]) -> list[AllocStream]:
    return [e.alloc_stream for e in shallow if e is not None]


def _built(shallow: Sequence[Any], construction: Construction, copies: int) -> TracedEstimate | None:
    """The estimate ``copies`` periods past the shallowest trace: the stream built, its peak the tracker's
    peak by category grown over the traces; None where they disagree."""
    streams = _streams(shallow)
    built = _build(streams[1], construction.runs, construction.rules, construction.indices, copies)
    extended = _sized_by_depth(streams, built, copies)
    grown = _grown(shallow, copies) if extended is not None else None
    if extended is None or grown is None:
        return None
    peak = stream_peak(extended)
    if sum(grown["peak"].values()) != peak:
        return None
    return replace(
        shallow[-1],
        params=grown["params"],
        peak_bytes=peak,
        peak_by_category=grown["peak"],
        states_by_category=grown["states"],
        model_states_bytes=grown["model_states"],
        wall_s=sum(e.wall_s for e in shallow),
        alloc_stream=extended,
    )


def _sized_by_depth(streams: Sequence[AllocStream], extended: AllocStream, copies: int) -> AllocStream | None:
    """``extended`` with each allocation of the whole model (``SIZED_BY_DEPTH``) at the size it has
    ``copies`` periods past the shallowest trace; None unless every trace has the same such allocations,
    each growing by the same amount per period."""

    def sizes(stream: AllocStream) -> list[int]:
        return [e.nbytes for e in stream.step if isinstance(e, Malloc) and e.category in SIZED_BY_DEPTH]

    by_trace = [sizes(s) for s in streams]
    if len({len(x) for x in by_trace}) != 1:
        return None
    grown = [_linear(column, copies) for column in zip(*by_trace, strict=True)]
    if any(g is None for g in grown):
        return None
    pending = iter(int(g or 0) for g in grown)
    step = tuple(
        replace(e, nbytes=next(pending)) if isinstance(e, Malloc) and e.category in SIZED_BY_DEPTH else e
        for e in extended.step
    )
    return replace(extended, step=step)


def repeated_note(depths: Sequence[int], blocks: int, learnt: bool = False) -> str:
    checked = " and followed the runs and frees read off a case differing only in batch or world size"
    return (
        f"traced with {', '.join(map(str, depths))} blocks and each block's events repeated to {blocks} "
        "(identical blocks; the construction reproduced the deeper traces event for event"
        f"{checked if learnt else ''})"
    )


def _linear(values: Sequence[int], periods: int) -> int | None:
    """``values`` one period apart, continued ``periods`` periods past the first; None unless they
    grow by the same amount each period."""
    step = values[1] - values[0]
    if any(v != values[0] + k * step for k, v in enumerate(values)):
        return None
    return values[0] + periods * step


def _grown(shallow: Sequence[TracedEstimate], copies: int) -> dict[str, Any] | None:
    """Parameter count, model states and states by category ``copies`` periods past the shallowest
    trace, each growing by the same amount per period over all traces; the tracker's peak by category
    likewise over the deeper ones (the shallowest peaks elsewhere in the step; their sum is checked
    against the built stream's peak)."""
    params = _linear([e.params for e in shallow], copies)
    states_total = _linear([e.model_states_bytes for e in shallow], copies)
    out: dict[str, Any] = {"params": params, "model_states": states_total}
    for name, attr, traces, periods in (
        ("states", "states_by_category", shallow, copies),
        ("peak", "peak_by_category", shallow[1:], copies - 1),
    ):
        keys = sorted(set().union(*(getattr(e, attr) for e in traces)))
        out[name] = {k: _linear([getattr(e, attr).get(k, 0) for e in traces], periods) for k in keys}
    if any(v is None for v in (params, states_total, *out["states"].values(), *out["peak"].values())):
        return None
    return out


# ---- the stream --------------------------------------------------------------------------------------
def _tokens(stream: AllocStream) -> dict[str, list[tuple]]:
    """Each event as what the allocator sees of it (a free as the kind of allocation it releases)."""
    kind: dict[str, tuple] = {}
    out: dict[str, list[tuple]] = {}
    for part in PARTS:
        seq: list[tuple] = []
        t: tuple
        for ev in getattr(stream, part):
            if isinstance(ev, Malloc):
                nbytes = None if ev.category in SIZED_BY_DEPTH else ev.nbytes
                kind[ev.key] = t = ("malloc", nbytes, ev.stream, ev.category)
            elif isinstance(ev, Free):
                t = ("free", kind.get(ev.key), ev.recorded_on)
            else:
                t = ("mark", ev.label)
            seq.append(t)
        out[part] = seq
    return out


def _runs(
    shallow: AllocStream, deeper: AllocStream, *, from_end: bool = False
) -> dict[str, list[tuple[int, int]]] | None:
    """The runs of events ``deeper`` has beyond ``shallow``, per part; None unless that is the only change.
    Where runs of equal events could sit in more than one place, the match from the start puts them
    first, the match ``from_end`` last."""
    a, b = _tokens(shallow), _tokens(deeper)
    runs = {}
    for part in PARTS:
        x, y = (a[part][::-1], b[part][::-1]) if from_end else (a[part], b[part])
        ops = difflib.SequenceMatcher(None, x, y, autojunk=False).get_opcodes()
        if any(tag not in ("equal", "insert") for tag, *_ in ops):
            return None
        found = [(j1, j2) for tag, _i1, _i2, j1, j2 in ops if tag == "insert"]
        runs[part] = sorted((len(y) - j2, len(y) - j1) for j1, j2 in found) if from_end else found
    return runs


def _layout(template: AllocStream, runs: dict[str, list[tuple[int, int]]], copies: int) -> list[Slot]:
    """The events of the stream with ``copies`` of each run, as slots of the template."""
    out: list[Slot] = []
    for part in PARTS:
        starts = dict(runs[part])
        n, j = len(getattr(template, part)), 0
        while j < n:
            end = starts.get(j)
            if end is None:
                out.append((part, j, 0))
                j += 1
            else:
                out.extend((part, i, c) for c in range(copies) for i in range(j, end))
                j = end
    return out


def _laid_out(
    stream: AllocStream, layout: list[Slot], template_tokens: dict[str, list[tuple]]
) -> dict[Slot, Slot] | None:
    """Which slot each free of ``stream`` releases, where its events are the template's laid out as
    ``layout`` (what the allocator sees of each); None where they are not."""
    tokens = _tokens(stream)
    if [t for part in PARTS for t in tokens[part]] != [template_tokens[p][i] for p, i, _ in layout]:
        return None
    return _targets(stream, layout)


def _targets(stream: AllocStream, layout: list[Slot]) -> dict[Slot, Slot] | None:
    """For a traced stream laid out as ``layout`` (its events in the same order), which slot each free's
    allocation has; None where the stream is not that layout's events."""
    events = [ev for part in PARTS for ev in getattr(stream, part)]
    if len(events) != len(layout):
        return None
    slot_of: dict[str, Slot] = {}
    out: dict[Slot, Slot] = {}
    for ev, slot in zip(events, layout, strict=True):
        if isinstance(ev, Malloc):
            slot_of[ev.key] = slot
        elif isinstance(ev, Free) and ev.key in slot_of:
            out[slot] = slot_of[ev.key]
    return out


def _rule_fits(rule: tuple, slot: Slot, copies: int, target: Slot) -> bool:
    return target == _rule_target(rule, slot[2], copies)


def _rule_target(rule: tuple, c: int, copies: int) -> Slot:
    """The slot a free of copy ``c`` releases under ``rule``: (shift, mirrored, the run's event for the
    first copy's frees, for the others', the event outside the runs when the copies run out)."""
    shift, mirrored, inside_first, inside_rest, outside = rule
    inside = inside_first if c == 0 else inside_rest
    t = (copies - 1 - c if mirrored else c) + shift
    if 0 <= t < copies:
        return (inside[0], inside[1], t) if inside is not None else None  # type: ignore[return-value]
    return outside


def _learn_rules(
    template: AllocStream, runs: dict[str, list[tuple[int, int]]], deeper: Sequence[AllocStream], in_run: set
) -> tuple[dict[tuple[str, int], tuple], dict[tuple[str, int], tuple[int, int, int]]] | int | None:
    """Per free of the template, the rule that gives its allocation's slot for any number of copies,
    consistent with every deeper trace (1, 2, 3 copies); and per allocation labelled with a block, the
    block's index as a function of its copy and of the copies. Where no rule of the family fits some
    frees, how many; None where the deeper traces are not this layout's events."""
    observed: dict[tuple[str, int], list[tuple[Slot, int, Slot]]] = {}
    blocks: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    template_tokens = _tokens(template)
    for copies, stream in enumerate(deeper, start=1):
        layout = _layout(template, runs, copies)
        targets = _laid_out(stream, layout, template_tokens)
        if targets is None:
            return None
        for slot, target in targets.items():
            observed.setdefault(slot[:2], []).append((slot, copies, target))
        events = [ev for part in PARTS for ev in getattr(stream, part)]
        for ev, slot in zip(events, layout, strict=True):
            index = _block_index(ev)
            if index is not None:
                blocks.setdefault(slot[:2], []).append((slot[2], copies, index))
    rules = {free: _find_rule(seen, in_run) for free, seen in observed.items()}
    if any(r is None for r in rules.values()):
        return len([r for r in rules.values() if r is None])
    # labels only (where the step was): one whose block index follows no such rule keeps the label of
    # the a + p trace (the module tracker's backward labels can lag behind the block that runs)
    indices = {slot: rule for slot, seen in blocks.items() if (rule := _block_rule(seen)) is not None}
    return rules, indices  # type: ignore[return-value]


def _block_index(ev: AllocEvent) -> int | None:
    match = LAYER_INDEX.search(ev.where) if isinstance(ev, Malloc) else None
    return int(match.group(2)) if match else None


def _block_rule(seen: list[tuple[int, int, int]]) -> tuple[int, int, int] | None:
    """(x, y, z) with index = x + y·copy + z·copies for every observation (copy, copies, index)."""
    at = {(c, m): index for c, m, index in seen}
    if (0, 1) not in at or (0, 2) not in at:
        return None
    z = at[(0, 2)] - at[(0, 1)]
    x = at[(0, 1)] - z
    y = at[(1, 2)] - x - 2 * z if (1, 2) in at else 0
    return (x, y, z) if all(index == x + y * c + z * m for (c, m), index in at.items()) else None


def _find_rule(seen: list[tuple[Slot, int, Slot]], in_run: set) -> tuple | None:
    """The first rule of the family that gives every observed allocation of one free."""
    none: set[Any] = {None}
    firsts: set[Any] = {t[:2] for slot, _, t in seen if t[:2] in in_run and slot[2] == 0} or none
    rests: set[Any] = {t[:2] for slot, _, t in seen if t[:2] in in_run and slot[2] > 0} or none
    outsides: set[Any] = {t for _, _, t in seen if t[:2] not in in_run} or none
    for first in firsts:
        for rest in rests:
            for outside in outsides:
                for shift in COPY_SHIFTS:
                    for mirrored in (False, True):
                        rule = (shift, mirrored, first, rest, outside)
                        if all(_rule_fits(rule, slot, copies, t) for slot, copies, t in seen):
                            return rule
    return None


def learn(streams: Sequence[AllocStream]) -> Construction | None:
    """The construction read off the streams of ``a``, ``a + p`` … blocks; None where it does not
    reproduce the deeper traces."""
    shallow, template = streams[0], streams[1]
    tokens = _tokens(template)
    for from_end in (False, True):
        runs = _runs(shallow, template, from_end=from_end)
        if runs is None:
            continue
        placed = _placed(template, runs, streams[1:], tokens)
        if placed is not None:
            return Construction(*placed, shape=_shape(tokens))
    return None


def extend(streams: Sequence[AllocStream], copies: int) -> AllocStream | None:
    """The stream of ``a + copies·p`` blocks from the streams of ``a``, ``a + p`` … blocks; None where
    the construction does not reproduce the deeper traces."""
    construction = learn(streams)
    if construction is None:
        return None
    return _build(streams[1], construction.runs, construction.rules, construction.indices, copies)


def _shape(tokens: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    """The events without their sizes (a free's kind included)."""

    def bare(t: tuple) -> tuple:
        if t[0] == "malloc":
            return (t[0], *t[2:])
        if t[0] == "free":
            return (t[0], bare(t[1]) if t[1] is not None else None, *t[2:])
        return t

    return {part: [bare(t) for t in seq] for part, seq in tokens.items()}


def _followed(learnt: Construction, streams: Sequence[AllocStream]) -> Construction | None:
    """``learnt`` for these streams, where the ``a + p`` stream has its events (sizes aside) with, at
    most, events of its own outside the runs (``_translations``), the ``a`` stream is it without the
    runs, and each deeper stream is it with the runs repeated and every free releasing the allocation
    ``learnt``'s rule says (a free of its own: the same allocation of its own, outside the runs, at every
    depth); None otherwise."""
    tokens = _tokens(streams[1])
    for construction in _translations(learnt, _shape(tokens)):
        if _follows(construction, streams, tokens):
            return construction
    return None


def _follows(construction: Construction, streams: Sequence[AllocStream], tokens: dict) -> bool:
    template = streams[1]
    in_run = {(part, i) for part in PARTS for j1, j2 in construction.runs[part] for i in range(j1, j2)}
    own: dict[tuple[str, int], Slot] = {}  # a free of this case's own -> the allocation it releases
    for copies in (1, 2, 0):  # the template first: most translations that are wrong fail there
        targets = _laid_out(streams[copies], _layout(template, construction.runs, copies), tokens)
        if targets is None:
            return False
        if copies == 0:  # the a stream: no copy, so no rule to follow (its layout checked above)
            continue
        for slot, target in targets.items():
            rule = construction.rules.get(slot[:2])
            if rule is not None:
                if not _rule_fits(rule, slot, copies, target):
                    return False
            elif slot[:2] in in_run or target[:2] in in_run or own.setdefault(slot[:2], target) != target:
                return False
    return True


TRANSLATIONS = 256  # places of a case's own events tried at most (equal events make them ambiguous)


def _translations(learnt: Construction, shape: dict[str, list[tuple]]) -> Iterator[Construction]:
    """``learnt`` moved to an ``a + p`` stream of ``shape``: ``learnt``'s events in order with events of
    its own inserted outside the runs (a larger batch's inputs staged and freed before the first block);
    its runs, rules and block indices at their events' new places. An event of its own among events equal
    to it could be any one of them (which one, only the frees tell): each way is given, up to
    ``TRANSLATIONS``; none where events are missing or changed, or inserted within a run."""
    if shape == learnt.shape:
        yield learnt
        return
    places = _own_places(learnt.shape, shape)
    if places is None or math.prod(len(p) for p in places) > TRANSLATIONS:
        return
    for picks in itertools.product(*places):
        own: dict[str, set[int]] = {part: set() for part in PARTS}
        for part, pick in picks:
            own[part] |= pick
        moved = {part: [j for j in range(len(shape[part])) if j not in own[part]] for part in PARTS}
        if any([shape[part][j] for j in moved[part]] != learnt.shape[part] for part in PARTS):
            continue
        translated = _moved(learnt, moved, shape)
        if translated is not None:
            yield translated


def _own_places(
    old: dict[str, list[tuple]], new: dict[str, list[tuple]]
) -> list[list[tuple[str, set[int]]]] | None:
    """Per group of equal events of ``new`` holding events ``old`` does not have: the ways to pick which
    of the group are those; None unless ``new`` is ``old`` with events inserted."""
    places = []
    for part in PARTS:
        ops = difflib.SequenceMatcher(None, old[part], new[part], autojunk=False).get_opcodes()
        if any(tag not in ("equal", "insert") for tag, *_ in ops):
            return None
        inserted = [j for tag, _, _, j1, j2 in ops if tag == "insert" for j in range(j1, j2)]
        for (a, b), count in Counter(_equal_run(new[part], j) for j in inserted).items():
            places.append([(part, set(pick)) for pick in itertools.combinations(range(a, b), count)])
    return places


def _equal_run(seq: list[tuple], j: int) -> tuple[int, int]:
    """The events around ``seq[j]`` equal to it: [a, b)."""
    a, b = j, j + 1
    while a > 0 and seq[a - 1] == seq[j]:
        a -= 1
    while b < len(seq) and seq[b] == seq[j]:
        b += 1
    return a, b


def _moved(
    learnt: Construction, moved: dict[str, list[int]], shape: dict[str, list[tuple]]
) -> Construction | None:
    """``learnt`` with its event ``i`` of each part at ``moved[part][i]``; None where a run does not stay
    whole (an event of the case's own inside it)."""
    runs = {
        part: [(moved[part][j1], moved[part][j2 - 1] + 1) for j1, j2 in found]
        for part, found in learnt.runs.items()
    }
    if any(
        b - a != j2 - j1
        for part in PARTS
        for (a, b), (j1, j2) in zip(runs[part], learnt.runs[part], strict=True)
    ):
        return None

    def at(event: Any) -> Any:  # (part, index) or a slot (part, index, copy), or None
        return None if event is None else (event[0], moved[event[0]][event[1]], *event[2:])

    rules = {at(free): (*rule[:2], *map(at, rule[2:])) for free, rule in learnt.rules.items()}
    indices = {at(event): index for event, index in learnt.indices.items()}
    return Construction(runs, rules, indices, shape)


def _placed(
    template: AllocStream,
    runs: dict[str, list[tuple[int, int]]],
    deeper: Sequence[AllocStream],
    tokens: dict[str, list[tuple]],
) -> tuple[dict[str, list[tuple[int, int]]], dict, dict] | None:
    """The runs, each where its frees follow one rule for any number of copies, with those rules; None
    where no place found does. A run inserted among events equal to it (a block's gradient freed among
    the others') is the same insertion anywhere among them, but which frees belong to a copy is decided
    by one of those places only: each run is tried as found and slid as far as it goes either way, one
    run at a time, keeping a move that leaves fewer frees without a rule."""

    def learn(r: dict[str, list[tuple[int, int]]]) -> Any:
        in_run = {(part, i) for part in PARTS for j1, j2 in r[part] for i in range(j1, j2)}
        return _learn_rules(template, r, deeper, in_run)

    def failing(result: Any) -> float:
        return float("inf") if result is None else result if isinstance(result, int) else 0

    best = learn(runs)
    for part in PARTS:
        for k in range(len(runs[part])):
            if failing(best) == 0:
                break
            for direction in (-1, 1):
                moved = _slid(runs[part], k, tokens[part], direction)
                if moved == runs[part][k]:
                    continue
                candidate = {**runs, part: [*runs[part][:k], moved, *runs[part][k + 1 :]]}
                result = learn(candidate)
                if failing(result) < failing(best):
                    runs, best = candidate, result
    return (runs, *best) if isinstance(best, tuple) else None


def _slid(runs: list[tuple[int, int]], k: int, seq: list[tuple], direction: int) -> tuple[int, int]:
    """Run ``k`` of ``runs`` (sorted, of ``seq``) moved one event at a time in ``direction`` while the
    sequence stays the same (the event it leaves equals the one it takes in) and it meets no other run."""
    j1, j2 = runs[k]
    low = runs[k - 1][1] if k > 0 else 0
    high = runs[k + 1][0] if k + 1 < len(runs) else len(seq)
    if direction < 0:
        while j1 - 1 >= low and seq[j1 - 1] == seq[j2 - 1]:
            j1, j2 = j1 - 1, j2 - 1
    else:
        while j2 + 1 <= high and seq[j2] == seq[j1]:
            j1, j2 = j1 + 1, j2 + 1
    return j1, j2


def _build(
    template: AllocStream, runs: dict[str, list[tuple[int, int]]], rules: dict, indices: dict, copies: int
) -> AllocStream:
    events = {part: getattr(template, part) for part in PARTS}
    key_of: dict[Slot, str] = {}
    parts: dict[str, list[AllocEvent]] = {part: [] for part in PARTS}
    for slot in _layout(template, runs, copies):
        part, i, c = slot
        ev = events[part][i]
        if isinstance(ev, Malloc):
            key_of[slot] = key = ev.key if c == 0 else f"{ev.key}~{c}"
            where = ev.where
            if (part, i) in indices:
                x, y, z = indices[(part, i)]
                where = LAYER_INDEX.sub(rf"\g<1>{x + y * c + z * copies}", where, count=1)
            parts[part].append(replace(ev, key=key, where=where))
        elif isinstance(ev, Free) and (part, i) in rules:
            parts[part].append(replace(ev, key=key_of[_rule_target(rules[(part, i)], c, copies)]))
        else:
            parts[part].append(ev)
    return AllocStream(
        tuple(parts["resident"]),  # type: ignore[arg-type]
        tuple(parts["step"]),
        tuple(parts["lazy"]),  # type: ignore[arg-type]
        source=template.source,
        notes=template.notes,
    )


# ---- the tracker's peak, from the stream --------------------------------------------------------------
def stream_peak(stream: AllocStream) -> int:
    """The live bytes at the step's highest moment, what exists before the step included: the tracker's
    peak, where the stream holds every storage the tracker counts (DDP's rebuilt buckets, which no tracker
    sees, left out)."""
    size = {m.key: m.nbytes for m in (*stream.resident, *stream.lazy) if m.category != DDP_BUCKET}
    total = best = sum(size.values())
    for ev in stream.step:
        if isinstance(ev, Malloc):
            size[ev.key] = ev.nbytes
            total += ev.nbytes
            best = max(best, total)
        elif isinstance(ev, Free) and ev.key in size:
            total -= size.pop(ev.key)
    return best
