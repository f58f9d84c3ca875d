"""Eager operations a speculative step runs outside what CUDA replays as graphs, counted on the CPU.

    python scripts/bench_eager_ops.py --out docs/bench/eager-ops.md
    python scripts/bench_eager_ops.py --top 30          # and where the most of them come from
    python scripts/bench_eager_ops.py --temperatures 0 1 --out docs/bench/eager-ops.md   # greedy and sampled

On a GPU at batch 1 a step costs what launching its kernels costs: a piece captured as a CUDA
graph is one launch, every other operation a launch and a pass through Python. This counts them on
any machine: the drafters of scripts/bench_gpu.py (EAGLE-3 with its EAGLE-2 tree, DFlash, Medusa,
Hydra++, Clover-2,
the one-layer draft model drafting a chain of 4 and an EAGLE-2 tree (depth 4, top-3, 10 nodes:
standalone-eagle2), the target drafting a chain of 4 from its first
quarter of layers: early exit; and suffix lookup merged with the EAGLE-3 head: hybrid) at a shape
on the static cache, one generation
each after a warm-up one, every aten operation dispatched (a TorchDispatchMode; views count too:
they cost Python, not a kernel). Beside it, the host reads a step makes (a GPU's host syncs:
``.tolist()``, ``int()`` of a device tensor...), counted by ``draftsmith.testing.SimulatedDevice``
in a second generation without graphs; the torch reference verification's own reads, which the
fused kernel does not make, are left out.

``--graphs simulated`` (the default) decodes as CUDA does, through the graphs
(``draftsmith.testing.simulated_cuda_graphs``): a replay counts one, each input copied into a
graph's buffers one, the replayed operations nothing; the greedy verification runs inside the
target's graph, as the fused kernel does on CUDA. ``--graphs left-out`` is the count before the
simulation existed (commits up to 2026-11-27 afternoon): no graphs, the callables CUDA captures
left out, and the torch reference verification, which CUDA replaces with the fused kernel,
counted apart (``reference verification``) and left out of the total.

Beside them, under simulated graphs, the kernels a step replays inside its graphs: every aten
operation of each replayed trace that computes (views, and allocations without a fill, left out),
summed over the step's replays; and the same for a plain step (the target alone on the same static
cache, one token a forward), so that their ratio says how much more a speculative step gives the
GPU to run, apart from launches. It counts what the CPU's traces hold: where CUDA fuses an operation
the CPU decomposes (or the other way round) the counts differ from a GPU's (rms_norm is six here,
one kernel on CUDA; the target's graph holds the torch reference verification where CUDA runs
the fused kernel: about 54 kernels greedy and 1,181 sampled, counted once around
``runtime.static.verified_in_graph`` at a 26-node tree and 512 tokens); and a kernel's cost grows
with its work, which a count leaves out (at a large shape the weights read set the time).

``--temperatures`` above 0 decode with lossless sampling: the drafter draws its children (on the
device on the static cache: ``draftsmith.sampling.DeviceDraws``) and the verification runs inside
the target's graph as the greedy one does (since the eleventh session: the uniforms drawn first,
an input of the graph), here the torch reference, on CUDA the fused kernel. Under ``--graphs
left-out`` it runs outside and is counted apart, as above.
"""

from __future__ import annotations

import collections
import functools
import json
import sys
from contextlib import ExitStack, nullcontext
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

KINDS = ("eagle3", "dflash", "medusa", "hydra", "clover", "standalone", "standalone-eagle2", "early-exit", "hybrid")


def graphed_callables():
    """(class, method name) of everything draftsmith captures as a CUDA graph on CUDA."""
    from draftsmith.heads.dflash import DFlashSession
    from draftsmith.heads.eagle import EagleSession
    from draftsmith.heads.medusa import MedusaSession
    from draftsmith.runtime.early_exit import EarlyExitDrafter
    from draftsmith.runtime.static import StaticSession

    return [(StaticSession, "_eager"), (StaticSession, "_tree_eager"), (StaticSession, "_tree_verified"), (EagleSession, "_slotted_forward"), (EagleSession, "_tree_function"),
            (DFlashSession, "_block_logits"), (MedusaSession, "_logits"), (StaticSession, "_read_then_draft"), (StaticSession, "_drafted_tree"),
            (EarlyExitDrafter, "_chain"), (EarlyExitDrafter, "_verified_static")]  # fmt: skip


