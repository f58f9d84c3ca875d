"""Prompt files for asking whether a drafter generalises: N first turns the drafter trained on and N
held-out ones, from the regenerated answers in a recipe's data cache.

    python scripts/split_prompts.py recipes/eagle3/smollm2-135m-large.yaml --n 20 --out runs/prompts

The regenerated file records each conversation's index in the selection, and prepare_data holds out
the last `data.eval_size` of them (read from the recipe), so index < selected - eval_size is training
data. Decoding the
training prompts greedily reproduces the answers the drafter saw (up to the regeneration's
max_new_tokens); `draftsmith eval` on both files then compares the accepted length on seen and unseen
text: a wide gap says the drafter memorised rather than generalised (more data would help), a narrow
one at a low level says it has not yet fitted even its training data (more steps or capacity).
Only conversations that open with a user turn of at most --max-chars characters, answered with at
least --min-answer tokens, are taken; the training ones are shuffled with --seed, the held-out ones kept in order.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from draftsmith.cli import OneLineParser, bounded, script_main


def main(argv=None) -> int:
    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="the recipe whose data cache (data.cache_dir) holds regenerated-*.jsonl")
    p.add_argument("--n", type=bounded(int, 1), default=20)
    p.add_argument("--max-chars", type=bounded(int, 1), default=600)
    p.add_argument("--min-answer", type=bounded(int, 0), default=64)
    p.add_argument("--seed", type=bounded(int, 0), default=0)
    p.add_argument("--out", default="runs/prompts")
    args = p.parse_args(argv)

    from draftsmith.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data_dir = recipe.data_dir()
    files = sorted(data_dir.glob("regenerated-*.jsonl"))
    if len(files) != 1:
        print(f"error: expected one regenerated-*.jsonl in {data_dir}, found {len(files)}", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    n_train = len(rows) - recipe.data.eval_size

    def usable(row: dict) -> bool:
        messages = row["messages"]
        return (
            [m["role"] for m in messages[:2]] == ["user", "assistant"]
            and len(messages[0]["content"]) <= args.max_chars
            and len(messages[1].get("token_ids") or []) >= args.min_answer
        )

    train = sorted((r for r in rows if r["index"] < n_train and usable(r)), key=lambda r: r["index"])
    held = sorted((r for r in rows if r["index"] >= n_train and usable(r)), key=lambda r: r["index"])
    random.Random(args.seed).shuffle(train)
    if len(train) < args.n or len(held) < args.n:
        print(f"error: only {len(train)} training and {len(held)} held-out prompts qualify, --n is {args.n}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = data_dir.name
    for name, chosen in (("train", train[: args.n]), ("heldout", held[: args.n])):
        path = out / f"{stem}-{name}{args.n}.jsonl"
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["messages"][0]["content"]}]}) + "\n" for r in chosen))
        print(f"{path}: conversations {[r['index'] for r in chosen]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
