"""Fixed trees against EAGLE-2's dynamic tree and adaptive (OPT-Tree) trees, for a draft model and for lookup.

    python scripts/bench_draft_structure.py --target smollm2-135m --prompts mtbench --limit 5 --max-new-tokens 64 \
        --draft-layers 8 --out runs/bench-structure

The draft model is the target's own first ``--draft-layers`` decoder layers with its final norm and
LM head (an untrained early exit run as a separate model: its probabilities are real, its cost
about draft-layers / L of the target's), drafting each structure in ``--draft-trees``; the lookup
drafters (prompt lookup, suffix matching) draft each structure in ``--lookup-trees``. Every run is
greedy in fp32 and checked token for token against the target's own greedy decoding. Reports tokens
per target forward (new tokens / target forwards, the prefill excluded), tokens/s, draft seconds and
draft model forwards,
and the mean expected accepted length the adaptive builder predicted where it predicts one.
Timings depend on what else runs on the machine: the tokens per target forward do not.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

DRAFT_TREES = ["1,1,1,1", "4,2,2,1", "dynamic:5,4,12", "adaptive:5,4,12", "adaptive:8,4,12,0.3"]
LOOKUP_TREES = ["1,1,1", "dynamic:5,3,10", "adaptive:8,3,10,0.3"]


def early_layers_model(model, layers: int):
    """A copy of a Llama-style HF model keeping its first `layers` decoder layers (embedding, final
    norm and LM head shared as copies): a draft model with the target's vocabulary."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft.eval()



def main() -> int:
    from draftsmith.data.chat import encode_prompt, stop_token_ids
    from draftsmith.eval.run import load_prompts
    from draftsmith.runtime.drafters import StandaloneDrafter
    from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
    from draftsmith.runtime.lookup import LookupDrafter, make_matcher
    from draftsmith.runtime.tree import parse_tree
    from draftsmith.target import FrozenTarget, cpu_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--draft-trees", nargs="*", default=DRAFT_TREES)
    ap.add_argument("--lookup-trees", nargs="*", default=LOOKUP_TREES)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    target = FrozenTarget.load(args.target, "float32")
    tok = target.tokenizer
    eos = stop_token_ids(tok, target.model.generation_config)
    prompts = [torch.tensor([encode_prompt(tok, m)]) for m in load_prompts(args.prompts, args.limit)]
    baseline, base_time = [], 0.0
    for ids in prompts:
        out, stats = autoregressive_generate(target, ids, args.max_new_tokens, eos_token_id=eos)
        baseline.append(out)
        base_time += stats.wall_time
    base_tokens = sum(o.shape[1] - p.shape[1] for o, p in zip(baseline, prompts))
    rows = [{"drafter": "none (plain decoding)", "tree": "-", "tokens_per_target_forward": 1.0, "tokens_per_second": base_tokens / base_time}]
    draft_model = early_layers_model(target.model, args.draft_layers)
    runs = [(f"first {args.draft_layers} layers", t, lambda spec: StandaloneDrafter(draft_model, spec)) for t in args.draft_trees]
    for kind in ("lookup", "suffix"):
        runs += [(kind, t, lambda spec, kind=kind: LookupDrafter(make_matcher(kind), spec)) for t in args.lookup_trees]
    for name, tree, build in runs:
        drafter = build(parse_tree(tree))
        new = forwards = identical = draft_forwards = 0
        wall = draft = 0.0
        for ids, reference in zip(prompts, baseline):
            out, stats = speculative_generate(target, drafter, ids, args.max_new_tokens, eos_token_id=eos)
            identical += int(torch.equal(out, reference))
            new += stats.new_tokens
            forwards += stats.target_forwards - (1 if ids.shape[1] > 1 else 0)
            wall += stats.wall_time
            draft += stats.draft_time
            draft_forwards += stats.draft_forwards or 0
        expected = getattr(drafter, "expected", None)
        row = {
            "drafter": name, "tree": tree, "tokens_per_target_forward": new / forwards, "tokens_per_second": new / wall,
            "draft_seconds": draft, "draft_forwards": draft_forwards, "identical": f"{identical}/{len(prompts)}",
            "mean_expected_length": sum(expected) / len(expected) if expected else None,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    machine = {"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "machine": machine, "rows": rows, "command": sys.argv}, indent=2))
    lines = [
        f"{args.target}, {args.prompts} x {len(prompts)}, {args.max_new_tokens} new tokens, greedy fp32; {machine['cpu']} ({machine['capability']}), {machine['threads']} threads",
        "",
        "| drafter | tree | tokens / target forward | tokens/s | identical |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['drafter']} | `{r['tree']}` | {r['tokens_per_target_forward']:.3f} | {r['tokens_per_second']:.1f} | {r.get('identical', '-')} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
