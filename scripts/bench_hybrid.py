"""A trained head, lookup drafting and their hybrid, side by side on the same prompts in one process.

    python scripts/bench_hybrid.py --drafter runs/eagle3-smollm2-135m-fp32 --prompts mtbench --limit 80 \\
        --max-new-tokens 128 --tree dynamic:5,3,10 --out runs/bench-hybrid-mtbench

Every row drafts for the drafter's own target, greedy, in fp32 (``--dtype``; in bf16 a tree
forward and a one-token forward round differently, so output identity is counted, not assumed),
and is checked token for token against plain decoding of the same prompt. A row is ``KIND[@TREE]``: ``head`` (the trained head
alone), ``lookup`` (prompt lookup), ``suffix`` (suffix matching), ``head+lookup`` or
``head+suffix`` (the hybrid: both in one tree under one node budget); ``TREE`` defaults to
``--tree``, so the rows share one node budget unless told otherwise.

For each prompt plain decoding runs first and then every row, so a change in the machine's load
between prompts moves all rows alike. Reported per row: tokens per target forward (new tokens /
target forwards after the prefill, which counts every step, those with nothing drafted included)
with a 95 % bootstrap interval over prompts; tokens/s and the speedup over plain decoding with a
paired interval; output identity. Each hybrid row is also divided by the better of the head alone
and its matcher alone (the best row of each, whatever its tree), paired over prompts: the issue's
target is 1.15x; and by the best row that drafts alone (head, lookup or suffix).

``--resume`` continues an interrupted run from ``per_prompt.jsonl`` in ``--out``. ``--against
DIR`` divides each row's tokens per target forward by the same row of an earlier run in DIR
(another drafter on the same prompts and settings), paired over prompts: two heads compared without
decoding the older one again (tokens per forward do not depend on the machine's load).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROWS = ["head", "lookup", "suffix", "head+lookup", "head+suffix"]
KINDS = ("head", "lookup", "suffix", "head+lookup", "head+suffix")


def parse_row(text: str, default_tree: str) -> tuple[str, str]:
    """``KIND[@TREE]`` -> (kind, tree)."""
    from draftsmith.cli import BadInput
    from draftsmith.runtime.tree import TreeError, parse_tree

    kind, _, tree = text.partition("@")
    if kind not in KINDS:
        raise BadInput(f"--row {text!r}: the kind is one of {', '.join(KINDS)} (then optionally @TREE)")
    tree = tree or default_tree
    try:
        parse_tree(tree)
    except (TreeError, ValueError) as err:
        raise BadInput(f"--row {text!r}: {err}") from None
    return kind, tree


def build(kind: str, tree: str, head, target, options):
    """The runtime drafter of one row."""
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.lookup import HybridDrafter, LookupDrafter
    from draftsmith.runtime.tree import parse_tree

    spec = parse_tree(tree)
    if kind in ("lookup", "suffix"):
        return LookupDrafter(options.matcher(kind), spec)
    alone = HeadDrafter(head, target, spec, cache="dynamic")
    if kind == "head":
        return alone
    return HybridDrafter(alone, options.matcher(kind.split("+")[1]), spec)


def summarize(rows: list[str], records: list[dict]) -> dict:
    """Per row: totals, tokens per target forward with its interval, speedup with a paired
    interval; per hybrid row its paired ratio to the better of its two parts and to the best row
    that drafts alone."""
    from draftsmith.eval.acceptance import paired_ratio, tau_interval

    plain = [(r["plain"]["new"], r["plain"]["seconds"]) for r in records]
    plain_rate = sum(n for n, _ in plain) / sum(s for _, s in plain)
    out = {"plain": {"tokens_per_second": plain_rate, "prompts": len(records)}}
    for name in rows:
        got = [r["rows"][name] for r in records]
        new, steps, seconds = (sum(g[k] for g in got) for k in ("new", "steps", "seconds"))
        out[name] = {
            "tokens_per_target_forward": new / steps,
            "tokens_per_target_forward_ci95": tau_interval([(g["steps"], g["new"] - g["steps"]) for g in got]),
            "tokens_per_second": new / seconds,
            "speedup": (new / seconds) / plain_rate,
            "speedup_ci95": paired_ratio([(g["new"], g["seconds"]) for g in got], plain),
            "identical": sum(g["identical"] for g in got),
            "new_tokens": new,
            "target_forwards": steps,
            "draft_seconds": sum(g["draft_seconds"] for g in got),
        }
    for name in rows:
        kind = name.partition("@")[0]
        if "+" not in kind:
            continue
        parts = [p for p in rows if p.partition("@")[0] in ("head", kind.split("+")[1])]
        if not parts:
            continue
        singles = [p for p in rows if "+" not in p.partition("@")[0]]
        pairs = [(r["rows"][name]["new"], r["rows"][name]["steps"]) for r in records]
        for key, among in (("better_part", parts), ("best_single", singles)):
            best = max(among, key=lambda p: out[p]["tokens_per_target_forward"])
            against = [(r["rows"][best]["new"], r["rows"][best]["steps"]) for r in records]
            out[name][key] = best
            out[name][f"ratio_to_{key}"] = out[name]["tokens_per_target_forward"] / out[best]["tokens_per_target_forward"]
            out[name][f"ratio_to_{key}_ci95"] = paired_ratio(pairs, against)
    return out


def read_against(other: Path, settings: dict) -> list[dict]:
    """The per-prompt records of the earlier run in ``other``, refused in one line unless it holds
    the same prompts and settings (checked before anything is decoded)."""
    from draftsmith.cli import BadInput

    path = other / "per_prompt.jsonl"
    if not path.exists():
        raise BadInput(f"--against {other}: no per_prompt.jsonl there (a folder scripts/bench_hybrid.py wrote)")
    theirs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    same = ("prompts", "limit", "max_new_tokens", "prompt_lookup_min", "prompt_lookup_max")
    mismatch = [k for k in same if {"dtype": "float32", **theirs[0]["settings"]}.get(k) != settings[k]] if theirs else ["prompts"]
    if mismatch:
        raise BadInput(f"--against {other}: another prompt set or settings ({', '.join(mismatch)})")
    return theirs


def against(rows: list[str], records: list[dict], theirs: list[dict], other: Path) -> tuple[dict, list[str]]:
    """Each row's tokens per target forward over the same row of the earlier run ``theirs`` (read
    from ``other``), paired over prompts (prompt index for prompt index); the Markdown lines."""
    from draftsmith.cli import BadInput
    from draftsmith.eval.acceptance import paired_ratio

    if len(theirs) != len(records):
        raise BadInput(f"--against {other}: it holds {len(theirs)} prompts, this run {len(records)} (an interrupted run? finish it with --resume)")
    drafter = theirs[0]["settings"]["drafter"]
    out, lines = {}, [f"Against `{drafter}` (the same rows of {other}, paired over the {len(records)} prompts):", "",
                      "| row | tokens per target forward here / there [95% CI] |", "| --- | --- |"]  # fmt: skip
    for name in rows:
        if name not in theirs[0]["rows"]:
            continue
        here = [(r["rows"][name]["new"], r["rows"][name]["steps"]) for r in records]
        there = [(r["rows"][name]["new"], r["rows"][name]["steps"]) for r in theirs]
        ratio = (sum(n for n, _ in here) / sum(s for _, s in here)) / (sum(n for n, _ in there) / sum(s for _, s in there))
        out[name] = {"drafter": drafter, "ratio": ratio, "ratio_ci95": paired_ratio(here, there)}
        lines.append(f"| `{name}` | {ratio:.3f} {_ci(out[name]['ratio_ci95'])} |")
    return out, lines


def _ci(values) -> str:
    return f"[{values[0]:.3f}, {values[-1]:.3f}]" if values else ""


def table(rows: list[str], summary: dict) -> list[str]:
    lines = [
        "| row | tokens per target forward [95% CI] | tokens/s | speedup over plain [95% CI] | output = plain "
        "| ratio to the better part [95% CI] | ratio to the best single drafter [95% CI] |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| plain decoding | 1 | {summary['plain']['tokens_per_second']:.1f} | 1 | | | |",
    ]
    prompts = summary["plain"]["prompts"]
    for name in rows:
        s = summary[name]
        ratios = [
            f"{s[f'ratio_to_{key}']:.3f} {_ci(s[f'ratio_to_{key}_ci95'])} (vs `{s[key]}`)" if key in s else "" for key in ("better_part", "best_single")
        ]
        lines.append(
            f"| `{name}` | {s['tokens_per_target_forward']:.3f} {_ci(s['tokens_per_target_forward_ci95'])} | {s['tokens_per_second']:.1f} | "
            f"{s['speedup']:.3f}x {_ci(s['speedup_ci95'])} | {s['identical']}/{prompts} | {' | '.join(ratios)} |"
        )
    return lines


def main() -> int:
    from tqdm import tqdm

    from draftsmith.cli import BadInput, OneLineParser, bounded
    from draftsmith.data.chat import encode_prompt, stop_token_ids
    from draftsmith.eval.run import fitting_prompts, load_prompts
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
    from draftsmith.runtime.load import LookupOptions, load_drafter
    from draftsmith.runtime.lookup import LOOKUP_KINDS
    from draftsmith.eval.report import write_bench_results
    from draftsmith.packed import packed_layers
    from draftsmith.target import cpu_machine

    ap = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True, help="a trained head's run, checkpoint or export folder")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--limit", type=bounded(int, 1), default=80)
    ap.add_argument("--max-new-tokens", type=bounded(int, 1), default=128)
    ap.add_argument("--tree", default="dynamic:5,3,10", help="the tree (node budget) of rows that name none")
    ap.add_argument("--row", action="append", help=f"KIND[@TREE], repeated (default: {' '.join(ROWS)})")
    ap.add_argument("--prompt-lookup-min", type=bounded(int, 1), default=1)
    ap.add_argument("--prompt-lookup-max", type=bounded(int, 1), default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true", help="keep the prompts per_prompt.jsonl in --out already holds")
    ap.add_argument("--against", type=Path, default=None, help="an earlier run's --out on the same prompts: each row's paired ratio to it")
    args = ap.parse_args()

    rows = [f"{k}@{t}" for k, t in (parse_row(r, args.tree) for r in (args.row or ROWS))]
    if len(set(rows)) != len(rows):
        raise BadInput(f"--row: a row is given twice ({' '.join(rows)})")
    out = Path(args.out)
    log_path = out / "per_prompt.jsonl"
    settings = {k: getattr(args, k) for k in ("drafter", "prompts", "limit", "max_new_tokens", "prompt_lookup_min", "prompt_lookup_max", "dtype")}
    done: list[dict] = []
    if log_path.exists():
        if not args.resume:
            raise BadInput(f"{log_path} exists: pass --resume to continue that run, or another --out")
        done = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        # Runs written before --dtype existed decoded in fp32.
        if done and ({"dtype": "float32", **done[0]["settings"]} != settings or set(done[0]["rows"]) != set(rows)):
            raise BadInput(f"{log_path} was written with other settings or rows: {done[0]['settings']}, {sorted(done[0]['rows'])}")

    theirs = read_against(args.against, settings) if args.against is not None else None
    if args.drafter in LOOKUP_KINDS:
        raise BadInput(f"--drafter {args.drafter}: a trained head is needed (lookup rows are --row lookup / suffix)")
    torch.manual_seed(0)
    options = LookupOptions(args.prompt_lookup_min, args.prompt_lookup_max)
    loaded = load_drafter(args.drafter, dtype=args.dtype, device="cpu", cache="dynamic")
    if not isinstance(loaded.drafter, HeadDrafter):
        raise BadInput(f"--drafter {args.drafter}: a trained head is needed (this is a {loaded.kind} drafter)")
    target, head = loaded.target, loaded.drafter.head
    out.mkdir(parents=True, exist_ok=True)  # once the drafter has loaded: a bad --drafter leaves no folder
    drafters = {name: build(*name.split("@", 1), head, target, options) for name in rows}
    tok = target.tokenizer
    eos = stop_token_ids(tok, target.model.generation_config)
    messages = fitting_prompts(loaded, load_prompts(args.prompts, args.limit), args.max_new_tokens)
    prompts = [torch.tensor([encode_prompt(tok, m)]) for m in messages]

    with log_path.open("a") as log:
        for index in tqdm(range(len(done), len(prompts)), desc="prompts", initial=len(done), total=len(prompts)):
            ids = prompts[index]
            reference, stats = autoregressive_generate(target, ids, args.max_new_tokens, eos_token_id=eos, cache="dynamic")
            record = {"index": index, "settings": settings, "plain": {"new": stats.new_tokens, "seconds": stats.wall_time}, "rows": {}}
            for name, drafter in drafters.items():
                got, s = speculative_generate(target, drafter, ids, args.max_new_tokens, eos_token_id=eos, cache="dynamic")
                record["rows"][name] = {
                    "new": s.new_tokens, "steps": s.steps, "seconds": s.wall_time, "draft_seconds": s.draft_time,
                    "identical": bool(torch.equal(got, reference)),
                }  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
            done.append(record)

    summary = summarize(rows, done)
    extra: list[str] = []
    if theirs is not None:
        summary["against"], extra = against(rows, done, theirs, args.against)
    machine = cpu_machine()
    packed = packed_layers(target.model)  # what decoding ran the target's linear layers from (draftsmith.packed)
    head_line = (
        f"{loaded.target_path} target, drafter {args.drafter} ({loaded.kind}); {args.prompts} x {len(done)}, {args.max_new_tokens} new tokens, "
        f"greedy {args.dtype}; lookup n-grams {args.prompt_lookup_min}-{args.prompt_lookup_max}; {machine['cpu']} ({machine['capability']}), {machine['threads']} threads; "
        f"the target's linear layers {f'on packed weights ({packed})' if packed else 'unpacked'}"
    )
    payload = {"settings": settings, "rows": rows, "machine": machine, "target_linears_packed": packed, "summary": summary, "command": sys.argv}
    write_bench_results(out, payload, [head_line, "", *table(rows, summary), *([""] + extra if extra else [])])
    print(f"per prompt: {log_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
