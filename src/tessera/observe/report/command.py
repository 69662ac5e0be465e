"""``tessera report RUN [--out FILE]``: the CLI's side of :func:`tessera.observe.report.write_report`."""

from __future__ import annotations

import argparse


def add_report_parser(sub) -> None:
    report = sub.add_parser("report", allow_abbrev=False, help="write one self-contained HTML page of a run",
                            description="Read a run folder (metrics.jsonl, summary.json, config.toml and a "
                                        "pipeline run's trace.json) and write one HTML file with the run's "
                                        "config, summary and plots: loss, throughput, model FLOP/s, memory per "
                                        "rank, bytes per axis and op, step-time split and pipeline timeline. Parts the "
                                        "run has no data for are replaced by a sentence.")
    report.add_argument("run", metavar="RUN", help="a run folder (runs/<name>)")
    report.add_argument("--out", help="the HTML file to write (default: <RUN>/report.html)")


def cmd_report(args: argparse.Namespace) -> int:
    from tessera.observe.report import write_report

    print(write_report(args.run, args.out))
    return 0
