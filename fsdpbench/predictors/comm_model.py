"""The α–β communication model: how long one collective takes on a link, and the link presets.

    time = α + S × algorithm_factor(kind, N) / busbw

S is the full tensor's size in bytes (the all-gather output, the reduce-scatter input, the
all-reduced or broadcast tensor: ``CollectiveRecord.payload_bytes`` of metrics/comm.py), N the
group size, busbw the link's *bus bandwidth* in the nccl-tests sense, whose factors are used
unchanged (nccl-tests, doc/PERFORMANCE.md):

    all_reduce                 2(N-1)/N
    all_gather, reduce_scatter  (N-1)/N
    broadcast                       1
    other                           1   (alltoall, send/recv: an upper bound, as in comm.py)

A link is two numbers. The presets are typical published figures for one GPU's path, not
measurements of this machine (docs/step-time-model.md gives each one's source); ``gloo`` is not
a preset: it is measured on this machine by the probe (fsdpbench/pipeline/comm_probe.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Link:
    """A link as the α–β model sees it: per-collective latency and bus bandwidth."""

    name: str
    alpha_us: float
    busbw_GBps: float  # 1 GB = 1e9 bytes, as nccl-tests reports
    source: str = ""  # where the numbers come from ("preset: …", "probed: …", "given on the command line")
    # gloo has no reduce-scatter algorithm: it all-reduces a clone of the full input (metrics/comm.py).
    # The probe times reduce_scatter_tensor itself, a line of its own in ``per_kind``; a probed link
    # without one (its cache from before 2026-11-26) times a reduce-scatter with the all-reduce's line.
    reduce_scatter_as_all_reduce: bool = False
    # (kind, α µs, busbw GB/s) of the kinds measured one by one (the gloo probe: gloo runs each kind
    # with its own algorithm, so one line does not fit all); α and busbw above are for the others
    per_kind: tuple[tuple[str, float, float], ...] = ()
    # the same for a collective *queued* behind the previous one (issued with no compute between
    # them: ZeRO-1's broadcasts); the gloo probe times these back to back, ``per_kind`` in context
    per_kind_queued: tuple[tuple[str, float, float], ...] = ()

    def alpha_busbw(self, kind: str, queued: bool = False) -> tuple[float, float]:
        """(α µs, busbw GB/s) for a collective of ``kind`` on this link (``queued``: issued while the
        previous collective was still running)."""
        for name, alpha, busbw in (self.per_kind_queued if queued else ()) + self.per_kind:
            if name == kind:
                return float(alpha), float(busbw)
        return self.alpha_us, self.busbw_GBps

    def label(self) -> str:
        """One line naming the link and its numbers, for tables and figures."""
        if self == ONE_RANK_LINK:
            return f"{self.name} (no collective leaves the process)"
        return f"{self.name} (α={self.alpha_us:.3g} µs, busbw={self.busbw_GBps:.3g} GB/s)"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


# One rank: every collective is over a group of one and takes no link time (step_model), whatever the
# link; a probed link is then not probed (2 processes, seconds, for numbers nothing uses).
ONE_RANK_LINK = Link(
    "one rank",
    alpha_us=0.0,
    busbw_GBps=math.inf,
    source="not probed: at 1 rank no collective leaves the process",
)

# One GPU's path to its peers. Sources and caveats: docs/step-time-model.md#link-presets.
LINK_PRESETS: dict[str, Link] = {
    "nvlink4": Link("nvlink4", alpha_us=10.0, busbw_GBps=360.0, source="preset: H100 SXM NVLink 4, 8 GPUs"),
    "nvlink5": Link("nvlink5", alpha_us=10.0, busbw_GBps=720.0, source="preset: B200 NVLink 5, 8 GPUs"),
    "ib-ndr400": Link(
        "ib-ndr400", alpha_us=20.0, busbw_GBps=45.0, source="preset: InfiniBand NDR 400 Gb/s, 1 NIC/GPU"
    ),
    "roce-200": Link("roce-200", alpha_us=30.0, busbw_GBps=22.0, source="preset: RoCE 200 Gb/s, 1 NIC/GPU"),
    "pcie4": Link("pcie4", alpha_us=15.0, busbw_GBps=20.0, source="preset: PCIe 4.0 x16, no NVLink"),
}
PROBED_LINKS = ("gloo",)  # measured on this machine, not preset
AUTO = "auto"  # gloo (probed) for gloo cases, nvlink4 for nccl cases


class LinkError(ValueError):
    """A --link value that names no preset and is not alpha_us=..,busbw_GBps=.."""


def link_choices() -> str:
    return ", ".join([AUTO, *PROBED_LINKS, *LINK_PRESETS, "alpha_us=A,busbw_GBps=B"])


def validate_link_spec(spec: str) -> str:
    """The spec unchanged if it is a preset, a probed link, 'auto' or explicit numbers; else LinkError."""
    if spec in LINK_PRESETS or spec in PROBED_LINKS or spec == AUTO:
        return spec
    parse_explicit_link(spec)
    return spec


def parse_explicit_link(spec: str) -> Link:
    """'alpha_us=5,busbw_GBps=100' → Link; LinkError naming what is wrong."""
    fields: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("alpha_us", "busbw_GBps"):
            raise LinkError(f"--link {spec!r}: expected one of {link_choices()}")
        try:
            fields[key] = float(value)
        except ValueError:
            raise LinkError(f"--link {spec!r}: {key}={value!r} is not a number") from None
    if set(fields) != {"alpha_us", "busbw_GBps"}:
        raise LinkError(f"--link {spec!r}: give both alpha_us and busbw_GBps")
    check_link_numbers(fields["alpha_us"], fields["busbw_GBps"], f"--link {spec!r}")
    return Link("custom", fields["alpha_us"], fields["busbw_GBps"], source="given on the command line")


# the numbers a link may have: beyond them, a typo or a forgery (a second per collective; a millibyte
# per second makes a step of years; a petabyte per second is a thousand NVLink 5 domains)
ALPHA_US_RANGE = (0.0, 1e6)
BUSBW_GBPS_RANGE = (1e-3, 1e6)


def check_link_numbers(alpha_us: object, busbw_GBps: object, where: str) -> None:
    """α and busbw finite and within ``ALPHA_US_RANGE``/``BUSBW_GBPS_RANGE``; LinkError naming ``where``
    (an inf or 5e-324 busbw made every modelled step time inf)."""
    from fsdpbench.core.readback import ReadBackError, finite_number

    try:
        finite_number(alpha_us, f"{where}: alpha_us", low=ALPHA_US_RANGE[0], high=ALPHA_US_RANGE[1])
        finite_number(busbw_GBps, f"{where}: busbw_GBps", low=BUSBW_GBPS_RANGE[0], high=BUSBW_GBPS_RANGE[1])
    except ReadBackError as exc:
        raise LinkError(str(exc)) from None


def algorithm_factor(kind: str, group_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of a collective of ``kind`` over ``group_size`` ranks."""
    n = int(group_size)
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if kind in ("broadcast", "other"):
        return 1.0
    raise ValueError(f"unknown collective kind {kind!r}")


def collective_time_us(
    link: Link, kind: str, payload_bytes: float, group_size: int, queued: bool = False
) -> float:
    """Modelled time of one collective on ``link``: α + S·factor/busbw (0 for a 1-rank group)."""
    if group_size <= 1:
        return 0.0
    if kind == "reduce_scatter" and link.reduce_scatter_as_all_reduce:
        kind = "all_reduce"
    alpha, busbw = link.alpha_busbw(kind, queued)
    return alpha + payload_bytes * algorithm_factor(kind, group_size) / (busbw * 1e3)
