"""Head-training speed at real shapes: tokens/s, ms a step and peak memory for EAGLE-3 and DFlash heads.

    python scripts/bench_gpu_train.py --out docs/bench/gpu-train.md                  # CUDA: Llama-3.1-8B shape
    python scripts/bench_gpu_train.py --device cpu --shapes tiny --steps 3 --warmup 1  # CPU smoke run (the unit test)

The heads trainer's step without its plumbing (data loading, logging, checkpoints): the target, a
random Llama of the named shape built on the device in bf16 (fp32 on the CPU; speed does not depend
on the weights' values), reads a batch of random token rows once without gradients, then the head
takes its loss, its backward and an AdamW step, under bf16 autocast on CUDA (the trainer's
``mixed_precision: bf16``). Two modes: ``online`` times the target's forward as part of each step
(``train`` without a feature cache); ``cached`` times the head alone on features computed once (the
feature cache's case, and what speculators' offline trainer does with its stored hidden states).
Every position whose label exists is trained (EAGLE-3 with ``out_of_vocab: keep``, as speculators
trains); tokens/s counts every token of the batch, and the table's trained share says what part of
them each depth's loss covered. Peak memory is
torch.cuda.max_memory_allocated over the timed steps, the target's weights included; step memory
is that peak less what was allocated as the timed steps began (weights, optimizer state, cached
features): a step's activations and transients, what speculators' script reports by the same name.

``--lm-head frozen`` (the default) keeps each head's own 32,000-token LM head at the target's rows,
as speculators 0.9.0 always does (its ``lm_head`` has ``requires_grad = False``), so the two
trainers do the same work; ``trained`` is our recipes' default (``train_lm_head: true``: a weight
gradient through the LM head at every depth and AdamW over its 131M parameters at the 8B shape);
both for a row each. In ``cached`` mode the target's decoder layers are dropped once the features
are computed, as ``train`` does when it reads a feature cache (trainers/features.py): what stays is
its embedding, final norm and LM head, so peak memory counts what training from a cache holds.

``--attention`` picks the heads' training attention (draftsmith.heads.layers.TRAINING_ATTENTION:
auto is FlexAttention on CUDA; flex, recompute, keep), several at once for a side-by-side table.
``--profile DIR`` writes, per row, torch.profiler's operator table over two extra steps
(sorted by device time) to DIR/<shape>-<head>-<features>-<attention>.txt.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# The heads as their large recipes train them, with the draft vocabulary speculators uses for Llama-3.1-8B.
# EAGLE-3 trains every position, as speculators does (out_of_vocab: keep): random tokens put only
# about a quarter of the labels inside a 32k draft vocabulary, and skipping the others (the
# recipes' default) would time a quarter of the work.
HEADS = {
    "eagle3": "{kind: eagle3, depth: 7, train_depth: 7, draft_vocab_size: 32000, out_of_vocab: keep}",
    "dflash": "{kind: dflash, block_size: 8, num_layers: 1, draft_vocab_size: 32000}",
}


def build_head(kind: str, target, device: torch.device, lm_head: str = "frozen"):
    from omegaconf import OmegaConf

    from draftsmith.heads import HEADS as HEAD_CLASSES

    values = OmegaConf.to_container(OmegaConf.create(HEADS[kind]))
    values.pop("kind")
    values["train_lm_head"] = lm_head == "trained"
    values["draft_vocab_size"] = min(values["draft_vocab_size"], target.dims.vocab_size)
    if target.dims.num_layers < 6:
        values["aux_layer_ids"] = [1, 2, 3]
    cls = HEAD_CLASSES[kind]
    torch.manual_seed(1)
    with torch.device(device):
        head = cls(cls.config_class(**values), target.dims)
    head.init_from_target(target)
    return head.train()


def bench(shape: str, kind: str, mode: str, attention: str, lm_head: str, device: torch.device, args) -> dict:
    """One row: `_bench` with the heads' training attention set to `attention` for its length."""
    import draftsmith.heads.layers as layers

    previous, layers.TRAINING_ATTENTION = layers.TRAINING_ATTENTION, attention
    try:
        return _bench(shape, kind, mode, attention, lm_head, device, args)
    finally:
        layers.TRAINING_ATTENTION = previous
        if device.type == "cuda":  # the row's target, head and optimizer went with _bench's frame
            torch.cuda.empty_cache()


