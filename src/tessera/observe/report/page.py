"""The report page: sections in a fixed order, each a heading with a plot or a table, or a sentence saying
the run has no such data. Everything is inline (CSS in a <style>, plots as data: URIs), so the one file
can be mailed, attached to an issue or opened offline.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from tessera.errors import UserError
from tessera.observe.report import plots
from tessera.observe.report.run_folder import RunRecords, read_run

STYLE = """body{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}
h2{border-bottom:1px solid #ddd;margin-top:1.6em}p.none{color:#666;font-style:italic}
details{margin:.4em 0}"""


def write_report(run_folder: str | Path, out: str | Path | None = None) -> Path:
    """Read ``run_folder`` and write its page to ``out`` (default ``<run_folder>/report.html``)."""
    run = read_run(run_folder)  # both checks come before anything is drawn
    out = Path(out) if out else Path(run_folder) / "report.html"
    if not out.parent.is_dir():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    out.write_text(render_page(run), encoding="utf-8")
    return out


def render_page(run: RunRecords) -> str:
    title = f"tessera run {run.folder.name}"
    bubble = run.summary.get("bubble_fraction")
    sections = [
        ("Summary", _table(run.summary) or _none("no summary.json: the run did not finish")),
        ("Configuration", _config(run.config) or _none("no config.toml in the run folder")),
        ("Loss", _figure(plots.loss_plot(run.train, run.evals), "no loss values in metrics.jsonl")),
        ("Throughput", _figure(plots.throughput_plot(run.train), "no tokens_per_s in metrics.jsonl")),
        ("Model FLOP/s", _figure(plots.flops_plot(run.train), "no flops_per_s in metrics.jsonl")),
        ("Memory per rank", _figure(plots.memory_plot(run.train), "no memory per rank in metrics.jsonl")),
        ("Communication per step", _figure(plots.comm_plot(run.train),
                                           "this run issued no collectives (a single process)")),
        ("Step time split", _figure(plots.time_split_plot(run.train),
                                    "no step-time split: the run did not set train.time_breakdown")),
        ("Pipeline timeline", _figure(plots.timeline_plot(run.timeline, bubble),
                                      "this run has no pipeline timeline (no pipeline stages, or "
                                      "pipeline.timeline was off)")),
    ]
    body = [f"<h1>{html.escape(title)}</h1>", f"<p>{html.escape(str(run.folder))}</p>"]
    body += [f'<p class="none">{html.escape(n)}</p>' for n in run.notes]
    for heading, content in sections:
        body.append(f"<h2>{heading}</h2>\n{content}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _none(sentence: str) -> str:
    return f'<p class="none">{html.escape(sentence)}.</p>'


def _figure(png_base64: str | None, absent: str) -> str:
    if png_base64 is None:
        return _none(absent)
    return f'<img src="data:image/png;base64,{png_base64}" alt="">'


def _cell(value) -> str:
    """A table cell: scalars as they are, lists and tables as compact JSON."""
    text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "))
    return f"<td>{html.escape(text)}</td>"


def _table(values: dict) -> str:
    """One row per key; nested tables (comm totals, memory per rank) folded under <details>."""
    if not values:
        return ""
    rows, folded = [], []
    for key, value in values.items():
        if isinstance(value, (dict, list)) and value:
            folded.append(f"<details><summary>{html.escape(key)}</summary><pre>"
                          f"{html.escape(json.dumps(value, indent=1))}</pre></details>")
        else:
            rows.append(f"<tr><td>{html.escape(key)}</td>{_cell(value)}</tr>")
    return "<table>" + "".join(rows) + "</table>" + "".join(folded)


def _config(config: dict) -> str:
    """The resolved config.toml, one row per ``section.key`` (lists such as profile.steps inline)."""
    rows = [f"<tr><td>{html.escape(f'{section}.{key}')}</td>{_cell(value)}</tr>"
            for section, table in config.items() if isinstance(table, dict) for key, value in table.items()]
    return "<table>" + "".join(rows) + "</table>" if rows else ""
