"""Head-training throughput: tokens/s and peak memory, online vs from the feature cache, 1 vs 2 processes.

    python scripts/bench_train.py --target smollm2-135m --steps 12 --out runs/bench-train      # CPU, SmolLM2
    python scripts/bench_train.py --tiny --steps 20 --out runs/bench-train-tiny                # CPU, seconds
    python scripts/bench_train.py --nproc 1 --threads 1 --global-batch 8 --out runs/bench-train-1t  # one process, one core
    python scripts/bench_train.py --gpu --target Qwen/Qwen2.5-7B-Instruct --nproc 8 --steps 30 --out runs/bench-gpu

Each configuration is a real `draftsmith train` run (one plain process, or torchrun) on the same
recipe: Medusa heads on ShareGPT conversations (no regeneration), the same global batch for every
process count (one process accumulates), bf16 target. Throughput is real (non-padding) tokens per
second over the steps after --warmup, from the timestamps in metrics.jsonl; peak memory is the
busiest rank's peak RSS (and peak CUDA memory on GPU) from final_metrics.json. In cache mode the
feature cache is built first by `draftsmith prepare`, timed separately.

--gpu compares DeepSpeed ZeRO-2 with ZeRO-3 (target replicated) and ZeRO-3 with the target
partitioned (deepspeed.shard_target), online, on --nproc GPUs: pick a target that fills the card.
Results go to <out>/results.json and a Markdown table on stdout.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.cli import OneLineParser, bounded, script_main

REPO = Path(__file__).resolve().parents[1]


def tiny_setup(out: Path) -> tuple[str, str]:
    """A tiny random Llama and synthetic chats: the benchmark's plumbing in seconds."""
    sys.path.insert(0, str(REPO))
    from draftsmith.testing import save_tiny_model

    model = out / "tiny-model"
    if not (model / "config.json").is_file():
        save_tiny_model(model, "llama", hidden_size=128, num_layers=4)
    data = out / "tiny-chats.jsonl"
    rng = random.Random(0)
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    with open(data, "w") as fh:
        for _ in range(400):
            w = [rng.choice(words) for _ in range(12)]
            fh.write(json.dumps({"messages": [{"role": "user", "content": "say " + " ".join(w)}, {"role": "assistant", "content": " ".join(w * 3)}]}) + "\n")
    return str(model), str(data)


def recipe_text(args, name: str, out: Path, target: str, data: str, features: str, nproc_max: int, deepspeed: str = "") -> str:
    global_batch = args.global_batch or args.micro_batch * nproc_max
    return f"""
trainer: heads
output_dir: {out / name}
target: {{path: {target}, dtype: {args.dtype}}}
data:
  path: {data}
  limit: {args.limit}
  eval_size: 8
  max_length: {args.max_length}
  cache_dir: {out / 'data'}
  features: {{{features}}}
head: {{kind: medusa, num_heads: {args.heads}, num_layers: 1, lm_head: target}}
train:
  micro_batch_size: {args.micro_batch}
  global_batch_size: {global_batch}
  max_steps: {args.steps}
  lr: 1.0e-3
  lr_schedule: constant
  device: {args.device}
  mixed_precision: "{args.mixed_precision}"
  log_every: 1
  eval_every: 1000000
  save_every: 1000000
{deepspeed}"""


def launch(command: str, recipe: Path, nproc: int, log: Path, extra_env: dict) -> float:
    """Run `draftsmith COMMAND RECIPE` in one process or under torchrun; return wall seconds."""
    base = ["-m", "draftsmith.cli", command, str(recipe)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *base]
    else:
        cmd = [sys.executable, *base]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra_env}
    started = time.time()
    with open(log, "w") as fh:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {done.returncode}; see {log}")
    return time.time() - started


def throughput(run_dir: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r["kind"] == "train"}
    last = max(steps)
    first = min(warmup, last - 1)
    tokens = sum(steps[s]["tokens"] for s in range(first + 1, last + 1))
    seconds = steps[last]["time"] - steps[first]["time"] if first in steps else float("nan")
    final = json.loads((run_dir / "final_metrics.json").read_text())
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "seconds_per_step": round(seconds / (last - first), 3),
        "tokens_per_step": round(tokens / (last - first)),
        "peak_rss_mb": final.get("peak_rss_mb"),
        "peak_device_mb": final.get("peak_device_mb"),
        "final_loss": round(steps[last]["loss"], 4),
    }


