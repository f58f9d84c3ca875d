"""Fused Triton tree verification vs the torch reference: median latency per verification step.

    python scripts/bench_verify.py                                   # GPU, full grid -> docs/benchmarks-verify.md (+ .json)
    python scripts/bench_verify.py --out results.md --modes greedy  # another path, one mode
    python scripts/bench_verify.py --device cpu --small             # CPU smoke run: the reference only
    python scripts/bench_verify.py --device cpu --small --interpret # ... and the kernels in the Triton interpreter

Grid (GPU): batch sizes 1, 4, 16, 64 x tree sizes 8, 26, 64 nodes x vocabularies 32000, 128256,
152064, for greedy and sampled verification (temperature 1, no top-k/top-p). bf16 target logits,
fp32 draft probabilities. Trees are random (60% of nodes hang off one of the previous three
nodes, so they are deep as well as wide) with tokens that match the target 70% of the time in
greedy mode and are drawn without replacement from the draft distribution in sampling mode.

Each cell times the whole public call (`fused_verify` vs `verify`: preprocessing, allocations and
the one host sync both make for the path length) with CUDA events after warm-up, and reports the
median; `fused_verify` also with a `VerifyWorkspace` (its buffers made once, no allocation per
call) and, on CUDA, with a graphed one (`VerifyWorkspace(graphs=True)`: the same call on the same
tensors replays one CUDA graph, as a loop over static buffers gets; the decoding loop itself runs
greedy verification inside the target's graph). Before timing, each cell checks that both give the same result (greedy: identical;
sampling: same uniforms, identical but for float boundary cases, counted in the `mismatch` column).

Writes a Markdown table to --out and the same rows as JSON next to it (.json). With --small and
no --out it only prints.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from draftsmith.cli import OneLineParser, bounded, script_main  # noqa: E402 (after the path)

FULL_GRID = dict(batch=(1, 4, 16, 64), nodes=(8, 26, 64), vocab=(32000, 128256, 152064))
SMALL_GRID = dict(batch=(1, 2), nodes=(4, 8), vocab=(64,))
FIELDS = ("accept_len", "best_node", "path", "accepted_tokens", "bonus")


def parse_args(argv=None):
    ap = OneLineParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="tiny grid for a CPU smoke run")
    ap.add_argument("--interpret", action="store_true", help="CPU: run the kernels in the Triton interpreter too")
    ap.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"])
    ap.add_argument("--batch", type=bounded(int, 1), nargs="+", help="override the batch sizes")
    ap.add_argument("--nodes", type=bounded(int, 1), nargs="+", help="override the tree sizes (nodes, root included)")
    ap.add_argument("--vocab", type=bounded(int, 2), nargs="+", help="override the vocabularies")
    ap.add_argument("--warmup", type=bounded(int, 0), default=5)
    ap.add_argument("--reps", type=bounded(int, 1), default=30)
    ap.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=0)
    ap.add_argument("--out", type=Path, help="Markdown path (default docs/benchmarks-verify.md; none with --small)")
    args = ap.parse_args(argv)
    if args.out is None and not args.small:
        args.out = ROOT / "docs" / "benchmarks-verify.md"
    return args


def random_tree(B: int, N: int, V: int, mode: str, device, gen: torch.Generator):
    """(DraftTree, target_logits [B,N,V] bf16): deep-and-wide random trees, all with N nodes."""
    from draftsmith.runtime.tree import DraftTree
    from draftsmith.runtime.verify import logits_to_probs

    parents = torch.full((B, N), -1, dtype=torch.long)
    depths = torch.zeros(B, N, dtype=torch.long)
    for i in range(1, N):
        near = torch.randint(max(0, i - 3), i, (B,), generator=gen)
        anywhere = torch.randint(0, i, (B,), generator=gen)
        p = torch.where(torch.rand(B, generator=gen) < 0.6, near, anywhere)
        parents[:, i] = p
        depths[:, i] = depths.gather(1, p[:, None]).squeeze(1) + 1
    parents, depths = parents.to(device), depths.to(device)
    logits = (3.0 * torch.randn(B, N, V, device=device)).to(torch.bfloat16)
    num_nodes = torch.full((B,), N, device=device)
    if mode == "greedy":
        pred = logits.argmax(-1).gather(1, parents.clamp_min(0))
        noise = torch.randint(0, V, (B, N), device=device)
        tokens = torch.where(torch.rand(B, N, device=device) < 0.7, pred, noise)
        tokens[:, 0] = 0
        return DraftTree(tokens, parents, depths, num_nodes), logits
    q = logits_to_probs(logits.float() + torch.randn(B, N, V, device=device))
    # Siblings without replacement: Gumbel top-k, the r-th child takes the r-th key.
    rank = torch.zeros_like(parents)
    for i in range(1, N):
        rank[:, i] = (parents[:, 1:i] == parents[:, i : i + 1]).sum(1)
    keys = torch.log(q) - torch.log(-torch.log(torch.rand(B, N, V, device=device).clamp_min(1e-20)))
    draws = keys.topk(int(rank.max()) + 1, dim=-1).indices
    tokens = draws[torch.arange(B, device=device)[:, None], parents.clamp_min(0), rank]
    tokens[:, 0] = 0
    return DraftTree(tokens, parents, depths, num_nodes, q), logits


def timer(device):
    """Median milliseconds of fn() after warm-up: CUDA events on a GPU, perf_counter on a CPU."""

    def run(fn, warmup: int, reps: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return run


def mismatches(got, want) -> int:
    """Trees whose results differ in any field."""
    B = want.bonus.shape[0]
    same = torch.ones(B, dtype=torch.bool, device=want.bonus.device)
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        if g.shape != w.shape:
            return B
        same &= (g == w).reshape(B, -1).all(-1)
    return int((~same).sum())


def environment(device) -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return info


def markdown(info: dict, rows: list[dict]) -> str:
    lines = [
        "# Fused verification benchmark",
        "",
        f"`{info['command']}` on {info['device']}; torch {info['torch']}, triton {info['triton']}, "
        f"{info['date']}. Median latency of one verification step (ms) over the whole public call, "
        "bf16 target logits, random trees (method: the docstring of scripts/bench_verify.py). "
        "`mismatch`: trees whose fused result differs from the reference's (greedy must be 0; "
        "sampling uses the same uniforms and may differ only at float boundaries).",
        "",
        "| mode | B | nodes | V | mean accepted | reference ms | fused ms | fused, workspace ms | fused, graphed workspace ms | speedup | mismatch |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        fused = "-" if r["fused_ms"] is None else f"{r['fused_ms']:.3f}"
        spaced = "-" if r.get("fused_workspace_ms") is None else f"{r['fused_workspace_ms']:.3f}"
        graphed = "-" if r.get("fused_graphed_ms") is None else f"{r['fused_graphed_ms']:.3f}"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        mism = "-" if r["mismatch"] is None else str(r["mismatch"])
        lines.append(
            f"| {r['mode']} | {r['batch']} | {r['nodes']} | {r['vocab']} | {r['mean_accept']:.2f} | "
            f"{r['reference_ms']:.3f} | {fused} | {spaced} | {graphed} | {speed} | {mism} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        # Before the kernel module is first imported: triton.jit decides at decoration time.
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available (use --device cpu --small)", file=sys.stderr)
        return 2
    from draftsmith.runtime.kernels import VerifyWorkspace, fused_verify, kernel_available
    from draftsmith.runtime.verify import SamplingParams, verify

    grid = dict(SMALL_GRID if args.small else FULL_GRID)
    for key in ("batch", "nodes", "vocab"):
        if getattr(args, key):
            grid[key] = tuple(getattr(args, key))
    use_kernel = kernel_available(device)
    if not use_kernel:
        print(f"note: the fused kernel cannot run on {device}; timing the reference only", file=sys.stderr)
    warmup, reps = (1, 3) if args.small else (args.warmup, args.reps)
    run = timer(device)
    torch.manual_seed(args.seed)  # device-side draws (logits, uniforms) too
    gen = torch.Generator().manual_seed(args.seed)

    def cell(mode: str, B: int, N: int, V: int) -> dict:
        """One row of the grid: the reference, then the fused kernel three ways, on one random tree."""
        tree, logits = random_tree(B, N, V, mode, device, gen)
        kw = dict(uniforms=torch.rand(B, N + 1, device=device)) if mode == "sample" else {}
        sampling = SamplingParams(mode)
        want = verify(tree, logits, sampling, **kw)
        row = dict(mode=mode, batch=B, nodes=N, vocab=V, mean_accept=float(want.accept_len.float().mean()))
        row["reference_ms"] = run(lambda: verify(tree, logits, sampling, **kw), warmup, reps)
        row["fused_ms"] = row["fused_workspace_ms"] = row["fused_graphed_ms"] = row["speedup"] = row["mismatch"] = None
        if use_kernel:
            space = VerifyWorkspace()
            row["mismatch"] = mismatches(fused_verify(tree, logits, sampling, **kw), want)
            row["mismatch"] += mismatches(fused_verify(tree, logits, sampling, workspace=space, **kw), want)
            row["fused_ms"] = run(lambda: fused_verify(tree, logits, sampling, workspace=None, **kw), warmup, reps)
            row["fused_workspace_ms"] = run(lambda: fused_verify(tree, logits, sampling, workspace=space, **kw), warmup, reps)
            if device.type == "cuda":
                # The same tensors every call (static buffers): captured at the second call, replayed after.
                graphed = VerifyWorkspace(graphs=True)
                for _ in range(3):
                    row["mismatch"] += mismatches(fused_verify(tree, logits, sampling, workspace=graphed, **kw), want)
                row["fused_graphed_ms"] = run(lambda: fused_verify(tree, logits, sampling, workspace=graphed, **kw), warmup, reps)
                row["graph_replays"] = graphed.replays
            row["speedup"] = row["reference_ms"] / row["fused_ms"]
        return row

    rows = []
    for mode in args.modes:
        for V in grid["vocab"]:
            for N in grid["nodes"]:
                for B in grid["batch"]:
                    rows.append(cell(mode, B, N, V))
                    print(json.dumps(rows[-1]), flush=True)
                    if device.type == "cuda":  # the cell's tensors went with its frame
                        torch.cuda.empty_cache()
    info = environment(device)
    text = markdown(info, rows)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"environment": info, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    bad = [r for r in rows if r["mode"] == "greedy" and r["mismatch"]]
    if bad:
        print(f"error: greedy results differ from the reference in {len(bad)} cells", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
