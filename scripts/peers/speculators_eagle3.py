"""speculators' EAGLE-3 trained on the data of a draftsmith EAGLE-3 recipe, beside draftsmith's.

    python scripts/peers/speculators_eagle3.py recipes/eagle3/smollm2-135m.yaml \
        --draftsmith-run runs/eagle3-smollm2-135m --setting same-schedule --out runs/peers/spec-same
    python scripts/peers/speculators_eagle3.py recipes/eagle3/smollm2-135m.yaml \
        --draftsmith-run runs/eagle3-smollm2-135m --setting defaults --out runs/peers/spec-defaults

Runs in draftsmith's environment and starts speculators (PyPI speculators==0.9.0) in its own venv
(--venv, default ~/.cache/draftsmith/venvs/speculators-0.9.0, built when missing: torch 2.13.0
first, then speculators, minus the CUDA torchvision/torchaudio it pulls) through
scripts/peers/speculators_train.py, which patches its three GPU assumptions for a CPU.

What both trainers see is the same: the recipe's prepared training examples (draftsmith's data
cache: the same regenerated answers and token ids), the draft vocabulary of the draftsmith run
(its d2t/t2d), and the target's hidden states of the same three auxiliary layers plus the last
layer's output before the final norm (speculators applies the norm itself), computed here in the
recipe's target precision (as draftsmith's feature cache holds them) and written in speculators'
offline layout (a datasets folder plus hidden_states/hs_{i}.safetensors).
speculators gates the prediction of token t with loss_mask[t-1]; the mask written is draftsmith's
shifted by one, so both train the prediction of exactly the same tokens.

Settings:
  same-schedule  draftsmith's recipe as speculators can express it: the same trained tokens, in
                 packed rows of the run's mean tokens per step (as many rows as it takes to train
                 as many real tokens as the draftsmith run did: its packing leaves rows a little
                 short, so a few more steps than draftsmith's), AdamW with the
                 recipe's lr, weight decay and warmup, a cosine schedule, clipping 1.0, the
                 recipe's training-time-test depth and step decay, fp32 hidden states, the draft
                 vocabulary, the plain EAGLE-3 layer (no EAGLE-3.1 norms). What stays speculators'
                 own: its frozen LM head, KL loss summed over steps, no masking of targets outside
                 the draft vocabulary. It validates on draftsmith's held-out examples.
  defaults       speculators as its documentation runs it, every training flag left at its own
                 default (0.9.0: 20 epochs, Muon + AdamW at lr 1e-3, a linear schedule with 1 %
                 warmup, 3 TTT steps of equal weight, its EAGLE-3.1 norms, 8192-token packed rows,
                 bf16 hidden states, the full vocabulary); only the data, the verifier, the CPU
                 stand-ins and the validation split are given. It trains as many tokens as its 20
                 epochs hold, not draftsmith's: result.json records both.

Writes into --out: data/ (the offline dataset), checkpoints/ (speculators' save path; the last
epoch's folder is the drafter), train.log, progress.json, and result.json (the command, wall time,
steps, trained tokens per second, peak RSS of the trainer, the drafter folder).
An interrupted run (Ctrl-C, a crash, the end of a session) goes on where it stopped: call it again
with the same --out. The data is not written again, speculators resumes from its last epoch
checkpoint, train.log gains a segment, and the wall time adds up the segments.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.cli import BadInput, OneLineParser, add_device_option

REPO = Path(__file__).resolve().parents[2]
WRAPPER = REPO / "scripts" / "peers" / "speculators_train.py"
SPECULATORS = "speculators==0.9.0"


def speculators_venv(path: str | None) -> Path:
    """The speculators venv's python, built (a few minutes) when missing."""
    from draftsmith.target import cache_root

    venv = Path(path or cache_root() / "venvs" / "speculators-0.9.0")
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import speculators"], capture_output=True).returncode == 0:
        return python
    if path is not None:
        # A venv the user named is theirs: never installed into, only used.
        raise BadInput(f"--venv {venv}: no python there imports speculators (leave --venv out to build one at {cache_root() / 'venvs' / 'speculators-0.9.0'})")
    print(f"building the speculators venv at {venv} (a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "--quiet", "--disable-pip-version-check"]
    # torch first and pinned: an unpinned resolve pulls gigabytes of CUDA wheels.
    subprocess.run([*pip, "install", "torch==2.13.0"], check=True)
    subprocess.run([*pip, "install", "torch==2.13.0", SPECULATORS], check=True)
    # Its CUDA torchvision/torchaudio break `import transformers` beside the CPU torch.
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    return python


def write_offline_data(recipe, run: Path, out: Path, hidden_dtype: str, device: str | None = None) -> dict:
    """The recipe's training examples in speculators' offline layout, and the draftsmith run's draft
    vocabulary as d2t.npy / t2d.npy. Returns what was written."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from draftsmith.artifacts import open_drafter
    from draftsmith.data import prepare_data
    from draftsmith.target import FrozenTarget, choose_device

    head = open_drafter(run).head
    if head.cfg.kind != "eagle3":
        raise BadInput(f"--draftsmith-run {run} holds a {head.cfg.kind} head, not eagle3")
    # The recipe's target precision: the prepared examples are keyed by it, and draftsmith's feature
    # cache holds what the target computes in it (written out here in --hidden-states precision).
    target = FrozenTarget.load(recipe.target.path, recipe.target.dtype, recipe.target.gguf_file, choose_device(device, "target"))
    data = prepare_data(recipe.data, target.tokenizer, recipe.data_dir(), target_model=target.model, progress=True)
    layers = [i - 1 for i in head.cfg.aux_layer_ids] + [target.dims.num_layers - 1]
    states = out / "hidden_states"
    states.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, hidden_dtype)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    tokens = 0
    # speculators validates on the last rows (int(rows x train ratio) onward): the held-out split
    # goes there, so it trains on exactly the training examples and validates on draftsmith's.
    examples = list(data.train) + list(data.eval)
    for i, example in enumerate(tqdm(examples, desc="hidden states", unit="example")):
        ids = list(example["input_ids"][: recipe.data.max_length])
        mask = list(example["loss_mask"][: len(ids)])
        with torch.no_grad():
            feats = target.features(torch.tensor([ids], device=target.device), layers=layers, need_logits=False)
        stacked = torch.stack([feats.hidden[layer][0] for layer in layers], dim=1).cpu()  # [T, 4, H]
        save_file({"hidden_states": stacked.to(dtype).contiguous(), "token_ids": torch.tensor(ids)}, str(states / f"hs_{i}.safetensors"))
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask[1:] + [0])  # speculators gates token t with mask[t-1]
        rows["seq_len"].append(len(ids))
        tokens += len(ids) if i < len(data.train) else 0
    np.save(out / "d2t.npy", head.d2t.cpu().numpy().astype(np.int64))
    np.save(out / "t2d.npy", head.t2d.cpu().numpy().astype(bool))
    (out / "rows.json").write_text(json.dumps(rows))
    return {
        "train_examples": len(data.train), "eval_examples": len(data.eval), "train_tokens": tokens,
        # int(rows x ratio) is the first validation row: exactly the training examples before it.
        "train_data_ratio": (len(data.train) + 0.5) / len(examples),
        "aux_layer_ids": list(head.cfg.aux_layer_ids), "draft_vocab_size": head.cfg.draft_vocab_size,
    }  # fmt: skip


# Built inside the speculators venv: its datasets version writes the folder its trainer reads.
SAVE_DATASET = """
import json, sys
from datasets import Dataset
out = sys.argv[1]
rows = json.load(open(out + "/rows.json"))
ds = Dataset.from_dict(rows)
ds.set_format("torch")
ds.save_to_disk(out)
"""


def packed_rows(lengths: list[int], seq_len: int) -> int:
    """Rows of at most `seq_len` tokens the examples fill when packed in order (longer ones cut)."""
    rows, used = 0, seq_len
    for n in lengths:
        n = min(n, seq_len)
        if used + n > seq_len:
            rows, used = rows + 1, 0
        used += n
    return rows


def run_metrics(run: Path, recipe, train_lengths: list[int]) -> dict:
    """Steps and trained tokens of the draftsmith run: its batch order replayed (the recipe's seed,
    batch size and accumulation over the same training examples) and checked against every step its
    metrics.jsonl logged, so the token count is the run's own, not an estimate from logged steps."""
    from draftsmith.data import BatchStream

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["tokens"] for r in records if r["kind"] == "train" and "tokens" in r}
    if not logged:
        raise BadInput(f"{run / 'metrics.jsonl'} records no training steps with token counts")
    stream = BatchStream(list(range(len(train_lengths))), batch_size=recipe.train.micro_batch_size, collator=list, seed=recipe.data.seed)
    per_step = [
        sum(train_lengths[i] for _ in range(recipe.train.grad_accum_steps) for i in stream.next_indices())
        for _ in range(max(logged))
    ]  # fmt: skip
    wrong = {step: (tokens, per_step[step - 1]) for step, tokens in logged.items() if per_step[step - 1] != tokens}
    if wrong:
        step, (theirs, ours) = min(wrong.items())
        raise BadInput(f"{run}: step {step} logged {theirs} tokens, replaying the recipe's batch order gives {ours} (another recipe or data?)")
    return {"steps": len(per_step), "tokens": sum(per_step), "tokens_per_step": sum(per_step) / len(per_step)}


