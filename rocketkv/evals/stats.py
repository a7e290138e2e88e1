"""Statistics of the accuracy tables: intervals for one cell, paired comparisons of two methods
over the same prompts, and exact paired tests.

Scores are per prompt, in [0, 1]. A cell (one task, length, method, budget, mode) is the mean
over its n prompts; a comparison "A vs B" pairs the two methods' scores on the prompts both
ran. Every function is deterministic: bootstrap draws come from ``numpy.random.default_rng``
seeded by the caller (default 0).

* ``wilson_interval(k, n)``: the Wilson score interval of a pass rate (pass/fail scores).
* ``bootstrap_interval(values)``: the percentile bootstrap interval of a mean (partial credit),
  optionally stratified (resampling prompts within each task, for a mean over tasks).
* ``stratified_score_interval(passes, sizes)``: the score interval of a mean of strata's pass
  rates (a pooled cell whose lengths hold different numbers of prompts).
* ``sign_flip_p(diffs)``: the exact two-sided sign-flip (paired permutation) test of a mean
  difference of zero.
* ``mcnemar_p(b, c)``: the exact McNemar test of pass/fail pairs (an exact binomial test of the
  discordant pairs).
* ``tango_paired_interval(only_a, only_b, n)``: Tango's score interval of a difference of
  paired pass rates; ``stratified_paired_interval`` the same for a mean over strata of
  different sizes.
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
Z90 = 1.6448536269514722  # its 0.95 quantile: the two one-sided tests at 5% (a 90% interval)
Z80 = 0.8416212335729143  # its 0.80 quantile: 80% power
EQUIVALENCE_MARGIN = 0.05  # "near" means within 5 points, as the two one-sided tests check
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


def _restricted_rate(k: float, n: int, c: float) -> float:
    # The pass rate p in [0, 1] that maximizes k log p + (n - k) log(1 - p) - c p: where
    # k / p - (n - k) / (1 - p) = c inside (0, 1), else the end that KKT picks
    if k <= 0:
        return max(0.0, 1.0 + n / c) if c < 0 else 0.0
    if k >= n:
        return min(1.0, n / c) if c > 0 else 1.0
    if c == 0:
        return k / n
    # c p^2 - (c + n) p + k = 0 has exactly one root in (0, 1): q(0) = k > 0 > k - n = q(1)
    b, disc = c + n, math.sqrt((c + n) ** 2 - 4 * c * k)
    r = 2 * k / (b + disc) if b >= 0 else 2 * k / (b - disc)
    if not 0.0 < r < 1.0:
        r = (b + disc) / (2 * c) if b >= 0 else (b - disc) / (2 * c)
    return min(1.0, max(0.0, r))


def stratified_score_interval(passes: Sequence[float], sizes: Sequence[int],
                              z: float = Z95) -> tuple[float, float]:
    """The score interval of the mean of H strata's pass rates, (1/H) sum_h p_h, from
    ``passes[h]`` passes in ``sizes[h]`` prompts (a pooled cell whose strata differ in size).

    The interval is every theta whose score statistic (p_hat - theta)^2 / V(theta) is at most
    z^2, with p_hat = (1/H) sum_h k_h / n_h and V(theta) = (1/H^2) sum_h p_h (1 - p_h) / n_h
    evaluated at the rates p_h that maximize the binomial likelihood subject to
    (1/H) sum_h p_h = theta (the restricted maximum-likelihood estimate, found by bisection on
    the Lagrange multiplier); each end is found by bisection on theta. One stratum gives
    Wilson's interval exactly. Unlike a stratified bootstrap it is not zero-width when every
    stratum is constant: two strata of n, one all pass and one all fail, give
    0.5 -/+ z^2 / (2 (n + z^2)) (n = 10: [0.361, 0.639]; Wilson on the 20 prompts pooled, which
    ignores the strata, [0.299, 0.701]). Passes may be fractional (the sum of partial-credit
    scores in [0, 1], whose variance is at most the Bernoulli's m (1 - m)).

    Source: the score-test inversion of E. B. Wilson (JASA 22, 1927), with the variance at the
    restricted maximum-likelihood estimate as O. Miettinen and M. Nurminen do for a difference
    of rates ("Comparative analysis of two rates", Statistics in Medicine 4, 1985).

    Raises:
        ValueError: no strata, ``passes`` and ``sizes`` of different lengths, a stratum with
            no prompts, or passes outside [0, size].
    """
    if len(passes) != len(sizes) or not sizes:
        raise ValueError(f"the stratified score interval needs one pass count per stratum, got "
                         f"{len(passes)} counts and {len(sizes)} sizes")
    if any(n <= 0 or not 0 <= k <= n for k, n in zip(passes, sizes)):
        raise ValueError(f"the stratified score interval needs 0 <= passes <= size and size > 0 "
                         f"in every stratum, got {list(passes)} of {list(sizes)}")
    h = len(sizes)
    est = sum(k / n for k, n in zip(passes, sizes)) / h

    def rates(theta: float) -> list[float]:
        # (1/H) sum_h p_h(c) falls from 1 to 0 as the multiplier c grows: bracket, then bisect
        def mean(c: float) -> float:
            return sum(_restricted_rate(k, n, c) for k, n in zip(passes, sizes)) / h
        lo, hi = -1.0, 1.0
        while mean(lo) < theta and lo > -1e150:
            lo *= 2
        while mean(hi) > theta and hi < 1e150:
            hi *= 2
        for _ in range(200):
            mid = (lo + hi) / 2
            if mid in (lo, hi):
                break
            lo, hi = (mid, hi) if mean(mid) > theta else (lo, mid)
        c = (lo + hi) / 2
        return [_restricted_rate(k, n, c) for k, n in zip(passes, sizes)]

    def inside(theta: float) -> bool:
        var = sum(p * (1 - p) / n for p, n in zip(rates(theta), sizes)) / (h * h)
        return (est - theta) ** 2 <= z * z * var

    def solve(a: float, b: float) -> float:
        # inside(a) is False, inside(b) is True (b = est): the boundary between them
        for _ in range(60):
            mid = (a + b) / 2
            a, b = (a, mid) if inside(mid) else (mid, b)
        return (a + b) / 2

    # at theta = 0 (or 1) every restricted rate is 0 (or 1) and V = 0: outside unless est is it
    lower = 0.0 if est <= 0 else solve(0.0, est)
    upper = 1.0 if est >= 1 else solve(1.0, est)
    return lower, upper


def _restricted_discordance(b: int, c: int, n: int, lam: float) -> tuple[float, float]:
    # The probabilities (p of "A alone", q of "B alone") that maximize
    # b log p + c log q + m log(1 - p - q) - lam (p - q), m = n - b - c: by the KKT
    # conditions p = b / (mu + lam), q = c / (mu - lam), 1 - p - q = m / mu for the mu >= |lam|
    # where they sum to 1; a zero count whose coefficient binds (mu = |lam|) takes the slack
    m = n - b - c
    lo = abs(lam)

    def total(mu: float) -> float:
        return ((b / (mu + lam) if b else 0.0) + (c / (mu - lam) if c else 0.0)
                + (m / mu if m else 0.0))

    binding_zero = (lam > 0 and c == 0) or (lam < 0 and b == 0)
    if binding_zero and total(lo) <= 1:
        rest = 1 - total(lo)  # to the coordinate whose marginal is zero at mu = |lam|
        p = b / (lo + lam) if b else (rest if lam < 0 else 0.0)
        q = c / (lo - lam) if c else (rest if lam > 0 else 0.0)
        return p, q
    a, z = lo, lo + n  # total(a+) > 1 >= total(lo + n)
    for _ in range(100):
        mid = (a + z) / 2
        if mid in (a, z):
            break
        a, z = (mid, z) if total(mid) > 1 else (a, mid)
    mu = (a + z) / 2
    return (b / (mu + lam) if b else 0.0), (c / (mu - lam) if c else 0.0)


def stratified_paired_interval(only_a: Sequence[int], only_b: Sequence[int],
                               sizes: Sequence[int], z: float = Z95) -> tuple[float, float]:
    """The score interval of the mean over H strata of the paired differences of pass rates,
    D = (1/H) sum_h (p_ah - p_bh), from ``only_a[h]`` prompts passed by A alone and
    ``only_b[h]`` by B alone of ``sizes[h]`` in stratum h (a pooled comparison whose strata
    differ in size).

    As Tango's interval (``tango_paired_interval``, which it gives for one stratum), the
    interval is every D whose score statistic (D_hat - D)^2 / V(D) is at most z^2, with
    D_hat = (1/H) sum_h (b_h - c_h) / n_h and
    V(D) = (1/H^2) sum_h (p_h + q_h - (p_h - q_h)^2) / n_h at the probabilities p_h ("A
    alone") and q_h ("B alone") that maximize the multinomial likelihood subject to the mean
    difference being D. Those are found for each Lagrange multiplier lambda (larger lambda,
    smaller D; lambda = 0 is the unrestricted estimate) and each end by bisection on lambda.
    With no discordant prompt in strata of 10 and 20 prompts the lower end is
    -z^2 / (2 (10 + z^2)) = -0.139 (only the smaller stratum moves: its prompts weigh twice);
    in strata of one size it is Tango's -z^2 / (n + z^2) for the n prompts pooled.

    Source: T. Tango, Statistics in Medicine 17 (1998), the restricted-MLE score interval of
    a paired difference, here for a weighted sum of strata's differences.

    Raises:
        ValueError: lists of different lengths or none, a stratum with no prompts, or more
            discordant prompts than its size.
    """
    if not (len(only_a) == len(only_b) == len(sizes)) or not sizes:
        raise ValueError("the stratified paired interval needs one (only_a, only_b, size) per "
                         f"stratum, got {len(only_a)}, {len(only_b)} and {len(sizes)}")
    if any(n <= 0 or min(b, c) < 0 or b + c > n for b, c, n in zip(only_a, only_b, sizes)):
        raise ValueError(f"the stratified paired interval needs 0 <= only_a + only_b <= size in "
                         f"every stratum, got {list(only_a)}, {list(only_b)} of {list(sizes)}")
    h = len(sizes)
    est = sum((b - c) / n for b, c, n in zip(only_a, only_b, sizes)) / h

    def at(lam: float) -> tuple[float, float]:  # (D, the score statistic) at the multiplier
        d = v = 0.0
        for b, c, n in zip(only_a, only_b, sizes):
            p, q = _restricted_discordance(b, c, n, lam)
            d += (p - q) / h
            v += (p + q - (p - q) ** 2) / n / (h * h)
        if abs(est - d) < 1e-12:  # the unrestricted estimate, up to rounding
            return d, 0.0
        return d, math.inf if v <= 0 else (est - d) ** 2 / v

    def end(sign: float) -> float:
        lo, hi = 0.0, 1.0
        while at(sign * hi)[1] < z * z:
            if hi > 1e12:  # the statistic stays under z^2: the interval reaches -1 (or 1)
                return at(sign * hi)[0]
            lo, hi = hi, hi * 2
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if at(sign * mid)[1] < z * z else (lo, mid)
        return at(sign * (lo + hi) / 2)[0]

    return max(-1.0, end(1.0)), min(1.0, end(-1.0))


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
    means), ``ci_low`` and ``ci_high`` (95%) and ``interval``, which says how they were made:

    * "wilson": pass/fail scores (``binary``, default: whether every value is 0 or 1) without
      strata or in strata of one size (the mean of their means is then the pooled pass rate);
      partial-credit scores that are all 0 (or all 1) too, not the bootstrap's zero-width
      interval (for scores in [0, 1] with mean m, P(all n are 0) <= (1 - m)^n, as for
      pass/fail). A percentile bootstrap of 40 passes is [1, 1], which Wilson's [0.91, 1] is
      not.
    * "score": pass/fail scores (or all-0/all-1 ones) in strata of different sizes
      (``stratified_score_interval``: the mean of the strata's rates weighs a prompt of a
      smaller stratum more, so the pooled Wilson interval would misstate it, and a stratified
      bootstrap is zero-width when every stratum is constant); partial credit whose bootstrap
      is zero-width (every stratum constant), with each stratum's score sum as its passes
      (a score in [0, 1] with mean m varies at most as a pass/fail one, m (1 - m)).
    * "bootstrap": every other partial-credit cell (``bootstrap_interval``, seeded,
      stratified when ``strata`` are given).

    Scores stay in [0, 1].

    Raises:
        ValueError: no values.
    """
    if len(values) == 0:
        raise ValueError("a cell needs at least one score")
    binary = is_binary(values) if binary is None else binary
    labels = [None] if strata is None else list(dict.fromkeys(strata))
    groups = ([list(values)] if strata is None else
              [[v for v, s in zip(values, strata) if s == lab] for lab in labels])
    score = float(np.mean([np.mean(g) for g in groups]))
    equal = len({len(g) for g in groups}) == 1
    same = min(values) == max(values) and min(values) in (0, 1)

    def stratified() -> tuple[float, float]:
        return stratified_score_interval([float(sum(g)) for g in groups],
                                         [len(g) for g in groups])

    if (binary or same) and equal:
        lo, hi = wilson_interval(int(round(sum(values))), len(values))
        kind = "wilson"
    elif binary or same:
        (lo, hi), kind = stratified(), "score"
    else:
        lo, hi = bootstrap_interval(values, strata=strata, seed=seed)
        kind = "bootstrap"
        if lo == hi:  # every stratum constant: a resample cannot vary
            (lo, hi), kind = stratified(), "score"
    return {"n": len(values), "score": score, "ci_low": lo, "ci_high": hi, "interval": kind}


def paired_comparison(a: Sequence[float], b: Sequence[float], *,
                      strata: Sequence[Hashable] | None = None,
                      seed: int = 0) -> dict[str, Any]:
    """A vs B over the same prompts (``a[i]`` and ``b[i]`` are one prompt's scores).

    Returns ``n``, ``diff`` (mean of a - b; with ``strata``, the mean over strata of their mean
    differences), ``ci_low``/``ci_high`` (95%) and ``interval``: "tango"
    (``tango_paired_interval``) when both are pass/fail, without strata or in strata of one
    size; "score" (``stratified_paired_interval``) when both are pass/fail in strata of
    different sizes; else "bootstrap" (the percentile bootstrap of the difference over
    prompts, stratified like ``bootstrap_interval``, seeded), ``p`` and ``test``: "mcnemar"
    (exact, ``mcnemar_p``) in the pass/fail case, else "sign-flip" (``sign_flip_p`` on the
    per-prompt differences; "sign-flip (Monte Carlo)" when not exact), ``wins`` (prompts
    where a > b) and ``losses`` (a < b).

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
    lo, hi, interval = _paired_interval(a, b, d, strata, binary, wins, losses, seed, 0.95)
    # the two one-sided tests of equivalence at 5% each reject both ends exactly where the
    # 90% interval (of the same kind) lies inside the margin (Schuirmann 1987)
    lo90, hi90, _ = _paired_interval(a, b, d, strata, binary, wins, losses, seed, 0.90)
    if strata is None and binary:
        p, test = mcnemar_p(wins, losses), "mcnemar"
    else:
        fr = [_fraction(v) for v in d]
        if not equal:  # the statistic weighs each prompt by 1 / its stratum's size
            fr = [v / sizes[s] for v, s in zip(fr, strata)]  # (equal sizes: the same test)
        p, exact = _sign_flip(fr, seed)
        test = "sign-flip" if exact else "sign-flip (Monte Carlo)"
    return {"n": len(a), "diff": diff, "ci_low": lo, "ci_high": hi, "interval": interval,
            "p": p, "test": test, "wins": wins, "losses": losses,
            "ci90_low": lo90, "ci90_high": hi90,
            "equivalent": bool(-EQUIVALENCE_MARGIN < lo90 and hi90 < EQUIVALENCE_MARGIN),
            "mdd": min_detectable_difference(d) if len(d) > 1 else None}


def _paired_interval(a, b, d, strata, binary: bool, wins: int, losses: int, seed: int,
                     level: float) -> tuple[float, float, str]:
    """``paired_comparison``'s interval of the difference at ``level`` (0.95 or 0.90), and its
    kind: "tango" when both are pass/fail, without strata or in strata of one size (every
    prompt weighs alike: the pooled difference is (b - c) / n); "score" when both are
    pass/fail in strata of different sizes (Tango's interval of the mean of their
    differences); else "bootstrap"."""
    z = {0.95: Z95, 0.90: Z90}[level]
    sizes = Counter(strata) if strata is not None else None  # prompts per stratum
    if binary and (sizes is None or len(set(sizes.values())) == 1):
        return (*tango_paired_interval(wins, losses, len(a), z=z), "tango")
    if binary:
        labels = list(dict.fromkeys(strata))
        return (*stratified_paired_interval(
            [sum(x > y for x, y, s in zip(a, b, strata) if s == lab) for lab in labels],
            [sum(x < y for x, y, s in zip(a, b, strata) if s == lab) for lab in labels],
            [sizes[lab] for lab in labels], z=z), "score")
    return (*bootstrap_interval(d, strata=strata, seed=seed, level=level), "bootstrap")


def min_detectable_difference(diffs: Sequence[float], *, z_alpha: float = Z95,
                              z_power: float = Z80) -> float:
    """The smallest true mean difference a paired comparison of these prompts detects with 80%
    power at a two-sided 5% level, by the normal approximation: (z_0.975 + z_0.8) sd(d) /
    sqrt(n), sd the per-prompt differences' sample standard deviation, at least that of one
    discordant prompt in n (identical runs would otherwise claim to detect anything). In the
    scores' unit (a fraction: 0.12 is 12 points).

    Raises:
        ValueError: fewer than two prompts.
    """
    n = len(diffs)
    if n < 2:
        raise ValueError(f"a detectable difference needs two prompts or more, got {n}")
    sd = float(np.std(np.asarray(diffs, dtype=float), ddof=1))
    floor = math.sqrt((1 - 1 / n) / (n - 1))  # the sd of n - 1 zeros and one 1
    return (z_alpha + z_power) * max(sd, floor) / math.sqrt(n)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p values (Holm 1979), in the input's order: with the m values
    sorted ascending, p_(i) becomes max over j <= i of min(1, (m - j + 1) p_(j)). Rejecting
    where the adjusted value is under alpha controls the family-wise error at alpha."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    m = len(pvalues)
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out
