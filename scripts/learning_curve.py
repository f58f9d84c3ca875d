"""A head run's learning curve: held-out top-1 per depth and the simulated accepted length against
the training tokens seen, from the run's metrics.jsonl.

    python scripts/learning_curve.py runs/eagle3-smollm2-135m-large

Training tokens are the real (non-padding) tokens of every step up to each evaluation, summed from
the train records; a run that logged only every n-th step (train.log_every > 1) gets the logged
steps' tokens times n, and the table says so. Writes learning_curve.png and learning_curve.md into
the run folder (or --out).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from draftsmith.cli import OneLineParser, script_main


def curve(metrics_file: Path) -> tuple[list[dict], int]:
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    train = sorted((r for r in records if r.get("kind") == "train" and "tokens" in r), key=lambda r: r["step"])
    evals = sorted((r for r in records if r.get("kind") == "eval"), key=lambda r: r["step"])
    if not evals:
        raise SystemExit(f"error: {metrics_file} has no evaluation records")
    steps = [r["step"] for r in train]
    gaps = Counter(b - a for a, b in zip(steps, steps[1:]))
    every = gaps.most_common(1)[0][0] if gaps else 1
    points = []
    for e in evals:
        seen = sum(r["tokens"] for r in train if r["step"] <= e["step"]) * every
        points.append({"step": e["step"], "tokens": seen, "top1": e["top1"], "simulated_accept_length": e.get("simulated_accept_length")})
    return points, every


def main(argv=None) -> int:
    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run folder (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write (default: the run folder)")
    args = p.parse_args(argv)
    run = Path(args.run)
    out = Path(args.out) if args.out else run
    out.mkdir(parents=True, exist_ok=True)
    points, every = curve(run / "metrics.jsonl")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    tokens = [pt["tokens"] / 1e3 for pt in points]
    for depth in range(len(points[0]["top1"])):
        left.plot(tokens, [pt["top1"][depth] for pt in points], marker="o", label=f"depth {depth + 1}")
    left.set(xlabel="training tokens (thousands)", ylabel="held-out top-1", title="per-depth accuracy")
    left.legend(fontsize=7)
    right.plot(tokens, [pt["simulated_accept_length"] for pt in points], marker="o", color="black")
    right.set(xlabel="training tokens (thousands)", ylabel="tau (simulated, chain)", title="mean accepted length")
    fig.suptitle(run.name)
    fig.tight_layout()
    fig.savefig(out / "learning_curve.png", dpi=120)

    depths = len(points[0]["top1"])
    lines = [
        f"Learning curve of {run} (held-out set; tokens {'estimated from every ' + str(every) + 'th step' if every > 1 else 'counted at every step'}):",
        "",
        "| step | training tokens | " + " | ".join(f"top-1 d{d + 1}" for d in range(depths)) + " | simulated tau |",
        "| --- | --- | " + " | ".join("---" for _ in range(depths)) + " | --- |",
    ]
    for pt in points:
        tau = pt["simulated_accept_length"]
        tail = f" | {tau:.3f} |" if tau is not None else " | |"
        lines.append(f"| {pt['step']} | {pt['tokens']:,} | " + " | ".join(f"{v:.3f}" for v in pt["top1"]) + tail)
    (out / "learning_curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"plot: {(out / 'learning_curve.png').resolve()} (table: learning_curve.md)")
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
