"""Acceptance statistics by hand, a closed form by simulation, and the report files."""

import json
import math
import random
from fractions import Fraction

import pytest

from draftsmith.eval import AcceptanceStats, write_report
from draftsmith.eval.acceptance import paired_ratio, paired_tau_difference, tau_interval

META = {
    "target": "tiny-target",
    "drafter": "tiny-draft",
    "prompts": "mt-bench (3 questions)",
    "temperature": 0.0,
    "max_new_tokens": 64,
}


def _hand_stats() -> AcceptanceStats:
    stats = AcceptanceStats()
    for accepted in [0, 2, 3, 1]:
        stats.add_step(accepted, max_depth=3)
    stats.add_generation(new_tokens=10, seconds=2.0, target_forwards=4)
    stats.add_baseline(new_tokens=10, seconds=5.0)
    return stats


def test_hand_computed_step_sequence():
    stats = _hand_stats()
    # Depths attempted per step (d = 1..min(accepted + 1, 3)) and accepted (d = 1..accepted):
    #   accepted 0: attempted {1}       accepted {}
    #   accepted 2: attempted {1, 2, 3} accepted {1, 2}
    #   accepted 3: attempted {1, 2, 3} accepted {1, 2, 3}
    #   accepted 1: attempted {1, 2}    accepted {1}
    # attempts per depth 4, 3, 2 (9 in all); accepts per depth 3, 2, 1 (6 in all).
    assert stats.depth_attempts == [4, 3, 2]
    assert stats.depth_accepts == [3, 2, 1]
    assert stats.acceptance_rate == pytest.approx(6 / 9, rel=1e-15)
    assert stats.per_depth_acceptance == pytest.approx([3 / 4, 2 / 3, 1 / 2], rel=1e-15)
    # tau = mean(0+1, 2+1, 3+1, 1+1) = 10 / 4.
    assert stats.mean_accepted_length == 2.5
    # One step each with 0, 1, 2 and 3 accepted tokens.
    assert stats.accepted_length_histogram == [1, 1, 1, 1]
    assert stats.tokens_per_second == 5.0
    assert stats.baseline_tokens_per_second == 2.0
    assert stats.speedup == 2.5
    assert stats.tokens_per_target_forward == 2.5


def test_steps_of_different_depths():
    stats = AcceptanceStats()
    stats.add_step(1, max_depth=1)  # full acceptance of a depth-1 draft: depth 2 never attempted
    stats.add_step(0, max_depth=4)
    stats.add_step(4, max_depth=4)
    assert stats.depth_attempts == [3, 1, 1, 1]
    assert stats.depth_accepts == [2, 1, 1, 1]
    assert stats.acceptance_rate == pytest.approx(5 / 6)
    assert stats.per_depth_acceptance == pytest.approx([2 / 3, 1.0, 1.0, 1.0])
    assert stats.accepted_length_histogram == [1, 1, 0, 0, 1]
    assert stats.mean_accepted_length == pytest.approx(8 / 3)


@pytest.mark.parametrize("accepted,max_depth", [(-1, 3), (4, 3), (0, 0)])
def test_impossible_steps_are_refused(accepted, max_depth):
    stats = AcceptanceStats()
    with pytest.raises(ValueError):
        stats.add_step(accepted, max_depth)
    assert stats.steps == 0


@pytest.mark.parametrize("alpha,depth", [(0.6, 4), (0.85, 6)])
def test_independent_acceptance_matches_the_closed_form(alpha, depth):
    """With each drafted token accepted independently with probability alpha, tau is
    (1 - alpha^(K+1)) / (1 - alpha) (Leviathan et al. 2023) and every depth accepts at alpha."""
    rng = random.Random(0)
    stats = AcceptanceStats()
    n = 20_000
    for _ in range(n):
        accepted = 0
        while accepted < depth and rng.random() < alpha:
            accepted += 1
        stats.add_step(accepted, depth)
    # Exact distribution of the emitted length L = accepted + 1, for a 5-sigma bound.
    probs = [alpha**k * (1 - alpha) for k in range(depth)] + [alpha**depth]
    mean = sum((k + 1) * pk for k, pk in enumerate(probs))
    var = sum((k + 1 - mean) ** 2 * pk for k, pk in enumerate(probs))
    assert mean == pytest.approx((1 - alpha ** (depth + 1)) / (1 - alpha))
    assert abs(stats.mean_accepted_length - mean) < 5 * math.sqrt(var / n)
    attempts = sum(stats.depth_attempts)
    assert abs(stats.acceptance_rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / attempts)
    for rate, tries in zip(stats.per_depth_acceptance, stats.depth_attempts):
        assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / tries)
    # The naive "accepted / drafted" rate is a different, smaller number: the definition matters.
    assert stats.accepted_tokens / (n * depth) < alpha - 0.05


