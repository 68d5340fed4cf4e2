"""Does a case fit on a GPU with this much memory? Answered the way the job would find out: the step's
allocation stream (traced op by op, ``traced_stream.py``) replayed through the CUDA caching allocator model
(``memory_model/allocator.py``) under the memory the allocator may take — the device's memory less what
NVML shows besides it (CUDA context and libraries, NCCL's buffers: ``memory_model/nvml.py``) — freeing
its cache and retrying before it gives up, as PyTorch does.

    from fsdpbench.predictors.device_fit import fit_on_device, predict_device_memory
    mem = predict_device_memory(case)            # tracked, allocated, reserved, NVML peaks (bytes)
    fit = fit_on_device(case, 20 * 2**30)        # fits? which figure decided, by how much

The analytic tracked peak (instant) is a necessary condition — the allocator holds at least the live
tensors — so a case whose tracked peak alone does not fit is answered without a trace, and the searches
(largest batch, smallest world size) start from the analytic answer and trace only near the boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsdpbench.core.case import Case
from fsdpbench.predictors.memory_model.alloc_stream import AllocStream, CudaRuntime
from fsdpbench.predictors.memory_model.allocator import AllocatorStats, AllocConf, OutOfMemory
from fsdpbench.predictors.memory_model.nvml import Calibration, NvmlTerms, job_loads, nvml_terms

if TYPE_CHECKING:
    from fsdpbench.predictors.block_repeat import Construction
    from fsdpbench.predictors.traced import TracedEstimate


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One rank's predicted device memory, layer by layer (bytes; modelled figures)."""

    tracked_peak: int  # live tensors at the peak (the traced tracker)
    allocated_peak: int  # the allocator's max_memory_allocated
    reserved_peak: int  # the allocator's max_memory_reserved
    fragmentation: float  # at the allocated peak: reserved but free, as a share of reserved
    terms: NvmlTerms
    conf: AllocConf
    reserved_by_stream: dict[str, int] = field(default_factory=dict)
    peak_where: str = ""
    notes: tuple[str, ...] = ()

    @property
    def nvml_peak(self) -> int:
        return self.terms.nvml_bytes(self.reserved_peak)

    def to_dict(self) -> dict:
        return {
            "tracked_peak_bytes": self.tracked_peak,
            "allocated_peak_bytes": self.allocated_peak,
            "reserved_peak_bytes": self.reserved_peak,
            "nvml_peak_bytes": self.nvml_peak,
            "fragmentation": round(self.fragmentation, 4),
            "context_bytes": self.terms.context_bytes,
            "context_source": self.terms.context_source,
            "nccl_bytes": self.terms.nccl_bytes,
            "nccl_source": self.terms.nccl_source,
            "nvml_terms_bytes": self.terms.by_name(),
            "alloc_conf": self.conf.describe(),
            "reserved_by_stream": dict(self.reserved_by_stream),
            "peak_where": self.peak_where,
        }


@dataclass(frozen=True, slots=True)
class DeviceFit:
    device_memory_bytes: int
    fits: bool
    decided_by: str  # which figure decided
    margin_bytes: int  # what is left (≥ 0) or missing (< 0) against the device memory
    needed_bytes: int | None  # NVML-level need when known: reserved peak + context + NCCL
    oom: OutOfMemory | None = None
    retries: int = 0  # times the allocator freed its cache and retried (slow steps, still fits)

    def describe(self, fmt) -> str:  # noqa: ANN001 — a bytes formatter
        """One line: fits or not, by which figure, by how much."""
        mem = fmt(self.device_memory_bytes)
        if self.fits:
            text = f"fits in {mem}: {self.decided_by}, {fmt(self.margin_bytes)} to spare"
            if self.retries:
                text += f" (only after freeing the allocator's cache {self.retries}×: slower steps)"
            return text
        if self.oom is not None:
            return (
                f"does NOT fit in {mem}: {self.decided_by} — out of memory allocating "
                f"{fmt(self.oom.nbytes)} at {self.oom.where or '?'} with {fmt(self.oom.allocated)} allocated "
                f"and {fmt(self.oom.reserved)} reserved of {fmt(self.oom.limit)} the allocator may use"
            )
        return f"does NOT fit in {mem}: {self.decided_by}, short by {fmt(-self.margin_bytes)}"


