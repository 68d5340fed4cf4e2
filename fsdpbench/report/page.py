"""The self-contained HTML page: plotly.js embedded once, one div per figure, tables, the environment.

No template engine and no network: the page opens from ``file://`` on a machine with no internet.
The page records its own JavaScript errors in ``<html data-js-errors=...>`` and sets
``<body data-figures-rendered=N>`` once every figure is drawn (the browser test reads both).
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from typing import Any

from fsdpbench.core.schema import COMMIT, FAILED, HOSTNAME, RUN, SKIPPED, STATUS, TORCH_VERSION
from fsdpbench.report.data import ReportData, RunData, shown_path
from fsdpbench.report.panel import Panel, describe_ranks
from fsdpbench.report.tables import (
    CompareRow,
    case_table,
    compare_rows,
    glance_groups,
    model_error_lines,
    traced_origin,
    verdict_lines,
)

_ERRORS_JS = """
window.__fsdpbenchErrors = [];
function __fsdpbenchRecord(msg) {
  window.__fsdpbenchErrors.push(String(msg));
  document.documentElement.setAttribute('data-js-errors', JSON.stringify(window.__fsdpbenchErrors));
}
window.addEventListener('error', function (e) { __fsdpbenchRecord('error: ' + e.message); });
window.addEventListener('unhandledrejection', function (e) { __fsdpbenchRecord('rejection: ' + e.reason); });
['error', 'warn'].forEach(function (level) {
  var orig = console[level];
  console[level] = function () {
    __fsdpbenchRecord('console.' + level + ': ' + Array.prototype.join.call(arguments, ' '));
    return orig.apply(console, arguments);
  };
});
"""

_RENDER_JS = """
(function () {
  var nodes = document.querySelectorAll('script.figure-data');
  var pending = [];
  nodes.forEach(function (node) {
    var fig = JSON.parse(node.textContent);
    pending.push(Plotly.newPlot(node.dataset.target, fig.data, fig.layout,
                                {responsive: true, displaylogo: false}));
  });
  Promise.all(pending).then(function () {
    document.body.setAttribute('data-figures-rendered', String(pending.length));
  }, function (err) { __fsdpbenchRecord('plot failed: ' + err); });
})();
"""

_CSS = """
body { font-family: 'DejaVu Sans', Arial, sans-serif; margin: 0 auto; max-width: 1400px; padding: 0 24px 60px;
       color: #222; }
h1 { margin: 24px 0 4px; } h2 { margin: 36px 0 6px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { margin: 18px 0 6px; font-size: 15px; }
.sub { color: #555; margin: 0 0 12px; } nav a { margin-right: 14px; font-size: 13px; }
.caption { color: #333; font-size: 13px; margin: 4px 0 8px; max-width: 1200px; }
.note, .missing { background: #fff7e0; border-left: 4px solid #e0a800; padding: 6px 10px; font-size: 13px; }
.missing { font-style: italic; }
.figure { width: 100%; min-height: 300px; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: right; vertical-align: top; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
tr.failed td { background: #fde8e8; } tr.skipped td { background: #fff7e0; }
td.win { font-weight: bold; background: #e6f4ea; }
td.n { white-space: nowrap; } code.id { font-size: 10px; color: #666; } .scroll { overflow-x: auto; }
table.cases td.l:last-child { max-width: 420px; }
pre { background: #f6f6f6; padding: 8px; font-size: 12px; overflow-x: auto; }
ul.verdict li { margin: 4px 0; } code { font-size: 12px; }
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _figure_json(fig: Any) -> str:
    return fig.to_json().replace("</", "<\\/")  # safe inside <script>


def render_panel(panel: Panel) -> str:
    parts = [f'<section id="{_e(panel.key)}"><h2>{_e(panel.title)}</h2>']
    if panel.figure is None:
        parts.append(
            f'<p class="missing" data-missing="{_e(panel.key)}">{_e(panel.missing or "no data")}</p>'
        )
    else:
        parts.append(f'<p class="caption">{_e(panel.caption)}</p>')
        parts += [f'<p class="note">{_e(n)}</p>' for n in panel.notes]
        div = f"fig-{panel.key}"
        parts.append(f'<div class="figure" id="{div}" data-figure="{_e(panel.key)}"></div>')
        parts.append(
            f'<script type="application/json" class="figure-data" data-target="{div}">'
            f"{_figure_json(panel.figure)}</script>"
        )
    parts.append("</section>")
    return "\n".join(parts)


def render_compare_table(rows: list[CompareRow], columns: list[str]) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="{"win" if c in row.winners else ""}">{_e(row.text.get(c, "—"))}</td>'
            for c in columns
        )
        winner = ", ".join(row.winners) if row.winners else ("—" if row.better else "")
        body.append(f'<tr><td class="l">{_e(row.metric)}</td>{cells}<td class="l">{_e(winner)}</td></tr>')
    return f'<table><tr><th class="l">metric</th>{head}<th class="l">winner</th></tr>{"".join(body)}</table>'


def render_glance(data: ReportData) -> str:
    lines = verdict_lines(data.cases) + model_error_lines(data.cases)
    parts = ['<section id="glance"><h2>At a glance</h2>']
    if lines:
        parts.append('<ul class="verdict">' + "".join(f"<li>{_e(x)}</li>" for x in lines) + "</ul>")
    else:
        parts.append(
            '<p class="missing">no two finished cases at the same world size and settings to compare</p>'
        )
    parts.append(
        '<p class="caption">Memory: tracker (live tensors from PyTorch\'s memory trackers), largest rank, '
        "memory-tracked step; cells read measured / predicted (error). Step time: slowest rank's median "
        "(p10–p90). Green = best in the row.</p>"
    )
    for title, group in glance_groups(data.cases)[:8]:
        parts.append(f"<h3>{_e(title)}</h3>")
        parts.append(render_compare_table(compare_rows(group), group["label"].tolist()))
    parts.append("</section>")
    return "\n".join(parts)


def render_case_table(data: ReportData) -> str:
    table = case_table(data.cases, {r.run: r.meta for r in data.runs})
    origin = traced_origin([r.meta for r in data.runs])
    traced = (
        f" (traced: the traced predictor, asked for by {origin})"
        if origin
        else " (no traced predictions: a run makes them with --traced or the scenario's traced: true)"
    )
    parts = [
        '<section id="cases"><h2>Every case</h2>',
        '<p class="caption">All cases of the run, failed and skipped ones with their reason. Memory: tracker '
        f"peak of the largest rank; prediction: analytic model for the same case{_e(traced)}, "
        "error = (predicted − measured) / measured; wall: launch to "
        "exit of the case's processes (from run.json); throughput: global batch / case step time; MFU: "
        "counted FLOPs / step time / the GPU's datasheet peak (not meaningful on CPU ranks); harness "
        "overhead (runs with bare_steps): mean timed step / mean bare-loop step − 1. Emulated cases (ranks "
        "column): only the named ranks ran, each alone with a fake process group: compute-only step time, "
        "no NCCL buffers, no losses. Columns no case has a value in are left out.</p>",
    ]
    if table.empty:
        parts.append('<p class="missing">no cases in this run</p></section>')
        return "\n".join(parts)
    cols = [c for c in table.columns if not c.startswith("_") and c != "case_id"]
    left = ("case", STATUS, "ranks", "note")
    parts.append(
        '<div class="scroll"><table class="cases"><tr>'
        + "".join(f'<th class="{"l" if c in left else ""}">{_e(c)}</th>' for c in cols)
        + "</tr>"
    )
    for _, row in table.iterrows():
        cls = FAILED if row["_failed"] else (SKIPPED if row[STATUS] == SKIPPED else "")
        cells = []
        for c in cols:
            text = _e(row[c]) + (f'<br><code class="id">{_e(row["case_id"])}</code>' if c == "case" else "")
            cells.append(f'<td class="{"l" if c in left else "n"}">{text}</td>')
        parts.append(f'<tr class="{cls}" data-status="{_e(row[STATUS])}">{"".join(cells)}</tr>')
    parts.append("</table></div></section>")
    return "\n".join(parts)


def render_environment(data: ReportData) -> str:
    parts = ['<section id="environment"><h2>Environment</h2>']
    for run in data.runs:
        ranks = describe_ranks(data.cases[data.cases[RUN] == run.run]) if RUN in data.cases else ""
        items = [*_run_items(run), *_machine_items(run.meta.get("env") or {}), ("ranks", ranks)]
        items += _emulation_items(run.meta.get("emulation") or {})
        if run.meta.get("gloo_loop_policy"):  # CPU ranks only (hosttuning/threads.py); runs before it: none
            items.append(("gloo loop threads", str(run.meta["gloo_loop_policy"])))
        skipped = run.meta.get(SKIPPED) or []
        if skipped:
            items.append((SKIPPED, "; ".join(f"{s.get('case_id')}: {s.get('reason')}" for s in skipped)))
        rows = "".join(f'<tr><th class="l">{_e(k)}</th><td class="l">{_e(v)}</td></tr>' for k, v in items)
        parts.append(f"<h3>{_e(run.run)}</h3><table>{rows}</table>")
        text = (run.meta.get("scenario") or {}).get("text")
        if text:
            parts.append(f"<details open><summary>scenario text</summary><pre>{_e(text)}</pre></details>")
    parts.append("</section>")
    return "\n".join(parts)


def _run_items(run: RunData) -> list[tuple[str, Any]]:
    """What was run, from run.json: the scenario, the command, when, how it ended."""
    meta = run.meta
    scenario = meta.get("scenario") or {}
    overrides = scenario.get("overrides")
    return [
        (RUN, f"{run.run} ({shown_path(run.run_dir)})"),
        ("scenario", scenario.get("name")),
        ("description", scenario.get("description")),
        ("scenario file", scenario.get("path")),
        ("overrides", json.dumps(overrides) if overrides else "none"),
        ("command", meta.get("command")),
        ("started", meta.get("started")),
        ("ended", meta.get("ended")),
        (STATUS, meta.get(STATUS)),
    ]


def _machine_items(env: dict[str, Any]) -> list[tuple[str, Any]]:
    """Where it ran: software versions, host, CPU, GPUs, backends."""
    backends = ", ".join(f"{k}: {_yes(v)}" for k, v in (env.get("backends") or {}).items())
    return [
        ("torch", env.get(TORCH_VERSION)),
        ("fsdpbench", f"{env.get('fsdpbench_version', '?')}, commit {env.get(COMMIT, '?')}"),
        ("python", env.get("python_version")),
        ("host", env.get(HOSTNAME)),
        ("platform", env.get("platform")),
        ("CPU", f"{env.get('cpu', '?')} ({env.get('cpu_count', '?')} cores)"),
        ("GPUs", ", ".join(env.get("gpus") or []) or "none"),
        ("backends", backends),
        ("CUDA", f"{_yes(env.get('cuda_available'))} — {env.get('cuda_reason', '')}"),
        ("NVML", f"{_yes(env.get('nvml_available'))} — {env.get('nvml_reason', '')}"),
    ]


def _emulation_items(emulation: dict[str, Any]) -> list[tuple[str, Any]]:
    if not emulation:
        return []
    cases = (
        f"{len(emulation.get('cases') or [])}: each listed rank ran alone on one device with a fake process "
        "group (collectives are no-ops; every allocation is real)"
    )
    unseen = [
        (f"emulation cannot see: {k.replace('_', ' ')}", v)
        for k, v in (emulation.get("cannot_see") or {}).items()
    ]
    return [("emulated cases", cases), *unseen]


def _yes(flag: Any) -> str:
    return "yes" if flag else "no"


def render_page(data: ReportData, panels: list[Panel], plotly_js: str) -> str:
    """The whole report as one HTML string."""
    names = list(dict.fromkeys((r.meta.get("scenario") or {}).get("name") or r.run for r in data.runs))
    cases = data.cases
    counts = cases[STATUS].value_counts().to_dict() if STATUS in cases else {}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    n_figs = sum(p.figure is not None for p in panels)
    nav = " ".join(
        f'<a href="#{_e(k)}">{_e(t)}</a>'
        for k, t in [("glance", "At a glance")]
        + [(p.key, p.title) for p in panels]
        + [("cases", "Every case"), ("environment", "Environment")]
    )
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    body = [
        f"<h1>fsdpbench report — {_e(', '.join(names))}</h1>",
        f'<p class="sub">{len(cases)} cases ({_e(summary)}) · {_e(describe_ranks(cases))} · '
        f"{len(data.runs)} run{'s' if len(data.runs) != 1 else ''} · generated {stamp}</p>",
        f"<nav>{nav}</nav>",
        render_glance(data),
        *(render_panel(p) for p in panels),
        render_case_table(data),
        render_environment(data),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>fsdpbench report — {_e(', '.join(names))}</title>\n"
        f"<script>{_ERRORS_JS}</script>\n<style>{_CSS}</style>\n"
        f'<script type="text/javascript">{plotly_js}</script>\n</head>\n'
        f'<body data-figures-expected="{n_figs}">\n'
        + "\n".join(body)
        + f"\n<script>{_RENDER_JS}</script>\n</body></html>\n"
    )