def test_report_files_and_values(tmp_path):
    stats = _hand_stats()
    report = write_report(stats, tmp_path / "eval", META)
    out = tmp_path / "eval"
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.csv", "draftsmith-manifest.json", "report.json", "report.md", "report.png"]
    # The speculator-benchmark columns: 4 drafts of 3 tokens, 6 accepted; position i accepted in
    # 3, 2 and 1 of the 4 drafts.
    import csv

    (row,) = list(csv.DictReader((out / "acceptance.csv").open()))
    assert list(row) == ["num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length", "acceptance_at_pos_0", "acceptance_at_pos_1", "acceptance_at_pos_2"]
    assert [float(v) for v in row.values()] == [4, 12, 6, 2.5, 0.75, 0.5, 0.25]

    data = json.loads((out / "report.json").read_text())
    assert data == report
    for key, value in META.items():
        assert data[key] == value
    assert data["acceptance_rate"] == pytest.approx(2 / 3, rel=1e-15)
    assert data["mean_accepted_length"] == 2.5
    assert data["per_depth_acceptance"] == pytest.approx([0.75, 2 / 3, 0.5], rel=1e-15)
    assert data["accepted_length_histogram"] == [1, 1, 1, 1]
    assert data["tokens_per_second"] == 5.0
    assert data["baseline_tokens_per_second"] == 2.0
    assert data["speedup"] == 2.5
    assert "assisted_tokens_per_second" not in data

    md = (out / "report.md").read_text()
    assert md.startswith("# Acceptance report: tiny-draft drafting for tiny-target")
    assert "| acceptance rate (accepted / judged drafted tokens) | 0.667 |" in md
    assert "| mean accepted length tau (tokens per target forward) | 2.500 |" in md
    assert "| speedup over baseline | 2.500 |" in md
    for row in ["| 1 | 4 | 3 | 0.750 |", "| 2 | 3 | 2 | 0.667 |", "| 3 | 2 | 1 | 0.500 |"]:
        assert row in md
    assert "| temperature | 0 |" in md

    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    image = imread(out / "report.png")
    assert image.shape[0] > 300 and image.shape[1] > 800
    assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas


def test_assisted_generation_figures(tmp_path):
    stats = _hand_stats()
    stats.add_assisted(new_tokens=10, seconds=4.0, target_forwards=5)
    report = write_report(stats, tmp_path, META)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["assisted_tokens_per_second"] == 2.5
    assert data["assisted_speedup"] == 1.25
    assert data["speedup_vs_assisted"] == 2.0
    assert data["assisted_tokens_per_target_forward"] == 2.0
    assert report == data
    assert "| our speedup over assisted generation | 2.000 |" in (tmp_path / "report.md").read_text()
    # A reference run that cannot count its target forwards leaves that one figure undefined.
    stats.add_assisted(new_tokens=10, seconds=4.0)
    assert stats.summary()["assisted_tokens_per_target_forward"] is None


def test_empty_stats_write_valid_files_with_nulls(tmp_path):
    report = write_report(AcceptanceStats(), tmp_path, {"target": "t"})
    data = json.loads((tmp_path / "report.json").read_text())
    assert data == report
    assert data["acceptance_rate"] is None and data["speedup"] is None and data["per_depth_acceptance"] == []
    assert (tmp_path / "report.png").stat().st_size > 0


def test_meta_cannot_overwrite_metrics(tmp_path):
    with pytest.raises(ValueError, match="speedup"):
        write_report(_hand_stats(), tmp_path, {"speedup": 10.0})


def test_exact_fractions_survive_accumulation():
    # Many steps: the counts are integers, so the rates are exact ratios, not running averages.
    stats = AcceptanceStats()
    for _ in range(1000):
        for accepted in [0, 2, 3, 1]:
            stats.add_step(accepted, 3)
    assert Fraction(stats.acceptance_rate).limit_denominator(100) == Fraction(2, 3)
    assert stats.per_depth_acceptance == _hand_stats().per_depth_acceptance


def test_tree_steps_count_only_judged_depths():
    """A tree step that stops on a leaf side branch judged no deeper token: attempted = accepted."""
    stats = AcceptanceStats()
    stats.add_step(1, 3, attempted=1)  # accepted a rank-1 sibling with no children
    stats.add_step(1, 3)  # a chain: depth 2 was judged and rejected
    assert stats.depth_attempts == [2, 1, 0] and stats.depth_accepts == [2, 0, 0]
    assert stats.acceptance_rate == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="attempted"):
        stats.add_step(1, 3, attempted=3)


def test_tau_interval_brackets_the_pooled_mean():
    rows = [(10, a) for a in (2, 4, 6, 8, 10, 3, 5)]  # (steps, accepted) per prompt
    low, high = tau_interval(rows)
    pooled = 1 + sum(a for _, a in rows) / sum(s for s, _ in rows)
    assert low < pooled < high
    assert 1.0 <= low and high <= 2.0
    # Prompts that all agree leave no spread; fewer than two prompts with steps give no interval.
    assert tau_interval([(4, 2)] * 5) == pytest.approx([1.5, 1.5])
    assert tau_interval([(4, 2), (0, 0)]) is None
    # AcceptanceStats' interval is this one over its generations.
    stats = AcceptanceStats(per_generation=list(rows))
    assert stats.mean_accepted_length_interval() == tau_interval(rows)


