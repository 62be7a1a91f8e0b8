"""The worker's status page at ``/`` (docs/operations.md, "Status page"): plain server-rendered HTML.

:func:`render_status` turns what ``/status.json`` serves (:meth:`dpstream.processor.adapters.worker.DpstreamWorker.status`
plus the worker's health state) into one page, with no script: queries, windows, last and next
trigger, releases, dead letters by reason, the budget ledger, the partitions owned with their lag
and watermarks, and the run's noise label. It shows what it is given, escaped; the data holds aggregates, counts and public
names only (no key, no user id, no record, no secret or fingerprint: docs/privacy.md, "What is
public").
"""
from __future__ import annotations

from html import escape
from typing import Any, Iterable, Optional

#: seconds between the page's own reloads (a meta refresh: no script)
REFRESH_S = 10

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 72em; padding: 0 1em; color: #1d232a; }
h1 { font-size: 1.4em; margin-bottom: .2em; } h2 { font-size: 1.1em; margin: 1.6em 0 .4em; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: .3em .6em; border-bottom: 1px solid #dde2e7; }
th { background: #f3f5f7; font-weight: 600; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.state { display: inline-block; padding: .1em .6em; border-radius: .8em; font-weight: 600; color: #fff; }
.ready { background: #2f8f46; } .restoring, .starting { background: #b7791f; } .waiting-for-broker, .stopping { background: #c53030; }
.t { white-space: nowrap; } .muted { color: #5f6b76; } .none { color: #5f6b76; font-style: italic; }
"""


def _cell(value: Any, numeric: bool = False) -> str:
    if value is None or value == "":
        return '<td class="none">-</td>'
    if isinstance(value, float):
        value = f"{value:.4g}"
    return f'<td class="n">{escape(str(value))}</td>' if numeric else f"<td>{escape(str(value))}</td>"


def _table(headers: Iterable[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p class="none">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(f"<tr>{''.join(r)}</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _t(iso: str) -> str:
    """A time, kept on one line."""
    return f'<span class="t">{escape(str(iso))}</span>'


def _html(markup: Optional[str]) -> str:
    """A cell of markup built here from escaped parts."""
    return '<td class="none">-</td>' if not markup else f"<td>{markup}</td>"


def _last(q: dict) -> Optional[str]:
    last = q.get("last_trigger")
    if not last:
        return None
    text = f"window {_t(last['window_start'])}, trigger {int(last['trigger'])}/{int(q['triggers'])}<br>due {_t(last['due'])}"
    if "at" in last:
        parts = int(last.get("partitions", 1))
        text += (f", fired {_t(last['at'])}<br>{int(last['keys_released'])} keys released"
                 + (f" from {parts} partitions, the slowest in " if parts > 1 else " in ")
                 + f"{float(last['duration_ms']):.0f} ms")
    return text


def _next(q: dict) -> Optional[str]:
    nxt = q.get("next_trigger")
    if not nxt:
        return "no open window"
    return f"window {_t(nxt['window_start'])}, trigger {int(nxt['trigger'])}/{int(q['triggers'])}<br>due {_t(nxt['due'])}"


def _windows(q: dict) -> Optional[str]:
    parts = []
    for w in q.get("open_windows", []):
        fired = str(int(w["triggers_fired"])) if w["triggers_fired"] == w["triggers_fired_max"] else \
            f"{int(w['triggers_fired'])}-{int(w['triggers_fired_max'])}"
        parts.append(f"{_t(w['start'])} ({fired}/{int(q['triggers'])} fired)")
    return "<br>".join(parts) or "none"


def render_status(data: dict) -> str:
    """The status page for ``data`` (the ``/status.json`` document)."""
    state = str(data.get("state", "unknown"))
    title = f"dpstream worker: {data.get('app_id', '')}"
    who = data.get("worker", "")
    out = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"{REFRESH_S}\">",
           f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{escape(title)}</title>",
           f"<style>{_STYLE}</style></head><body>",
           f"<h1>{escape(title)}</h1>",
           f"<p><span class=\"state {escape(state)}\" id=\"state\">{escape(state)}</span> "
           f"{escape(str(data.get('reason') or ''))}</p>",
           f"<p class=\"muted\">{escape(str(who))}; assignment {escape(str(data.get('assignment', '')))}, delivery "
           f"{escape(str(data.get('delivery', '')))}; as of {escape(str(data.get('now', '')))} (reloads every {REFRESH_S} s). "
           f"Counts are since this worker started, over the partitions it owns.</p>"]
    if data.get("noise_label"):  # public: every release carries it too (docs/privacy.md, "Noise")
        out.append(f"<p class=\"muted\" id=\"noise-label\">Noise label <code>{escape(str(data['noise_label']))}</code>: "
                   f"<code>dpstream replay --noise-label</code> with it reproduces this worker's releases.</p>")
    queries = data.get("queries")
    if queries is None:
        out.append('<p class="none">The worker has not opened its state yet.</p></body></html>')
        return "".join(out)

    out.append("<h2>Queries</h2>")
    out.append(_table(
        ["query", "output topic", "aggregate", "window", "triggers", "allowed lateness", "epsilon", "delta", "events in",
         "triggers fired", "releases"],
        [[_cell(q["name"]), _cell(q.get("output_topic")), _cell(q.get("aggregate")), _cell(q.get("window") or (q.get("tick") and f"dynamic, tick {q['tick']}")),
          _cell(q.get("triggers"), True), _cell(q.get("allowed_lateness")), _cell(q.get("epsilon"), True), _cell(q.get("delta"), True),
          _cell(q.get("events_in"), True), _cell(q.get("triggers_fired"), True), _cell(q.get("releases"), True)] for q in queries],
        "No query configured."))

    out.append("<h2>Windows and triggers</h2>")
    out.append(_table(["query", "input watermark", "open windows", "last trigger", "next trigger"],
                      [[_cell(q["name"]), _html(_t(q["input_watermark"]["at"]) if q.get("input_watermark") else None),
                        _html(_windows(q)), _html(_last(q)), _html(_next(q))]
                       for q in queries if q.get("kind") == "windowed"],
                      "No windowed query."))
    out.append('<p class="muted">A trigger fires once every input partition has been read past its due time '
               '(docs/privacy.md, "Time").</p>')

    out.append("<h2>Dead letters by reason</h2>")
    out.append(_table(["query", "reason", "records"],
                      [[_cell(q["name"]), _cell(reason), _cell(n, True)] for q in queries for reason, n in q.get("dead_letters", {}).items()],
                      "No dead letter since this worker started."))

    out.append("<h2>Privacy budget</h2>")
    budget = data.get("budget")
    if budget is None:
        out.append('<p class="none" id="budget">No ledger configured (the config has no budget section).</p>')
    else:
        out.append(f"<p class=\"muted\" id=\"budget\">Ledger epoch {escape(str(budget.get('epoch')))}, as the ledger recorded "
                   f"each principal at its last charge.</p>")
        out.append(_table(
            ["principal", "epsilon spent", "epsilon max", "epsilon left", "delta spent", "delta max", "charges", "refused",
             "period began", "period ends"],
            [[_cell(p["principal"]), _cell(p["spent_epsilon"], True), _cell(p["max_epsilon"], True), _cell(p["remaining_epsilon"], True),
              _cell(p["spent_delta"], True), _cell(p["max_delta"], True), _cell(p["charges"], True), _cell(p["refusals"], True),
              _html(_t(p["period_began"])), _html(_t(p["period_ends"])) if p["period_ends"] else _cell("never refreshes")]
             for p in budget.get("principals", [])],
            "Nothing charged yet."))

    out.append("<h2>Partitions owned</h2>")
    owned = data.get("partitions_owned") or {}
    out.append(_table(["topic", "partitions"], [[_cell(t), _cell(", ".join(map(str, ps)))] for t, ps in sorted(owned.items())],
                      "No partition owned."))
    out.append("<h2>Lag and watermarks</h2>")
    out.append(_table(["topic", "partition", "read", "read to", "log end", "lag", "watermark"],
                      [[_cell(r["topic"]), _cell(r["partition"], True), _cell(r["kind"]), _cell(r["offset"], True),
                        _cell(r["end"], True), _cell(r["lag"], True), _html(_t(r["watermark"]) if r.get("watermark") else None)]
                       for r in data.get("partitions") or []],
                      "No partition owned."))
    out.append('<p class="muted">Lag: the log end the broker last reported minus the offset read to. An input '
               'partition\'s watermark is the one it last announced to stage 2 (once it passes a fire time); a '
               'by-key partition\'s is the input watermark its triggers fire by (docs/operations.md, "Status page").</p>')
    offsets = data.get("offsets_group")
    if offsets:
        out.append(f"<p class=\"muted\">Consumer offsets are committed to Kafka as group {escape(str(offsets))}, for lag tools "
                   f"(docs/operations.md, \"Consumer offsets\").</p>")
    out.append('<p class="muted">Also: <a href="/status.json">/status.json</a>, <a href="/metrics">/metrics</a>, '
               '<a href="/readyz">/readyz</a>.</p></body></html>')
    return "".join(out)
