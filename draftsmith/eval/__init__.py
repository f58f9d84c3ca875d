"""Acceptance measurement and reports: AcceptanceStats accumulates, write_report writes."""

from draftsmith.eval.acceptance import AcceptanceStats
from draftsmith.eval.report import write_report

__all__ = ["AcceptanceStats", "write_report"]