# the largest per-rank batch the allocator model's search traces: a trace makes the rank's batch sample by
# sample, as a data loader hands them (models.make_samples), so its cost grows with the batch (decoder-tiny
# at 80 GiB would search past a million sequences, minutes a trace); an answer at the limit reads "or more"
TRACED_MAX_BATCH = 4096
SEARCHED = ("batch_size", "world_size")  # the case fields the searches vary


@dataclass(frozen=True, slots=True)
class AllocatorAnswer:
    """``predict --device-memory`` on CUDA: one rank's device memory layer by layer, fits?, and the
    largest batch and the smallest world size that fit (all modelled)."""

    memory: DeviceMemory
    # None: the predictions contradict each other (``disagreements``) on what decides it: no verdict
    fit: DeviceFit | None
    largest_batch: int | None
    smallest_world_size: int | None
    max_world_size: int
    recipe: str = ""  # the optimizer, clipping and checkpointing the stream was traced with
    device_memory_bytes: int = 0
    # where this case's predictions contradict each other (predictors.consistency.disagreements)
    disagreements: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        fit = self.fit
        return {
            "method": "allocator model (traced allocation stream replayed; modelled)",
            "recipe": self.recipe,
            **self.memory.to_dict(),
            "device_memory_bytes": self.device_memory_bytes,
            "consistent": not self.disagreements,
            "disagreements": list(self.disagreements),
            "fits": fit.fits if fit else None,
            "decided_by": fit.decided_by if fit else None,
            "margin_bytes": fit.margin_bytes if fit and fit.oom is None else None,
            "oom_where": fit.oom.where if fit and fit.oom else None,
            "alloc_retries": fit.retries if fit else None,
            "largest_batch": self.largest_batch,
            "largest_batch_limit": TRACED_MAX_BATCH,  # the search traces no larger batch
            "smallest_world_size": self.smallest_world_size,
        }

    def lines(self, fmt, *, width: int = 78) -> list[str]:  # noqa: ANN001 — a bytes formatter
        """The answer as the terminal shows it: each figure on its own line, then the verdict; every line
        at most ``width`` columns (a figure's source goes on the line below when it does not fit)."""
        m, t = self.memory, self.memory.terms
        settings = m.conf.describe() or "torch's defaults"
        rows = [
            ("tracked peak (live tensors, traced tracker)", m.tracked_peak, ""),
            ("allocated peak (max_memory_allocated)", m.allocated_peak, ""),
            (
                "reserved peak (max_memory_reserved, no limit)",
                m.reserved_peak,
                f"fragmentation at the allocated peak {m.fragmentation:.0%}",
            ),
            *((f"+ {term.name}", term.nbytes, term.source.strip("()")) for term in t.terms),
            ("NVML used, no limit", m.nvml_peak, "reserved + the terms above"),
        ]
        label_width = max(len(label) for label, _, _ in rows)
        out = _wrapped(
            "device memory, modelled: the step's allocation stream (traced) replayed through the CUDA "
            f"caching allocator model (CUDACachingAllocator.cpp, torch 2.11 rules; settings: {settings})",
            width,
        )
        for label, value, why in rows:
            figure = f"  {label:<{label_width}}  {fmt(value):>12}"
            if why and len(figure) + len(why) + 4 <= width:
                out.append(f"{figure}  ({why})")
            else:
                out.append(figure)
                out += _wrapped(f"({why})", width, indent=" " * 6) if why else []
        if self.recipe:
            out += _wrapped(self.recipe, width, indent="  ")
        if self.disagreements or self.fit is None:
            out += _wrapped("this case's predictions contradict each other:", width)
            for found in self.disagreements:
                out += _wrapped(f"- {found}", width, indent="  ")
            if self.fit is None:
                text = (
                    f"no verdict on {fmt(self.device_memory_bytes)}: whether it fits is not known from them"
                )
            else:  # the live tensors alone, on which both methods agree, decide it
                text = self.fit.describe(fmt) + " (both methods agree on the live tensors)"
            return out + _wrapped(text, width) + _wrapped("no search: it would rest on them", width)
        out += _wrapped(self.fit.describe(fmt), width)
        out += _wrapped(
            f"largest per-rank batch that fits: {batch_text(self.largest_batch)}; smallest world size that "
            f"fits (powers of two ≤ {self.max_world_size}): {self.smallest_world_size or 'none'} "
            "(allocator model)",
            width,
        )
        return out


