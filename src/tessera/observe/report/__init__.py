"""``tessera report RUN``: one self-contained HTML page of a run folder.

:func:`read_run` reads what a run wrote (``config.toml``, ``summary.json``, ``metrics.jsonl`` and, for a
pipeline run, the Chrome trace ``trace.json``); :func:`render_page` turns it into HTML whose plots are
inline base64 PNGs drawn with matplotlib (no network, no JavaScript); :func:`write_report` does both.
A part the run has no data for is replaced by a sentence saying so.
"""

from tessera.observe.report.page import render_page, write_report
from tessera.observe.report.run_folder import RunRecords, read_run

__all__ = ["RunRecords", "read_run", "render_page", "write_report"]