def test_paired_tau_difference_resamples_prompts_together():
    base = [(10, a) for a in (1, 9, 2, 8, 3, 7)]
    assert paired_tau_difference(base, base) == pytest.approx([0.0, 0.0, 0.0])
    # One more accepted token on every prompt: a small difference, but on every prompt, so the
    # paired interval excludes 0 although the two unpaired intervals overlap.
    better = [(s, a + 1) for s, a in base]
    low, mid, high = paired_tau_difference(better, base)
    assert 0 < low <= mid <= high and mid == pytest.approx(0.1)
    ours, theirs = tau_interval(better), tau_interval(base)
    assert ours[0] < theirs[1]
    assert paired_tau_difference(base, base[:-1]) is None


def test_paired_ratio_is_a_ratio_of_pooled_rates_over_prompts_resampled_together():
    base = [(10.0 + i, 2.0 + i % 3) for i in range(8)]  # (tokens, forwards or seconds) per prompt
    assert paired_ratio(base, base) == pytest.approx([1.0, 1.0, 1.0])
    # 20 % more tokens on every prompt at the same cost: the ratio is 1.2 on every resample.
    more = [(1.2 * x, y) for x, y in base]
    assert paired_ratio(more, base) == pytest.approx([1.2, 1.2, 1.2])
    # A gain on some prompts only: the interval spreads around the pooled ratio and holds it.
    mixed = [(x * (1.5 if i % 2 else 1.0), y) for i, (x, y) in enumerate(base)]
    low, mid, high = paired_ratio(mixed, base)
    pooled = sum(x for x, _ in mixed) / sum(x for x, _ in base)
    assert 1.0 < low < pooled < high < 1.5
    assert paired_ratio(base[:1], base[:1]) is None and paired_ratio(base, base[:4]) is None


def test_the_speedup_has_a_paired_interval_over_prompts(tmp_path):
    """The report's speedup comes with a 95 % bootstrap interval, each prompt's speculative and
    baseline generations resampled together; with one prompt there is none."""
    stats = AcceptanceStats()
    for tokens, fast, slow in [(40, 1.0, 2.0), (40, 1.5, 2.0), (40, 0.8, 2.4), (40, 1.2, 1.8)]:
        stats.add_step(1, 2)
        stats.add_generation(tokens, fast, 20)
        stats.add_baseline(tokens, slow)
    low, high = stats.speedup_interval()
    assert low <= stats.speedup <= high and low < high
    assert [low, high] == paired_ratio(stats.per_generation_timing, stats.per_baseline_timing)[::2]
    report = write_report(stats, tmp_path / "r", {"drafter": "x"})
    assert report["speedup_ci95"] == [low, high]
    assert f"| speedup, 95% interval over prompts (paired bootstrap) | [{low:.3f}, {high:.3f}] |" in (tmp_path / "r" / "report.md").read_text()
    one = AcceptanceStats()
    one.add_step(1, 2)
    one.add_generation(40, 1.0, 20)
    one.add_baseline(40, 2.0)
    assert one.speedup_interval() is None and one.summary()["speedup_ci95"] is None


def test_a_list_of_records_is_a_table_of_its_own(tmp_path):
    """eval's exit-layer sweep (one record an exit) reads as a table, not a Python list."""
    rows = [{"exit_layer": 2, "speedup": 1.25}, {"exit_layer": 4, "speedup": 0.5}]
    write_report(_hand_stats(), tmp_path, {**META, "exit_sweep": rows})
    markdown = (tmp_path / "report.md").read_text()
    assert "## exit_sweep\n\n| exit_layer | speedup |\n| --- | --- |\n| 2 | 1.250 |\n| 4 | 0.500 |" in markdown
    assert "{'exit_layer'" not in markdown and json.loads((tmp_path / "report.json").read_text())["exit_sweep"] == rows


def test_a_speedup_past_the_tokens_per_forward_is_flagged_as_disturbed_timing(tmp_path):
    """Nothing accepted (one token a target forward) yet twice as fast as the target alone: the
    walk-through's loaded machine. The report says the timings were disturbed; a speedup within
    10 % of what the counts allow gets no such note."""

    def stats_at(fast: float) -> AcceptanceStats:
        stats = AcceptanceStats()
        for _ in range(8):
            stats.add_step(0, 3)
        stats.add_generation(new_tokens=8, seconds=fast, target_forwards=8)
        stats.add_baseline(new_tokens=8, seconds=2.0)
        return stats

    report = write_report(stats_at(1.0), tmp_path / "loaded", META)
    assert report["speedup"] == pytest.approx(2.0) and report["tokens_per_target_forward"] == 1.0
    assert "exceeds the 1.000 tokens made per target forward" in report["timing_note"]
    assert "**Warning:** the speedup 2.00x exceeds" in (tmp_path / "loaded" / "report.md").read_text()
    quiet = write_report(stats_at(1.9), tmp_path / "quiet", META)
    assert quiet["speedup"] == pytest.approx(2.0 / 1.9) and quiet["timing_note"] is None
    assert "Warning" not in (tmp_path / "quiet" / "report.md").read_text()
