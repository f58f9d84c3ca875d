"""python scripts/simulate_online.py [--recipe recipes/online/qwen2.5-coder-1.5b.yaml] [--first mtbench --then humaneval]
       [--requests-per-source 8] [--update-every 4] [--steps-per-update 4] [--max-new-tokens 32] --out runs/online-sim

Online speculative decoding on a stream whose topic changes part way: chat prompts first (MT-bench
by default), then code (HumanEval). The drafter serves every request, learns from what the target
verified every --update-every requests, and the acceptance rate over the stream is plotted to
<out>/acceptance.png (metrics in <out>/metrics.jsonl, summary in <out>/final_metrics.json).
Any option left out keeps the recipe's value; --target/--draft swap the models (tests use tiny ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from draftsmith.cli import MAX_NEW_TOKENS, OneLineParser, bounded, script_main

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes/online/qwen2.5-coder-1.5b.yaml"))
    p.add_argument("--target", help="target model (folder, .gguf, hub id or built-in name)")
    p.add_argument("--draft", help="draft model sharing the target's tokenizer")
    p.add_argument("--first", help="prompts served first (data.path): a file or mtbench / humaneval / sharegpt")
    p.add_argument("--then", nargs="*", help="prompt sources served after it, in order (online.shift_to)")
    p.add_argument("--requests-per-source", type=bounded(int, 1))
    p.add_argument("--update-every", type=bounded(int, 1))
    p.add_argument("--steps-per-update", type=bounded(int, 1))
    p.add_argument("--max-new-tokens", type=bounded(int, 1, MAX_NEW_TOKENS))
    p.add_argument("--out", required=True, help="run folder (output_dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from draftsmith.recipe import RecipeError, load_recipe
    from draftsmith.trainers import TRAINERS
    from draftsmith.trainers.online import plot_acceptance

    args = parse_args(argv)
    extra: dict = {"output_dir": args.out, "online": {}, "data": {}}
    if args.target:
        extra["target"] = {"path": args.target, "dtype": "float32"}
    if args.draft:
        extra["draft"] = {"path": args.draft, "dtype": "float32", "lora": {"enabled": False}}
    if args.first:
        extra["data"]["path"] = args.first
    if args.then is not None:
        extra["online"]["shift_to"] = args.then
    for key in ("requests_per_source", "update_every", "steps_per_update", "max_new_tokens"):
        if getattr(args, key) is not None:
            extra["online"][key] = getattr(args, key)
    # The command-line choices go in as one more YAML layer: paths need no dotlist quoting.
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(json.dumps(extra))
    try:
        recipe = load_recipe(args.recipe, fh.name)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        Path(fh.name).unlink()
    trainer = TRAINERS["online"](recipe, argv=[Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]).setup()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    png = plot_acceptance(args.out, Path(args.out) / "acceptance.png", title=f"online: {recipe.draft.path} for {recipe.target.path}")
    print(json.dumps({k: v for k, v in summary.items() if k != "checkpoint"}, indent=2))
    print(f"plot: {png.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
