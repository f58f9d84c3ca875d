"""scripts/bench_hybrid.py on a tiny trained head: every row decodes the plain output, the hybrid
rows are divided by their better part, and an interrupted run resumes without redoing prompts."""

import json
import subprocess
import sys

import pytest

from draftsmith.testing import REPO, heads_recipe, run_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def head_run(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("hybrid")
    recipe = heads_recipe(tmp, tiny_llama_dir, "run", "train.max_steps=6", "head.num_heads=3")
    run_trainer(recipe)
    prompts = tmp / "prompts.jsonl"
    rows = [{"prompt": p} for p in ("say red cat sun red cat", "say dog moon dog moon", "count one two one two")]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return recipe.output_dir, prompts


def bench(*args):
    cmd = [sys.executable, "scripts/bench_hybrid.py", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)


def test_rows_decode_the_plain_output_and_a_run_resumes(head_run, tmp_path):
    run, prompts = head_run
    common = ["--drafter", run, "--prompts", prompts, "--max-new-tokens", 20, "--tree", "dynamic:3,2,6", "--out", tmp_path / "b"]
    rows = ["head", "suffix", "head+suffix", "head+lookup@adaptive:3,2,6"]
    proc = bench(*common, "--limit", 2, *[a for r in rows for a in ("--row", r)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "b" / "results.json").read_text())
    summary = result["summary"]
    assert summary["plain"]["prompts"] == 2
    from draftsmith.packed import packing_available

    # What the target's layers decoded from is on record: packed weights in the suite's fp32.
    assert result["target_linears_packed"] > 0 or not packing_available()
    for name in ("head@dynamic:3,2,6", "suffix@dynamic:3,2,6", "head+suffix@dynamic:3,2,6", "head+lookup@adaptive:3,2,6"):
        assert summary[name]["identical"] == 2, name
        assert summary[name]["tokens_per_target_forward"] >= 1.0
    hybrid = summary["head+suffix@dynamic:3,2,6"]
    assert hybrid["better_part"] in ("head@dynamic:3,2,6", "suffix@dynamic:3,2,6")
    part = summary[hybrid["better_part"]]["tokens_per_target_forward"]
    assert hybrid["ratio_to_better_part"] == pytest.approx(hybrid["tokens_per_target_forward"] / part)
    # No lookup row was measured: the adaptive head+lookup hybrid is held against the head alone.
    assert summary["head+lookup@adaptive:3,2,6"]["better_part"] == "head@dynamic:3,2,6"
    singles = ("head@dynamic:3,2,6", "suffix@dynamic:3,2,6")
    best = max(singles, key=lambda r: summary[r]["tokens_per_target_forward"])
    assert all(summary[h]["best_single"] == best for h in ("head+suffix@dynamic:3,2,6", "head+lookup@adaptive:3,2,6"))

    # The same --out without --resume is refused; with it, only the missing prompt is decoded.
    again = bench(*common, "--limit", 3, *[a for r in rows for a in ("--row", r)])
    assert again.returncode == 2 and "--resume" in again.stderr
    resumed = bench(*common, "--limit", 3, "--resume", *[a for r in rows for a in ("--row", r)])
    assert resumed.returncode == 2 and "other settings" in resumed.stderr  # --limit changed
    (tmp_path / "b" / "per_prompt.jsonl").write_text((tmp_path / "b" / "per_prompt.jsonl").read_text().splitlines()[0] + "\n")
    resumed = bench(*common, "--limit", 2, "--resume", *[a for r in rows for a in ("--row", r)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "b" / "per_prompt.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1]

    # Against an earlier run of the same rows (here itself): every paired ratio is exactly 1.
    common[-1] = tmp_path / "c"
    proc = bench(*common, "--limit", 2, "--against", tmp_path / "b", "--row", "head", "--row", "suffix")
    assert proc.returncode == 0, proc.stderr[-3000:]
    versus = json.loads((tmp_path / "c" / "results.json").read_text())["summary"]["against"]
    assert set(versus) == {"head@dynamic:3,2,6", "suffix@dynamic:3,2,6"}
    assert all(v["ratio"] == 1.0 and v["ratio_ci95"] == [1.0, 1.0, 1.0] for v in versus.values())
    assert "tokens per target forward here / there" in (tmp_path / "c" / "results.md").read_text()
    wrong = bench(*common[:-1], tmp_path / "d", "--limit", 1, "--against", tmp_path / "b", "--row", "head")
    assert wrong.returncode == 2 and "another prompt set or settings (limit)" in wrong.stderr
    assert not (tmp_path / "d").exists()  # refused before anything was decoded
    missing = bench(*common[:-1], tmp_path / "e", "--limit", 2, "--against", tmp_path / "nope", "--row", "head")
    assert missing.returncode == 2 and "no per_prompt.jsonl there" in missing.stderr and "Traceback" not in missing.stderr


def test_bad_rows_are_one_line(head_run, tmp_path):
    run, prompts = head_run
    proc = bench("--drafter", run, "--prompts", prompts, "--row", "eagle", "--out", tmp_path / "x")
    assert proc.returncode == 2 and "the kind is one of" in proc.stderr and "Traceback" not in proc.stderr
    proc = bench("--drafter", "lookup", "--prompts", prompts, "--tree", "dynamic:3,2,6", "--out", tmp_path / "y")
    assert proc.returncode == 2 and "a trained head is needed" in proc.stderr
