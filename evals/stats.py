"""Statistics of the accuracy tables: intervals for one cell, paired comparisons of two methods
over the same prompts, and exact paired tests.

Scores are per prompt, in [0, 1]. A cell (one task, length, method, budget, mode) is the mean
over its n prompts; a comparison "A vs B" pairs the two methods' scores on the prompts both
ran. Every function is deterministic: bootstrap draws come from ``numpy.random.default_rng``
seeded by the caller (default 0).

* ``wilson_interval(k, n)``: the Wilson score interval of a pass rate (pass/fail scores).
* ``bootstrap_interval(values)``: the percentile bootstrap interval of a mean (partial credit),
  optionally stratified (resampling prompts within each task, for a mean over tasks).
* ``sign_flip_p(diffs)``: the exact two-sided sign-flip (paired permutation) test of a mean
  difference of zero.
* ``mcnemar_p(b, c)``: the exact McNemar test of pass/fail pairs (an exact binomial test of the
  discordant pairs).
* ``tango_paired_interval(only_a, only_b, n)``: Tango's score interval of a difference of
  paired pass rates.
* ``paired_comparison(a, b)``: the difference of means, its interval (Tango's when both
  are pass/fail, else the bootstrap) and the exact test (McNemar when both are pass/fail,
  else sign-flip).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile: two-sided 95%
BOOTSTRAP_REPS = 4000
MAX_EXACT_SUMS = 2_000_000  # the exact sign-flip's grid: |sums| up to this many units
MONTE_CARLO_DRAWS = 200_000


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion of ``k`` passes in ``n`` trials.

    With p = k / n:  centre = (p + z^2 / 2n) / (1 + z^2 / n),
    half-width = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2);  the interval is centre
    -/+ half-width, clipped to [0, 1]. Unlike the normal (Wald) interval it stays inside [0, 1]
    and is not degenerate at k = 0 or k = n (0/5 gives [0, 0.4345]).

    Source: E. B. Wilson, "Probable inference, the law of succession, and statistical
    inference", JASA 22 (1927); recommended for small n by Brown, Cai and DasGupta, "Interval
    estimation for a binomial proportion", Statistical Science 16 (2001).

    Raises:
        ValueError: n <= 0 or k outside [0, n].
    """
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"the Wilson interval needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(values: Sequence[float], *, strata: Sequence[Hashable] | None = None,
                       reps: int = BOOTSTRAP_REPS, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of ``values`` (one per prompt).

    ``reps`` resamples of the n values drawn with replacement (numpy's default generator
    seeded with ``seed``); the interval is the (1 - level) / 2 and (1 + level) / 2 quantiles
    of the resampled means. With ``strata`` (one label per value, e.g. the task), each
    stratum is resampled on its own to its own size and the statistic is the mean of the
    strata's means (the RULER average over tasks); when some stratum holds a single value
    (which a stratified resample could never vary), all values are resampled together
    instead. All values equal: a zero-width interval.

    Source: B. Efron and R. Tibshirani, "An Introduction to the Bootstrap" (1993), ch. 13
    (percentile interval).

    Raises:
        ValueError: no values, or ``strata`` of another length.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("the bootstrap needs at least one value")
    rng = np.random.default_rng(seed)
    if strata is None:
        groups = [x]
    else:
        if len(strata) != len(x):
            raise ValueError("strata must give one label per value")
        labels = list(dict.fromkeys(strata))
        groups = [x[[i for i, s in enumerate(strata) if s == lab]] for lab in labels]
        if min(g.size for g in groups) < 2:  # a stratum of one cannot vary: resample all
            groups = [x]
    means = np.zeros(reps)
    for g in groups:
        means += g[rng.integers(0, g.size, size=(reps, g.size))].mean(axis=1)
    means /= len(groups)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def mcnemar_p(b: int, c: int) -> float:
    """The exact two-sided McNemar p-value of ``b`` pairs where only A passed and ``c`` where
    only B passed: under no difference each discordant pair is A's with probability 1/2, so
    p = min(1, 2 * P(X <= min(b, c))) with X ~ Binomial(b + c, 1/2); 1.0 when b = c = 0.

    Source: Q. McNemar, Psychometrika 12 (1947); the exact (binomial) form as in A. Agresti,
    "Categorical Data Analysis" (3rd ed., 2013), sec. 11.1.

    Raises:
        ValueError: a negative count.
    """
    if b < 0 or c < 0:
        raise ValueError(f"McNemar counts must not be negative, got {b}, {c}")
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2 ** m)