def _bench(shape: str, kind: str, mode: str, attention: str, lm_head: str, device: torch.device, args) -> dict:
    from bench_gpu import build_target, sync

    from draftsmith.trainers.features import drop_decoder_layers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build_target(shape, device, dtype)
    head = build_head(kind, target, device, lm_head)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.dims.vocab_size, (args.batch, args.seq_len), generator=gen).to(device)
    mask = torch.ones_like(ids)
    layers = head.required_layers()

    def features():
        with torch.no_grad():
            out = target.features(ids, attention_mask=mask, layers=layers, need_logits=False)
        out.final_hidden = out.final_hidden.float()
        out.hidden = {i: h.float() for i, h in out.hidden.items()}
        return out

    cached = None
    if mode == "cached":
        cached = features()
        drop_decoder_layers(target)  # as train does on a feature cache: embedding, norm and LM head stay
        if device.type == "cuda":
            torch.cuda.empty_cache()

    trained = []  # per step, the positions a depth trained on, as a share of the batch's (mean over depths)

    def step():
        feats = cached if cached is not None else features()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, stats = head.loss(feats, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if "count" in stats:
            trained.append(stats["count"].float().mean() / ids.numel())
        return loss.detach()

    for _ in range(args.warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync(device)
    seconds = (time.perf_counter() - started) / args.steps
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    if args.profile:
        profile(step, device, args.profile / f"{shape}-{kind}-{mode}-{attention}-{lm_head}.txt")
    row = {
        "shape": shape, "head": kind, "mode": mode, "attention": attention, "lm_head": lm_head, "batch": args.batch, "seq_len": args.seq_len,
        "ms_per_step": round(1000 * seconds, 2), "tokens_per_s": round(args.batch * args.seq_len / seconds, 1),
        "peak_memory_gb": round(peak / 2**30, 2) if peak is not None else None,
        "step_memory_gb": round((peak - before) / 2**30, 2) if peak is not None else None,
        "final_loss": round(float(loss), 4), "head_parameters_m": round(trainable / 1e6, 1), "trainable_parameters": trainable,
        "target_parameters_held": sum(p.numel() for p in target.model.parameters()),
        "trained_share": round(float(torch.stack(trained).mean()), 3) if trained else None,
    }  # fmt: skip
    return row


def profile(step, device: torch.device, out: Path) -> None:
    """torch.profiler's operator table over two more steps, by device time (CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with run_profiler(activities=activities) as prof:
        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
    print(f"profile: {out}", flush=True)


def write(out: Path, rows: list[dict], meta: dict) -> None:
    from bench_gpu import save

    lines = [
        f"# Head-training speed, {meta['date']}", "",
        f"{meta['device_name']}; torch {meta['torch']}; batch {meta['batch']} x {meta['seq_len']} tokens; "
        f"{meta['steps']} timed steps after {meta['warmup']}; random weights of the named shapes. "
        "Trained share: the positions a depth's loss covers, over the batch's, mean over depths (depth k has no label for a row's last k + 1 positions).", "",
        "| shape | head | features | attention | LM head | ms / step | tokens / s | peak memory (GB) | step memory (GB) | trained share | trainable params (M) | target params held (M) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['head']} | {r['mode']} | {r['attention']} | {r.get('lm_head', 'trained')} | {r['ms_per_step']} | {r['tokens_per_s']} | {r['peak_memory_gb'] or '-'} | "
            f"{r['step_memory_gb'] or '-'} | {r['trained_share'] if r.get('trained_share') is not None else '-'} | {r['head_parameters_m']} | "
            f"{round(r['target_parameters_held'] / 1e6, 1) if 'target_parameters_held' in r else '-'} |"
        )
    save(out, lines, rows, meta)


def main(argv=None) -> int:
    from bench_gpu import SHAPES, device_name

    from draftsmith.cli import OneLineParser, add_device_option, bounded
    from draftsmith.target import choose_device

    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    add_device_option(p)
    p.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES), help="default: llama-3.1-8b on CUDA, tiny on the CPU")
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--modes", nargs="+", default=["online", "cached"], choices=["online", "cached"])
    p.add_argument("--batch", type=bounded(int, 1), default=None, help="rows a step (default 4 on CUDA, 2 on the CPU)")
    p.add_argument("--seq-len", type=bounded(int, 8), default=None, help="tokens a row (default 2048 on CUDA, 64 on the CPU)")
    p.add_argument("--steps", type=bounded(int, 1), default=10)
    p.add_argument("--warmup", type=bounded(int, 0), default=2)
    p.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "flex", "recompute", "keep"],
                   help="the heads' training attention (draftsmith.heads.layers.TRAINING_ATTENTION); several: a row each")
    p.add_argument("--lm-head", nargs="+", default=["frozen"], choices=["frozen", "trained"],
                   help="the heads' own LM head: frozen at the target's rows (speculators' setting, the default) or trained (our recipes'); several: a row each")
    p.add_argument("--profile", type=Path, default=None, help="folder for a torch.profiler operator table per row (two extra steps)")
    p.add_argument("--out", type=Path, default=None, help="Markdown table (and .json beside it); default: print only")
    args = p.parse_args(argv)
    device = choose_device(args.device or "auto", "benchmark")
    cuda = device.type == "cuda"
    args.batch = args.batch or (4 if cuda else 2)
    args.seq_len = args.seq_len or (2048 if cuda else 64)
    shapes = args.shapes or (["llama-3.1-8b"] if cuda else ["tiny"])
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
        "device_name": device_name(device),
        "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
    }  # fmt: skip
    rows = []
    for shape in shapes:
        for kind in args.heads:
            for mode in args.modes:
                for attention in args.attention:
                    for lm_head in args.lm_head:
                        rows.append(bench(shape, kind, mode, attention, lm_head, device, args))
                        print(json.dumps(rows[-1]), flush=True)
                        if args.out:  # after every row: a run cut short keeps what it measured
                            write(args.out, rows, meta)
    if args.out:
        print(f"results: {args.out.resolve()} (and {args.out.with_suffix('.json').name})")
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