def main() -> int:
    parser = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="a built-in name, HF folder or hub id")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model and synthetic chats instead")
    parser.add_argument("--data", default="sharegpt")
    parser.add_argument("--limit", type=bounded(int, 2), default=200, help="conversations (train + eval)")
    parser.add_argument("--steps", type=bounded(int, 1), default=12)
    parser.add_argument("--warmup", type=bounded(int, 0), default=2, help="steps left out of the timing")
    parser.add_argument("--micro-batch", type=bounded(int, 1), default=4, help="per process; the global batch is this x the largest --nproc")
    parser.add_argument("--global-batch", type=bounded(int, 1), default=None, help="examples per optimizer step (default: --micro-batch x the largest --nproc)")
    parser.add_argument("--max-length", type=bounded(int, 16), default=256)
    parser.add_argument("--heads", type=bounded(int, 1), default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"], help="target precision")
    parser.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"], help="default: no on CPU, bf16 with --gpu")
    parser.add_argument("--nproc", type=bounded(int, 1), nargs="+", default=None, help="process counts (default: 1 2 on CPU, 8 with --gpu)")
    parser.add_argument("--modes", nargs="+", default=["online", "cache"], choices=["online", "cache"])
    parser.add_argument("--threads", type=bounded(int, 1), default=None, help="OMP_NUM_THREADS for one-process runs (torchrun sets 1 per rank; default: torch's own choice)")
    parser.add_argument("--gpu", action="store_true", help="DeepSpeed ZeRO-2 vs ZeRO-3 (replicated and sharded target) on GPUs")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"], help="the runs' train.device (default: cuda with --gpu, else cpu)")
    parser.add_argument("--out", default="runs/bench-train")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target, data = (tiny_setup(out) if args.tiny else (args.target, args.data))
    if args.tiny:
        args.dtype = "float32"
    args.mixed_precision = args.mixed_precision or ("bf16" if args.gpu else "no")
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    nprocs = args.nproc or ([8] if args.gpu else [1, 2])
    env = {} if args.gpu else {"DS_ACCELERATOR": "cpu"}
    results = []

    if args.gpu:
        engines = {
            "zero2": "deepspeed: {zero_stage: 2}",
            "zero3": "deepspeed: {zero_stage: 3}",
            "zero3-sharded-target": "deepspeed: {zero_stage: 3, shard_target: true}",
        }
        for nproc in nprocs:
            for engine, block in engines.items():
                name = f"{engine}-{nproc}proc"
                shutil.rmtree(out / name, ignore_errors=True)
                recipe = out / f"{name}.yaml"
                recipe.write_text(recipe_text(args, name, out, target, data, "mode: online", nproc, block))
                wall = launch("train", recipe, nproc, out / f"{name}.log", env)
                results.append({"config": name, "engine": engine, "features": "online", "nproc": nproc, "wall_s": round(wall, 1), **throughput(out / name, args.warmup)})
                print(json.dumps(results[-1]), flush=True)
    else:
        # Tokenization (and the GGUF conversion of a built-in target) once, outside every timing.
        recipe = out / "data.yaml"
        recipe.write_text(recipe_text(args, "data", out, target, data, "mode: online", max(nprocs)))
        launch("prepare", recipe, 1, out / "data.log", env)
        for mode in args.modes:
            features = "mode: online" if mode == "online" else "mode: cache, dtype: bfloat16"
            if mode == "cache":
                for built in (out / "data").glob("features*"):  # features-<key> (trainers/features.py: features_dir)
                    shutil.rmtree(built, ignore_errors=True)
                recipe = out / "prepare.yaml"
                recipe.write_text(recipe_text(args, "prepare", out, target, data, features, max(nprocs)))
                wall = launch("prepare", recipe, max(nprocs), out / "prepare.log", env)
                (folder,) = (out / "data").glob("features*")
                index = json.loads((folder / "index.json").read_text())
                size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
                results.append({"config": f"prepare-{max(nprocs)}proc", "features": "build cache", "nproc": max(nprocs), "wall_s": round(wall, 1), "cache_mb": round(size / 2**20, 1), "layers": index["layers"]})
                print(json.dumps(results[-1]), flush=True)
            for nproc in nprocs:
                name = f"{mode}-{nproc}proc"
                shutil.rmtree(out / name, ignore_errors=True)
                recipe = out / f"{name}.yaml"
                recipe.write_text(recipe_text(args, name, out, target, data, features, max(nprocs)))
                run_env = {**env, "OMP_NUM_THREADS": str(args.threads)} if args.threads and nproc == 1 else env
                wall = launch("train", recipe, nproc, out / f"{name}.log", run_env)
                results.append({"config": name, "features": mode, "nproc": nproc, "wall_s": round(wall, 1), **throughput(out / name, args.warmup)})
                print(json.dumps(results[-1]), flush=True)

    meta = {"target": target, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "args": vars(args), "cpus": os.cpu_count(), "load_avg_end": os.getloadavg()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print("\n| config | processes | tokens/s | s/step | tokens/step | peak RSS MB | peak GPU MB | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['config']} | {r['nproc']} | {r.get('tokens_per_s', '-')} | {r.get('seconds_per_step', '-')} | {r.get('tokens_per_step', '-')} "
            f"| {r.get('peak_rss_mb', '-')} | {r.get('peak_device_mb') or '-'} | {r['wall_s']} |"
        )
    print(f"\nresults: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
