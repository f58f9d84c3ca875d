"""What a speculative step costs against a plain one, per drafter kind, on random weights of real shapes.

    python scripts/bench_gpu.py --out docs/bench/gpu-decode.md              # CUDA: SmolLM2-135M and Llama-3.1-8B shapes, bf16
    python scripts/bench_gpu.py --device cpu --shapes tiny --new-tokens 16  # CPU smoke run (what the unit test runs)
    python scripts/bench_gpu.py --temperature 1 --out docs/bench/gpu-decode-sampled.md  # lossless sampling throughout

Speed does not depend on the weights' values, and the GPU machines hold no model files: the target
is a random Llama of the named shape built on the device (bf16 on CUDA, fp32 on the CPU). For each
shape it times, over --prompts prompts of --prompt-len tokens and --new-tokens new tokens:

- plain decoding: transformers' greedy generate() (on its dynamic cache, and on its static cache,
  which on CUDA it compiles itself) and draftsmith's own autoregressive loop (the fastest is the
  baseline);
- a speculative step with nothing accepted: untrained (random) EAGLE-3 (EAGLE-2 dynamic tree, depth
  5, top-4, 26 nodes), DFlash (one block of 4), Medusa (sparse tree 4,2,2,1) heads, a one-layer
  standalone draft model (chain of 4), so each step is all overhead;
- a speculative step of the target's first quarter of layers drafting for it (early exit,
  LayerSkip: chain of 4), accepting what a random target's early exit accepts;
- a speculative step with everything accepted: the target drafting for itself (a chain of 4);
- then Hydra++ and Clover-2 heads with nothing accepted (Medusa's tree).

draftsmith's loops run twice: on transformers' DynamicCache with eager forwards (the reference path),
and on the static cache whose forwards replay as CUDA graphs (runtime/static.py; eager on the CPU).
A draft model (the standalone rows), an EAGLE-3 head and a DFlash head keep their own caches the
same way, and they and Medusa's heads replay their steps as graphs in the static rows. It reports ms per step, tokens per step and the step cost over the
plain step, and projects the speedup a drafter would give at the accepted lengths measured on the
CPU for trained drafters (docs/peers.md, docs/heads.md): tau tokens per step at the
nothing-accepted step's cost. Writes a Markdown table to --out and the rows as JSON beside it;
``--profile KIND`` adds torch.profiler's view of one generation with that head (kernel launches
and host syncs per step, operators by host time) beside it.

``--temperature T`` (above 0) decodes every row with lossless sampling at T, no top-k or top-p:
transformers' generate() samples (``do_sample``), draftsmith's loops sample, the drafters draw their
children and the verification is the sampled one (the fused kernel on CUDA, after the target's
graph). A target drafting for itself still has everything accepted (its q is the target's p).
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

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}
# Accepted lengths (tokens per target forward) measured for trained drafters on the CPU with real
# SmolLM2-135M weights: the EAGLE-3 and DFlash large-recipe heads on 20 MT-bench turns in draftsmith's
# runtime (docs/bench/dflash-smollm2-135m-large.md), the quickstart Medusa heads on 80 MT-bench turns
# (README), suffix decoding in vLLM on MT-bench (docs/peers.md).
MEASURED_TAU = {"eagle3": 1.491, "dflash": 1.485, "medusa": 1.375}
DRAFTERS = {
    "eagle3": ("{kind: eagle3, depth: 5, train_depth: 5, draft_vocab_size: 0}", "dynamic:5,4,26"),
    "dflash": ("{kind: dflash, block_size: 5, num_layers: 1}", "1,1,1,1"),
    "medusa": ("{kind: medusa, num_heads: 4, num_layers: 1}", "4,2,2,1"),
    # Timed after the rows issue 32 asks for: Hydra++ (4 heads with their own LM heads, the prefix
    # layer) and Clover-2 (2 augmenting layers), on Medusa's tree.
    "hydra": ("{kind: hydra, num_heads: 4}", "4,2,2,1"),
    "clover": ("{kind: clover, depth: 4}", "4,2,2,1"),
}
LATER = ("hydra", "clover")


# The target's cache in each measurement: transformers' DynamicCache with eager forwards (the
# reference), and the preallocated StaticSession, its forwards replayed as CUDA graphs on a GPU.
CACHES = ("dynamic", "static")


def build_target(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.target import FrozenTarget

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="sdpa",
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    return FrozenTarget(model)


def build_head_drafter(kind: str, target, cache: str = "auto"):
    from omegaconf import OmegaConf

    from draftsmith.heads import HEADS
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.tree import parse_tree

    text, tree = DRAFTERS[kind]
    values = OmegaConf.to_container(OmegaConf.create(text))
    values.pop("kind")
    if kind == "eagle3" and not values.get("draft_vocab_size"):
        values["draft_vocab_size"] = min(32000, target.dims.vocab_size)
    if target.dims.num_layers < 6 and kind in ("eagle3", "dflash"):
        values["aux_layer_ids"] = [1, 2, 3]
    cls = HEADS[kind]
    torch.manual_seed(1)
    with torch.device(target.device):  # built where it runs: an 8B-shaped head's LM head is large
        head = cls(cls.config_class(**values), target.dims)
    head.init_from_target(target)
    return HeadDrafter(head.to(dtype=target.dtype).eval(), target, parse_tree(tree), cache=cache)


def build_draft_model_drafter(target, cache: str = "auto", tree=None):
    """The standalone rows' drafter: a random one-layer Llama (width at most 256) on the target's
    vocabulary, drafting ``tree`` (default a chain of 4), on the target's device and dtype."""
    from draftsmith.runtime.drafters import StandaloneDrafter
    from draftsmith.runtime.tree import TreeSpec
    from draftsmith.testing import tiny_causal_lm

    small = tiny_causal_lm("llama", vocab_size=target.dims.vocab_size, hidden_size=min(256, target.dims.hidden_size), num_layers=1, seed=2)
    small = small.to(device=target.device, dtype=target.dtype)
    small.config._attn_implementation = "sdpa"
    return StandaloneDrafter(small, TreeSpec.chain(4) if tree is None else tree, cache=cache)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generation(fn, prompts, device) -> tuple[float, int, int]:
    """(seconds, new tokens, target steps) of fn(prompt) over every prompt, after one warm-up."""
    fn(prompts[0])
    sync(device)
    started, tokens, steps = time.perf_counter(), 0, 0
    for ids in prompts:
        new, n_steps = fn(ids)
        tokens += new
        steps += n_steps
    sync(device)
    return time.perf_counter() - started, tokens, steps


