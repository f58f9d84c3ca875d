"""speculators' side of the head-training benchmark: EAGLE-3 and DFlash trained by speculators 0.9.0
at the shape and schedule of scripts/bench_gpu_train.py, written in its columns.

    # GPU machine, beside draftsmith's numbers in the same call (wheels from `make gpu-wheels`):
    bash scripts/gpu_check.sh --only bench-train bench-train-speculators
    # or on its own, with the image's python:
    pip install -q --no-index --no-deps --target /tmp/spec-site .whl/speculators/*.whl
    PYTHONPATH=/tmp/spec-site python scripts/peers/speculators_gpu_train.py --out runs/bench-train-speculators.md
    # CPU smoke run in the speculators venv (docs/peers.md), under a minute on 2 cores:
    ~/.cache/draftsmith/venvs/speculators-0.9.0/bin/python scripts/peers/speculators_gpu_train.py \\
        --shape tiny --steps 2 --warmup 1 --out /tmp/spec-smoke/bench.md

It runs where speculators imports and imports nothing of draftsmith: speculators 0.9.0 wants
transformers <= 5.19, draftsmith pins 5.23. Under --work (default /tmp/speculators-gpu-train,
rebuilt every run; 2.1 GB at the 8B shape, so not inside --out) it writes:

- verifier/: what speculators reads of a verifier, and no more: config.json (a Llama of the named
  shape), and model.safetensors with its index holding only model.embed_tokens.weight,
  lm_head.weight and model.norm.weight (random, bf16). speculators 0.9.0 reads the config
  (AutoConfig), those three tensors (DraftVocabMixin._load_verifier_weights, through the index)
  and a tokenizer only to choose a mask token, which --mask-token-id makes unnecessary; it never
  builds the verifier. So the 8B shape costs 2.1 GB on disk, not 16.
- data/: an offline dataset in speculators' layout (datasets.save_to_disk with input_ids,
  loss_mask and seq_len; hidden_states/hs_{i}.safetensors = {hidden_states [T, 4, H] bf16,
  token_ids [T]}; token_freq.pt, from which speculators builds its d2t/t2d for a 32,000-token draft
  vocabulary). Speed does not depend on values, so every example is the same random one, every
  hs_{i} a hard link to one file, every position a loss position. A step is one packed row of
  --batch examples of --seq-len tokens, bench_gpu_train.py's batch. speculators' EAGLE-3 drops
  each example's first position when it aligns tokens with hidden states, so it trains and counts
  --seq-len - 1 positions an example (8,188 of 8,192 a step at the defaults).

Then `speculators train` (speculators.train.cli.main, through scripts/peers/speculators_train.py,
whose CPU patches do nothing where an accelerator exists) runs in a process of its own per head with
bench_gpu_train.py's schedule: --warmup then --steps optimizer steps, AdamW at lr 1e-4 without a
schedule, the 32,000-token draft vocabulary (all of a smaller one); EAGLE-3 unrolled over 7
training-time-test steps; DFlash with one layer, blocks of 8 and --max-anchors = --batch x 512
(draftsmith draws 512 anchors a row). On CUDA its fast paths are on (its defaults, named anyway):
`--draft-attn-impl simple_flex_attention`, `--loss-implementation fused` (Triton), bf16 hidden
states and autocast, its forward under torch.compile (speculators compiles it whenever CUDA is
there; the warm-up steps pay for that and for the losses' autotuning). On the CPU: `sdpa`, `eager`,
fp32. With `--loss auto` (the default) a head whose fused-loss run fails is run again with the
eager loss: on the H200 image (torch 2.11) speculators 0.9.0's fused loss fails inside torch.compile
("ListVariable(length=21) is already tracked for mutation"), so its EAGLE-3 row there is the eager
loss's, and the row says which (`loss_implementation`).

The figures are speculators' own. Its trainer logs, each step, step_ms (from the end of the previous
step to this one's optimizer step, waiting for data included, every phase synchronized) and the
positions it trained (those that are not padding). A probe on its metrics logger, in the training
process, keeps those of the timed steps, resets the peak-memory counter as the warm-up ends and
reads torch.cuda.max_memory_allocated after the last timed step: the draft, its optimizer state,
the verifier's embedding and LM head it holds, and a step's activations (offline training has no
target model). The step memory is that peak less what was allocated when the counter was reset:
the activations and transients of a step, bench_gpu_train.py's column of the same name. The checkpoint and validation pass that would follow are skipped. Rows go to --out
(Markdown, .json beside) in bench_gpu_train.py's columns, the features column reading
`speculators offline` (stored hidden states: bench_gpu_train.py's `cached`); the json adds the
data wait, the wall clock between steps and the command line. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXIT_BAD_INPUT = 2
# bench_gpu.py's shapes (Llama-3.1-8B with its rope theta).
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, rope_theta=500000.0),
}  # fmt: skip
HEADS = ("eagle3", "dflash")
DRAFT_VOCAB = 32000
EAGLE3_TTT_STEPS = 7
DFLASH_BLOCK = 8
DFLASH_ANCHORS_PER_EXAMPLE = 512
MARKER = ".speculators-gpu-train"


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


def build_verifier(folder: Path, shape: str) -> None:
    """config.json and the three tensors speculators reads of a verifier (random, bf16)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    dims = dict(SHAPES[shape])
    rope_theta = dims.pop("rope_theta", 10000.0)
    config = LlamaConfig(**dims, max_position_embeddings=131072, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, architectures=["LlamaForCausalLM"])  # fmt: skip
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    V, H = dims["vocab_size"], dims["hidden_size"]
    tensors = {
        "model.embed_tokens.weight": torch.empty(V, H, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen),
        "lm_head.weight": torch.empty(V, H, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def build_data(folder: Path, shape: str, example_len: int, examples: int) -> None:
    """`examples` copies of one random example of `example_len` tokens in speculators' offline layout."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    V, H = SHAPES[shape]["vocab_size"], SHAPES[shape]["hidden_size"]
    gen = torch.Generator().manual_seed(1)
    # Token ids below V - 1: the last id is the mask token (--mask-token-id), never in the data.
    ids = torch.randint(3, V - 1, (example_len,), generator=gen)
    states = folder / "hidden_states"
    states.mkdir(parents=True)
    first = states / "hs_0.safetensors"
    save_file({"hidden_states": torch.randn(example_len, 4, H, generator=gen).to(torch.bfloat16), "token_ids": ids}, str(first))
    for i in range(1, examples):
        try:
            os.link(first, states / f"hs_{i}.safetensors")
        except OSError:  # a file system without hard links
            shutil.copyfile(first, states / f"hs_{i}.safetensors")
    rows = {"input_ids": [ids.tolist()] * examples, "loss_mask": [[1] * example_len] * examples, "seq_len": [example_len] * examples}
    dataset = Dataset.from_dict(rows)
    dataset.set_format("torch")
    dataset.save_to_disk(str(folder))
    # speculators' token_freq.pt: {token id: count} over the loss positions of the training rows.
    counts = torch.bincount(ids, minlength=V) * (examples - 1)
    torch.save({int(t): int(counts[t]) for t in counts.nonzero().flatten()}, folder / "token_freq.pt")


def loss_implementation(choice: str, cuda: bool) -> str:
    """speculators' --loss-implementation for --loss: auto is its fused (Triton) loss on CUDA (the
    parent falls back to eager when that run fails), eager on the CPU."""
    return ("fused" if cuda else "eager") if choice == "auto" else choice


def speculators_argv(head: str, args, verifier: Path, data: Path, run: Path, cuda: bool) -> list[str]:
    """The `speculators train` command line of one head."""
    dims = SHAPES[args.shape]
    train_rows = args.batch * (args.warmup + args.steps)
    argv = [
        "--speculator-type", head, "--verifier-name-or-path", str(verifier), "--data-path", str(data),
        "--save-path", str(run / "checkpoints"), "--log-dir", str(run / "logs"), "--on-missing", "raise",
        "--total-seq-len", str(args.batch * args.seq_len), "--epochs", "1", "--max-steps", str(args.warmup + args.steps),
        # One validation row after the training rows (speculators needs one); int(rows x ratio) is its first.
        "--train-data-ratio", f"{(train_rows + 0.5) / (train_rows + 1):.8f}",
        "--optimizer", "adamw", "--lr", "1e-4", "--scheduler-type", "none", "--log-freq", "1", "--seed", "0",
        "--draft-vocab-size", str(min(DRAFT_VOCAB, dims["vocab_size"])), "--mask-token-id", str(dims["vocab_size"] - 1),
        "--hidden-states-dtype", "bfloat16" if cuda else "float32", "--num-workers", "4" if cuda else "0",
        "--draft-attn-impl", "simple_flex_attention" if cuda else "sdpa", "--loss-implementation", loss_implementation(args.loss, cuda),
    ]  # fmt: skip
    if dims["num_hidden_layers"] < 6:  # speculators' default [2, n // 2, n - 3] repeats layers; bench_gpu_train.py's choice
        argv += ["--target-layer-ids", "1", "2", "3"]
    if head == "eagle3":
        argv += ["--ttt-steps", str(EAGLE3_TTT_STEPS)]
    else:
        argv += ["--num-layers", "1", "--block-size", str(DFLASH_BLOCK), "--max-anchors", str(args.batch * min(DFLASH_ANCHORS_PER_EXAMPLE, args.seq_len))]
    return argv


class StepProbe(logging.Handler):
    """Reads speculators' per-step metric records as they are logged: the timed steps' profiles,
    the peak memory of the timed steps, and, after the last one, stops what would follow it."""

    def __init__(self, warmup: int, steps: int, head: str):
        super().__init__()
        self.warmup, self.steps, self.head = warmup, steps, head
        self.trainer = None
        self.timed: list[dict] = []
        self.clock: dict[int, float] = {}
        self.peak_bytes: int | None = None
        self.base_bytes: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        import torch

        message = record.msg
        if not (isinstance(message, dict) and message.get("profile")):
            return
        step, profile = message["global_step"], message["profile"]
        self.clock[step] = time.perf_counter()
        last = self.warmup + self.steps - 1
        tokens = round(profile["tokens_per_s"] * profile["step_ms"] / 1000)
        phase = "warm-up" if step < self.warmup else "timed"
        print(f"[speculators {self.head}] step {step + 1}/{last + 1} ({phase}): {profile['step_ms']:.1f} ms, {tokens} tokens, "
              f"{profile['tokens_per_s']:.0f} tokens/s, loss {message['train'].get('loss', float('nan')):.4f}", flush=True)  # fmt: skip
        if step >= self.warmup:
            self.timed.append({"tokens": tokens, "loss": message["train"].get("loss"), **profile})
        if step == self.warmup - 1 and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.base_bytes = torch.cuda.memory_allocated()
        if step == last:
            if torch.cuda.is_available():
                self.peak_bytes = torch.cuda.max_memory_allocated()
            # The measurement is complete: no checkpoint, no validation pass.
            self.trainer.maybe_save_checkpoint = lambda *a, **k: None
            self.trainer.val_loader = None


def train_one(head: str, args) -> dict:
    """Run `speculators train` for one head in this process; its row."""
    import torch

    sys.path.insert(0, str(HERE))
    from speculators_train import apply_cpu_patches

    apply_cpu_patches()
    import speculators.train.cli as cli
    from speculators.train.config import TrainConfig

    work = Path(args.work)
    cuda = torch.cuda.is_available()
    argv = speculators_argv(head, args, work / "verifier", work / "data", work / f"run-{head}", cuda)
    probe = StepProbe(args.warmup, args.steps, head)

    class ProbedTrainer(cli.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            probe.trainer = self

    setup_metric_logger = cli.setup_metric_logger

    def setup_with_probe(*a, **k):
        setup_metric_logger(*a, **k)  # it replaces the metric logger's handlers, so the probe goes on after
        logging.getLogger("speculators.metrics").addHandler(probe)

    cli.Trainer, cli.setup_metric_logger = ProbedTrainer, setup_with_probe
    print(f"[speculators {head}] speculators train {' '.join(argv)}", flush=True)
    cli.main(TrainConfig.resolve(argv))
    if len(probe.timed) < args.steps:
        raise RuntimeError(f"speculators logged {len(probe.timed)} of {args.steps} timed steps")
    model = probe.trainer.model
    ms = sum(s["step_ms"] for s in probe.timed) / len(probe.timed)
    tokens = sum(s["tokens"] for s in probe.timed) / len(probe.timed)
    first = probe.warmup - 1
    return {
        "shape": args.shape, "head": head, "mode": "speculators offline", "batch": args.batch, "seq_len": args.seq_len,
        "ms_per_step": round(ms, 2), "tokens_per_s": round(tokens / ms * 1000, 1),
        "peak_memory_gb": round(probe.peak_bytes / 2**30, 2) if probe.peak_bytes is not None else None,
        "step_memory_gb": round((probe.peak_bytes - probe.base_bytes) / 2**30, 2) if probe.peak_bytes is not None and probe.base_bytes is not None else None,
        "loss_implementation": loss_implementation(args.loss, cuda),
        "final_loss": round(float(probe.timed[-1]["loss"]), 4),
        "head_parameters_m": round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 1),
        "tokens_per_step": tokens, "data_ms_per_step": round(sum(s["fetch_ms"] for s in probe.timed) / len(probe.timed), 2),
        "wall_ms_per_step": round(1000 * (probe.clock[first + args.steps] - probe.clock[first]) / args.steps, 2),
        "speculators": version("speculators"), "command": ["speculators", "train", *argv],
    }  # fmt: skip


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    return f"{model} ({torch.backends.cpu.get_cpu_capability()})"


def write(out: Path, rows: list[dict], meta: dict) -> None:
    lines = [
        f"# Head-training speed, speculators {meta['speculators']}, {meta['date']}", "",
        f"{meta['device_name']}; torch {meta['torch']}, transformers {meta['transformers']}; batch {meta['batch']} x {meta['seq_len']} tokens "
        f"(one packed row), every position a loss position (speculators' EAGLE-3 trains all but each example's first); {meta['steps']} timed steps after {meta['warmup']}; random weights and hidden states; "
        "speculators' own step_ms and token counts; `speculators offline` reads stored hidden states (bench_gpu_train.py's `cached`).", "",
        "| shape | head | features | ms / step | tokens / s | peak memory (GB) | step memory (GB) | trainable params (M) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['shape']} | {r['head']} | {r['mode']} | {r['ms_per_step']} | {r['tokens_per_s']} | {r['peak_memory_gb'] or '-'} | {r.get('step_memory_gb') or '-'} | {r['head_parameters_m']} |")
    lines += ["", "Of each step, waiting for data (speculators' fetch_ms): " + ", ".join(f"{r['head']} {r['data_ms_per_step']} ms" for r in rows) + ".",
              "Loss implementation: " + ", ".join(f"{r['head']} {r.get('loss_implementation', '?')}" for r in rows) + "."]  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


def ours_or_empty(work: Path) -> bool:
    """Whether --work may be emptied: it is missing, empty, or written by this script."""
    return not work.exists() or not any(work.iterdir()) or (work / MARKER).exists()


def prepare_work(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / MARKER).write_text("written by scripts/peers/speculators_gpu_train.py; removed and rebuilt on every run\n")


def main(argv=None) -> int:
    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when visible, else the CPU")
    p.add_argument("--shape", choices=list(SHAPES), default=None, help="default: llama-3.1-8b on CUDA, tiny on the CPU")
    p.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS))
    p.add_argument("--batch", type=at_least(1), default=None, help="examples a step (default 4 on CUDA, 2 on the CPU)")
    p.add_argument("--seq-len", type=at_least(DFLASH_BLOCK + 1), default=None, help="tokens an example (default 2048 on CUDA, 64 on the CPU)")
    p.add_argument("--steps", type=at_least(1), default=10, help="timed steps")
    p.add_argument("--warmup", type=at_least(1), default=2, help="steps before the timed ones (torch.compile and Triton autotuning run there)")
    p.add_argument("--work", default="/tmp/speculators-gpu-train", help="verifier, data and runs (rebuilt every run; 2.1 GB at the 8B shape)")
    p.add_argument("--out", type=Path, default=None, help="Markdown table (and .json beside it); default: print only")
    p.add_argument("--loss", choices=["auto", "fused", "eager"], default="auto",
                   help="speculators' --loss-implementation; auto: fused on CUDA, and eager if that run fails (speculators 0.9.0's fused loss does not compile under torch 2.11), eager on the CPU")
    p.add_argument("--one-head", choices=HEADS, default=None, help=argparse.SUPPRESS)  # the per-head process
    args = p.parse_args(argv)
    work = Path(args.work)
    if not args.one_head and not ours_or_empty(work):
        p.error(f"--work {work}: not empty and not written by this script (it empties the folder it uses); name another")
    try:
        import speculators  # noqa: F401
        import torch
        import transformers
    except ImportError as err:
        p.error(f"speculators 0.9.0 does not import here ({err}); run this with the speculators venv's python, or PYTHONPATH at its unpacked wheels")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch here")
    if args.device == "cpu" and torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        # speculators trains on the accelerator whenever one is visible: hide it from this process and its own.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.execv(sys.executable, [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])])
    cuda = torch.cuda.is_available()
    args.shape = args.shape or ("llama-3.1-8b" if cuda else "tiny")
    args.batch = args.batch or (4 if cuda else 2)
    args.seq_len = args.seq_len or (2048 if cuda else 64)
    if args.one_head:
        row = train_one(args.one_head, args)
        (work / f"row-{args.one_head}.json").write_text(json.dumps(row) + "\n")
        return 0

    prepare_work(work)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device_name": device_name(), "torch": torch.__version__,
        "transformers": transformers.__version__, "speculators": version("speculators"),
        "shape": args.shape, "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
    }  # fmt: skip
    started = time.perf_counter()
    print(f"verifier ({args.shape}: config, embedding, LM head, final norm) -> {work / 'verifier'}", flush=True)
    build_verifier(work / "verifier", args.shape)
    examples = args.batch * (args.warmup + args.steps) + 1  # and one to validate on, which speculators wants
    print(f"data ({examples} examples of {args.seq_len} tokens) -> {work / 'data'} [{time.perf_counter() - started:.0f} s]", flush=True)
    build_data(work / "data", args.shape, args.seq_len, examples)
    rows = []
    losses = ["fused", "eager"] if args.loss == "auto" and cuda else [loss_implementation(args.loss, cuda)]
    for head in args.heads:
        for loss in losses:
            log = work / f"run-{head}-{loss}.log"
            print(f"training {head} with speculators ({args.warmup} + {args.steps} steps, {loss} loss); log: {log}", flush=True)
            command = [sys.executable, __file__, "--one-head", head, "--work", str(work), "--shape", args.shape, "--batch", str(args.batch),
                       "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup), "--loss", loss]  # fmt: skip
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
            with open(log, "w") as fh:
                proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
                for line in proc.stdout:  # our probe's lines on the console, everything in the log
                    fh.write(line)
                    if line.startswith("[speculators"):
                        print(line, end="", flush=True)
                code = proc.wait()
            if not code:
                break
            print(f"{head}: speculators failed with its {loss} loss (exit {code}); the end of {log}:\n"
                  + "".join(log.read_text(errors="replace").splitlines(True)[-25:]), flush=True)  # fmt: skip
        if code:
            continue
        rows.append(json.loads((work / f"row-{head}.json").read_text()))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "command"}), flush=True)
        if args.out:  # after every head: a run cut short keeps what it measured
            write(args.out, rows, meta)
    print(f"done in {time.perf_counter() - started:.0f} s; logs, verifier and data: {work}", flush=True)
    if args.out and rows:
        print(f"results: {args.out.resolve()} (and {args.out.with_suffix('.json').name})")
    return 0 if len(rows) == len(args.heads) else 1


if __name__ == "__main__":
    sys.exit(main())
