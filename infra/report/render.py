"""Render :class:`~trainguard.infra.report.data.ReportData` as one self-contained HTML file.

Plots are Plotly's (``plotly`` draws interactive SVG in the browser from a JSON figure: hover,
zoom and pan on a months-long curve, two small pure-Python dependencies, and its JavaScript
inlined once, so the file opens on an air-gapped cluster with no network).  The page records
its own rendering in ``#tg-render-check`` (plots drawn, incidents shaded, JavaScript errors) so a
headless browser test can check what a person would see.
"""

from __future__ import annotations

import datetime as dt
import html
import json
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from trainguard.infra.report.data import JobData, ReportData, phases

#: the phases' colours (the same in the legend, the plot and the table); "recover" is the recovery
#: procedure, "resume" from its end to the job's first training step (see ``data.phases``).
PHASE_COLOURS = {
    "detect": "#f5a623",
    "localise": "#9b59b6",
    "decide": "#e74c3c",
    "recover": "#2ecc71",
    "resume": "#3498db",
}
#: above this many incidents the curve's incident labels become hover-only (they would overlap).
MAX_LABELS = 40
#: evidence JSON beyond this is cut in the page (the full record is in ClickHouse).
MAX_EVIDENCE_CHARS = 20_000

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1280px;
color:#222;padding:0 16px}
h1{font-size:1.6em;margin-bottom:4px}h2{margin-top:36px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;margin-top:0}.cards{display:flex;gap:12px;flex-wrap:wrap;margin:16px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:10px 16px;min-width:140px}
.card b{display:block;font-size:1.5em}.card span{color:#666;font-size:.85em}
table{border-collapse:collapse;width:100%;font-size:.85em;margin:8px 0}
th,td{border-bottom:1px solid #eee;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f7f7f7;position:sticky;top:0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#1e8449}.bad{color:#c0392b}.held{color:#b9770e}details{margin:6px 0;border:1px solid #eee;
border-radius:4px;padding:4px 8px}summary{cursor:pointer}pre{background:#f7f7f7;padding:8px;overflow:auto;
max-height:400px;font-size:.8em}.legend span{display:inline-block;padding:2px 8px;margin-right:6px;
border-radius:3px;font-size:.85em}.note{color:#666;font-size:.9em}
"""

# Runs first: records uncaught errors and console.error calls for the page's own check.
_ERROR_TRAP = """
window.__tgErrors=[];window.addEventListener('error',function(e){window.__tgErrors.push(String(e.message))});
(function(){var orig=console.error;console.error=function(){window.__tgErrors.push(
Array.prototype.map.call(arguments,String).join(' '));orig.apply(console,arguments)}})();
"""

# Runs after load: what was actually drawn, for the browser test and for anyone curious.
_RENDER_CHECK = """
window.addEventListener('load',function(){setTimeout(function(){
var el=document.getElementById('tg-render-check');var gd=document.getElementById('tg-curve');
var shapes=(gd&&gd.layout&&gd.layout.shapes)||[];var ids={};
shapes.forEach(function(s){var n=s.name||'';if(n.indexOf('incident:')===0){ids[n.split(':')[1]]=1}});
el.dataset.incidents=Object.keys(ids).length;
el.dataset.svgShapes=gd?gd.querySelectorAll('.shapelayer path').length:0;
el.dataset.plots=document.querySelectorAll('.js-plotly-plot .main-svg').length?
document.querySelectorAll('.js-plotly-plot').length:0;
el.dataset.errors=JSON.stringify(window.__tgErrors);el.dataset.done='1';},0)});
"""


def _t(ms: int | float) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _secs(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{float(v):.{digits}f}"


def _label(inc: dict[str, Any]) -> str:
    what = inc["category"] or inc["kind"] or str(inc.get("reason") or "")[:28] or "?"
    return f"{what} · {inc['action']}"


def curve_figure(data: ReportData) -> go.Figure:
    """Step and loss over wall time, every incident shaded by phase and labelled."""
    j = data.job
    fig = go.Figure()
    kept = [r for r in j.curve if r["survived"]]
    lost = [r for r in j.curve if not r["survived"]]
    fig.add_trace(
        go.Scatter(
            x=[_t(r["ts_ms"]) for r in kept],
            y=[r["step"] for r in kept],
            mode="markers",
            marker={"size": 3, "color": "#2471a3"},
            name="step",
        )
    )
    if lost:
        fig.add_trace(
            go.Scatter(
                x=[_t(r["ts_ms"]) for r in lost],
                y=[r["step"] for r in lost],
                mode="markers",
                marker={"size": 4, "color": "#aaaaaa", "symbol": "x"},
                name="step (work lost, recomputed later)",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=[_t(r["ts_ms"]) for r in j.curve if r["loss"] is not None],
            y=[r["loss"] for r in j.curve if r["loss"] is not None],
            mode="lines",
            line={"width": 1, "color": "#ca6f1e"},
            name="loss",
            yaxis="y2",
        )
    )
    end_ms = max([int(r["ts_ms"]) for r in j.curve] + [data.generated_ms if not j.curve else 0])
    shapes, notes = [], []
    for inc in data.incidents:
        for name, a, b in phases(inc, end_ms):
            shapes.append(
                {
                    "type": "rect",
                    "xref": "x",
                    "yref": "paper",
                    "x0": _t(a),
                    "x1": _t(b),
                    "y0": 0,
                    "y1": 1,
                    "fillcolor": PHASE_COLOURS[name],
                    "opacity": 0.3,
                    "line": {"width": 0},
                    "layer": "below",
                    "name": f"incident:{inc['decision_id']}:{name}",
                }
            )
        if len(data.incidents) <= MAX_LABELS:
            notes.append(
                {
                    "x": _t(inc["source_ts_ms"]),
                    "y": 1.0,
                    "xref": "x",
                    "yref": "paper",
                    "text": html.escape(_label(inc)),
                    "showarrow": False,
                    "textangle": -60,
                    "xanchor": "left",
                    "yanchor": "bottom",
                    "font": {"size": 10},
                }
            )
    # hover markers: every incident, even where labels would overlap
    fig.add_trace(
        go.Scatter(
            x=[_t(i["source_ts_ms"]) for i in data.incidents],
            y=[0] * len(data.incidents),
            mode="markers",
            marker={"size": 9, "color": "#c0392b", "symbol": "triangle-up"},
            name="incident",
            text=[
                f"{_e(_label(i))}<br>{_e(','.join(i['machines']) or 'job-wide')}<br>"
                f"recovered {_secs(i['recovered_s'])} s, procedure {_secs(i['procedure_s'], 2)} s "
                f"({_e(i['outcome'])})"
                for i in data.incidents
            ],
            hoverinfo="text",
        )
    )
    fig.update_layout(
        shapes=shapes,
        annotations=notes,
        height=520,
        margin={"t": 130, "l": 60, "r": 60, "b": 40},
        xaxis={"title": "time (UTC)"},
        yaxis={"title": "step", "rangemode": "tozero"},
        yaxis2={"title": "loss", "overlaying": "y", "side": "right", "showgrid": False},
        legend={"orientation": "h", "y": -0.15},
        template="plotly_white",
    )
    return fig


def ettr_figure(data: ReportData) -> go.Figure:
    fig = go.Figure()

    def add(j: JobData, suffix: str, dash: str) -> None:
        fig.add_trace(
            go.Scatter(
                x=[_t(t) for t, _ in j.cumulative],
                y=[v * 100 for _, v in j.cumulative],
                mode="lines",
                name=f"cumulative {suffix}",
                line={"dash": dash, "color": "#2471a3", "width": 3},
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[_t(t) for t, _ in j.sliding],
                y=[v * 100 for _, v in j.sliding],
                mode="lines",
                name=f"1-hour sliding {suffix}",
                line={"dash": dash, "color": "#1e8449", "width": 1.5},
            )
        )

    add(data.job, data.job.job, "solid")
    if data.baseline is not None and data.baseline.curve:
        add(data.baseline, f"{data.baseline.job} (baseline)", "dot")
    fig.update_layout(
        height=360,
        yaxis={"title": "ETTR %", "range": [0, 105]},
        xaxis={"title": "time (UTC)"},
        margin={"t": 20, "l": 60, "r": 20, "b": 40},
        legend={"orientation": "h", "y": -0.25},
        template="plotly_white",
    )
    return fig


def evictions_figure(data: ReportData) -> go.Figure:
    ev = data.evictions
    fig = go.Figure(
        go.Scatter(
            x=[_t(e["evicted_ts_ms"]) for e in ev],
            y=[e["machine"] for e in ev],
            mode="markers",
            marker={"size": 12, "symbol": "x", "color": "#c0392b"},
            text=[f"{_e(e['category'] or e['kind'])}<br>{_e(e['decision_id'][:12])}" for e in ev],
            hoverinfo="text+x+y",
            name="evicted",
        )
    )
    fig.update_layout(
        height=max(200, 60 + 28 * len({e["machine"] for e in ev})),
        xaxis={"title": "time (UTC)"},
        yaxis={"type": "category"},
        margin={"t": 20, "l": 120, "r": 20, "b": 40},
        template="plotly_white",
    )
    return fig


def _table(head: list[str], rows: list[list[str]], num: set[int] | None = None) -> str:
    num = num or set()
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join(
        "<tr>"
        + "".join(f"<td class='num'>{c}</td>" if i in num else f"<td>{c}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return (
        f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"
        if rows
        else "<p class='note'>none</p>"
    )


def _outcome(o: str) -> str:
    cls = {"succeeded": "ok", "failed": "bad", "held": "held"}.get(o, "")
    return f"<span class='{cls}'>{_e(o)}</span>"


_INCIDENT_COLUMNS = [
    "time", "category", "detection", "machines", "action",
    "detect s", "localise s", "decide s", "recovered s", "procedure s", "outcome", "evidence",
]  # fmt: skip


_MTTR_COLUMNS = ["category", "incidents", "recovered", "MTTR s", "worst s", "procedure s"]


def _incident_rows(data: ReportData) -> list[list[str]]:
    return [
        [
            _e(_t(i["source_ts_ms"])),
            _e(i["category"] or "-"),
            _e(i["kind"] or "-"),
            _e(", ".join(i["machines"]) or "job-wide"),
            _e(i["action"]),
            _secs(i["detected_s"]),
            _secs(i["localised_s"]),
            _secs(i["decided_s"]),
            _secs(i["recovered_s"]),
            _secs(i["procedure_s"], 2),
            _outcome(i["outcome"]),
            f"<a href='#dec-{_e(i['decision_id'])}'>{_e(i['decision_id'][:12])}</a>",
        ]
        for i in data.incidents
    ]


def _stack_classes(ev: dict[str, Any]) -> str:
    """The classes of stacks behind a stack-based verdict (suspects first), as a table."""
    analysis = ev.get("analysis") if isinstance(ev.get("analysis"), dict) else None
    inner = analysis.get("evidence") if analysis else None
    classes = inner.get("classes") if isinstance(inner, dict) else None
    if not isinstance(classes, list) or not classes:
        return ""
    rows = []
    for c in sorted(classes, key=lambda c: (not c.get("suspect"), -int(c.get("count", 0)))):
        frames = c.get("frames") or []
        rows.append(
            [
                "<b class='bad'>suspect</b>" if c.get("suspect") else "",
                _e(c.get("role", "")),
                _e(c.get("process", "")),
                _e(", ".join(str(r) for r in (c.get("ranks") or [])[:32])),
                _e(c.get("count", "")),
                "<br>".join(_e(f) for f in frames[:4]),
            ]
        )
    fr = analysis.get("flight_recorder") if analysis else None
    fr_reason = ""
    if isinstance(fr, dict) and isinstance(fr.get("evidence"), dict) and fr["evidence"].get("reason"):
        fr_reason = f"<p>Flight Recorder: {_e(fr['evidence']['reason'])}</p>"
    head = (
        f"<p>Verdict <b>{_e(analysis.get('verdict', '')) if analysis else ''}</b>, decided by "
        f"<b>{_e(analysis.get('decided_by', 'stacks')) if analysis else ''}</b>: "
        f"{_e(inner.get('reason', ''))}</p>"
        if isinstance(inner, dict)
        else ""
    )
    return head + fr_reason + _table(["", "role", "process", "ranks", "stacks", "top frames"], rows, {4})


def _decisions_html(data: ReportData) -> str:
    out = []
    for d in data.decisions:
        ev = d["evidence"]
        raw = json.dumps(ev, indent=1, sort_keys=True, default=str)
        if len(raw) > MAX_EVIDENCE_CHARS:
            raw = (
                raw[:MAX_EVIDENCE_CHARS]
                + f"\n... ({len(raw) - MAX_EVIDENCE_CHARS} more characters in ClickHouse)"
            )
        out.append(
            f"<details id='dec-{_e(d['decision_id'])}'><summary>{_e(_t(d['ts_ms']))} "
            f"<b>{_e(d['action'])}</b> "
            f"{_e(d['group_kind'])} {_e(', '.join(d['machines']) or '')} — {_e(d['reason'][:200])}</summary>"
            f"{_stack_classes(ev)}<pre>{_e(raw)}</pre></details>"
        )
    return "".join(out) or "<p class='note'>none</p>"


def _cards(data: ReportData) -> str:
    e = data.job.ettr
    cards = [
        (f"{float(e['ettr']) * 100:.1f}%", "ETTR (whole job)"),
        (f"{int(e['steps'])}", f"steps ({int(e['recomputed_steps'])} recomputed)"),
        (f"{float(e['wall_s']) / 3600:.2f} h", "wall clock"),
        (str(len(data.incidents)), "incidents"),
        (str(len({x["machine"] for x in data.evictions})), "machines evicted"),
    ]
    if data.baseline is not None and data.baseline.curve:
        cards.append(
            (f"{float(data.baseline.ettr['ettr']) * 100:.1f}%", f"baseline ETTR ({data.baseline.job})")
        )
    return (
        "<div class='cards'>"
        + "".join(f"<div class='card'><b>{v}</b><span>{_e(k)}</span></div>" for v, k in cards)
        + "</div>"
    )


def render(data: ReportData) -> str:
    """The whole page."""
    figs = [
        ("tg-curve", curve_figure(data)),
        ("tg-ettr", ettr_figure(data)),
        ("tg-evictions", evictions_figure(data)),
    ]
    divs = {
        div_id: fig.to_html(
            full_html=False, include_plotlyjs=False, div_id=div_id, config={"displaylogo": False}
        )
        for div_id, fig in figs
    }
    legend = "".join(f"<span style='background:{c}'>{n}</span>" for n, c in PHASE_COLOURS.items())
    mttr_rows = [
        [
            _e(m["fault"]),
            str(m["incidents"]),
            str(m["recovered"]),
            _secs(m["mttr_s"]),
            _secs(m["worst_s"]),
            _secs(m["procedure_s"], 2),
        ]
        for m in data.mttr
    ]
    ev_rows = [
        [
            _e(_t(e["evicted_ts_ms"])),
            _e(e["machine"]),
            _e(e["category"] or e["kind"]),
            _outcome(e["outcome"]),
            f"<a href='#dec-{_e(e['decision_id'])}'>{_e(e['decision_id'][:12])}</a>",
        ]
        for e in data.evictions
    ]
    sb_rows = [
        [_e(_t(s["ts_ms"])), _e(s["step"]), _e(s["detail"]), f"{float(s['duration_ms']) / 1000:.1f}"]
        for s in data.standbys
    ]
    loader_rows = [
        [
            _e(_t(r["ts_ms"])),
            _e(r["node"]),
            str(r["rank"]),
            _e(r["event"]),
            _e(r["reason"]),
            f"{float(r['stalled_s']):.2f}",
            f"{float(r['takeover_s']):.3f}",
        ]
        for r in data.loaders
    ]
    node_rows = [
        [
            _e(_t(t["ts_ms"])),
            _e(t["node"]),
            _e(t["from_state"] or "-"),
            _e(t["to_state"]),
            _e(t["cause"]),
            _e(t["by"]),
            _e(t["detail"]),
        ]
        for t in data.node_transitions
    ]
    lat_rows = [
        [
            _e(r["kind"]),
            _e(r["category"]),
            str(r["detections"]),
            _secs(r["p50_s"]),
            _secs(r["p95_s"]),
            _secs(r["max_s"]),
        ]
        for r in data.detection_latency
    ]
    span = ""
    if data.job.curve:
        span = f"{_t(data.job.curve[0]['ts_ms'])} to {_t(data.job.curve[-1]['ts_ms'])} UTC"
    thinned = (
        f"<p class='note'>{data.job.points} step records, drawn as {len(data.job.curve)} points.</p>"
        if data.job.points > len(data.job.curve)
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>TrainGuard report: {_e(data.job.job)}</title>
<style>{_CSS}</style><script>{_ERROR_TRAP}</script>
<script>{get_plotlyjs()}</script></head>
<body>
<h1>TrainGuard postmortem: {_e(data.job.job)}</h1>
<p class="sub">{span} · generated {_e(_t(data.generated_ms))} UTC from ClickHouse (the queries of
<code>trainguard sql list</code>)</p>
{_cards(data)}
<h2>Training</h2>
<p class="legend">Incident phases: {legend}</p>
{divs["tg-curve"]}{thinned}
<h2>ETTR over time</h2>
{divs["tg-ettr"]}
<h2>Incidents</h2>
<p class="note">Seconds from the fault's first sign (the source event) to each phase's end;
recovered: to the job's first training step after its recovery.  Procedure: the recovery procedure
alone, from the decision to its end (the job may step again only later).</p>
{_table(_INCIDENT_COLUMNS, _incident_rows(data), {5, 6, 7, 8, 9})}
<h3>MTTR per category</h3>
<p class="note">Fault to training again, over the incidents training again; procedure: their
recovery procedures' mean.</p>
{_table(_MTTR_COLUMNS, mttr_rows, {1, 2, 3, 4, 5})}
<h3>Detection latency</h3>
{_table(["detection", "category", "count", "p50 s", "p95 s", "max s"], lat_rows, {2, 3, 4, 5})}
<h2>Machines</h2>
{divs["tg-evictions"]}
{_table(["evicted", "machine", "fault", "outcome", "decision"], ev_rows)}
<h3>Evicted machines' way back</h3>
<p class="note">Each change of an evicted machine's state (<code>trainguard nodes</code>): repaired,
validated, returned or quarantined, and who or what caused it.</p>
{_table(["time", "node", "from", "to", "cause", "by", "detail"], node_rows)}
<h3>Standby pool</h3>
{_table(["time", "step", "detail", "took s"], sb_rows, {3})}
<h3>Data loaders</h3>
<p class="note">Hung or dead loaders the ranks' shadow loaders took over in place (no decision, no
restart), and shadow loaders that gave up.</p>
{_table(["time", "node", "rank", "event", "reason", "stalled s", "takeover s"], loader_rows, {2, 5, 6})}
<h2>Decisions and their evidence</h2>
{_decisions_html(data)}
<div id="tg-render-check" hidden></div>
<script>{_RENDER_CHECK}</script>
</body></html>
"""