def write_json(path: Path, value: dict) -> None:
    """`value` as JSON at `path`, written whole or not at all."""
    from draftsmith.atomic import write_atomic

    write_atomic(path, json.dumps(value, indent=2))


def resumable(progress_file: Path, args) -> dict | None:
    """The progress of an earlier, unfinished call into the same --out (its data written, its
    segments timed), or None to start afresh. A finished run (result.json) starts afresh; another
    setting or draftsmith run in the same folder is refused rather than mixed."""
    if not progress_file.is_file() or (progress_file.parent / "result.json").is_file():
        return None
    progress = json.loads(progress_file.read_text())
    for key, given in [("setting", args.setting), ("draftsmith_run", str(Path(args.draftsmith_run)))]:
        if progress.get(key) != given:
            raise BadInput(f"--out {progress_file.parent} holds an unfinished run with {key} {progress.get(key)!r}, not {given!r}: choose another --out, or delete it to start again")
    return progress


def main(argv=None) -> int:
    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="the draftsmith EAGLE-3 recipe whose data both train on")
    p.add_argument("--draftsmith-run", required=True, help="the draftsmith run of that recipe (its draft vocabulary and schedule)")
    p.add_argument("--setting", required=True, choices=["same-schedule", "defaults"])
    p.add_argument("--out", required=True)
    p.add_argument("--venv", default=None, help="speculators venv (default ~/.cache/draftsmith/venvs/speculators-0.9.0)")
    add_device_option(p, default="auto", note="where the target computes the hidden states speculators trains on")
    args = p.parse_args(argv)

    from draftsmith.atomic import check_destination
    from draftsmith.recipe import load_recipe
    from draftsmith.serving import servable_folder

    recipe = load_recipe(args.recipe)
    run, out = Path(args.draftsmith_run), Path(args.out)
    progress_file = out / "progress.json"
    check_destination(out, inputs=[run], owned=lambda folder: (folder / "result.json").is_file() or (folder / "progress.json").is_file())
    python = speculators_venv(args.venv)
    same = args.setting == "same-schedule"
    data = out / "data"
    progress = resumable(progress_file, args)
    if progress is None:
        # A finished run in --out is replaced whole (speculators would otherwise "resume" after
        # its last epoch and train nothing).
        for name in ("result.json", "progress.json", "train.log", "checkpoints", "logs", "data"):
            if (out / name).is_dir():
                shutil.rmtree(out / name)
            elif (out / name).exists():
                (out / name).unlink()
        hidden_dtype = "float32" if same else "bfloat16"
        written = write_offline_data(recipe, run, data, hidden_dtype, args.device)
        subprocess.run([str(python), "-c", SAVE_DATASET, str(data)], check=True)
        progress = {"setting": args.setting, "recipe": args.recipe, "draftsmith_run": str(run), "data": written, "segments": []}
        write_json(progress_file, progress)
    else:
        written = progress["data"]
        done_epochs = [p.name for p in (out / "checkpoints").glob("[0-9]*") if p.is_dir()] if (out / "checkpoints").is_dir() else []
        print(f"resuming in {out}: the data is written, speculators continues after epoch {max(map(int, done_epochs), default=-1)} "
              f"({len(progress['segments'])} earlier segment(s), {sum(s['seconds'] for s in progress['segments']):.0f} s)", flush=True)  # fmt: skip
    verifier = servable_folder(recipe.target.path, recipe.target.gguf_file)
    lengths = json.loads((data / "rows.json").read_text())["seq_len"][: written["train_examples"]]
    schedule = run_metrics(run, recipe, lengths)
    head = recipe.head
    common = [
        "--verifier-name-or-path", str(verifier), "--data-path", str(data), "--save-path", str(out / "checkpoints"),
        "--speculator-type", "eagle3", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--on-missing", "raise",
        "--num-workers", "0", "--log-dir", str(out / "logs"), "--train-data-ratio", f"{written['train_data_ratio']:.6f}",
        "--target-layer-ids", *map(str, written["aux_layer_ids"]), "--checkpoint-freq", "1",
    ]  # fmt: skip
    if same:
        seq_len = int(round(schedule["tokens_per_step"]))
        rows_per_epoch = packed_rows(lengths, seq_len)
        # As many rows as hold draftsmith's trained tokens: a packed row holds train_tokens /
        # rows_per_epoch real tokens on average, a little under seq_len.
        steps = math.ceil(schedule["tokens"] * rows_per_epoch / written["train_tokens"])
        # speculators' --max-steps ends an epoch early but not the run: every later epoch still
        # takes one step. Its sampler packs some epochs into a row fewer than `packed_rows` counts,
        # so the run gets one epoch more than `steps` rows need: it reaches `steps`, and at most one
        # step more runs. Its log says how many ran; result.json counts their tokens.
        epochs = math.ceil(steps / rows_per_epoch) + 1
        flags = [
            "--total-seq-len", str(seq_len), "--max-steps", str(steps), "--epochs", str(epochs), "--optimizer", "adamw", "--lr", str(recipe.train.lr),
            "--weight-decay", str(recipe.train.weight_decay), "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(recipe.train.warmup_steps),
            "--ttt-steps", str(head.train_depth), "--ttt-step-loss-decay", str(head.loss_decay), "--hidden-states-dtype", "float32",
            "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"),
            "--no-norm-before-fc", "--no-norm-before-residual", "--no-norm-output",
        ]  # fmt: skip
    else:
        # Its own defaults, nothing set: 8,192-token rows and 20 epochs (speculators 0.9.0's schema).
        seq_len, epochs = 8192, 20
        rows_per_epoch = packed_rows(lengths, seq_len)
        steps = epochs * rows_per_epoch
        flags = []
    command = [str(python), str(WRAPPER), *common, *flags]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    print(f"training speculators ({args.setting}): {steps} steps of {seq_len} packed tokens; log: {out / 'train.log'}", flush=True)
    started = time.time()
    # Appended: a resumed run's log holds every segment (speculators resumes from its last epoch
    # checkpoint by itself, and its global_step counter goes on from there).
    with open(out / "train.log", "a") as log:
        log.write(f"=== segment {len(progress['segments']) + 1}, started {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        log.flush()
        try:
            done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            # Ctrl-C or a crash keeps what ran: the next call with the same --out goes on from there.
            progress["segments"].append({"started": started, "seconds": round(time.time() - started, 1)})
            write_json(progress_file, progress)
    seconds = sum(s["seconds"] for s in progress["segments"])
    if done.returncode:
        sys.exit(f"error: speculators failed (exit {done.returncode}); see {out / 'train.log'} (run the same command again to go on from its last epoch)")
    ran = max((int(n) for n in re.findall(r"global_step=(\d+)", (out / "train.log").read_text())), default=-1) + 1
    epochs = sorted((p for p in (out / "checkpoints").iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    result = {
        "setting": args.setting, "recipe": args.recipe, "draftsmith_run": str(run), "data": written, "steps": steps, "steps_run": ran,
        "packed_tokens_per_step": seq_len, "draftsmith_tokens_per_step": schedule["tokens_per_step"], "draftsmith_trained_tokens": schedule["tokens"], "wall_seconds": round(seconds, 1),
        "segments": len(progress["segments"]),
        "seconds_per_step": round(seconds / max(ran, 1), 3), "rows_per_epoch": rows_per_epoch,
        # Real tokens a row holds on average, times the rows trained.
        "trained_tokens": round(ran * written["train_tokens"] / rows_per_epoch),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
        "drafter": str(epochs[-1]) if epochs else None, "command": command,
    }  # fmt: skip
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=2))
    print(f"drafter: {result['drafter']}  (result: {out / 'result.json'})")
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