def bench_shape(shape: str, device: torch.device, args, saved=lambda rows: None) -> list[dict]:
    """The rows of one shape; ``saved(rows)`` after each, so a run cut short keeps what it measured."""
    from draftsmith.runtime.drafters import HeadDrafter, StandaloneDrafter
    from draftsmith.runtime.early_exit import EarlyExitDrafter
    from draftsmith.runtime.generate import autoregressive_generate, speculative_generate, verification_kernel
    from draftsmith.runtime.lookup import HybridDrafter, SuffixMatcher
    from draftsmith.runtime.tree import TreeSpec
    from draftsmith.runtime.verify import SamplingParams

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build_target(shape, device, dtype)
    gen = torch.Generator().manual_seed(0)
    V = target.dims.vocab_size
    prompts = [torch.randint(3, V, (1, args.prompt_len), generator=gen).to(device) for _ in range(args.prompts)]
    N = args.new_tokens
    rows = []
    CACHE_NAMES = {"dynamic": "dynamic cache", "static": "static cache + CUDA graphs" if device.type == "cuda" else "static cache"}

    def record(name: str, seconds: float, tokens: int, steps: int, **extra) -> None:
        rows.append({
            "shape": shape, "drafter": name, "ms_per_step": round(1000 * seconds / max(steps, 1), 3),
            "tokens_per_step": round(tokens / max(steps, 1), 3), "ms_per_token": round(1000 * seconds / max(tokens, 1), 3), **extra,
        })  # fmt: skip
        if extra.get("cache") == "static":  # did the graphs hold (a failed capture decodes on eagerly)?
            rows[-1]["graphs"] = all(session.graphs for session in target.__dict__.get("_static_sessions", {}).values())
        print(json.dumps(rows[-1]), flush=True)
        saved(rows)

    sampled = args.temperature > 0
    sampling = SamplingParams(mode="sample", temperature=args.temperature) if sampled else SamplingParams()
    # transformers' sampling, at the same temperature with its default top-k (50) off.
    hf_sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)

    def generator():
        return torch.Generator(device).manual_seed(0) if sampled else None

    def hf_greedy(cache_implementation=None):
        # "static": transformers' StaticCache, and on CUDA generate() compiles the decoding forward
        # itself (its auto-compile, torch.compile "reduce-overhead"); the warm-up pays the compile.
        extra = {"cache_implementation": cache_implementation} if cache_implementation else {}

        def run(ids):
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N, pad_token_id=0, **hf_sampling, **extra)
            return out.shape[1] - ids.shape[1], out.shape[1] - ids.shape[1]

        return run

    def own_plain(cache):
        def run(ids):
            out, stats = autoregressive_generate(target, ids, N, sampling=sampling, cache=cache, generator=generator())
            return stats.new_tokens, stats.steps

        return run

    with torch.no_grad():
        record("plain: transformers generate()", *time_generation(hf_greedy(), prompts, device), cache="transformers dynamic")
        hf_static = "transformers generate(), static cache" + (" + its torch.compile" if device.type == "cuda" else "")
        record(f"plain: {hf_static}", *time_generation(hf_greedy("static"), prompts, device), cache="transformers static")
        for cache in args.caches:
            record(f"plain: draftsmith loop, {CACHE_NAMES[cache]}", *time_generation(own_plain(cache), prompts, device), cache=cache)
        plain = min(r["ms_per_step"] for r in rows)

        def speculative(drafter, cache):
            def run(ids):
                out, stats = speculative_generate(target, drafter, ids, N, sampling=sampling, generator=generator(), cache=cache)
                return stats.new_tokens, stats.steps

            return run

        drafters = {kind: build_head_drafter(kind, target) for kind in DRAFTERS if kind not in LATER}
        drafters["standalone (1-layer draft, chain of 4)"] = build_draft_model_drafter(target)
        exit_layer = max(1, target.dims.num_layers // 4)  # LayerSkip: the target's first quarter of layers drafts
        drafters[f"early exit at layer {exit_layer} (chain of 4)"] = EarlyExitDrafter(target, exit_layer, TreeSpec.chain(4))
        drafters["target drafting for itself (chain of 4)"] = StandaloneDrafter(target.model, TreeSpec.chain(4))
        drafters.update((kind, build_head_drafter(kind, target)) for kind in LATER)
        # Suffix lookup merged with the EAGLE-3 head under one budget (the tree merged on the device).
        drafters["eagle3 + suffix lookup (hybrid)"] = HybridDrafter(drafters["eagle3"], SuffixMatcher())
        for name, built in drafters.items():
            for cache in args.caches:
                # A draft model and an EAGLE head keep caches of their own: the target's kind in each row.
                if isinstance(built, StandaloneDrafter):
                    drafter = StandaloneDrafter(built.model, built.tree, cache=cache)
                elif isinstance(built, EarlyExitDrafter):  # drafts on the target's own session: its cache is the row's
                    drafter = built
                elif isinstance(built, HybridDrafter):
                    drafter = HybridDrafter(HeadDrafter(built.head.head, target, built.head.tree, cache=cache), SuffixMatcher())
                else:
                    drafter = HeadDrafter(built.head, target, built.tree, cache=cache)
                # Untrained heads and draft models accept as good as nothing; an early exit from the
                # target's own layers, or lookup in the target's own (repetitive) output, may accept
                # some (its row's tokens / step says how much).
                own = name.startswith("early exit") or isinstance(built, HybridDrafter)
                accepted = "everything accepted" if "itself" in name else "its own acceptance" if own else "nothing accepted"
                record(f"{name}, {accepted}, {CACHE_NAMES[cache]}", *time_generation(speculative(drafter, cache), prompts, device), cache=cache)
                rows[-1]["cost_over_plain"] = round(rows[-1]["ms_per_step"] / plain, 3)
                if name in MEASURED_TAU:
                    rows[-1]["projected_speedup_at_measured_tau"] = round(MEASURED_TAU[name] * plain / rows[-1]["ms_per_step"], 3)
                    rows[-1]["measured_tau"] = MEASURED_TAU[name]
                saved(rows)
        if args.profile:
            profile_step(shape, args.profile, speculative(drafters[args.profile], "static"), prompts[0], device, args)
    for row in rows:
        row.update(
            device=str(device), dtype=str(dtype).replace("torch.", ""), verification=verification_kernel(device, sampling), plain_ms_per_step=plain,
            decoding=sampling.describe(),
        )  # fmt: skip
    saved(rows)
    return rows


def profile_step(shape: str, kind: str, run, prompt, device: torch.device, args) -> None:
    """One generation with `kind` on the static cache under torch.profiler: the operators by
    host time, and per step the kernel launches and host syncs (where a step's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _, steps = run(prompt)
    averages = prof.key_averages()
    counts = {e.key: e.count for e in averages}
    launches = sum(n for key, n in counts.items() if key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch"))
    syncs = sum(n for key, n in counts.items() if key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense"))
    summary = (f"{shape}, {kind}, static cache: {steps} steps; per step {launches / max(steps, 1):.1f} kernel and graph launches, "
               f"{syncs / max(steps, 1):.1f} host syncs (cudaStreamSynchronize and .item()-like reads)")  # fmt: skip
    table = averages.table(sort_by="self_cpu_time_total", row_limit=30)
    print(summary, flush=True)
    if args.out:
        path = args.out.with_name(f"{args.out.stem}-profile-{shape}-{kind}.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(summary + "\n\n" + table + "\n")
        print(f"profile: {path.resolve()}", flush=True)


def write(out: Path, rows: list[dict], meta: dict) -> None:
    lines = [
        f"# Speculative step cost, {meta['date']}", "",
        f"{meta['device_name']}; torch {meta['torch']}; {meta['prompts']} prompts x {meta['new_tokens']} new tokens after {meta['prompt_len']} "
        "prompt tokens; random weights of the named shapes (speed does not depend on their values); "
        + (f"lossless sampling at temperature {meta['temperature']:g} in every row." if meta.get("temperature") else "greedy."), "",
        "| shape | drafter | ms / step | tokens / step | ms / token | step cost / plain step | projected speedup at measured tau |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for r in rows:
        projected = f"{r['projected_speedup_at_measured_tau']}x (tau {r['measured_tau']})" if "projected_speedup_at_measured_tau" in r else "-"
        lines.append(f"| {r['shape']} | {r['drafter']} | {r['ms_per_step']} | {r['tokens_per_step']} | {r['ms_per_token']} | {r.get('cost_over_plain', '-')} | {projected} |")
    save(out, lines, rows, meta)


def save(out: Path, lines: list[str], rows: list[dict], meta: dict) -> None:
    """The Markdown table at `out`, and the rows with their settings as JSON beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


def device_name(device: torch.device) -> str:
    from draftsmith.target import cpu_name

    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()})"


