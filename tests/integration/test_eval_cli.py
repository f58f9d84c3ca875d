"""`draftsmith eval` / `generate` end to end on tiny models: reports, losslessness, clear errors."""

import json
import re

import pytest

from draftsmith.export import export
from draftsmith.testing import cli, heads_recipe, run_trainer, save_tiny_model


@pytest.fixture(scope="module")
def head_export(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("eval")
    recipe = heads_recipe(tmp, tiny_llama_dir, "run", "train.max_steps=8", "head.num_heads=3")
    run_trainer(recipe)
    return export(recipe.output_dir, tmp / "export"), tmp


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": "say red cat sun"}, {"prompt": "say dog moon"}, {"prompt": "say tree blue"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_head_export_writes_report_and_is_lossless(head_export, prompts, tmp_path):
    export, _ = head_export
    proc = cli("eval", "--drafter", export, "--prompts", prompts, "--max-new-tokens", 24, "--out", tmp_path / "report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    for key in ("acceptance_rate", "mean_accepted_length", "per_depth_acceptance", "tokens_per_second",
                "baseline_tokens_per_second", "speedup"):
        assert key in report, key
    assert report["num_prompts"] == 3 and report["drafter_kind"] == "medusa"
    assert report["greedy_identical_to_baseline"] == "3/3"  # fp32: token for token the target's output
    assert 1.0 <= report["mean_accepted_length"] <= 4.0
    # The default tree is the sparse tree the export stores: per-depth figures for each of its depths.
    stored = json.loads((export / "config.json").read_text())["draftsmith"]["tree"]
    assert len(report["per_depth_acceptance"]) == max(len(c) for c in stored["choices"])
    assert (tmp_path / "report" / "report.md").is_file() and (tmp_path / "report" / "report.png").stat().st_size > 1000
    assert "report.md" in proc.stdout
    assert report["kv_cache"] == "dynamic cache (transformers)"  # auto on the CPU
    # fp32 on a CPU (the suite pins fp32): the target decodes from packed weights, and the report says so.
    from draftsmith.packed import packing_available

    assert report["target_dtype"] == "float32" and (report["target_linears_packed"] > 0 or not packing_available())


def test_the_static_cache_is_chosen_by_flag_and_decodes_the_same(head_export, prompts, tmp_path):
    """--cache static on the CPU: the preallocated caches (what a GPU replays as graphs), for the
    drafter's target and the plain baseline alike, token-identical; generate names the cache."""
    export, tmp = head_export
    proc = cli("eval", "--drafter", export, "--prompts", prompts, "--max-new-tokens", 24, "--cache", "static", "--out", tmp_path / "report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["kv_cache"] == "static cache" and report["greedy_identical_to_baseline"] == "3/3"
    # Sampled, the head's static tree drawn on the device (top-k 2 under nodes of more children: some past the support).
    proc = cli(
        "eval", "--drafter", export, "--prompts", prompts, "--max-new-tokens", 16, "--cache", "static", "--temperature", "0.8", "--top-k", "2",
        "--out", tmp_path / "sampled",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "sampled" / "report.json").read_text())
    assert report["kv_cache"] == "static cache" and report["lossless"] is True and "top_k 2" in report["verification"]
    proc = cli("generate", "--drafter", tmp / "run", "--prompt", "say red", "--max-new-tokens", 12, "--cache", "static")
    assert proc.returncode == 0 and "on cpu, static cache;" in proc.stderr, proc.stderr[-2000:]
    proc = cli("generate", "--drafter", tmp / "run", "--prompt", "say red", "--cache", "paged")
    assert proc.returncode == 2 and "--cache" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_from_run_folder(head_export):
    _, tmp = head_export
    proc = cli("generate", "--drafter", tmp / "run", "--prompt", "say red", "--max-new-tokens", 12)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The summary's figures agree with each other: tokens a step kept are the tokens over the steps
    # (the mean accepted length may count the last step's tokens past --max-new-tokens, and says so).
    line = re.search(r"(\d+) tokens in (\d+) target steps: mean accepted length ([\d.]+)(?:, ([\d.]+) kept a step)?", proc.stderr)
    assert line, proc.stderr[-2000:]
    new, steps, tau = int(line[1]), int(line[2]), float(line[3])
    assert float(line[4] or tau) == pytest.approx(new / steps, abs=5e-3) and tau >= new / steps - 5e-3


def test_standalone_drafter_with_assisted_generation(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "chats.jsonl"
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"say {w}"}] for w in ("red", "dog", "sun")]
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    draft = save_tiny_model(tmp_path / "draft", "llama", seed=3, num_layers=1)
    (draft / "recipe.yaml").write_text(f"target:\n  path: {tiny_llama_dir}\n  dtype: float32\n")
    proc = cli("eval", "--drafter", draft, "--prompts", prompts, "--max-new-tokens", 16, "--tree", "1,1,1", "--out", tmp_path / "r")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["drafter_kind"] == "standalone" and report["greedy_identical_to_baseline"] == "3/3"
    assert report["assisted_tokens_per_second"] is not None