def batch_text(batch: int | None) -> str:
    """The allocator model's largest batch as a person reads it: at the search's limit, "or more"."""
    if batch is None:
        return "none"
    return f"{batch} or more (the search traces no larger batch)" if batch >= TRACED_MAX_BATCH else str(batch)


def _wrapped(text: str, width: int, *, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width`` columns, the first indented by ``indent``, the rest by two
    more spaces."""
    import textwrap

    return textwrap.wrap(
        text, width, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False
    )


class DeviceModel:
    """Traces and replays cases for one set of settings. A step's allocation stream is fixed by the case
    (its batch, world size, strategy, recipe …) and the rank, so each distinct case is traced once and its
    stream replayed under every limit asked; ``traced`` lists the cases traced, in order."""

    def __init__(
        self,
        conf: AllocConf | None = None,
        *,
        rank: int = 0,
        runtime: CudaRuntime | None = None,
        context_bytes: int | None = None,
        nccl_channels: int | None = None,
        on_trace: Callable[[Case], None] | None = None,
        calibration: Calibration | None = None,
        fsdpbench_run: bool = False,
        repeat_blocks: bool = True,
    ) -> None:
        self.conf = conf or AllocConf()  # a case's own alloc_conf: DeviceModel.for_case
        self.rank = rank
        self.runtime = runtime or CudaRuntime()
        self.context_bytes = context_bytes
        self.nccl_channels = nccl_channels
        self.on_trace = on_trace  # told before each trace (a progress line)
        self.traced: list[Case] = []
        self._estimates: dict[str, TracedEstimate] = {}
        self._replays: dict[str, AllocatorStats] = {}  # per case, its stream replayed with no limit
        self.calibration = calibration  # None: the reference H100's measured terms
        self.fsdpbench_run = fsdpbench_run  # NVML of one of fsdpbench's ranks (profiler, samplers)
        self.repeat_blocks = repeat_blocks  # a deep decoder from shallow traces (block_repeat.py)
        # per case but for batch and world size: how its blocks repeated (block_repeat.Construction; its
        # searches' cases follow it with one depth fewer) or None where they did not (traced whole)
        self._constructions: dict[str, Construction | None] = {}

    @classmethod
    def for_case(cls, case: Case, **kwargs) -> DeviceModel:  # noqa: ANN003 — DeviceModel's keywords
        """A model with the case's own allocator settings (``alloc_conf``)."""
        from fsdpbench.predictors.memory_model.allocator import parse_alloc_conf

        return cls(parse_alloc_conf(case.alloc_conf), **kwargs)

    def terms(self, case: Case) -> NvmlTerms:
        return nvml_terms(
            job_loads(case, fsdpbench_run=self.fsdpbench_run),
            calibration=self.calibration,
            context_bytes=self.context_bytes,
            nccl_channels=self.nccl_channels,
        )

    def estimate(self, case: Case) -> TracedEstimate:
        """The case's trace (tracker peak, states and allocation stream), made once per distinct case."""
        key = _case_key(case)
        if key not in self._estimates:
            from fsdpbench.predictors.block_repeat import DEPTHS, repeat_blocks
            from fsdpbench.predictors.traced import estimate

            if self.on_trace is not None:
                self.on_trace(case)
            self.traced.append(case)
            rank = min(self.rank, case.world_size - 1)

            def trace(c: Case) -> TracedEstimate:
                return estimate(c, rank=rank, record_stream=True)

            # a decoder's identical blocks traced once (block_repeat.py), else the case whole. A search's
            # case differs from the case asked only in its batch or world size: where the asked case's
            # blocks repeated it is traced one depth shallower (block_repeat.repeat_blocks), where they
            # did not it is traced whole at once (its shallow traces would most likely be spent for nothing)
            family = repr(sorted((k, v) for k, v in case.to_dict().items() if k not in SEARCHED))
            repeated = None
            if self.repeat_blocks and self._constructions.get(family, True) is not None:
                learnt = self._constructions.get(family)
                depths = DEPTHS if learnt is None else DEPTHS - 1
                repeated = repeat_blocks(case, trace, depths=depths, learnt=learnt)
                if learnt is None:
                    self._constructions[family] = repeated[1] if repeated else None
            self._estimates[key] = repeated[0] if repeated else trace(case)
        return self._estimates[key]

    def stream(self, case: Case) -> tuple[AllocStream, int]:
        """The case's traced allocation stream and tracked peak."""
        est = self.estimate(case)
        assert est.alloc_stream is not None  # recorded: record_stream=True
        return est.alloc_stream, est.peak_bytes

    def memory(self, case: Case) -> DeviceMemory:
        stream, tracked = self.stream(case)
        return self.replayed(case, stream, tracked)

    def replayed(self, case: Case, stream: AllocStream, tracked: int) -> DeviceMemory:
        """The device memory of a stream already traced (``tracked``: its tracker peak)."""
        stats = self._unlimited(case, stream)
        return DeviceMemory(
            tracked_peak=tracked,
            allocated_peak=stats.peak_allocated,
            reserved_peak=stats.peak_reserved,
            fragmentation=stats.fragmentation,
            terms=self.terms(case),
            conf=self.conf,
            reserved_by_stream=stats.reserved_by_stream,
            peak_where=stats.peak_allocated_where,
            notes=stream.notes,
        )

    def _unlimited(self, case: Case, stream: AllocStream) -> AllocatorStats:
        """The stream replayed with no limit, once per case. Under a limit it never reaches, a replay takes
        the same steps (the limit is read only where a segment would pass it): the same figures."""
        key = _case_key(case)
        if key not in self._replays:
            self._replays[key] = stream.replay(self.conf, runtime=self.runtime)
        return self._replays[key]

    def analytic_needed(self, case: Case) -> int | None:
        """The analytic tracked peak + NVML's terms: what the device needs at least (allocator ≥ tracker)."""
        from fsdpbench.predictors.memory_model import predict_memory

        analytic = predict_memory(case, rank=min(self.rank, case.world_size - 1), context_bytes=0)
        tracked = analytic.device_peak_bytes
        return None if tracked is None else tracked + self.terms(case).total

    def allocator_needed(self, case: Case) -> int:
        """NVML's figure with no limit: the allocator model's reserved peak + context + NCCL."""
        return self.memory(case).nvml_peak

    def fit(self, case: Case, device_memory: int) -> DeviceFit:
        """Fits? The analytic tracked peak first (a necessary condition), then the allocator model."""
        terms = self.terms(case)
        budget = device_memory - terms.total  # what the caching allocator may reserve
        needed = self.analytic_needed(case)
        if needed is not None and needed > device_memory:
            return DeviceFit(
                device_memory,
                False,
                "the tracked peak alone (analytic) + context + NCCL",
                device_memory - needed,
                None,
            )
        stream, _ = self.stream(case)
        stats = self._unlimited(case, stream)
        if stats.peak_reserved > budget:  # the limit decides: replayed under it (where it runs out)
            stats = stream.replay(self.conf, runtime=self.runtime, limit=max(0, budget))
        if stats.oom is not None:
            return DeviceFit(device_memory, False, "the allocator model", -1, None, stats.oom)
        needed = terms.nvml_bytes(stats.peak_reserved)
        return DeviceFit(
            device_memory,
            True,
            "the allocator model's reserved peak + context + NCCL",
            device_memory - needed,
            needed,
            retries=stats.num_alloc_retries,
        )

    # ---- searches -----------------------------------------------------------------------------------
    def analytic_largest_batch(self, case: Case, limit: int, *, max_batch: int = 1 << 20) -> int | None:
        """The largest per-rank batch whose analytic need (tracked peak + NVML's terms) is ≤ ``limit``."""
        from fsdpbench.predictors.memory_model import predict_memory
        from fsdpbench.predictors.memory_model.search import largest_batch

        rank = min(self.rank, case.world_size - 1)
        total = self.terms(case).total
        return largest_batch(
            case, lambda c: predict_memory(c, rank=rank, context_bytes=total), limit, max_batch=max_batch
        )

    def largest_batch(
        self, case: Case, device_memory: int, *, max_batch: int = TRACED_MAX_BATCH
    ) -> int | None:
        """The largest per-rank batch that fits, traced only near its edge. The analytic answer bounds it
        from above (the allocator holds at least the live tensors). The first guess is the analytic answer
        under the device memory less what the allocator model added to the analytic need of the case
        asked (its own trace); from there the search steps outwards, doubling, until it straddles the edge,
        then bisects: a right guess costs two traces (it fits, one more does not), or one at the bound."""
        bound = self.analytic_largest_batch(case, device_memory, max_batch=max_batch)
        if bound is None:
            return None
        guess, analytic = bound, self.analytic_needed(case)
        if analytic is not None:
            overhead = max(0, self.allocator_needed(case) - analytic)
            guess = self.analytic_largest_batch(case, device_memory - overhead, max_batch=bound) or 1

        def fits(b: int) -> bool:
            return self.fit(case.replace(batch_size=b), device_memory).fits

        if fits(guess):  # walk up to the edge: lo fits, hi does not (bound + 1 does not, analytically)
            lo, hi, step = guess, bound + 1, 1
            while lo + step < hi:
                if not fits(lo + step):
                    hi = lo + step
                    break
                lo, step = lo + step, 2 * step
        else:  # walk down to the edge: hi does not fit
            hi, step = guess, 1
            while True:
                if hi == 1:
                    return None  # batch 1 does not fit
                lo = max(1, hi - step)
                if fits(lo):
                    break
                hi, step = lo, 2 * step
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def smallest_world_size(
        self, case: Case, device_memory: int, *, max_world_size: int = 65536, multiple: int = 1
    ) -> int | None:
        """The smallest power of two from the analytic answer up (the allocator needs at least what the
        tracker does) that fits. A rank of a larger world holds no more (its shards only shrink), so the
        candidates are searched as an ordered list: the analytic answer first (usually the answer: one
        trace, none when it is the world size asked), then the largest (none fits if it does not), then
        by bisection between — a few traces where walking up would trace every power of two. Where no
        candidate fits analytically under the device memory less what the allocator model added to the
        analytic need of the case asked (its own trace; the guess ``largest_batch`` makes too), the largest
        is tried first: what a rank keeps whole (ZeRO-1's and DDP's parameters and gradients) does not
        shrink with the world, and the answer is most likely none, known from one trace."""
        from fsdpbench.predictors.memory_model import predict_memory
        from fsdpbench.predictors.memory_model.search import smallest_world_size

        predicted: dict[int, Any] = {}  # world size -> its MemoryPrediction (both searches ask)

        def analytic(c: Case):  # noqa: ANN202 — a MemoryPrediction
            if c.world_size not in predicted:
                rank = min(self.rank, c.world_size - 1)
                predicted[c.world_size] = predict_memory(c, rank=rank, context_bytes=self.terms(c).total)
            return predicted[c.world_size]

        def analytic_answer(limit: int) -> int | None:
            return smallest_world_size(
                case, analytic, limit, max_world_size=max_world_size, multiple=multiple
            )

        n = analytic_answer(device_memory)
        candidates = []
        while n is not None and n <= max_world_size:
            if n % multiple == 0:
                candidates.append(n)
            n *= 2
        if not candidates:
            return None

        def fits(k: int) -> bool:
            return self.fit(case.replace(world_size=candidates[k]), device_memory).fits

        last = len(candidates) - 1
        lo, hi = 0, last  # lo: does not fit (-1: none known); hi: the first that fits, once known
        if self._likely_none_fits(case, device_memory, analytic_answer):
            if not fits(last):
                return None
            lo = -1
        else:
            if fits(0):
                return candidates[0]
            if last == 0 or not fits(last):
                return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return candidates[hi]

    def _likely_none_fits(
        self, case: Case, device_memory: int, analytic_answer: Callable[[int], int | None]
    ) -> bool:
        """Whether no world size fits analytically once the allocator model's overhead on the case asked
        (its need beyond the analytic one) is set aside."""
        analytic = self.analytic_needed(case)
        if analytic is None:
            return False
        overhead = max(0, self.allocator_needed(case) - analytic)
        return overhead > 0 and analytic_answer(device_memory - overhead) is None


def _case_key(case: Case) -> str:
    """What makes a case distinct for its trace and its replay: every field."""
    return repr(sorted(case.to_dict().items()))
