"""The confidence scheduler of speculative decoding and the tables it reads (engine.speculative).

Calibration turns a draft's own probability into the probability it is accepted, per draft
position, from the acceptance measured so far; survival() multiplies those into the probability
that a sequence's first j drafts all survive. StepCosts holds the seconds a plain, speculative or
draft step takes per bucket, profiled at start-up and refined by every step. admit() chooses, for
one step, how many drafts each sequence verifies (or a plain step) from the two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


class Calibration:
    """Per draft position, measured acceptance against the draft's own probability: BINS bins of
    the probability, each a Beta-like count seeded with PRIOR pseudo-trials at the bin's centre
    (so an unmeasured bin trusts the draft probability, and data takes over as it comes)."""

    BINS = 10
    PRIOR = 4.0

    def __init__(self, num_draft: int):
        centre = (np.arange(self.BINS) + 0.5) / self.BINS
        self.hits = np.tile(centre * self.PRIOR, (num_draft, 1))
        self.trials = np.full((num_draft, self.BINS), self.PRIOR)
        self.accepted = np.zeros(num_draft, np.int64)     # what the stats report: raw counts
        self.tested = np.zeros(num_draft, np.int64)

    def _bin(self, prob: float) -> int:
        return min(int(prob * self.BINS), self.BINS - 1)

    def __call__(self, pos: int, prob: float) -> float:
        """The probability that the draft at position `pos` (0-based) is accepted, given its
        draft probability and that every draft before it was."""
        b = self._bin(prob)
        return float(self.hits[pos, b] / self.trials[pos, b])

    def update(self, pos: int, prob: float, accepted: bool) -> None:
        b = self._bin(prob)
        self.trials[pos, b] += 1
        self.hits[pos, b] += accepted
        self.tested[pos] += 1
        self.accepted[pos] += accepted

    def mean(self, pos: int) -> float:
        return float(self.hits[pos].sum() / self.trials[pos].sum())


class StepCosts:
    """Seconds per step: plain decode by sequences bucket, speculative by verify-rows bucket, a
    recursive draft by sequences bucket. Profiled at start-up, then an exponential average of the
    steps the engine times (host wall time of the whole step, sampling included)."""

    ALPHA = 0.2
    OUTLIER = 2.0

    def __init__(self):
        self.plain: dict = {}
        self.spec: dict = {}
        self.draft: dict = {}

    @staticmethod
    def _get(table: dict, key: int) -> float:
        if key in table:
            return table[key]
        keys = sorted(table)
        if not keys:
            return 0.0
        # between measured buckets: linear; beyond them: proportional to the size
        lo = max((k for k in keys if k <= key), default=None)
        hi = min((k for k in keys if k >= key), default=None)
        if lo is None:
            return table[hi] * key / hi
        if hi is None:
            return table[lo] * key / lo
        w = (key - lo) / (hi - lo)
        return table[lo] * (1 - w) + table[hi] * w

    def get(self, kind: str, key: int) -> float:
        return self._get(getattr(self, kind), key)

    def observe(self, kind: str, key: int, seconds: float) -> None:
        t = getattr(self, kind)
        if key in t:
            # one stalled step (a page fault, the collector, another process) counts as at most
            # twice the estimate: the kind it slowed may not run again to correct it (a plain
            # step's 2.7 ms among 0.25 ms ones kept a CPU engine speculating at 0.8x), while a
            # real change still moves the estimate by up to ALPHA a step
            seconds = min(seconds, self.OUTLIER * t[key])
        t[key] = seconds if key not in t else (1 - self.ALPHA) * t[key] + self.ALPHA * seconds

    def describe(self) -> dict:
        return {k: {n: round(v * 1e6, 1) for n, v in sorted(getattr(self, k).items())}
                for k in ("plain", "spec", "draft")}


@dataclass
class Admission:
    """The scheduler's decision for one step: drafts verified per sequence (None: a plain step)."""

    counts: Optional[list]
    expected_tokens: float = 0.0
    expected_seconds: float = 0.0


def admit(drafts: list, survival: list, costs: StepCosts, bucket, threshold, spec_ready: bool,
          allow_plain: bool = True, overhead: float = 0.0) -> Admission:
    """Choose how many of its drafts each sequence verifies this step.

    drafts[i]: sequence i's available drafts (their number); survival[i][j]: the probability that
    its drafts 0..j are all accepted. threshold None: the throughput scheduler (admit candidates
    in order of survival while (S + expected accepted) / step seconds is best, and run a plain
    step if that is faster still); a number: admit the drafts whose survival is >= threshold.
    spec_ready False: no sequence can speculate (no drafts): plain. overhead: seconds a speculative
    step costs besides its verify step (the recursive drafts it goes on to make)."""
    S = len(drafts)
    if not spec_ready:
        return Admission(None)
    if threshold is not None:
        counts = [sum(1 for p in survival[i][:drafts[i]] if p >= threshold) for i in range(S)]
        return Admission(counts, S + sum(sum(survival[i][:c]) for i, c in enumerate(counts)))
    cands = sorted(((survival[i][j], i) for i in range(S) for j in range(drafts[i])), reverse=True)
    tokens, T = float(S), S
    sec = max(costs.get("spec", bucket(T)) + overhead, 1e-9)
    best = (tokens / sec, 0, tokens, sec)
    for n, (p, _) in enumerate(cands, 1):
        tokens += p
        T += 1
        sec = max(costs.get("spec", bucket(T)) + overhead, 1e-9)
        if tokens / sec > best[0]:
            best = (tokens / sec, n, tokens, sec)
    plain_sec = max(costs.get("plain", bucket(S)), 1e-9)
    if allow_plain and S / plain_sec >= best[0]:
        return Admission(None, float(S), plain_sec)
    counts = [0] * S
    for _, i in cands[:best[1]]:
        counts[i] += 1
    return Admission(counts, best[2], best[3])


def survival(confs: list, cal: Calibration) -> list:
    """Prefix-survival probabilities of one sequence's drafts from their draft probabilities."""
    out, p = [], 1.0
    for j, c in enumerate(confs):
        p *= cal(j, c)
        out.append(p)
    return out