class EagerOps(TorchDispatchMode):
    """Counts aten operations outside the graphed callables, by the innermost draftsmith line."""

    def __init__(self) -> None:
        super().__init__()
        import draftsmith

        self.package = str(Path(draftsmith.__file__).parent)
        self.depth = 0  # > 0 inside a graphed callable
        self.lines: collections.Counter[str] = collections.Counter()
        self.replayed = 0  # kernels inside the graphs replayed (simulated graphs)

    def patch(self, stack: ExitStack) -> None:
        for cls, name in graphed_callables():
            original = getattr(cls, name, None)
            if original is None:  # an older draftsmith, for a before-and-after count
                continue

            @functools.wraps(original)
            def inside(*args, _original=original, **kwargs):
                self.depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.depth -= 1

            setattr(cls, name, inside)
            stack.callback(setattr, cls, name, original)

    def patch_replays(self, stack: ExitStack, traced) -> None:
        """Under simulated graphs: each replay counts as one operation (a graph launch), the input
        copies before it as one each (CapturedForward's copy_ on CUDA), the replayed operations
        not at all (``replayed`` counts them apart: the kernels inside the graphs)."""
        original = traced.replay

        def replay(graph):
            self.lines[REPLAY] += 1
            self.replayed += trace_kernels(graph.trace)
            self.depth += 1
            try:
                return original(graph)
            finally:
                self.depth -= 1

        traced.replay = replay
        stack.callback(setattr, traced, "replay", original)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.depth:
            frame, where, reference = sys._getframe(1), None, False
            while frame is not None:
                name = frame.f_code.co_filename
                if name.startswith(self.package):
                    if where is None:
                        where = f"{Path(name).relative_to(self.package)}:{frame.f_lineno} {frame.f_code.co_name}"
                    # The torch reference verification (runtime/verify.py, and the tree checks and
                    # masks it calls), which CUDA replaces with the fused kernel.
                    reference = reference or name.endswith("runtime/verify.py")
                frame = frame.f_back
            self.lines[(REFERENCE if reference else "") + (where or "?")] += 1
        return func(*args, **(kwargs or {}))


REFERENCE = "reference verification: "
REPLAY = "graph replays (one launch each)"


def trace_kernels(trace) -> int:
    """The operations of a traced graph (``draftsmith.testing.TracedGraph.trace``) that run a
    kernel: every aten call but views (a result aliasing an input without writing it, and
    ``_unsafe_view``, which aten does not mark so) and bare allocations."""
    cache = trace.__dict__.get("_kernels")
    if cache is None:
        cache = 0
        for node in trace.graph.nodes:
            op = node.target
            if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.overloadpacket in NO_KERNEL:
                continue
            alias = op._schema.returns[0].alias_info if op._schema.returns else None
            cache += not (alias is not None and not alias.is_write)
        trace.__dict__["_kernels"] = cache
    return cache


NO_KERNEL = (torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten._unsafe_view)


def reference_verification(line: str) -> bool:
    return line.startswith(REFERENCE)


