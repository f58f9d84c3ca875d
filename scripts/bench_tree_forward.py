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
``DRAFTSMITH_PACKED_LINEARS=0`` measures them unpacked).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> int:
    from draftsmith.runtime.generate import TargetSession
    from draftsmith.runtime.tree import DraftTree
    from draftsmith.cli import OneLineParser, bounded
    from draftsmith.eval.report import write_bench_results
    from draftsmith.packed import packed_linears
    from draftsmith.target import FrozenTarget, cpu_machine

    ap = OneLineParser(prog="bench_tree_forward.py", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--context", type=bounded(int, 1), default=200, help="tokens in the cache before the step")
    ap.add_argument("--nodes", type=bounded(int, 1), nargs="*", default=[1, 2, 4, 6, 8, 11, 16])
    ap.add_argument("--reps", type=bounded(int, 1), default=30)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    target = FrozenTarget.load(args.target, args.dtype)
    with packed_linears(target.model) as packed_layers:  # as decoding runs the target
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

        plain_ms = median_ms(plain, args.reps)
        rows = []
        for n in args.nodes:
            tree = DraftTree.from_lists([3 + i % (vocab - 3) for i in range(n)], [-1] + list(range(n - 1)))
            hidden = torch.randn(1, n, target.dims.hidden_size, dtype=target.dtype)

            def verify(tree=tree) -> None:
                session.forward_tree(tree)
                session.keep([0])
                rewind()

            ms = median_ms(verify, args.reps)
            head_ms = median_ms(lambda: target.lm_head(hidden), args.reps)
            rows.append({"nodes": n, "verify_ms": ms, "lm_head_ms": head_ms, "ratio_to_plain": ms / plain_ms})
            print(json.dumps(rows[-1]), flush=True)

    machine = cpu_machine()
    lines = [
        f"{args.target}, {args.dtype}, {args.context} tokens cached; {machine['cpu']} ({machine['capability']}), {machine['threads']} threads; "
        f"plain step {plain_ms:.1f} ms (median of {args.reps}); {packed_layers} linear layers on packed weights",
        "",
        "| tree nodes, the root included | ms (LM head on every node, path kept) | of which the LM head alone | x a plain step |",
        "| --- | --- | --- | --- |",
        *(f"| {r['nodes']} | {r['verify_ms']:.1f} | {r['lm_head_ms']:.1f} | {r['ratio_to_plain']:.2f} |" for r in rows),
    ]
    write_bench_results(args.out, {"args": vars(args), "machine": machine, "packed_layers": packed_layers, "plain_ms": plain_ms, "rows": rows, "command": sys.argv}, lines)
    return 0


if __name__ == "__main__":
    from draftsmith.cli import script_main

    sys.exit(script_main(main))
