"""Acceptance reports: report.json (for machines), report.md (for people), report.png (for both)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from draftsmith.atomic import atomic_path, manifest_files, previous_output, previous_report, write_manifest
from draftsmith.eval.acceptance import AcceptanceStats

__all__ = ["report_folder", "write_report"]

REPORT_FILES = ("report.json", "report.md", "report.png")
ACCEPTANCE_CSV = "acceptance.csv"


def report_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds only what eval writes: a complete report (its manifest lists every
    file), or what an eval of an earlier version left half-written (report files, no manifest),
    which a rerun may replace."""
    folder = Path(folder)
    if previous_output(folder):
        return previous_report(folder)  # eval's; an export's is not eval's to replace
    present = {p.name for p in folder.iterdir()}
    return manifest_files(folder) is None and bool(present) and present <= {*REPORT_FILES, ACCEPTANCE_CSV}


def write_report(stats: AcceptanceStats, out_dir: str | os.PathLike, meta: dict[str, Any]) -> dict[str, Any]:
    """Write report.json, report.md and report.png into `out_dir`; return the report dict.

    The report is `meta` (target, drafter, prompts, temperature, max_new_tokens, ...: whatever
    describes the run, JSON-serializable) merged with `stats.summary()`: acceptance_rate,
    mean_accepted_length, per_depth_acceptance, accepted_length_histogram, tokens_per_second,
    baseline_tokens_per_second, speedup, the raw counts, and the assisted-generation figures when
    any were recorded. Figures that were not measured are None (null in JSON), never NaN.
    A meta key that collides with a metric name is an error rather than a silent overwrite.
    """
    summary = stats.summary()
    clash = sorted(set(meta) & set(summary))
    if clash:
        raise ValueError(f"meta keys collide with report metrics: {clash}")
    report = {**meta, **summary}
    # Like a checkpoint, the report appears whole or not at all (a full disk, Ctrl-C): written
    # into a temporary folder beside `out_dir`, renamed into place once its manifest is written.
    with atomic_path(out_dir, folder=True) as out:
        # allow_nan=False: a NaN that slipped into meta would otherwise write invalid JSON.
        (out / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
        (out / "report.md").write_text(_markdown(report, meta, stats))
        _plot(stats, meta, out / "report.png")
        write_acceptance_csv(out / ACCEPTANCE_CSV, [stats.speculator_row()])
        # The folder is now a previous output of eval: a later eval may replace it as a whole.
        write_manifest(out)
    return report


def write_bench_results(out: str | os.PathLike, payload: dict[str, Any], lines: list[str]) -> Path:
    """A benchmark script's results: ``results.json`` (`payload`) and ``results.md`` (`lines`) in
    `out`, the table printed and where they went said on stderr. Returns the Markdown file."""
    import sys

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {out / 'results.md'} and {out / 'results.json'}", file=sys.stderr)
    return out / "results.md"


def write_acceptance_csv(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Rows in the RedHatAI speculator-benchmark columns (AcceptanceStats.speculator_row, or vLLM's
    counters put the same way), the position columns as wide as the deepest row."""
    import csv

    depth = max((sum(k.startswith("acceptance_at_pos_") for k in row) for row in rows), default=0)
    columns = ["num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length"]
    extra = [k for row in rows for k in row if k not in columns and not k.startswith("acceptance_at_pos_")]
    header = list(dict.fromkeys([*extra, *columns, *(f"acceptance_at_pos_{i}" for i in range(depth))]))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=header)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in header})
    return Path(path)


def _fmt(value: Any, digits: int | None = 3) -> str:
    """A table cell: floats to `digits` places (or as written when None), None as n/a."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if digits is not None else f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v, digits) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _title(meta: dict[str, Any]) -> str:
    drafter, target = meta.get("drafter"), meta.get("target")
    if drafter and target:
        return f"{drafter} drafting for {target}"
    return str(drafter or target or "speculative decoding")


def _markdown(report: dict[str, Any], meta: dict[str, Any], stats: AcceptanceStats) -> str:
    lines = [f"# Acceptance report: {_title(meta)}", ""]
    # A list of records (eval's exit-layer sweep: one per exit) is a table of its own below.
    tables = {key: value for key, value in meta.items() if isinstance(value, list) and value and all(isinstance(row, dict) for row in value)}
    if meta:
        lines += ["| run | |", "| --- | --- |"]
        lines += [f"| {key} | {_fmt(value, digits=None)} |" for key, value in meta.items() if key not in tables]
        lines.append("")
    for key, records in tables.items():
        header = list(dict.fromkeys(k for row in records for k in row))
        lines += [f"## {key}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        lines += ["| " + " | ".join(_fmt(row.get(k)) for k in header) + " |" for row in records]
        lines.append("")

    rows = [
        ("acceptance rate (accepted / judged drafted tokens)", report["acceptance_rate"]),
        ("mean accepted length tau (tokens per target forward)", report["mean_accepted_length"]),
        ("tokens per target forward, whole generations", report["tokens_per_target_forward"]),
        ("speculative tokens/s", report["tokens_per_second"]),
        ("baseline (target alone) tokens/s", report["baseline_tokens_per_second"]),
        ("speedup over baseline", report["speedup"]),
    ]
    if report.get("speedup_ci95"):
        low, high = report["speedup_ci95"]
        rows.append(("speedup, 95% interval over prompts (paired bootstrap)", f"[{low:.3f}, {high:.3f}]"))
    if "assisted_tokens_per_second" in report:
        rows += [
            ("assisted generation tokens/s", report["assisted_tokens_per_second"]),
            ("assisted generation speedup over baseline", report["assisted_speedup"]),
            ("our speedup over assisted generation", report["speedup_vs_assisted"]),
        ]
    rows += [("speculative steps", report["steps"]), ("generations", report["generations"])]
    lines += ["| metric | value |", "| --- | ---: |"]
    lines += [f"| {name} | {_fmt(value)} |" for name, value in rows]
    lines.append("")
    if report.get("timing_note"):
        lines += [f"**Warning:** {report['timing_note']}.", ""]

    if stats.depth_attempts:
        lines += [
            "## Per-depth acceptance",
            "",
            "P(depth d accepted | depth d attempted): depth d is judged only when depths 1..d-1 were accepted.",
            "",
            "| depth | attempted | accepted | rate |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for d, (n, a, rate) in enumerate(
            zip(stats.depth_attempts, stats.depth_accepts, stats.per_depth_acceptance), start=1
        ):
            lines.append(f"| {d} | {n} | {a} | {_fmt(rate)} |")
        lines.append("")

    if stats.steps:
        lines += [
            "## Accepted length",
            "",
            "| drafted tokens accepted | tokens emitted | steps | share |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for k, count in enumerate(stats.accepted_length_histogram):
            lines.append(f"| {k} | {k + 1} | {count} | {_fmt(count / stats.steps)} |")
        lines.append("")
    return "\n".join(lines)


def _plot(stats: AcceptanceStats, meta: dict[str, Any], path: Path) -> None:
    # The Agg canvas directly, not pyplot: no global backend switch, no figure registry to leak
    # from a long evaluation loop, and it works on machines without a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_depth, ax_hist = fig.subplots(1, 2)

    rates = stats.per_depth_acceptance
    depths = list(range(1, len(rates) + 1))
    heights = [r if r is not None else 0.0 for r in rates]
    bars = ax_depth.bar(depths, heights, color="#4C72B0")
    for bar, rate, n in zip(bars, rates, stats.depth_attempts):
        label = f"{rate:.2f}\nn={n}" if rate is not None else "n/a"
        ax_depth.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax_depth.set_ylim(0, 1.15)
    ax_depth.set_xticks(depths)
    ax_depth.set_xlabel("draft depth d")
    ax_depth.set_ylabel("P(accepted | attempted)")
    rate = stats.acceptance_rate
    ax_depth.set_title("Per-depth acceptance" + (f" (overall {rate:.2f})" if rate is not None else ""))
    ax_depth.grid(axis="y", alpha=0.3)

    hist = stats.accepted_length_histogram
    lengths = list(range(1, len(hist) + 1))
    total = max(stats.steps, 1)
    ax_hist.bar(lengths, [c / total for c in hist], color="#55A868")
    tau = stats.mean_accepted_length
    if tau is not None:
        ax_hist.axvline(tau, color="#C44E52", linestyle="--", label=f"tau = {tau:.2f}")
        ax_hist.legend(loc="upper right")
    ax_hist.set_xticks(lengths)
    ax_hist.set_xlabel("tokens emitted per step (accepted + 1)")
    ax_hist.set_ylabel(f"share of {stats.steps} steps")
    ax_hist.set_title("Accepted length")
    ax_hist.grid(axis="y", alpha=0.3)

    suptitle = _title(meta)
    if stats.speedup is not None:
        suptitle += f"  |  speedup {stats.speedup:.2f}x"
    fig.suptitle(suptitle)
    fig.savefig(path, dpi=110)
