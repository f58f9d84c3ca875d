"""Acceptance statistics of speculative decoding, accumulated step by step.

One speculative step drafts up to `max_depth` tokens along a path, runs the target once, accepts
the longest prefix the verifier agrees with (`accepted` tokens, 0..max_depth) and adds one token of
its own (the correction at the first rejection, or the bonus token when everything was accepted).
A step therefore emits `accepted + 1` tokens per target forward.

Depth d (1-based) of a step is *attempted* (judged by the verifier) when every shallower depth
was accepted and d <= max_depth, i.e. for d = 1 .. min(accepted + 1, max_depth); it is *accepted*
for d = 1 .. accepted. Drafted tokens past the first rejection are never judged and are not
counted as attempts: they say nothing about the draft.

The accumulator does not know the runtime: anything that can report (accepted, max_depth) per step
and (tokens, seconds) per generation can feed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AcceptanceStats"]


def _ratio(num: float, den: float) -> float | None:
    # None, not NaN: undefined figures must stay valid JSON and read as "not measured".
    return num / den if den else None


@dataclass
class AcceptanceStats:
    """Accumulator for speculative steps, generation timings and baseline timings.

    Feed it with `add_step` (per speculative step), `add_generation` (per speculative generation),
    `add_baseline` (per plain target-only generation) and optionally `add_assisted` (per
    generation of another speculative implementation, e.g. transformers' assisted generation).
    """

    steps: int = 0
    accepted_tokens: int = 0
    # Sum of each step's drafted depth (a chain of k drafts k tokens a step).
    drafted_tokens: int = 0
    # Index d - 1 holds depth d.
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    # Index k counts steps that accepted k drafted tokens (emitted k + 1 tokens).
    accepted_counts: list[int] = field(default_factory=list)
    generations: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    baseline_tokens: int = 0
    baseline_seconds: float = 0.0
    assisted_tokens: int = 0
    assisted_seconds: float = 0.0
    # None once any assisted generation could not report its target forwards.
    assisted_target_forwards: int | None = 0
    assisted_generations: int = 0
    # (steps, accepted tokens) of each speculative generation (one prompt each), for the spread.
    per_generation: list[tuple[int, int]] = field(default_factory=list)
    # (new tokens, seconds) of each speculative generation and of each baseline one, for the
    # speedup's interval (paired by prompt).
    per_generation_timing: list[tuple[int, float]] = field(default_factory=list)
    per_baseline_timing: list[tuple[int, float]] = field(default_factory=list)
    _open_steps: int = 0
    _open_accepted: int = 0

    # ---- feeding -------------------------------------------------------------------------------

    def add_step(self, accepted: int, max_depth: int, attempted: int | None = None) -> None:
        """One speculative step that accepted `accepted` of a path drafted `max_depth` deep.

        `attempted`: depths the step judged, when the caller knows it exactly. In a tree the node
        where acceptance stopped may be a leaf (a side branch), so depth accepted+1 was never
        judged; by default a chain is assumed: min(accepted + 1, max_depth).
        """
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if not 0 <= accepted <= max_depth:
            raise ValueError(f"accepted must be in [0, max_depth={max_depth}], got {accepted}")
        attempted = min(accepted + 1, max_depth) if attempted is None else attempted
        if not accepted <= attempted <= min(accepted + 1, max_depth):
            raise ValueError(f"attempted must be accepted or accepted + 1 (<= max_depth), got {attempted}")
        _grow(self.depth_attempts, max_depth)
        _grow(self.depth_accepts, max_depth)
        _grow(self.accepted_counts, max_depth + 1)
        for d in range(attempted):
            self.depth_attempts[d] += 1
        for d in range(accepted):
            self.depth_accepts[d] += 1
        self.accepted_counts[accepted] += 1
        self.accepted_tokens += accepted
        self.drafted_tokens += max_depth
        self.steps += 1
        self._open_steps += 1
        self._open_accepted += accepted

    def add_generation(self, new_tokens: int, seconds: float, target_forwards: int) -> None:
        """One speculative generation (the steps added since the last one are its own): tokens it
        produced, wall time, target forwards it ran."""
        _check_timing(new_tokens, seconds)
        self.per_generation.append((self._open_steps, self._open_accepted))
        self.per_generation_timing.append((new_tokens, seconds))
        self._open_steps = self._open_accepted = 0
        self.generations += 1
        self.new_tokens += new_tokens
        self.seconds += seconds
        self.target_forwards += target_forwards

    def add_baseline(self, new_tokens: int, seconds: float) -> None:
        """One generation of the same prompt by the target alone (plain autoregressive decoding)."""
        _check_timing(new_tokens, seconds)
        self.per_baseline_timing.append((new_tokens, seconds))
        self.baseline_tokens += new_tokens
        self.baseline_seconds += seconds

    def add_assisted(self, new_tokens: int, seconds: float, target_forwards: int | None = None) -> None:
        """One generation by a reference speculative implementation (transformers' assisted
        generation); `target_forwards` when it is known."""
        _check_timing(new_tokens, seconds)
        self.assisted_generations += 1
        self.assisted_tokens += new_tokens
        self.assisted_seconds += seconds
        if target_forwards is None or self.assisted_target_forwards is None:
            self.assisted_target_forwards = None
        else:
            self.assisted_target_forwards += target_forwards

    # ---- derived figures -----------------------------------------------------------------------

    @property
    def mean_accepted_length(self) -> float | None:
        """tau = mean over steps of (accepted + 1): tokens emitted per target forward."""
        return _ratio(self.accepted_tokens + self.steps, self.steps)

    def mean_accepted_length_interval(self, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> list[float] | None:
        """A percentile bootstrap interval of tau over generations (prompts): `tau_interval` of
        their (steps, accepted). Tells a difference from prompt-to-prompt noise when two drafters
        ran on the same prompts."""
        return tau_interval(self.per_generation, level, resamples, seed)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted depth attempts / depth attempts = sum(accepted) / sum(min(accepted + 1, max_depth)).

        The fraction of drafted tokens the verifier judged that it accepted. For a draft whose
        tokens are accepted independently with probability alpha this estimates alpha (it is the
        maximum-likelihood estimate); it is not sum(accepted) / sum(max_depth), which would count
        tokens past the first rejection that were never judged.
        """
        return _ratio(self.accepted_tokens, sum(self.depth_attempts))

    @property
    def per_depth_acceptance(self) -> list[float | None]:
        """Entry d - 1 is P(depth d accepted | depth d attempted); None where never attempted."""
        return [_ratio(a, n) for a, n in zip(self.depth_accepts, self.depth_attempts)]

    @property
    def accepted_length_histogram(self) -> list[int]:
        """Entry k counts the steps that accepted k drafted tokens, i.e. emitted k + 1 tokens."""
        return list(self.accepted_counts)

    @property
    def tokens_per_second(self) -> float | None:
        """Speculative decoding throughput: new tokens / wall seconds over all generations."""
        return _ratio(self.new_tokens, self.seconds)

    @property
    def tokens_per_target_forward(self) -> float | None:
        """New tokens / target forwards over whole generations (tau seen end to end)."""
        return _ratio(self.new_tokens, self.target_forwards)

    @property
    def baseline_tokens_per_second(self) -> float | None:
        """Target-only throughput: baseline new tokens / baseline seconds."""
        return _ratio(self.baseline_tokens, self.baseline_seconds)

    def speedup_interval(self) -> list[float] | None:
        """A 95 % percentile bootstrap interval of the speedup over prompts, each prompt's
        speculative and baseline generations resampled together (``paired_ratio``); None without a
        baseline for each of two or more generations. Wall-clock figures: on a shared machine
        they move with its load, which the interval shows only in part."""
        interval = paired_ratio(self.per_generation_timing, self.per_baseline_timing)
        return None if interval is None else [interval[0], interval[2]]

    @property
    def speedup(self) -> float | None:
        """tokens_per_second / baseline_tokens_per_second (wall-clock speedup over the target)."""
        tps, base = self.tokens_per_second, self.baseline_tokens_per_second
        return _ratio(tps, base) if tps is not None and base is not None else None

    @property
    def timing_note(self) -> str | None:
        """A warning where the wall clock contradicts the counts: a speculative step costs at least
        a target forward, so the speedup cannot pass the tokens made per target forward by more
        than timing noise (10 %); past that, something else used the machine during one of the two
        timings. None otherwise. The acceptance figures, which are counts, stand either way."""
        speedup, made = self.speedup, self.tokens_per_target_forward
        if speedup is None or made is None or speedup <= 1.1 * made:
            return None
        return (
            f"the speedup {speedup:.2f}x exceeds the {made:.3f} tokens made per target forward, which no speculative step can "
            "beat: the timings were disturbed (other processes on the machine, or more threads than cores: set OMP_NUM_THREADS); "
            "rerun on a quiet machine for the speed figures"
        )

    @property
    def assisted_tokens_per_second(self) -> float | None:
        """Throughput of the reference speculative implementation."""
        return _ratio(self.assisted_tokens, self.assisted_seconds)

    @property
    def assisted_speedup(self) -> float | None:
        """assisted_tokens_per_second / baseline_tokens_per_second."""
        a, base = self.assisted_tokens_per_second, self.baseline_tokens_per_second
        return _ratio(a, base) if a is not None and base is not None else None

    @property
    def speedup_vs_assisted(self) -> float | None:
        """tokens_per_second / assisted_tokens_per_second (> 1: we beat the reference)."""
        tps, a = self.tokens_per_second, self.assisted_tokens_per_second
        return _ratio(tps, a) if tps is not None and a is not None else None

    def speculator_row(self) -> dict:
        """The figures in the columns of the RedHatAI speculator benchmarks (what vLLM's
        spec-decode counters give): num_drafts (steps), num_draft_tokens, num_accepted_tokens,
        acceptance_length (1 + accepted / drafts) and acceptance_at_pos_{i} (the share of drafts
        whose i-th drafted token was accepted)."""
        row = {
            "num_drafts": self.steps,
            "num_draft_tokens": self.drafted_tokens,
            "num_accepted_tokens": self.accepted_tokens,
            "acceptance_length": self.mean_accepted_length,
        }
        for i, accepted in enumerate(self.depth_accepts):
            row[f"acceptance_at_pos_{i}"] = _ratio(accepted, self.steps)
        return row

    def summary(self) -> dict:
        """All derived figures and the raw counts behind them, as plain JSON-ready values."""
        out = {
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "mean_accepted_length_ci95": self.mean_accepted_length_interval(),
            "per_depth_acceptance": self.per_depth_acceptance,
            "accepted_length_histogram": self.accepted_length_histogram,
            "tokens_per_second": self.tokens_per_second,
            "baseline_tokens_per_second": self.baseline_tokens_per_second,
            "speedup": self.speedup,
            "speedup_ci95": self.speedup_interval(),
            "timing_note": self.timing_note,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "steps": self.steps,
            "accepted_tokens": self.accepted_tokens,
            "depth_attempts": list(self.depth_attempts),
            "depth_accepts": list(self.depth_accepts),
            "generations": self.generations,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "target_forwards": self.target_forwards,
            "baseline_tokens": self.baseline_tokens,
            "baseline_seconds": self.baseline_seconds,
        }
        if self.assisted_generations:
            out.update(
                assisted_tokens_per_second=self.assisted_tokens_per_second,
                assisted_speedup=self.assisted_speedup,
                speedup_vs_assisted=self.speedup_vs_assisted,
                assisted_tokens_per_target_forward=_ratio(self.assisted_tokens, self.assisted_target_forwards or 0),
                assisted_tokens=self.assisted_tokens,
                assisted_seconds=self.assisted_seconds,
            )
        return out


def _resampled_taus(rows: list[tuple[int, int]], pick):
    """tau = 1 + sum(accepted) / sum(steps) of each resample; `rows` holds (steps, accepted) per
    prompt, `pick` [resamples, prompts] the resampled row indices."""
    import torch

    steps = torch.tensor([s for s, _ in rows], dtype=torch.float64)
    accepted = torch.tensor([a for _, a in rows], dtype=torch.float64)
    return 1 + accepted[pick].sum(1) / steps[pick].sum(1).clamp(min=1)


def _resample(count: int, resamples: int, seed: int):
    import torch

    return torch.randint(count, (resamples, count), generator=torch.Generator().manual_seed(seed))


def tau_interval(rows: list[tuple[int, int]], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """A percentile bootstrap interval of tau = 1 + accepted / steps over prompts, from (steps,
    accepted) per prompt (a generation's steps, or an engine's drafts): prompts resampled with
    replacement. Prompts with no steps are left out; None with fewer than two left."""
    import torch

    rows = [(s, a) for s, a in rows if s]
    if len(rows) < 2:
        return None
    taus = _resampled_taus(rows, _resample(len(rows), resamples, seed))
    return torch.quantile(taus, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()


def paired_tau_difference(first: list[tuple[int, int]], second: list[tuple[int, int]], resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """tau of `first` minus tau of `second`, two drafters' (steps, accepted) on the same prompts in
    the same order: [2.5 %, 50 %, 97.5 %] of the difference over prompts resampled together (one
    resample serves both), which tells a small real difference from noise better than two
    overlapping intervals do. None unless both hold the same two or more prompts."""
    import torch

    if len(first) != len(second) or len(first) < 2:
        return None
    pick = _resample(len(first), resamples, seed)
    diff = _resampled_taus(first, pick) - _resampled_taus(second, pick)
    return torch.quantile(diff, torch.tensor([0.025, 0.5, 0.975], dtype=torch.float64)).tolist()


def paired_ratio(first: list[tuple[float, float]], second: list[tuple[float, float]], resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """(sum x / sum y) of `first` over (sum x / sum y) of `second`, two runs' (x, y) per prompt on
    the same prompts in the same order (tokens and target forwards: the ratio of tokens per
    forward; tokens and seconds: a speedup): [2.5 %, 50 %, 97.5 %] of it over prompts resampled
    together. None unless both hold the same two or more prompts."""
    import torch

    if len(first) != len(second) or len(first) < 2:
        return None
    pick = _resample(len(first), resamples, seed)
    a, b = (torch.tensor(rows, dtype=torch.float64) for rows in (first, second))

    def rate(rows):
        return rows[pick, 0].sum(1) / rows[pick, 1].sum(1).clamp(min=1e-12)

    return torch.quantile(rate(a) / rate(b), torch.tensor([0.025, 0.5, 0.975], dtype=torch.float64)).tolist()


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))


def _check_timing(new_tokens: int, seconds: float) -> None:
    if new_tokens < 0 or seconds < 0:
        raise ValueError(f"new_tokens and seconds must be >= 0, got {new_tokens} and {seconds}")