def tango_paired_interval(only_a: int, only_b: int, n: int,
                          z: float = Z95) -> tuple[float, float]:
    """Tango's score interval of p_a - p_b, the difference of two pass rates measured on the
    same ``n`` prompts, of which ``only_a`` pass under A alone and ``only_b`` under B alone.

    The interval is every difference D whose score statistic
    T(D) = (only_a - only_b - n D) / sqrt(n (2 q(D) + D (1 - D))) lies within -/+ z, where
    q(D), the maximum-likelihood probability of "B alone" under D, is the positive root of
    2n q^2 + (-(only_a + only_b) + (2n - only_a + only_b) D) q - only_b D (1 - D) = 0;
    T falls as D grows, so each end is found by bisection. With no discordant prompts it is
    -/+ z^2 / (n + z^2) (20 prompts: -/+ 16.1 points) where a percentile bootstrap of the
    paired differences is [0, 0]; with 4 discordant prompts of 20, all one way, it is
    [+0.7, +41.6] points (the bootstrap's [+5, +40]). It is an asymptotic interval (its
    test at D = 0 is McNemar's z test): with that few discordant prompts it can exclude 0
    where the exact McNemar test (p = 0.125 there) does not; the summaries state a
    difference by the exact test only.

    Source: T. Tango, "Equivalence test and confidence interval for the difference in
    proportions for the paired-sample design", Statistics in Medicine 17 (1998);
    recommended by Fagerland, Lydersen and Laake, "Recommended tests and confidence intervals
    for paired binomial proportions", Statistics in Medicine 33 (2014).

    Raises:
        ValueError: negative counts, or more discordant prompts than ``n``.
    """
    b, c = only_a, only_b
    if min(b, c) < 0 or n <= 0 or b + c > n:
        raise ValueError(f"Tango's interval needs 0 <= only_a + only_b <= n, n > 0, got "
                         f"{only_a}, {only_b}, {n}")

    def score(d: float) -> float:
        qa, qb, qc = 2 * n, -(b + c) + (2 * n - b + c) * d, -c * d * (1 - d)
        q = (math.sqrt(max(0.0, qb * qb - 4 * qa * qc)) - qb) / (2 * qa)
        var = n * (2 * q + d * (1 - d))
        num = b - c - n * d
        if var <= 0:
            return 0.0 if num == 0 else math.copysign(math.inf, num)
        return num / math.sqrt(var)

    def solve(lo: float, hi: float, target: float) -> float:
        for _ in range(100):  # T(lo) >= target >= T(hi)
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if score(mid) > target else (lo, mid)
        return (lo + hi) / 2

    est = (b - c) / n
    lower = -1.0 if score(-1.0) <= z else solve(-1.0, est, z)
    upper = 1.0 if score(1.0) >= -z else solve(est, 1.0, -z)
    return lower, upper


def _fraction(x: float) -> Fraction:
    # scores are ratios of small integers (hits / items); recover them from their floats
    return Fraction(x).limit_denominator(10_000)


def sign_flip_p(diffs: Sequence[float], *, seed: int = 0) -> tuple[float, bool]:
    """The two-sided sign-flip (paired permutation) p-value of the paired differences
    ``diffs`` and whether it is exact.

    Under no difference between A and B, each prompt's difference d_i is as likely to have
    either sign; the test statistic is S = sum_i d_i, and p = P(|S*| >= |S|) over the 2^n
    equally likely sign vectors S* = sum_i s_i |d_i| (zeros contribute nothing). Each d_i is
    made an exact fraction (denominator at most 10^4: scores are ratios of small integers)
    and all are scaled by the least common multiple of the denominators to integers, so ties
    count exactly; the distribution of S* is then computed exactly by dynamic programming on
    the integer grid (one convolution with {-|d_i|, +|d_i|} per prompt, probabilities halved
    each time). When the grid would exceed ``MAX_EXACT_SUMS`` units, p is estimated from
    ``MONTE_CARLO_DRAWS`` random sign vectors (seeded), counting the observed one:
    (hits + 1) / (draws + 1); the second value is then False.
    For differences in {-1, 0, 1} this is the exact sign test, equal to ``mcnemar_p``.

    Source: R. A. Fisher, "The Design of Experiments" (1935), sec. 21; E. J. G. Pitman, JRSS
    Suppl. 4 (1937).

    Raises:
        ValueError: no differences.
    """
    if len(diffs) == 0:
        raise ValueError("the sign-flip test needs at least one difference")
    return _sign_flip([_fraction(d) for d in diffs], seed)


def _sign_flip(diffs: Sequence[Fraction], seed: int) -> tuple[float, bool]:
    mags = [abs(d) for d in diffs if d != 0]
    observed = abs(sum(diffs, Fraction(0)))
    if not mags or observed == 0:
        return 1.0, True
    scale = math.lcm(*(m.denominator for m in mags))
    ints = [int(m * scale) for m in mags]
    target = int(observed * scale)
    total = sum(ints)
    if total <= MAX_EXACT_SUMS and total * len(ints) <= 250 * MAX_EXACT_SUMS:
        # P(S* = s) on the integer grid s = -total .. total (index s + total), halved per flip
        dist = np.zeros(2 * total + 1)
        dist[total] = 1.0
        for v in ints:
            new = np.zeros_like(dist)
            new[v:] += dist[:-v]
            new[:-v] += dist[v:]
            dist = new / 2
        s = np.arange(-total, total + 1)
        return min(1.0, float(dist[np.abs(s) >= target].sum())), True
    rng = np.random.default_rng(seed)
    a = np.asarray(ints, dtype=np.float64)
    hits = 0
    for start in range(0, MONTE_CARLO_DRAWS, 10_000):
        signs = rng.choice((-1.0, 1.0), size=(min(10_000, MONTE_CARLO_DRAWS - start), a.size))
        hits += int((np.abs(signs @ a) >= target - 0.5).sum())
    return (hits + 1) / (MONTE_CARLO_DRAWS + 1), False