def build_drafter(kind: str, target):
    """One of KINDS on ``target``, its own caches preallocated as on CUDA."""
    from bench_gpu import build_draft_model_drafter, build_head_drafter

    if kind == "early-exit":
        from draftsmith.runtime.early_exit import EarlyExitDrafter
        from draftsmith.runtime.tree import TreeSpec

        return EarlyExitDrafter(target, exit_layer=max(1, target.dims.num_layers // 4), tree=TreeSpec.chain(4))
    if kind == "hybrid":
        from draftsmith.runtime.lookup import HybridDrafter, SuffixMatcher

        return HybridDrafter(build_head_drafter("eagle3", target, cache="static"), SuffixMatcher())
    if kind == "standalone-eagle2":
        from draftsmith.runtime.tree import DynamicTreeSpec

        return build_draft_model_drafter(target, cache="static", tree=DynamicTreeSpec(depth=4, topk=3, budget=10))
    return build_draft_model_drafter(target, cache="static") if kind == "standalone" else build_head_drafter(kind, target, cache="static")


def sampling_of(temperature: float):
    """Greedy at 0, else lossless sampling at ``temperature`` (no top-k / top-p); and a generator
    seeded alike for each generation, so that the counted one draws what the warm-up drew and
    meets no shape (a number of accepted positions) whose graph the warm-up did not capture."""
    from draftsmith.runtime.verify import SamplingParams

    if temperature == 0:
        return SamplingParams(), lambda: None
    return SamplingParams(mode="sample", temperature=temperature), lambda: torch.Generator().manual_seed(0)


def kernels_cell(row: dict) -> str:
    """"replayed (plain)", or "-" without simulated graphs."""
    if row["kernels_replayed_per_step"] is None:
        return "-"
    return f"{row['kernels_replayed_per_step']} ({row['plain_step_kernels']})"


def decoding(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"sampled, T={temperature:g}"


def host_reads(shape: str, kind: str, args, temperature: float = 0.0) -> tuple[float, list]:
    """(host reads a step, the lines making the most), under SimulatedDevice, the second of two generations."""
    import inspect

    from bench_gpu import build_target

    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.runtime.tree import DraftTree
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import SimulatedDevice

    device = torch.device("cpu")
    with SimulatedDevice() as guard, torch.no_grad():
        target = FrozenTarget(build_target(shape, device, torch.float32).model.to(device))  # its weights on the simulated device
        drafter = build_drafter(kind, target)
        prompt = torch.randint(3, target.dims.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
        sampling, generator = sampling_of(temperature)
        speculative_generate(target, drafter, prompt, args.new_tokens, cache="static", sampling=sampling, generator=generator())
        before = len(guard.reads)
        _, stats = speculative_generate(target, drafter, prompt, args.new_tokens, cache="static", sampling=sampling, generator=generator())
    checks = set()
    for method in (DraftTree.validate, DraftTree.children_table):  # the tree checks and the table of the reference verification
        lines, first = inspect.getsourcelines(method)
        checks |= {f"tree.py:{n}" for n in range(first, first + len(lines))}
    reads = [r for r in guard.reads[before:] if not r.split(" at ")[1].startswith("verify.py") and r.split(" at ")[1] not in checks]
    steps = len(stats.accept_lens)
    return round(len(reads) / steps, 2), [(line, round(n / steps, 2)) for line, n in collections.Counter(reads).most_common(args.top)]


def count(shape: str, kind: str, args, temperature: float = 0.0) -> dict:
    from bench_gpu import build_target

    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.testing import TracedGraph, simulated_cuda_graphs

    with simulated_cuda_graphs() if args.graphs == "simulated" else nullcontext(), torch.no_grad():
        target = build_target(shape, torch.device("cpu"), torch.float32)
        drafter = build_drafter(kind, target)
        prompt = torch.randint(3, target.dims.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
        sampling, generator = sampling_of(temperature)
        # warm-up: buffers, sessions and graphs made (as large)
        speculative_generate(target, drafter, prompt, args.new_tokens, cache="static", sampling=sampling, generator=generator())
        counter = EagerOps()
        with ExitStack() as stack:
            counter.patch(stack)
            if args.graphs == "simulated":
                counter.patch_replays(stack, TracedGraph)
            with counter:
                _, stats = speculative_generate(target, drafter, prompt, args.new_tokens, cache="static", sampling=sampling, generator=generator())
    steps = len(stats.accept_lens)
    replayed = round(counter.replayed / steps, 1) if args.graphs == "simulated" else None
    reference = sum(n for line, n in counter.lines.items() if reference_verification(line))
    total = sum(counter.lines.values()) - reference
    reads, read_lines = host_reads(shape, kind, args, temperature)
    return {
        "shape": shape, "drafter": kind, "temperature": temperature, "steps": steps, "eager_ops_per_step": round(total / steps, 1),
        "reference_verification_per_step": round(reference / steps, 1), "host_reads_per_step": reads, "kernels_replayed_per_step": replayed,
        "host_read_lines": read_lines,
        "top": [(line, round(n / steps, 1)) for line, n in counter.lines.most_common() if not reference_verification(line)][: args.top],
    }  # fmt: skip


def plain_kernels(shape: str, args) -> float:
    """Kernels a plain step replays (the target alone on the static cache, through simulated
    graphs, one token a forward), the second of two generations."""
    from bench_gpu import build_target

    from draftsmith.runtime.generate import autoregressive_generate
    from draftsmith.testing import TracedGraph, simulated_cuda_graphs

    with simulated_cuda_graphs(), torch.no_grad():
        target = build_target(shape, torch.device("cpu"), torch.float32)
        prompt = torch.randint(3, target.dims.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
        autoregressive_generate(target, prompt, args.new_tokens, cache="static")
        counter = EagerOps()
        with ExitStack() as stack:
            counter.patch_replays(stack, TracedGraph)
            _, stats = autoregressive_generate(target, prompt, args.new_tokens, cache="static")
    return round(counter.replayed / len(stats.accept_lens), 1)


def main(argv=None) -> int:
    from bench_gpu import SHAPES, save

    from draftsmith.cli import OneLineParser, bounded

    p = OneLineParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["tiny"], choices=list(SHAPES), help="target shapes (random weights; the count does not depend on the width)")
    p.add_argument("--drafters", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--prompt-len", type=bounded(int, 2), default=16)
    p.add_argument("--new-tokens", type=bounded(int, 1), default=40)
    p.add_argument("--top", type=bounded(int, 0), default=10, help="lines with the most eager operations, per row")
    p.add_argument(
        "--temperatures", nargs="+", type=bounded(float, 0.0), default=[0.0],
        help="0: greedy; above: lossless sampling at that temperature (its verification counted apart, as the torch reference's)",
    )  # fmt: skip
    p.add_argument(
        "--graphs", choices=["simulated", "left-out"], default="simulated",
        help="simulated: decode through the graphs as CUDA does (draftsmith.testing.simulated_cuda_graphs), a replay and each input copy one operation; "
        "left-out: no graphs, the callables CUDA captures left out of the count (the count of commits before the simulation)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="Markdown table (and .json beside it); default: print only")
    args = p.parse_args(argv)
    rows, plain = [], {}
    for shape in args.shapes:
        if args.graphs == "simulated":
            plain[shape] = plain_kernels(shape, args)
            print(json.dumps({"shape": shape, "plain_step_kernels": plain[shape]}), flush=True)
        for temperature in args.temperatures:
            for kind in args.drafters:
                rows.append(count(shape, kind, args, temperature))
                rows[-1]["plain_step_kernels"] = plain.get(shape)
                print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("top", "host_read_lines")}), flush=True)
                for line, n in rows[-1]["top"]:
                    print(f"  {n:7.1f}  {line}")
                for line, n in rows[-1]["host_read_lines"]:
                    print(f"  {n:7.2f}  host read: {line}")
    if args.out:
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__, "new_tokens": args.new_tokens, "graphs": args.graphs}
        lines = [
            f"# Eager operations a speculative step runs outside CUDA graphs, {meta['date']}", "",
            f"`scripts/bench_eager_ops.py --graphs {args.graphs}`, torch {meta['torch']}, the static cache, {args.new_tokens} new tokens after a warm-up generation of as many. "
            + ("Counted on the CPU, decoding through simulated CUDA graphs: a graph replay and each input copy count one operation. "
               "The last column counts the kernels replayed inside the graphs a step (views and bare allocations left out) and, in brackets, a "
               "plain step's (the target alone on the same cache). It counts the CPU's operations: the target's graph holds the torch reference "
               "verification (about 54 kernels greedy and 1,181 sampled at a 26-node tree, where CUDA runs the fused kernel), and rms_norm counts "
               "its six operations (one fused kernel on CUDA)."
               if args.graphs == "simulated" else
               "Counted on the CPU without graphs, the callables CUDA captures left out; the torch reference verification, which CUDA replaces with the fused kernel, apart."), "",
            "| shape | drafter | decoding | steps | eager operations a step | reference verification a step | host reads a step | kernels replayed a step (a plain step's) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]  # fmt: skip
        lines += [f"| {r['shape']} | {r['drafter']} | {decoding(r['temperature'])} | {r['steps']} | {r['eager_ops_per_step']} | {r['reference_verification_per_step']} | {r['host_reads_per_step']} | {kernels_cell(r)} |" for r in rows]
        save(args.out, lines, rows, meta)
        print(f"results: {args.out.resolve()} (and {args.out.with_suffix('.json').name})")
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
