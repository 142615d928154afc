"""posttrain.report: the run report (docs/report.md).

    from posttrain.report import write_report, summary_renderable
    path = write_report(run_dir)              # run_dir/report.html, one self-contained file
    console.print(summary_renderable(run_dir)) # the terminal summary at the end of a run

Reads only the run folder (docs/run_dir.md); computes nothing the run did not record beyond the
roofline placement and the cycle gap of `posttrain.telemetry`.
"""

from __future__ import annotations

from posttrain.report.curves import downsample
from posttrain.report.eval_bisect import EvalTrack, Move, bisect_run, bisect_table
from posttrain.report.page import render, write_report
from posttrain.report.run_data import ReportError, RunData, load_run
from posttrain.report.summaries import character, eval_table, rl_iteration, rl_iterations, summarize
from posttrain.report.terminal import summary_renderable

__all__ = [
    "EvalTrack",
    "Move",
    "ReportError",
    "RunData",
    "bisect_run",
    "bisect_table",
    "character",
    "downsample",
    "eval_table",
    "load_run",
    "render",
    "rl_iteration",
    "rl_iterations",
    "summarize",
    "summary_renderable",
    "write_report",
]