def main(argv=None) -> int:
    from draftsmith.cli import OneLineParser, add_device_option, bounded
    from draftsmith.target import choose_device

    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    add_device_option(p)
    p.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES), help="default: smollm2-135m llama-3.1-8b on CUDA, tiny on the CPU")
    p.add_argument("--prompts", type=bounded(int, 1), default=4)
    p.add_argument("--prompt-len", type=bounded(int, 1), default=128)
    p.add_argument("--new-tokens", type=bounded(int, 1), default=96)
    p.add_argument("--out", type=Path, default=None, help="Markdown table (and .json beside it); default: print only")
    p.add_argument("--caches", nargs="+", choices=list(CACHES), default=list(CACHES), help="our rows on these caches (default both; static alone halves a GPU check's time)")
    p.add_argument("--profile", choices=list(DRAFTERS), default=None, help="also profile one generation with this head on the static cache (a table beside --out)")
    p.add_argument("--temperature", type=bounded(float, 0.0), default=0.0, help="0: greedy (the default); above: every row samples at it, losslessly")
    args = p.parse_args(argv)
    device = choose_device(args.device or "auto", "benchmark")
    shapes = args.shapes or (["smollm2-135m", "llama-3.1-8b"] if device.type == "cuda" else ["tiny"])
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
        "device_name": device_name(device),
        "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "temperature": args.temperature,
    }  # fmt: skip
    rows = []
    for shape in shapes:
        done = list(rows)
        # After every row: a run cut short (the GPU check's time limits) keeps what it measured.
        rows += bench_shape(shape, device, args, lambda shape_rows: args.out and write(args.out, done + shape_rows, meta))
        if device.type == "cuda":  # the shape's target and drafters went with bench_shape's frame
            torch.cuda.empty_cache()
    if args.out:
        print(f"results: {args.out.resolve()} (and {args.out.with_suffix('.json').name})")
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