def test_mismatched_target_bad_prompts_bad_tree(head_export, prompts, tmp_path):
    export, _ = head_export
    other = save_tiny_model(tmp_path / "other", "qwen2", hidden_size=32)
    proc = cli("generate", "--drafter", export, "--target", other, "--prompt", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "hidden size 64" in proc.stderr and "hidden size 32" in proc.stderr

    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "   "}) + "\n")
    proc = cli("eval", "--drafter", export, "--prompts", empty, "--out", tmp_path / "x")
    assert proc.returncode == 2 and "no usable" in proc.stderr and "empty.jsonl" in proc.stderr, proc.stderr[-2000:]

    proc = cli("generate", "--drafter", export, "--prompt", "hi", "--tree", "[[0],[0,0],[1,0]]")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "tree" in proc.stderr.lower(), proc.stderr[-2000:]


def test_standalone_drafter_that_does_not_fit_the_target(tiny_llama_dir, tmp_path):
    from draftsmith.testing import tiny_causal_lm, tiny_tokenizer

    other_tokens = tmp_path / "other-tokens"
    save_tiny_model(other_tokens, "llama", num_layers=1)
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other_tokens)
    proc = cli("generate", "--drafter", other_tokens, "--target", tiny_llama_dir, "--prompt", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "different tokenizer" in proc.stderr and "105 vs 104" in proc.stderr, proc.stderr[-2000:]

    wider = tmp_path / "wider-vocab"
    tiny_causal_lm("llama", vocab_size=128, num_layers=1).save_pretrained(wider)
    tiny_tokenizer().save_pretrained(wider)
    proc = cli("generate", "--drafter", wider, "--target", tiny_llama_dir, "--prompt", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "vocabulary of 128" in proc.stderr and "of 104" in proc.stderr, proc.stderr[-2000:]


def test_sampling_flags_are_checked_before_anything_loads(head_export):
    export, _ = head_export
    for flag, value, words in (("--top-p", "1.5", "(0.0, 1.0]"), ("--temperature", "-0.5", ">= 0.0"), ("--top-k", "-1", ">= 0")):
        proc = cli("generate", "--drafter", export, "--prompt", "hi", flag, value)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert f"argument {flag}: must be" in proc.stderr and words in proc.stderr, proc.stderr


def test_stored_sparse_tree_is_the_default_and_an_explicit_tree_wins(head_export, prompts, tmp_path):
    export, tmp = head_export
    stored = json.loads((export / "config.json").read_text())["draftsmith"]["tree"]
    assert stored["kind"] == "sparse" and stored["nodes"] == len(stored["choices"]) == 8
    assert len(stored["rank_accuracy"]) == 3  # one row of rank accuracies per head
    proc = cli("eval", "--drafter", export, "--prompts", prompts, "--max-new-tokens", 12, "--limit", 1, "--out", tmp_path / "a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["tree"].startswith("stored sparse tree, 8 nodes") and report["lossless"] is True
    proc = cli("eval", "--drafter", tmp / "run", "--prompts", prompts, "--max-new-tokens", 12, "--limit", 1, "--tree", "1,1", "--out", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["tree"] == "given: 1,1" and len(report["per_depth_acceptance"]) == 2


def test_typical_acceptance_is_reported_as_not_lossless_and_refuses_what_it_cannot_do(head_export, prompts, tmp_path):
    export, _ = head_export
    proc = cli(
        "eval", "--drafter", export, "--prompts", prompts, "--max-new-tokens", 12, "--limit", 2, "--temperature", "0.7",
        "--verify", "typical", "--posterior-threshold", "0.2", "--out", tmp_path / "t",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    assert report["lossless"] is False and "NOT lossless" in report["verification"] and "posterior_threshold=0.2" in report["verification"]
    assert "NOT lossless" in proc.stdout and "NOT lossless" in (tmp_path / "t" / "report.md").read_text()
    for extra, words in ((("--temperature", "0"),), "temperature > 0"), ((("--temperature", "0.7"), ("--top-p", "0.9")), "top-k / top-p"):
        flags = [x for pair in extra for x in pair]
        proc = cli("generate", "--drafter", export, "--prompt", "hi", "--verify", "typical", *flags)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and words in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1
    proc = cli("generate", "--drafter", export, "--prompt", "hi", "--verify", "typical", "--temperature", "0.7", "--max-new-tokens", 8)
    assert proc.returncode == 0 and "NOT lossless" in proc.stderr, proc.stderr[-2000:]


def test_lookup_and_suffix_drafters_by_name(tiny_llama_dir, tmp_path):
    """--drafter lookup / suffix need no folder: reports say so, output is the target's own, and
    transformers' prompt lookup runs beside lookup as the peer."""
    prompts = tmp_path / "repeat.jsonl"
    rows = [{"prompt": "repeat: red cat red cat red cat"}, {"prompt": "say 1 2 3 1 2 3 1 2"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = cli("eval", "--drafter", "lookup", "--target", tiny_llama_dir, "--prompts", prompts, "--max-new-tokens", 24,
               "--prompt-lookup-max", 4, "--out", tmp_path / "lookup")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "lookup" / "report.json").read_text())
    assert report["drafter_kind"] == "lookup" and report["greedy_identical_to_baseline"] == "2/2"
    assert report["matcher"] == "prompt lookup, n-grams 1-4" and report["assisted_tokens_per_second"] is not None
    proc = cli("eval", "--drafter", "suffix", "--target", tiny_llama_dir, "--prompts", prompts, "--max-new-tokens", 24,
               "--suffix-cache", "--tree", "adaptive:6,3,12,0.2", "--out", tmp_path / "suffix")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "suffix" / "report.json").read_text())
    assert report["drafter_kind"] == "suffix" and report["greedy_identical_to_baseline"] == "2/2"
    assert "global cache" in report["matcher"] and report["tree"] == "given: adaptive:6,3,12,0.2"


def test_hybrid_of_a_head_with_suffix_matching(head_export, prompts, tmp_path):
    export, _ = head_export
    proc = cli("eval", "--drafter", export, "--hybrid", "suffix", "--prompts", prompts, "--max-new-tokens", 24, "--out", tmp_path / "h")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "h" / "report.json").read_text())
    assert report["drafter_kind"] == "medusa+suffix" and report["greedy_identical_to_baseline"] == "3/3"
    assert "merged with suffix under one budget" in report["tree"]


def test_lookup_flags_that_cannot_work_are_refused_in_one_line_before_a_model_loads(head_export, tiny_llama_dir):
    export, _ = head_export
    for args, words in (
        (("--drafter", "lookup", "--hybrid", "suffix"), "trained drafter"),
        (("--drafter", "lookup", "--suffix-cache"), "suffix matching"),
        (("--drafter", export, "--suffix-cache"), "suffix matching"),
        (("--drafter", "lookup", "--prompt-lookup-min", "4", "--prompt-lookup-max", "2"), "above --prompt-lookup-max"),
    ):
        proc = cli("generate", *args, "--prompt", "hi", "--max-new-tokens", 4)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and words in proc.stderr, (args, proc.stderr[-2000:])
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # What kind a folder holds is known once it is open: a draft LM is refused after loading, in one line.
    proc = cli("generate", "--drafter", tiny_llama_dir, "--target", tiny_llama_dir, "--hybrid", "lookup", "--prompt", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "cannot join" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
