"""The peer benchmark scripts' own logic (packing arithmetic, the ngram flag) and their bad input: one line, exit 2, before anything heavy runs."""

from __future__ import annotations

import json
import sys

import pytest

from draftsmith.cli import BadInput, script_main
from draftsmith.testing import REPO, load_script


@pytest.fixture(scope="module")
def peers():
    return load_script("scripts/peers/speculators_eagle3.py")


@pytest.fixture(scope="module")
def bench():
    return load_script("scripts/bench_vllm.py")


def test_packed_rows_fill_in_order_and_cut_long_examples(peers):
    # [500, 500] | [300] (1300 would not fit) | [1216] (1300 cut to the row)
    assert peers.packed_rows([500, 500, 300, 1300], 1216) == 3
    assert peers.packed_rows([1216, 1], 1216) == 2
    assert peers.packed_rows([600, 616], 1216) == 1
    assert peers.packed_rows([], 1216) == 0


def test_ngram_flag(bench):
    assert bench.parse_ngram("3") == (3, {})
    assert bench.parse_ngram("3:1-3") == (3, {"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert bench.parse_ngram("5:2") == (5, {"prompt_lookup_min": 2, "prompt_lookup_max": 2})


def test_script_main_maps_bad_input_to_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)

    def bad():
        raise BadInput("--flag: not usable")

    assert script_main(bad) == 2
    assert capsys.readouterr().err == "error: --flag: not usable\n"

    def broken():
        raise RuntimeError("a bug, not bad input")

    with pytest.raises(RuntimeError):
        script_main(broken)


def test_speculators_script_refuses_a_venv_without_speculators(peers, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    venv = tmp_path / "not-a-venv"
    argv = [
        "speculators_eagle3.py", str(REPO / "recipes/eagle3/smollm2-135m.yaml"), "--draftsmith-run", str(tmp_path / "run"),
        "--setting", "same-schedule", "--out", str(tmp_path / "out"), "--venv", str(venv),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert script_main(peers.main) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --venv {venv}: no python there imports speculators") and err.count("\n") == 1
    assert not venv.exists() and not (tmp_path / "out").exists()  # nothing built, nothing written


def test_bench_script_refuses_a_missing_drafter(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    missing = tmp_path / "no-such-run"
    monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--drafter", f"mine={missing}", "--out", str(tmp_path / "out")])
    assert script_main(bench.main) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_gpu_check_runs_a_step_under_its_limit_and_reports_counts_and_failures(tmp_path):
    """scripts/gpu_check.py reads pytest's closing line and failing tests, kills a step past its
    limit, and writes report.md/.json after every step."""
    gpu_check = load_script("scripts/gpu_check.py")
    test = tmp_path / "test_two.py"
    test.write_text("def test_ok():\n    assert True\n\ndef test_bad():\n    assert 1 == 2\n")
    env = {**__import__("os").environ}
    row = gpu_check.run_step("two", [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", str(test)], 120, tmp_path, env)
    assert row["exit_code"] == 1 and row["counts"] == {"passed": 1, "failed": 1}
    assert len(row["failing"]) == 1 and row["failing"][0].endswith("test_two.py::test_bad")
    slow = gpu_check.run_step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1, tmp_path, env)
    assert slow["exit_code"] == "timeout" and slow["seconds"] < 10
    gpu_check.write_report(tmp_path, {"gpu": "none", "python": "3"}, [row, slow])
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == ["two", "slow"]
    md = (tmp_path / "report.md").read_text()
    assert "| two | 1 |" in md and "test_two.py::test_bad" in md and "## slow: exit timeout" in md


def test_bench_gpu_times_every_drafter_kind_on_the_cpu(tmp_path):
    """scripts/bench_gpu.py at a tiny shape on the CPU: every row is there on both caches, the
    target drafting for itself accepts whole chains, the profile and the table and JSON are written
    (into a folder that did not exist)."""
    bench = load_script("scripts/bench_gpu.py")
    out = tmp_path / "new" / "bench.md"
    argv = ["--device", "cpu", "--shapes", "tiny", "--prompts", "1", "--prompt-len", "8", "--new-tokens", "11", "--out", str(out), "--profile", "eagle3"]
    assert bench.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    names = [r["drafter"] for r in rows]
    assert names[:4] == [
        "plain: transformers generate()", "plain: transformers generate(), static cache", "plain: draftsmith loop, dynamic cache",
        "plain: draftsmith loop, static cache",
    ]  # fmt: skip
    for cache in ("dynamic cache", "static cache"):
        assert {f"{kind}, nothing accepted, {cache}" for kind in ("eagle3", "dflash", "medusa", "hydra", "clover")} <= set(names)
        assert f"early exit at layer 1 (chain of 4), its own acceptance, {cache}" in names
        assert f"eagle3 + suffix lookup (hybrid), its own acceptance, {cache}" in names
    assert all(r["graphs"] is False for r in rows if r.get("cache") == "static")  # no graphs on the CPU
    itself = [r for r in rows if r["drafter"].startswith("target drafting for itself")]
    assert len(itself) == 2 and all(r["tokens_per_step"] > 3.0 for r in itself)  # chains of 4 plus the bonus
    assert all(r["verification"] == "torch reference" and r["ms_per_step"] > 0 for r in rows)
    assert "| tiny | eagle3, nothing accepted, static cache |" in out.read_text()
    assert "host syncs" in (tmp_path / "new" / "bench-profile-tiny-eagle3.txt").read_text()
    # --caches static: our rows on the static cache only (transformers' two plain rows stay).
    argv = ["--device", "cpu", "--shapes", "tiny", "--prompts", "1", "--prompt-len", "8", "--new-tokens", "5", "--out", str(tmp_path / "s.md"), "--caches", "static"]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert {r["cache"] for r in rows} == {"transformers dynamic", "transformers static", "static"} and len(rows) == 2 + 1 + 9
    assert all(r["decoding"] == "exact, greedy" for r in rows)
    # --temperature 1: every row samples; the target drafting for itself still accepts whole chains.
    argv = ["--device", "cpu", "--shapes", "tiny", "--prompts", "1", "--prompt-len", "8", "--new-tokens", "11", "--out", str(tmp_path / "t.md"), "--caches", "static",
            "--temperature", "1"]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert len(rows) == 12 and all(r["decoding"].startswith("exact, lossless sampling at temperature 1.0") for r in rows)
    assert "lossless sampling at temperature 1 in every row" in (tmp_path / "t.md").read_text()
    itself = [r for r in rows if r["drafter"].startswith("target drafting for itself")]
    assert len(itself) == 1 and itself[0]["tokens_per_step"] > 3.0


def test_bench_gpu_train_times_eagle3_and_dflash_training_on_the_cpu(tmp_path):
    """scripts/bench_gpu_train.py at a tiny shape on the CPU: a row per head, mode and training
    attention, the heads learn (the same data and start give the same loss online and from cached
    features, with attention kept or recomputed), a profile per row, and the table and JSON are
    written; the process's training attention is left as it was."""
    import draftsmith.heads.layers as layers

    bench = load_script("scripts/bench_gpu_train.py")
    out = tmp_path / "train.md"
    argv = ["--device", "cpu", "--shapes", "tiny", "--steps", "2", "--warmup", "1", "--seq-len", "32", "--out", str(out)]
    assert bench.main([*argv, "--attention", "keep", "recompute", "--profile", str(tmp_path / "prof")]) == 0
    assert layers.TRAINING_ATTENTION == "auto"
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["head"], r["mode"], r["attention"]) for r in rows] == [
        (head, mode, attention) for head in ("eagle3", "dflash") for mode in ("online", "cached") for attention in ("keep", "recompute")
    ]
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gb"] is None and r["step_memory_gb"] is None and r["trainable_parameters"] > 0 for r in rows)
    assert len({r["final_loss"] for r in rows[:4]}) == 1 and len({r["final_loss"] for r in rows[4:]}) == 1
    assert "| tiny | dflash | cached | recompute |" in out.read_text()
    # EAGLE-3 trains every position with a label (depth k predicts x_{t+k+1}: all but a row's last
    # k + 1 of 32), none skipped for lying outside the draft vocabulary.
    eagle3 = [r for r in rows if r["head"] == "eagle3"]
    assert all(r["trained_share"] == pytest.approx(1 - ((1 + 7) / 2 + 1) / 32, abs=0.002) for r in eagle3), eagle3
    tables = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert len(tables) == 8 and "tiny-eagle3-cached-recompute-frozen.txt" in tables
    assert "aten::" in (tmp_path / "prof" / "tiny-eagle3-cached-recompute-frozen.txt").read_text()
    # From cached features the target holds only its embedding, LM head and final norm, as train
    # does on a feature cache; online it holds its decoder layers too.
    D, V = 64, 512
    held = {r["mode"]: r["target_parameters_held"] for r in rows}
    assert held["cached"] == 2 * V * D + D and held["online"] > held["cached"]


def test_bench_gpu_train_freezes_the_lm_head_as_speculators_or_trains_it(tmp_path):
    """--lm-head: frozen (speculators' setting, the default) leaves the heads' own LM head out of the
    trained parameters, trained (our recipes') puts it in: a row each, in the table's column."""
    bench = load_script("scripts/bench_gpu_train.py")
    out = tmp_path / "train.md"
    argv = ["--device", "cpu", "--shapes", "tiny", "--steps", "1", "--warmup", "0", "--seq-len", "16", "--modes", "cached", "--attention", "keep"]
    assert bench.main([*argv, "--lm-head", "frozen", "trained", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["head"], r["lm_head"]) for r in rows] == [(h, m) for h in ("eagle3", "dflash") for m in ("frozen", "trained")]
    D, Vd = 64, 512  # the tiny shape's width; its whole 512-token vocabulary is the draft vocabulary
    for frozen, trained in (rows[:2], rows[2:]):
        assert trained["trainable_parameters"] - frozen["trainable_parameters"] == Vd * D
    assert "| tiny | dflash | cached | keep | trained |" in out.read_text()


# Every script under scripts/ refuses a bad command line in one line, exit 2, before it loads a
# model, starts an engine or writes anything (the line names the flag).
BAD_SCRIPT_ARGS = [
    ("scripts/bench_gpu_train.py", ["--steps", "0"], "--steps"),
    ("scripts/bench_eager_ops.py", ["--new-tokens", "0"], "--new-tokens"),
    ("scripts/bench_eager_ops.py", ["--drafters", "lookup"], "--drafters"),
    ("scripts/bench_gpu_train.py", ["--heads", "medusa"], "--heads"),
    ("scripts/bench_gpu_train.py", ["--device", "cuda:7"], "--device"),
    ("scripts/bench_vllm.py", ["--ngram", "abc"], "--ngram"),
    ("scripts/bench_vllm.py", ["--ngram", "3:4-2"], "--ngram"),
    ("scripts/bench_vllm.py", ["--k", "0"], "--k"),
    ("scripts/bench_vllm.py", ["--limit", "0"], "--limit"),
    ("scripts/bench_vllm.py", ["--max-new-tokens", "-5"], "--max-new-tokens"),
    ("scripts/bench_vllm.py", ["--suffix", "0"], "--suffix"),
    ("scripts/bench_vllm.py", ["--draftsmith-limit", "nan"], "--draftsmith-limit"),
    ("scripts/bench_train.py", ["--steps", "0"], "--steps"),
    ("scripts/bench_train.py", ["--steps", "2", "--warmup", "2"], "--warmup"),
    ("scripts/bench_verify.py", ["--reps", "0"], "--reps"),
    ("scripts/bench_verify.py", ["--device", "tpu"], "--device"),
    ("scripts/bench_regenerate.py", ["recipe.yaml", "--backends", "hf,gpu"], "--backends"),
    ("scripts/split_prompts.py", ["recipe.yaml", "--n", "0"], "--n"),
    ("scripts/simulate_online.py", ["--update-every", "0"], "--update-every"),
    ("scripts/learning_curve.py", [], "run"),
    ("scripts/check_speculators_dflash.py", [], "out"),
    ("scripts/peers/speculators_eagle3.py", ["recipe.yaml", "--setting", "best"], "--setting"),
    ("scripts/peers/speculators_gpu_train.py", ["--steps", "0"], "--steps"),
    ("scripts/peers/speculators_gpu_train.py", ["--heads", "medusa"], "--heads"),
    # draftsmith's environment has no speculators (it pins another transformers): said in one line.
    ("scripts/peers/speculators_gpu_train.py", ["--shape", "tiny", "--work", "spec-work"], "speculators 0.9.0 does not import here"),
    ("scripts/bench_hybrid.py", ["--drafter", "run", "--limit", "0"], "--limit"),
    ("scripts/bench_tree_forward.py", ["--reps", "0"], "--reps"),
    ("scripts/bench_tree_forward.py", ["--nodes", "4", "0"], "--nodes"),
]


@pytest.mark.parametrize("script, argv, flag", BAD_SCRIPT_ARGS, ids=[f"{s.split('/')[-1]} {' '.join(a)}" for s, a, _ in BAD_SCRIPT_ARGS])
def test_every_script_refuses_a_bad_command_line_in_one_line(script, argv, flag, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DRAFTSMITH_VLLM_VENV", str(tmp_path / "no-venv"))
    module = load_script(script)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [script, *argv, *(["--out", str(out)] if "--out" in open(REPO / script).read() and "learning_curve" not in script else [])])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        script_main(module.main)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and flag in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_bench_script_names_its_real_options_for_an_out_it_will_not_replace(bench, tmp_path, capsys, monkeypatch):
    """The script has --resume, not --overwrite: an unfinished benchmark is to be resumed, a folder
    of the user's to be left alone."""
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    unfinished, mine = tmp_path / "bench", tmp_path / "mine"
    unfinished.mkdir()
    (unfinished / "job.json").write_text("{}")
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    for out, words in [(unfinished, ["unfinished benchmark", "--resume"]), (mine, ["notes.txt", "choose another destination"])]:
        monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--ngram", "3", "--out", str(out)])
        assert script_main(bench.main) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--overwrite" not in err and all(w in err for w in words), err


def test_bench_tree_forward_times_each_tree_size_against_a_plain_step(tiny_llama_dir, tmp_path):
    bench = load_script("scripts/bench_tree_forward.py")
    out = tmp_path / "tree"
    sys_argv = ["bench_tree_forward.py", "--target", str(tiny_llama_dir), "--context", "12", "--nodes", "1", "5", "--reps", "2", "--unpacked-too", "--out", str(out)]
    import unittest.mock

    with unittest.mock.patch.object(sys, "argv", sys_argv):
        assert bench.main() == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["nodes"] for r in result["rows"]] == [1, 5] and result["plain_ms"] > 0
    assert all(r["verify_ms"] > 0 and r["lm_head_ms"] > 0 and r["ratio_to_plain"] == pytest.approx(r["verify_ms"] / result["plain_ms"]) for r in result["rows"])
    assert "| 5 |" in (out / "results.md").read_text()
    # The fp32 target ran packed, and unpacked in turns with it.
    assert result["packed_layers"] > 0 and result["unpacked_plain_ms"] > 0
    assert all(r["unpacked_verify_ms"] > 0 and r["unpacked_ratio_to_plain"] == pytest.approx(r["unpacked_verify_ms"] / result["unpacked_plain_ms"]) for r in result["rows"])


def test_bench_vllm_per_prompt_rows_give_tokens_per_forward_and_paired_figures(bench):
    from draftsmith.eval.acceptance import paired_ratio, paired_tau_difference, tau_interval

    # Two prompts of 10 new tokens: 4 and 0 drafts accepted, so 6 and 10 target forwards.
    got = {"outputs": [[1] * 10, [2] * 10], "per_prompt": [{"drafts": 5, "accepted": 4}, {"drafts": 3, "accepted": 0}], "prompt_seconds": [1.0, 2.0]}
    assert bench.forward_rows(got) == [(6, 4), (10, 0)]
    # Resampling only these two prompts, tokens per forward lies between theirs: 10/6 and 10/10.
    low, high = tau_interval(bench.forward_rows(got))
    assert 1.0 <= low <= 20 / 16 <= high <= 10 / 6 + 1e-9
    assert bench.tokens_and_seconds(got) == [(10, 1.0), (10, 2.0)]
    assert bench.tokens_and_seconds({"outputs": [[1]], "per_prompt": [{}]}) is None  # a resumed old vllm.json
    # Against itself, the paired difference is exactly zero and the paired speedup exactly one.
    assert paired_tau_difference(bench.forward_rows(got), bench.forward_rows(got)) == [0.0, 0.0, 0.0]
    assert paired_ratio(bench.tokens_and_seconds(got), bench.tokens_and_seconds(got)) == [1.0, 1.0, 1.0]
    # Twice as fast on every prompt: a paired speedup of exactly 2, however the prompts are drawn.
    faster = dict(got, prompt_seconds=[0.5, 1.0])
    assert paired_ratio(bench.tokens_and_seconds(faster), bench.tokens_and_seconds(got)) == pytest.approx([2.0, 2.0, 2.0])


def test_bench_vllm_pairs_a_run_with_an_earlier_benchmark_on_the_same_prompts(bench, tmp_path):
    from draftsmith.cli import BadInput

    got = {"outputs": [[1] * 10, [2] * 10], "per_prompt": [{"drafts": 5, "accepted": 4}, {"drafts": 3, "accepted": 0}]}
    better = {"outputs": [[1] * 10, [2] * 10], "per_prompt": [{"drafts": 5, "accepted": 5}, {"drafts": 3, "accepted": 1}]}
    now = {"plain": {"outputs": got["outputs"]}, "new": better}
    earlier = {"plain": {"outputs": [[1] * 10, [3] * 10]}, "old": got, "lookup": better}
    paired = bench.against_rows(now, earlier)
    assert paired["plain_identical"] == "1/2"  # the check is reported, prompt by prompt
    assert set(paired["tokens_per_forward"]) == {"new - old", "new - lookup"}
    assert paired["tokens_per_forward"]["new - lookup"] == [0.0, 0.0, 0.0]  # the same counts: exactly no difference
    low, mid, high = paired["tokens_per_forward"]["new - old"]
    assert 0 < low <= mid <= high  # one more accepted token on each prompt: better on every resample
    assert paired["acceptance_length"]["new - lookup"] == [0.0, 0.0, 0.0]
    # The earlier benchmark must have served the same target, prompts and budget.
    job = {"target": "t", "prompts": [[1, 2]], "max_tokens": 10}
    (tmp_path / "job.json").write_text(json.dumps(dict(job, runs=[])))
    (tmp_path / "vllm.json").write_text(json.dumps(earlier))
    assert bench.earlier_job(tmp_path, job)[1] == earlier
    for key, value, words in (("prompts", [[1, 3]], "prompts"), ("max_tokens", 20, "--max-new-tokens"), ("target", "u", "target")):
        with pytest.raises(BadInput, match=words):
            bench.earlier_job(tmp_path, dict(job, **{key: value}))
    with pytest.raises(BadInput, match="no finished benchmark"):
        bench.earlier_job(tmp_path / "missing", job)


def test_speculators_script_counts_the_draftsmith_runs_tokens_by_replaying_its_batch_order(peers, tmp_path):
    from types import SimpleNamespace

    from draftsmith.data import BatchStream

    recipe = SimpleNamespace(train=SimpleNamespace(micro_batch_size=2, grad_accum_steps=2), data=SimpleNamespace(seed=7))
    lengths = [10, 20, 30, 40, 50]
    # The trainer's own stream, written out by hand step by step: 2 micro-batches of 2 a step.
    stream = BatchStream(list(range(5)), batch_size=2, collator=list, seed=7)
    steps = [sum(lengths[i] for _ in range(2) for i in stream.next_indices()) for _ in range(6)]
    log = [{"step": s, "kind": "train", "tokens": steps[s - 1]} for s in (1, 5, 6)] + [{"step": 6, "kind": "eval", "top1": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    got = peers.run_metrics(tmp_path, recipe, lengths)
    assert got == {"steps": 6, "tokens": sum(steps), "tokens_per_step": sum(steps) / 6}
    assert got["tokens"] != 6 * sum(r["tokens"] for r in log[:3]) / 3  # not the estimate from logged steps
    # A log the replay does not reproduce (another seed, recipe or data) is refused, naming the step.
    log[1]["tokens"] += 1
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    with pytest.raises(BadInput, match="step 5 logged"):
        peers.run_metrics(tmp_path, recipe, lengths)


def test_bench_eager_ops_counts_what_cuda_would_launch_eagerly(tmp_path):
    """scripts/bench_eager_ops.py at the tiny shape, both ways. Graphs left out: the reference
    verification apart, and EAGLE-3, its whole tree one graph, runs fewer eager operations a step
    than DFlash. Simulated graphs: the step's graphs replayed (counted one each), the verification
    inside the target's graph (no reference verification left), no capture during the counted
    generation, DFlash's step a graph (fewer operations than without graphs), and every step a few
    dozen operations (40.4 and 33.4 at 40 new tokens, docs/bench/eager-ops.md). The graphed
    callables are restored afterwards."""
    from draftsmith.heads.eagle import EagleSession
    from draftsmith.testing import TracedGraph

    bench = load_script("scripts/bench_eager_ops.py")
    before, replay = EagleSession._tree_function, TracedGraph.replay
    counts = {}
    for graphs in ("left-out", "simulated"):
        out = tmp_path / f"ops-{graphs}.md"
        assert bench.main(["--drafters", "eagle3", "dflash", "--new-tokens", "16", "--top", "40", "--graphs", graphs, "--out", str(out)]) == 0
        assert EagleSession._tree_function is before and TracedGraph.replay is replay
        rows = {r["drafter"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
        assert all(r["steps"] > 0 and len(r["top"]) > 3 for r in rows.values())
        counts[graphs] = {kind: r["eager_ops_per_step"] for kind, r in rows.items()}
        assert "| tiny | eagle3 |" in out.read_text()
        for r in rows.values():
            lines = dict(r["top"])
            if graphs == "simulated":
                # The target's tree forward with its verification, and the drafter's graph: replayed every step.
                assert r["reference_verification_per_step"] == 0 and lines[bench.REPLAY] >= 2
                assert not any("__init__" in line for line in lines)  # nothing captured while counting
                # The kernels inside them: the target's (a plain step's and the tree's verification) and the drafter's.
                assert 0 < r["plain_step_kernels"] < r["kernels_replayed_per_step"], r
            else:
                assert r["reference_verification_per_step"] > 0 and bench.REPLAY not in lines
                assert r["kernels_replayed_per_step"] is None  # no graphs, nothing replayed
    assert "| - |" in (tmp_path / "ops-left-out.md").read_text()
    assert 0 < counts["left-out"]["eagle3"] < counts["left-out"]["dflash"]
    assert counts["simulated"]["dflash"] < counts["left-out"]["dflash"]
    assert all(0 < n < 60 for n in counts["simulated"].values()), counts


def test_bench_eager_ops_counts_the_kernels_of_a_trace_not_its_views():
    """trace_kernels, the kernels column: a multiplication and an addition are two kernels; the
    views, the slices and a bare allocation between them none."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    bench = load_script("scripts/bench_eager_ops.py")
    trace = make_fx(lambda x: (x * 2).view(-1)[1:3] + torch.empty_like(x).view(-1)[:2].unsqueeze(0).squeeze(0))(torch.ones(2, 2))
    assert bench.trace_kernels(trace) == 2


def test_bench_eager_ops_counts_sampled_steps(tmp_path):
    """Sampled (--temperatures 1), a draft model's and a Medusa head's static trees are drawn on the
    device and verified inside the target's graph: a step makes about one host read besides the
    draft model's path (drawing a node at a time on the host made 9 to 14), and a few dozen eager
    operations (226 and 124 before, the verification apart; 32.0 and 55.0 at 40 new tokens,
    docs/bench/eager-ops.md), none of them a verification's."""
    bench = load_script("scripts/bench_eager_ops.py")
    out = tmp_path / "ops.md"
    assert bench.main(["--drafters", "standalone", "medusa", "--new-tokens", "16", "--temperatures", "1", "--out", str(out)]) == 0
    rows = {r["drafter"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert "| tiny | medusa | sampled, T=1 |" in out.read_text()
    for kind, r in rows.items():
        assert r["temperature"] == 1.0 and r["steps"] > 0 and r["reference_verification_per_step"] == 0
        assert 0 < r["eager_ops_per_step"] < 80, (kind, r["top"])
        assert r["host_reads_per_step"] <= (2.3 if kind == "standalone" else 1.3), (kind, r["host_read_lines"])


def test_speculators_script_resumes_an_interrupted_run(peers, tmp_path, monkeypatch):
    """A run cut short (here: speculators exits 1 after its first epoch) goes on when called again
    with the same --out: the data is not written again, the log gains a segment, the wall time adds
    the segments; another setting into the same folder is refused."""
    import draftsmith.serving

    out, run = tmp_path / "out", tmp_path / "run"
    run.mkdir()
    writes, trainings, fail_next = [], [], [True]

    def write_offline_data(recipe, run, data, hidden_dtype, device=None):
        writes.append(hidden_dtype)
        data.mkdir(parents=True)
        (data / "rows.json").write_text(json.dumps({"seq_len": [100, 200, 300]}))
        return {"train_examples": 2, "eval_examples": 1, "train_tokens": 300, "train_data_ratio": 0.8, "aux_layer_ids": [2, 15, 27]}

    def fake_run(command, env=None, stdout=None, stderr=None, check=False):
        if "-c" in command:  # SAVE_DATASET
            return __import__("subprocess").CompletedProcess(command, 0)
        trainings.append(command)
        epoch = len(trainings) - 1
        (out / "checkpoints" / str(epoch)).mkdir(parents=True)
        stdout.write(f"global_step={epoch}\n")
        return __import__("subprocess").CompletedProcess(command, 1 if fail_next and fail_next.pop() else 0)

    monkeypatch.setattr(peers, "speculators_venv", lambda venv: tmp_path / "python")
    monkeypatch.setattr(peers, "write_offline_data", write_offline_data)
    monkeypatch.setattr(peers, "run_metrics", lambda run, recipe, lengths: {"steps": 2, "tokens": 300, "tokens_per_step": 150.0})
    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    monkeypatch.setattr(draftsmith.serving, "servable_folder", lambda path, gguf: tmp_path / "verifier")
    argv = [str(REPO / "recipes/eagle3/smollm2-135m.yaml"), "--draftsmith-run", str(run), "--setting", "defaults", "--out", str(out), "--device", "cpu"]
    with pytest.raises(SystemExit, match="run the same command again"):
        peers.main(argv)
    assert writes == ["bfloat16"] and not (out / "result.json").exists()
    assert len(json.loads((out / "progress.json").read_text())["segments"]) == 1
    with pytest.raises(BadInput, match="unfinished run with setting 'defaults', not 'same-schedule'"):
        peers.main([*argv[:4], "same-schedule", *argv[5:]])
    assert peers.main(argv) == 0
    assert writes == ["bfloat16"]  # written once
    result = json.loads((out / "result.json").read_text())
    assert result["segments"] == 2 and result["steps_run"] == 2 and result["drafter"] == str(out / "checkpoints" / "1")
    segments = json.loads((out / "progress.json").read_text())["segments"]
    assert result["wall_seconds"] == pytest.approx(sum(s["seconds"] for s in segments), abs=0.2)
    log = (out / "train.log").read_text()
    assert log.count("=== segment") == 2 and "global_step=0" in log and "global_step=1" in log
    # Called again after it finished: a new run from scratch, the old one's outputs replaced.
    trainings.clear()
    assert peers.main(argv) == 0
    assert writes == ["bfloat16", "bfloat16"] and json.loads((out / "result.json").read_text())["segments"] == 1
    assert (out / "train.log").read_text().count("=== segment") == 1
