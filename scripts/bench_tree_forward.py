"""What one verification forward costs against a plain decoding step, by tree size, on this machine.

    python scripts/bench_tree_forward.py --target smollm2-135m --context 200 --out runs/bench-tree-forward

The target's own session (draftsmith.runtime.generate.TargetSession, the DynamicCache path eval
takes on a CPU) after a prefill of ``--context`` tokens: a plain step (one token, the LM head on
its last row) against a forward over a tree of N nodes (the root, the last decided token, and N - 1
drafted ones; a chain here) with the LM head on every node and the accepted path kept, as
speculative decoding runs it; and the LM head alone on N rows. A
speculative step pays off only when its tokens per target forward exceed the ratio in the last
column (plus the drafter's own time). Milliseconds are medians of ``--reps`` runs after warm-up.
The target's linear layers run on packed weights in fp32, as decoding runs them (draftsmith.packed;
``DRAFTSMITH_PACKED_LINEARS=0`` measures them unpacked); ``--unpacked-too`` measures both, one
call of each in turn, so that a machine whose speed drifts slows both alike.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from draftsmith.packed import packed_layers, packed_linears


def median_ms(fn, reps: int, model, modes: tuple[bool, ...]) -> list[float]:
    """Median ms of ``fn`` with ``model``'s linear layers packed or not, per mode (True: packed),
    the modes taking turns call by call."""
    times: list[list[float]] = [[] for _ in modes]
    for rep in range(reps + 3):  # three warm-ups
        for i, packed in enumerate(modes):
            with packed_linears(model, enabled=packed):
                start = time.perf_counter()
                fn()
                if rep >= 3:
                    times[i].append(time.perf_counter() - start)
    return [1000 * statistics.median(t) for t in times]


def main() -> int:
    from draftsmith.runtime.generate import TargetSession
    from draftsmith.runtime.tree import DraftTree
    from draftsmith.cli import OneLineParser, bounded
    from draftsmith.eval.report import write_bench_results
    from draftsmith.target import FrozenTarget, cpu_machine

    ap = OneLineParser(prog="bench_tree_forward.py", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--context", type=bounded(int, 1), default=200, help="tokens in the cache before the step")
    ap.add_argument("--nodes", type=bounded(int, 1), nargs="*", default=[1, 2, 4, 6, 8, 11, 16])
    ap.add_argument("--reps", type=bounded(int, 1), default=30)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--unpacked-too", action="store_true", help="measure with the linear layers unpacked as well, in turns")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    target = FrozenTarget.load(args.target, args.dtype)
    packed = packed_layers(target.model)  # packs the weights (where they can be), outside the timings
    modes = (True, False) if args.unpacked_too and packed else (True,)
    vocab = target.dims.vocab_size
    session = TargetSession(target)
    session.prefill(torch.randint(3, min(vocab, 20000), (1, args.context), generator=torch.Generator().manual_seed(0)))
    base = session.length

    def rewind() -> None:
        extra = session.cache.get_seq_length() - base
        if extra > 0:
            session.cache.crop(-extra)
        session.length = base

    def plain() -> None:
        session.next_logits(torch.tensor([[3]]))
        rewind()

    plain_ms = median_ms(plain, args.reps, target.model, modes)
    rows = []
    for n in args.nodes:
        tree = DraftTree.from_lists([3 + i % (vocab - 3) for i in range(n)], [-1] + list(range(n - 1)))
        hidden = torch.randn(1, n, target.dims.hidden_size, dtype=target.dtype)

        def verify(tree=tree) -> None:
            session.forward_tree(tree)
            session.keep([0])
            rewind()

        ms = median_ms(verify, args.reps, target.model, modes)
        head_ms = median_ms(lambda: target.lm_head(hidden), args.reps, target.model, modes)
        rows.append({"nodes": n, "verify_ms": ms[0], "lm_head_ms": head_ms[0], "ratio_to_plain": ms[0] / plain_ms[0]})
        if len(modes) == 2:
            rows[-1].update(unpacked_verify_ms=ms[1], unpacked_lm_head_ms=head_ms[1], unpacked_ratio_to_plain=ms[1] / plain_ms[1])
        print(json.dumps(rows[-1]), flush=True)

    machine = cpu_machine()
    packed_words = f"{packed} linear layers on packed weights" if packed else "linear layers unpacked"
    lines = [
        f"{args.target}, {args.dtype}, {args.context} tokens cached; {machine['cpu']} ({machine['capability']}), {machine['threads']} threads; "
        f"plain step {plain_ms[0]:.1f} ms (median of {args.reps}); {packed_words}"
        + (f"; unpacked in turns with them: plain step {plain_ms[1]:.1f} ms" if len(modes) == 2 else ""),
        "",
    ]
    if len(modes) == 2:
        lines += [
            "| tree nodes, the root included | ms, packed | x a plain step, packed | ms, unpacked | x a plain step, unpacked | LM head alone, packed / unpacked |",
            "| --- | --- | --- | --- | --- | --- |",
            *(f"| {r['nodes']} | {r['verify_ms']:.1f} | {r['ratio_to_plain']:.2f} | {r['unpacked_verify_ms']:.1f} | {r['unpacked_ratio_to_plain']:.2f} | "
              f"{r['lm_head_ms']:.1f} / {r['unpacked_lm_head_ms']:.1f} |" for r in rows),
        ]  # fmt: skip
    else:
        lines += [
            "| tree nodes, the root included | ms (LM head on every node, path kept) | of which the LM head alone | x a plain step |",
            "| --- | --- | --- | --- |",
            *(f"| {r['nodes']} | {r['verify_ms']:.1f} | {r['lm_head_ms']:.1f} | {r['ratio_to_plain']:.2f} |" for r in rows),
        ]
    write_bench_results(args.out, {"args": vars(args), "machine": machine, "packed_layers": packed, "plain_ms": plain_ms[0], "unpacked_plain_ms": plain_ms[1] if len(modes) == 2 else None, "rows": rows, "command": sys.argv}, lines)
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