def is_binary(values: Sequence[float]) -> bool:
    """Whether every value is 0 or 1 (pass/fail)."""
    return all(v in (0, 1) for v in values)


def cell_stats(values: Sequence[float], *, binary: bool | None = None,
               strata: Sequence[Hashable] | None = None, seed: int = 0) -> dict[str, Any]:
    """One table cell: ``n``, ``score`` (the mean; with ``strata``, the mean of the strata's
    means), ``ci_low`` and ``ci_high`` (95%) and ``interval``: "wilson" for pass/fail scores
    (``binary``, default: whether every value is 0 or 1) without strata or in strata of one
    size (the mean of their means is then the pooled pass rate), else "bootstrap"
    (``bootstrap_interval``, seeded; a percentile bootstrap of 40 passes is [1, 1], which
    Wilson's [0.91, 1] is not). Partial-credit scores that are all 0 (or all 1) take Wilson's
    interval too, not the bootstrap's zero-width one. Scores stay in [0, 1].

    Raises:
        ValueError: no values.
    """
    if len(values) == 0:
        raise ValueError("a cell needs at least one score")
    binary = is_binary(values) if binary is None else binary
    if strata is not None:
        labels = list(dict.fromkeys(strata))
        means = [np.mean([v for v, s in zip(values, strata) if s == lab]) for lab in labels]
        score = float(np.mean(means))
    else:
        score = float(np.mean(values))
    sizes = set() if strata is None else set(Counter(strata).values())
    same = min(values) == max(values) and min(values) in (0, 1)
    if (binary and len(sizes) <= 1) or same:
        # every score 0 (or 1): a percentile bootstrap would give the zero-width [0, 0]; for
        # scores in [0, 1] with mean m, P(all n are 0) <= (1 - m)^n as for pass/fail, so the
        # pass/fail interval bounds the mean here too
        lo, hi = wilson_interval(int(round(sum(values))), len(values))
        kind = "wilson"
    else:
        lo, hi = bootstrap_interval(values, strata=strata, seed=seed)
        kind = "bootstrap"
    return {"n": len(values), "score": score, "ci_low": lo, "ci_high": hi, "interval": kind}


def paired_comparison(a: Sequence[float], b: Sequence[float], *,
                      strata: Sequence[Hashable] | None = None,
                      seed: int = 0) -> dict[str, Any]:
    """A vs B over the same prompts (``a[i]`` and ``b[i]`` are one prompt's scores).

    Returns ``n``, ``diff`` (mean of a - b; with ``strata``, the mean over strata of their mean
    differences), ``ci_low``/``ci_high`` (95%) and ``interval``: "tango"
    (``tango_paired_interval``) when both are pass/fail, without strata or in strata of one
    size, else
    "bootstrap" (the percentile bootstrap of the difference over prompts, stratified like
    ``bootstrap_interval``, seeded), ``p`` and ``test``: "mcnemar" (exact, ``mcnemar_p``) in
    the pass/fail case, else "sign-flip" (``sign_flip_p`` on the per-prompt differences;
    "sign-flip (Monte Carlo)" when not exact), ``wins`` (prompts where a > b) and ``losses``
    (a < b).

    Raises:
        ValueError: no prompts, or ``a`` and ``b`` of different lengths.
    """
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"a paired comparison needs equal, non-empty score lists, got "
                         f"{len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    wins = sum(x > y for x, y in zip(a, b))
    losses = sum(x < y for x, y in zip(a, b))
    if strata is not None:
        labels = list(dict.fromkeys(strata))
        diff = float(np.mean([np.mean([v for v, s in zip(d, strata) if s == lab])
                              for lab in labels]))
    else:
        diff = float(np.mean(d))
    binary = is_binary(a) and is_binary(b)
    sizes = Counter(strata) if strata is not None else None  # prompts per stratum
    equal = sizes is None or len(set(sizes.values())) == 1
    if binary and equal:
        # strata of one size weigh every prompt alike: the pooled difference is (b - c) / n
        lo, hi = tango_paired_interval(wins, losses, len(a))
        interval = "tango"
    else:
        lo, hi = bootstrap_interval(d, strata=strata, seed=seed)
        interval = "bootstrap"
    if strata is None and binary:
        p, test = mcnemar_p(wins, losses), "mcnemar"
    else:
        fr = [_fraction(v) for v in d]
        if not equal:  # the statistic weighs each prompt by 1 / its stratum's size
            fr = [v / sizes[s] for v, s in zip(fr, strata)]  # (equal sizes: the same test)
        p, exact = _sign_flip(fr, seed)
        test = "sign-flip" if exact else "sign-flip (Monte Carlo)"
    return {"n": len(a), "diff": diff, "ci_low": lo, "ci_high": hi, "interval": interval,
            "p": p, "test": test, "wins": wins, "losses": losses}
