"""Reports of a plan: a self-contained HTML page and a Markdown file with its figures
(``autoplan model.py --devices N --report``). ``write_report`` is the entry point."""

from autoplan.reports.report import build_report, write_report
from autoplan.reports.runlog import RunLog, parse_train_log

__all__ = ["RunLog", "build_report", "parse_train_log", "write_report"]
