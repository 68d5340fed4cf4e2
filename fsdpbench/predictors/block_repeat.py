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
out — is a rule read off the three deeper traces per free and required to hold in all of them. The
tracked peak is the stream's (checked equal to the tracker's on every shallow trace); parameter counts
and model states grow by a block's worth per period (checked on all four). Anything that does not hold
answers None, and the case is traced whole. ``tests/test_block_repeat.py`` compares the result with
whole traces.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from fsdpbench.core.case import Case, ac_every
from fsdpbench.predictors.memory_model.alloc_stream import AllocStream
from fsdpbench.predictors.memory_model.allocator import AllocEvent, Free, Malloc
from fsdpbench.predictors.traced import TracedEstimate

PARTS = ("resident", "lazy", "step")
LAYER_INDEX = re.compile(r"(layers\.)(\d+)")
SHALLOWEST = 2  # blocks of the shallowest trace: a first and a last block that differ from the rest
COPY_SHIFTS = (0, -1, 1)  # a free's copy: its own, the previous one's, the next one's (or mirrored)

Slot = tuple[str, int, int]  # (part, index in the a + p stream, copy)


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


def shallow_depths(blocks: int, period: int) -> list[int] | None:
    """The four depths traced (``a`` … ``a + 3p``); None where they are not fewer than the blocks."""
    a = SHALLOWEST + (blocks - SHALLOWEST) % period
    depths = [a + k * period for k in range(4)]
    return depths if depths[-1] < blocks else None


def repeat_blocks(case: Case, trace: Callable[[Case], TracedEstimate]) -> TracedEstimate | None:
    """The traced estimate of ``case`` from ``trace`` of four shallow copies of it, or None (see above)."""
    shape = blocks_and_period(case)
    depths = shallow_depths(*shape) if shape else None
    if shape is None or depths is None:
        return None
    blocks, period = shape
    copies = (blocks - depths[0]) // period
    shallow = [trace(case.replace(model_args={**case.model_args, "n_layers": d})) for d in depths]
    streams = [e.alloc_stream for e in shallow]
    if any(s is None or stream_peak(s) != e.peak_bytes for s, e in zip(streams, shallow, strict=True)):
        return None
    extended = extend(streams, copies)
    grown = _grown(shallow, copies) if extended is not None else None
    if extended is None or grown is None:
        return None
    peak = stream_peak(extended)
    if sum(grown["peak"].values()) != peak:
        return None
    last = shallow[-1]
    return replace(
        last,
        case_id=case.case_id,
        params=grown["params"],
        peak_bytes=peak,
        peak_by_category=grown["peak"],
        states_by_category=grown["states"],
        model_states_bytes=grown["model_states"],
        wall_s=sum(e.wall_s for e in shallow),
        notes=(*last.notes, repeated_note(depths, blocks)),
        alloc_stream=extended,
    )


def repeated_note(depths: Sequence[int], blocks: int) -> str:
    return (
        f"traced with {', '.join(map(str, depths))} blocks and each block's events repeated to {blocks} "
        "(identical blocks; the construction reproduced the deeper traces event for event)"
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
    trace, each growing by the same amount per period over all four traces; the tracker's peak by
    category likewise over the three deeper ones (the shallowest peaks elsewhere in the step)."""
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
                kind[ev.key] = t = ("malloc", ev.nbytes, ev.stream, ev.category)
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
) -> tuple[dict[tuple[str, int], tuple], dict[tuple[str, int], tuple[int, int, int]]] | None:
    """Per free of the template, the rule that gives its allocation's slot for any number of copies,
    consistent with every deeper trace (1, 2, 3 copies), None where no rule of the family fits; and per
    allocation labelled with a block, the block's index as a function of its copy and of the copies."""
    observed: dict[tuple[str, int], list[tuple[Slot, int, Slot]]] = {}
    blocks: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    template_tokens = _tokens(template)
    for copies, stream in enumerate(deeper, start=1):
        layout = _layout(template, runs, copies)
        tokens = _tokens(stream)
        if [t for part in PARTS for t in tokens[part]] != [template_tokens[p][i] for p, i, _ in layout]:
            return None
        targets = _targets(stream, layout)
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
        return None
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


def extend(streams: Sequence[AllocStream], copies: int) -> AllocStream | None:
    """The stream of ``a + copies·p`` blocks from the streams of ``a`` … ``a + 3p`` blocks; None where
    the construction does not reproduce the deeper traces."""
    shallow, template = streams[0], streams[1]
    for from_end in (False, True):
        runs = _runs(shallow, template, from_end=from_end)
        if runs is None:
            continue
        in_run = {(part, i) for part in PARTS for j1, j2 in runs[part] for i in range(j1, j2)}
        learnt = _learn_rules(template, runs, streams[1:], in_run)
        if learnt is not None:
            return _build(template, runs, copies, *learnt)
    return None


def _build(
    template: AllocStream, runs: dict[str, list[tuple[int, int]]], copies: int, rules: dict, indices: dict
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
    peak, where the stream holds every storage the tracker counts."""
    size = {m.key: m.nbytes for m in (*stream.resident, *stream.lazy)}
    total = best = sum(size.values())
    for ev in stream.step:
        if isinstance(ev, Malloc):
            size[ev.key] = ev.nbytes
            total += ev.nbytes
            best = max(best, total)
        elif isinstance(ev, Free) and ev.key in size:
            total -= size.pop(ev.key)
    return best
