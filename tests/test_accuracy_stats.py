"""evals/stats.py against values computed by hand from the formulas, evals/scoring.py on the
garbled and guessing answers of issue 48, the hashed prompt seeds and the paraphrased needle.
No model: fast."""

import hashlib
import json
import math
import re

import numpy as np
import pytest

from rocketkv.evals.needle import PARAPHRASE_ADJECTIVES, PARAPHRASE_NOUNS, needle_fact
from rocketkv.evals.prompts import prompt_seed
from rocketkv.evals.ruler import WORD_POOL, score_task
from rocketkv.evals.scoring import first_value_pass, list_f1, matches_whole
from rocketkv.evals.stats import (
    bootstrap_interval,
    cell_stats,
    mcnemar_p,
    paired_comparison,
    sign_flip_p,
    stratified_paired_interval,
    stratified_score_interval,
    tango_paired_interval,
    wilson_interval,
)

# --------------------------------------------------------------------------------------------
# Intervals


def test_wilson_interval_by_hand():
    # 7/10: p = .7, z^2 = 3.841459, 1 + z^2/n = 1.3841459,
    # centre = (.7 + .1920729) / 1.3841459 = .644487,
    # half = 1.959964 / 1.3841459 * sqrt(.021 + .00960365) = .247713
    lo, hi = wilson_interval(7, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.3968, 0.8922)
    # 0/5: centre = half = (z^2 / 10) / (1 + z^2 / 5) = .3841459 / 1.7682918 = .217241
    lo, hi = wilson_interval(0, 5)
    assert lo == 0.0 and round(hi, 4) == 0.4345
    lo, hi = wilson_interval(5, 5)  # symmetric
    assert round(lo, 4) == 0.5655 and hi == 1.0
    for bad in ((1, 0), (-1, 3), (4, 3)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def test_bootstrap_interval_is_seeded_and_sensible():
    vals = [0.11, 0.37, 0.52, 0.93, 0.05, 0.66, 0.71]
    a = bootstrap_interval(vals, seed=3)
    assert a == bootstrap_interval(vals, seed=3) != bootstrap_interval(vals, seed=4)
    assert a[0] < sum(vals) / len(vals) < a[1]
    assert bootstrap_interval([0.4] * 5) == pytest.approx((0.4, 0.4))
    # stratified: two strata of constant values cannot vary -> zero width at the strata mean
    lo, hi = bootstrap_interval([0, 0, 0, 1, 1], strata=["a", "a", "a", "b", "b"])
    assert lo == hi == 0.5
    # a stratum of one: the prompts are resampled together, the interval has width
    lo, hi = bootstrap_interval([0, 0, 1, 1], strata=["a", "a", "a", "b"])
    assert lo < hi


def test_cell_stats_picks_the_interval():
    c = cell_stats([1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    assert c["interval"] == "wilson" and c["n"] == 10 and c["score"] == 0.7
    assert (round(c["ci_low"], 4), round(c["ci_high"], 4)) == (0.3968, 0.8922)
    c = cell_stats([1.0, 0.5, 0.0])
    assert c["interval"] == "bootstrap" and c["score"] == 0.5
    c = cell_stats([1.0, 0.5, 1, 1, 1], strata=["x", "x", "y", "y", "y"])
    assert c["interval"] == "bootstrap" and c["score"] == 0.875  # mean of .75 and 1
    # strata of one size: the mean of their means is the pooled rate, Wilson's interval of it
    # (a percentile bootstrap of all passes would be [1, 1])
    c = cell_stats([1] * 40, strata=[4096] * 20 + [8192] * 20)
    assert c["interval"] == "wilson" and c["score"] == 1.0
    assert c["ci_high"] == 1.0 and round(c["ci_low"], 4) == 0.9124  # 40 / (40 + z^2)
    c = cell_stats([1, 0, 1, 1], strata=["x", "x", "y", "y"])
    assert c["interval"] == "wilson" and c["score"] == 0.75
    # partial-credit scores all 0: not the bootstrap's [0, 0] but Wilson's
    # [0, z^2 / (n + z^2)] = [0, 0.2775] at n = 10 (strata of one size)...
    c = cell_stats([0.0] * 10, binary=False, strata=["a"] * 5 + ["b"] * 5)
    assert c["interval"] == "wilson" and c["score"] == 0.0
    assert c["ci_low"] == 0.0 and round(c["ci_high"], 4) == 0.2775
    # ... and in strata of unequal size the stratified score interval, wider than the pooled
    # Wilson's: the 3-prompt stratum weighs as much as the 7-prompt one
    c = cell_stats([0.0] * 10, binary=False, strata=["a"] * 3 + ["b"] * 7)
    assert c["interval"] == "score" and c["score"] == 0.0 and c["ci_low"] == 0.0
    assert c["ci_high"] == pytest.approx(_score_interval_by_grid([0, 0], [3, 7])[1], abs=2e-3)
    assert c["ci_high"] > 0.2775


def _score_interval_by_grid(passes, sizes, z=1.959963984540054, step=5e-4):
    # Slow reference for two strata: for each theta on a grid, the restricted MLE by a grid
    # search over p1 (p2 = 2 theta - p1), then the score statistic against z^2
    (k1, k2), (n1, n2) = passes, sizes
    est = (k1 / n1 + k2 / n2) / 2

    def loglik(k, n, p):
        with np.errstate(divide="ignore", invalid="ignore"):
            a = np.where(k > 0, k * np.log(p), 0.0)
            b = np.where(n - k > 0, (n - k) * np.log(1 - p), 0.0)
        return a + b

    inside = []
    for theta in np.arange(0, 1 + step / 2, step):
        p1 = np.linspace(max(0.0, 2 * theta - 1), min(1.0, 2 * theta), 4001)
        p2 = np.clip(2 * theta - p1, 0.0, 1.0)
        ll = loglik(k1, n1, p1) + loglik(k2, n2, p2)
        i = int(np.nanargmax(np.where(np.isfinite(ll), ll, -np.inf)))
        var = (p1[i] * (1 - p1[i]) / n1 + p2[i] * (1 - p2[i]) / n2) / 4
        if (est - theta) ** 2 <= z * z * var + 1e-15:
            inside.append(theta)
    return min(inside), max(inside)


def test_stratified_score_interval_by_hand_and_by_grid():
    # one stratum: Wilson's interval exactly
    for k, n in ((7, 10), (0, 5), (5, 5), (13, 20)):
        assert stratified_score_interval([k], [n]) == pytest.approx(wilson_interval(k, n))
    # two strata of n, all pass and all fail, theta < 1/2: the restricted MLE is p1 = 2 theta,
    # p2 = 0, so V = theta (1 - 2 theta) / 2n and (1/2 - theta)^2 = z^2 V solves to
    # 1/2 - theta = z^2 / (2 (n + z^2)): n = 10 gives [0.3612, 0.6388]
    z2 = 1.959963984540054 ** 2
    lo, hi = stratified_score_interval([10, 0], [10, 10])
    assert (lo, hi) == pytest.approx((0.5 - z2 / (2 * (10 + z2)), 0.5 + z2 / (2 * (10 + z2))))
    assert (round(lo, 4), round(hi, 4)) == (0.3612, 0.6388)
    # unequal strata and fractional passes against the slow grid reference
    for passes, sizes in (([4, 1], [5, 2]), ([20, 0], [20, 10]), ([2.5, 9], [5, 10]),
                          ([0, 3], [4, 3])):
        got = stratified_score_interval(passes, sizes)
        assert got == pytest.approx(_score_interval_by_grid(passes, sizes), abs=2e-3)
    for bad in (([1], [1, 2]), ([3], [2]), ([1], [0]), ([], [])):
        with pytest.raises(ValueError):
            stratified_score_interval(*bad)


def test_stratified_paired_interval_by_hand_and_against_tango():
    # one stratum: Tango's interval (computed there from its closed-form restricted MLE)
    for b, c, n in ((0, 0, 20), (4, 0, 20), (3, 5, 20), (10, 2, 12), (0, 10, 10), (1, 0, 1)):
        assert stratified_paired_interval([b], [c], [n]) == pytest.approx(
            tango_paired_interval(b, c, n), abs=1e-9)
    # no discordant prompt in strata of 10 and 20: while lambda < 20 only the smaller
    # stratum's q_1 = 1 - 10 / lambda moves, D = -q_1 / 2, V = q_1 (1 - q_1) / 40, and
    # D^2 = z^2 V gives q_1 = z^2 / (10 + z^2) (lambda = 13.8 < 20): D = -z^2 / (2 (10 + z^2))
    z2 = 1.959963984540054 ** 2
    lo, hi = stratified_paired_interval([0, 0], [0, 0], [10, 20])
    assert (lo, hi) == pytest.approx((-z2 / (2 * (10 + z2)), z2 / (2 * (10 + z2))))
    # strata of one size: Tango's interval of the prompts pooled (-/+ z^2 / (40 + z^2))
    assert stratified_paired_interval([0, 0], [0, 0], [20, 20]) == pytest.approx(
        tango_paired_interval(0, 0, 40))
    # all discordant one way in one stratum, none in the other: inside [-1, 1], around D_hat
    lo, hi = stratified_paired_interval([0, 0], [10, 0], [10, 20])
    assert -1 <= lo < -0.5 < hi < 0 and hi > -0.5
    for bad in (([1], [0], [1, 2]), ([2], [1], [2]), ([0], [0], [0]), ([], [], [])):
        with pytest.raises(ValueError):
            stratified_paired_interval(*bad)


def test_pooled_cells_of_constant_strata_have_width():
    # the needle pooled over lengths of 20, 20, 20 and 10 prompts, two lengths all pass and two
    # all fail (hybrid, question-agnostic @256): the stratified bootstrap gave 50 [50, 50]
    strata = [4096] * 20 + [8192] * 20 + [16384] * 20 + [32000] * 10
    values = [1] * 20 + [0] * 20 + [1] * 20 + [0] * 10
    c = cell_stats(values, strata=strata)
    assert c["interval"] == "score" and c["score"] == 0.5
    assert (c["ci_low"], c["ci_high"]) == pytest.approx(
        stratified_score_interval([20, 0, 20, 0], [20, 20, 20, 10]))
    assert 0.4 < c["ci_low"] < 0.5 < c["ci_high"] < 0.6
    # pass/fail in strata of unequal size always take it, not the bootstrap
    c = cell_stats([1, 0, 1, 1, 1], strata=["x", "x", "y", "y", "y"])
    assert c["interval"] == "score" and c["score"] == 0.75
    assert (c["ci_low"], c["ci_high"]) == pytest.approx(stratified_score_interval([1, 3], [2, 3]))
    # partial credit whose every stratum is constant: the score interval on the strata's sums
    c = cell_stats([0.5] * 4 + [0.25] * 4, strata=["a"] * 4 + ["b"] * 4)
    assert c["interval"] == "score" and c["score"] == pytest.approx(0.375)
    assert (c["ci_low"], c["ci_high"]) == pytest.approx(stratified_score_interval([2, 1], [4, 4]))
    assert c["ci_low"] < 0.375 < c["ci_high"]


# --------------------------------------------------------------------------------------------
# Paired tests


def test_sign_flip_p_enumerated_by_hand():
    # sums of +-1 +-.5 +-.25: 1.75 1.25 .75 .25 -.25 -.75 -1.25 -1.75; observed .75:
    # 6 of 8 at least as far from 0
    assert sign_flip_p([1, -0.5, 0.25]) == (0.75, True)
    # only +-1.5 of the 8 reach 1.5; a zero difference changes nothing
    assert sign_flip_p([0.5, 0.5, 0.5])[0] == 0.25
    assert sign_flip_p([0.5, 0.5, 0.5, 0.0])[0] == 0.25
    # thirds, where float sums do not tie exactly: +-1/3 +-1/3 +-2/3 gives 4/3 twice of 8
    assert sign_flip_p([1 / 3, 1 / 3, 2 / 3])[0] == 0.25
    assert sign_flip_p([0.0, 0.0]) == (1.0, True)
    assert sign_flip_p([0.2, -0.2]) == (1.0, True)


def test_mcnemar_exact_binomial_by_hand():
    # b = 1, c = 5: 2 * P(X <= 1), X ~ Bin(6, 1/2) = 2 * (1 + 6) / 64
    assert mcnemar_p(1, 5) == pytest.approx(14 / 64)
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_p(3, 3) == 1.0 and mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(2, 10) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    # the sign-flip test of +-1 differences is the same exact test
    assert sign_flip_p([1, -1, -1, -1, -1, -1])[0] == pytest.approx(mcnemar_p(1, 5))


def test_paired_comparison():
    a = [1, 1, 1, 1, 1, 1, 0, 0]
    b = [0, 0, 0, 0, 0, 1, 0, 1]
    r = paired_comparison(a, b)
    assert r["test"] == "mcnemar" and r["n"] == 8 and r["wins"] == 5 and r["losses"] == 1
    assert r["diff"] == pytest.approx(0.5) and r["p"] == pytest.approx(mcnemar_p(5, 1))
    assert r["ci_low"] <= 0.5 <= r["ci_high"]
    assert r["interval"] == "tango"
    assert (r["ci_low"], r["ci_high"]) == tango_paired_interval(5, 1, 8)
    # pass/fail pooled over strata of one size: the same interval (every prompt weighs alike)
    pooled = paired_comparison(a, b, strata=[0, 1] * 4)
    assert pooled["interval"] == "tango" and pooled["ci_low"] == r["ci_low"]
    assert pooled["test"] == "sign-flip" and pooled["p"] == pytest.approx(r["p"])
    # pass/fail over strata of different sizes: the stratified score interval
    # (stratum 0: prompts 0-1, A alone twice; 1: prompts 2-7, A alone 3 times, B alone once)
    uneven = paired_comparison(a, b, strata=[0] * 2 + [1] * 6)
    assert uneven["interval"] == "score" and uneven["diff"] == pytest.approx((1 + 2 / 6) / 2)
    assert (uneven["ci_low"], uneven["ci_high"]) == pytest.approx(
        stratified_paired_interval([2, 3], [0, 1], [2, 6]))
    r = paired_comparison([1.0, 0.5, 0.25], [0.0, 1.0, 0.0])
    assert r["interval"] == "bootstrap"
    assert r["test"] == "sign-flip" and r["p"] == 0.75
    with pytest.raises(ValueError):
        paired_comparison([1], [1, 0])


# --------------------------------------------------------------------------------------------
# Scoring


def test_garbled_numbers_do_not_pass():
    assert not matches_whole("The code is 167921525.", "1679215")
    assert matches_whole("The code is 1679215.", "1679215")
    assert first_value_pass(" 167921525", "1679215", "number") == 0.0
    assert first_value_pass(" 99982250252252502525258", "9982250", "number") == 0.0
    assert first_value_pass(" 1679215.", "1679215", "number") == 1.0
    # the first value stated is the answer: a wrong one before the right one fails
    assert first_value_pass(" 1234567 or 1679215", "1679215", "number") == 0.0
    assert first_value_pass(" no idea", "1679215", "number") == 0.0
    # the RULER tasks through score_task
    assert score_task("niah_single_essay", " 99982250252252502525258", ["9982250"]) == 0.0
    assert score_task("niah_single_essay", " 9982250.", ["9982250"]) == 1.0
    uuid = "0f3a9c1e-2b4d-4e8f-9a7b-1c2d3e4f5a6b"
    assert score_task("niah_single_uuid", f" {uuid}", [uuid]) == 1.0
    assert score_task("niah_single_uuid", f" {uuid}7", [uuid]) == 0.0


def test_list_guessing_costs_precision():
    want = ["9551912", "4410333"]
    # recall 1/2, precision 1/5 -> F1 = 2 * .2 * .5 / .7
    guess = " 9551912, 9551913, 9551914, 9551915, 9551916"
    assert score_task("niah_multivalue", guess, want) == pytest.approx(2 / 7)
    assert score_task("niah_multivalue", " 9551912 and 4410333.", want) == 1.0
    assert score_task("niah_multivalue", " 9551912.", want) == pytest.approx(2 / 3)
    assert score_task("niah_multivalue", " 95519124410333", want) == 0.0
    # words on boundaries, list numbering and filler ignored
    assert list_f1("1. Apple 2. Pear", ["apple", "pear"], "word", {"apple", "pear"}) == 1.0
    assert list_f1("pineapple", ["apple"] * 2 + ["pear"], "word", None) == 0.0
    # cwe: listing 20 pool words for 10 expected: recall 1, precision .5 -> 2/3
    common, extra = list(WORD_POOL[:10]), list(WORD_POOL[10:20])
    assert score_task("cwe", ", ".join(common + extra), common) == pytest.approx(2 / 3)
    assert score_task("cwe", "The words are " + ", ".join(common), common) == 1.0
    # vt: names are upper-case 5-letter words; "VAR" does not count
    assert score_task("vt", " VAR ABCDE, VAR FGHIJ", ["ABCDE", "FGHIJ"]) == 1.0
    assert score_task("vt", " ABCDEF", ["ABCDE"]) == 0.0
    # fwe: made-up consonant-vowel words; other words are filler
    assert score_task("fwe", " the words are bafegi, dobuka and kimopa",
                      ["bafegi", "dobuka", "kimopa"]) == 1.0


# The cut-value and per-key rules (score_answer's capped and keys), and rescore.py

CUT = ":\n\n1. 9471328\n2. 4784516\n3. 5409226\n4. 9471328\n5. 4784516\n6. 54092"
CUT_WANT = ["4784516", "5409226", "9471328", "3569943"]


def test_a_value_cut_by_the_cap_is_neither_right_nor_wrong():
    from rocketkv.evals.scoring import cut_candidate, score_answer

    # the audit's answer: "54092" is 5409226 cut by the cap; as a candidate it costs precision
    old = score_answer(CUT, CUT_WANT, "number")
    assert old == list_f1(CUT, CUT_WANT, "number") == pytest.approx(0.75)  # P 3/4, R 3/4
    assert score_answer(CUT, CUT_WANT, "number", capped=False) == old
    new = score_answer(CUT, CUT_WANT, "number", capped=True)
    assert new == pytest.approx(2 * 1 * 0.75 / 1.75) and new > old  # P 3/3, R still 3/4
    assert cut_candidate(CUT, "number", expected=CUT_WANT) == "54092"
    # a value with anything after it is complete: kept, capped or not
    for tail in ("6. 1234567.", "6. 1234567\n", "6. 1234567 "):
        done = CUT.rsplit("6. ", 1)[0] + tail
        assert score_answer(done, CUT_WANT, "number", capped=True) == pytest.approx(0.75)
        assert cut_candidate(done, "number", expected=CUT_WANT) is None
    full = CUT.rsplit("6. ", 1)[0] + "6. 3569943."
    assert score_answer(full, CUT_WANT, "number", capped=True) == 1.0
    # a cut number no expected value starts with is wrong whatever followed: kept
    wrong = CUT.rsplit("6. ", 1)[0] + "6. 88888"
    assert score_answer(wrong, CUT_WANT, "number", capped=True) == pytest.approx(0.75)
    assert cut_candidate(wrong, "number", expected=CUT_WANT) is None
    assert cut_candidate(wrong, "number") == "88888"  # without expected: any last number
    # a list whose only candidate is cut: no hit, F1 0 (not None)
    assert score_answer(" 47845", CUT_WANT, "number", capped=True) == 0.0


def test_a_one_value_answer_cut_before_its_first_value_ends_has_no_verdict():
    from rocketkv.evals.scoring import score_answer

    assert score_answer(" 79755", ["7975559"], "number", capped=True) is None
    assert score_answer(" 79755", ["7975559"], "number") == 0.0  # the old rule
    # the right value with nothing after it may be cut too ("79755591..."): no verdict
    assert score_answer(" 7975559", ["7975559"], "number", capped=True) is None
    assert score_answer(" 7975559.", ["7975559"], "number", capped=True) == 1.0
    # the first complete value decides
    assert score_answer(" 1234567 or 79755", ["7975559"], "number", capped=True) == 0.0
    assert score_answer(" 7975559 or 12345", ["7975559"], "number", capped=True) == 1.0
    assert score_answer(" 7975559, 12", ["7975559"], "number", capped=True) == 1.0
    # a runaway repetition is no prefix of the value: wrong, cut or not
    assert score_answer(" 79755555555555555555555", ["7975559"], "number",
                        capped=True) == 0.0
    uuid = "0f3a9c1e-2b4d-4e8f-9a7b-1c2d3e4f5a6b"
    assert score_answer(f": {uuid}", [uuid], "uuid", capped=True) is None
    assert score_task("niah_single_uuid", f": {uuid}", [uuid], capped=True) is None
    assert score_task("niah_single_uuid", f": {uuid}.", [uuid], capped=True) == 1.0


KEYS = ["broom-nugget", "sequoia-anchor", "button-cable", "jigsaw-bamboo"]
VALS = ["4784516", "5409226", "9471328", "3569943"]


def _keyed(pairs):
    return "\n".join(f"{i}. {k}: {v}" for i, (k, v) in enumerate(pairs, 1))


def test_multiquery_counts_a_value_only_under_its_own_key():
    from rocketkv.evals.scoring import score_answer

    def f1(text, **kw):
        return score_answer(text, VALS, "number", keys=KEYS, **kw)

    right = _keyed(zip(KEYS, VALS))
    assert f1(right) == 1.0
    swapped = _keyed(zip(KEYS, [VALS[1], VALS[0], VALS[2], VALS[3]]))
    assert score_answer(swapped, VALS, "number") == 1.0  # the old rule: any key will do
    assert f1(swapped) == pytest.approx(0.5)  # 2 hits of 4 pairs stated, of 4 keys
    assert f1(swapped) < f1(right)
    # a value under the wrong key is no hit (the old rule: a hit)
    assert f1(f"{KEYS[0]}: {VALS[1]}") == 0.0
    assert score_answer(f"{KEYS[0]}: {VALS[1]}", VALS, "number") == pytest.approx(0.4)
    # keys ignore case; each value goes to the key mentioned last before it
    assert f1(f"The numbers for {KEYS[0].upper()} are {VALS[0]} and for {KEYS[3]} "
              f"{VALS[3]}.") == pytest.approx(2 * 1 * 0.5 / 1.5)
    # a value before any key belongs to none: no hit, one more pair stated
    assert f1(f"{VALS[0]}, then {KEYS[1]}: {VALS[1]}") == pytest.approx(1 / 3)
    # a key only inside another word is no mention
    assert f1(f"x{KEYS[0]}: {VALS[0]}") == f1(VALS[0]) == pytest.approx(0.4)


def test_multiquery_without_keys_is_scored_as_a_list():
    from rocketkv.evals.scoring import score_answer

    def f1(text, **kw):
        return score_answer(text, VALS, "number", keys=KEYS, **kw)

    assert f1(":\n\n1. 4784516\n2. 5409226\n3. 9471328\n4. 3569943") == 1.0
    # no key named: nothing ties a value to a key, so the distinct values score as a list
    assert f1("1. 4784516\n2. 4784516\n3. 5409226\n4. 9471328") == pytest.approx(6 / 7)
    # in another order than asked: still the values asked for
    assert f1("1. 5409226\n2. 4784516\n3. 9471328\n4. 3569943") == 1.0
    # a value asked for by no key costs precision
    assert f1("4784516 5409226 9471328 3569943 1111111") == pytest.approx(8 / 9)
    # the keys named only after the values: no value is under a key, a list again
    assert f1("4784516 5409226 9471328 3569943 are the numbers for " + ", ".join(KEYS)) == 1.0
    # capped: the cut last value is dropped before the assignment
    cut = "1. 4784516\n2. 5409226\n3. 9471328\n4. 35699"
    assert f1(cut) == pytest.approx(0.75)
    assert f1(cut, capped=True) == pytest.approx(6 / 7)
    assert f1("no numbers") == 0.0


def test_bad_keys_are_refused():
    from rocketkv.evals.scoring import score_answer

    for keys in (KEYS[:3], ["a-b", "A-B", "c-d", "e-f"], ["a-b", "", "c-d", "e-f"], "a-b"):
        with pytest.raises(ValueError):
            score_answer("1234567", VALS, "number", keys=keys)
    with pytest.raises(ValueError):
        score_answer("1234567", [], "number", capped=True)


def test_the_old_scores_stand_without_the_new_arguments():
    """score_answer and score_task without capped or keys: exactly first_value_pass and
    list_f1, floats, never None."""
    from rocketkv.evals.scoring import score_answer

    cases = [(" 167921525", ["1679215"]), (" 1679215.", ["1679215"]), (" 79755", ["7975559"]),
             (CUT, CUT_WANT), (_keyed(zip(KEYS, reversed(VALS))), VALS), ("", VALS)]
    for text, want in cases:
        ref = (first_value_pass(text, want[0], "number") if len(want) == 1
               else list_f1(text, want, "number"))
        got = score_answer(text, want, "number")
        assert got == ref and isinstance(got, float)
        task = "niah_single_essay" if len(want) == 1 else "niah_multiquery"
        assert score_task(task, text, want) == ref


def test_score_task_takes_multiquerys_keys_from_its_facts():
    from rocketkv.evals.ruler import asked_keys

    facts = [*KEYS, *VALS]  # build_items: the keys, then their values (the outputs)
    assert asked_keys("niah_multiquery", facts, VALS) == KEYS
    assert asked_keys("niah_multivalue", facts, VALS) is None
    swapped = _keyed(zip(KEYS, [VALS[1], VALS[0], VALS[2], VALS[3]]))
    assert score_task("niah_multiquery", swapped, VALS) == 1.0
    assert score_task("niah_multiquery", swapped, VALS, facts=facts) == pytest.approx(0.5)
    # other tasks ignore facts
    assert score_task("niah_multivalue", swapped, VALS, facts=facts) == 1.0
    # capped reaches score_answer; the audit's answer names no key: scored as a list
    assert score_task("niah_multivalue", CUT, CUT_WANT, capped=True) == pytest.approx(6 / 7)
    assert score_task("niah_multiquery", CUT, CUT_WANT, capped=True,
                      facts=[*KEYS, *CUT_WANT]) == pytest.approx(6 / 7)
    with pytest.raises(ValueError):
        score_task("niah_multiquery", swapped, VALS, facts=[*VALS, *KEYS])


def test_task_rows_leave_none_scores_out():
    from types import SimpleNamespace

    from rocketkv.evals.ruler import task_rows

    items = [SimpleNamespace(meta={"task": t}) for t in ("vt", "vt", "cwe")]
    (row,) = task_rows([{"scores": [1.0, None, 0.5]}], items, ["vt", "cwe"])
    assert row["per_task"] == {"vt": 1.0, "cwe": 0.5} and row["score"] == 0.75


class _FakeTokenizer:
    """One token a whitespace-separated piece: what rescore needs of a tokenizer."""

    def encode(self, text, bos=True):
        return ([0] if bos else []) + [1] * len(text.split())


def _ruler_json(path):
    items = [
        {"task": "niah_single_essay", "outputs": ["7975559"], "facts": ["a-b", "7975559"],
         "max_new_tokens": 4},
        {"task": "niah_single_essay", "outputs": ["1234567"], "facts": ["c-d", "1234567"],
         "max_new_tokens": 4},
        {"task": "niah_multiquery", "outputs": VALS, "facts": [*KEYS, *VALS],
         "max_new_tokens": 8},
    ]
    answers = [" 79755",  # 1 token of 4: not capped, a wrong number (0)
               " the answer is 12345",  # 4 tokens: capped, the only value cut: None
               "1. 5409226 2. 4784516 3. 9471328 4. 35699"]  # 8: capped, last value cut
    old = [0.0, 0.0, 0.75]
    res = {"task": "ruler", "mode": "standard", "tasks": ["niah_single_essay",
                                                          "niah_multiquery"],
           "items": items,
           "rows": [{"method": "full", "budget": None, "score": (0.0 + 0.75) / 2,
                     "scores": old, "answers": answers,
                     "per_task": {"niah_single_essay": 0.0, "niah_multiquery": 0.75}},
                    {"method": "quest", "budget": 16, "error": "budget too small"}]}
    path.write_text(json.dumps(res))
    return res


def test_rescore_a_small_ruler_file(tmp_path):
    from rocketkv.evals.rescore import is_capped, markdown, rescore_files

    path = tmp_path / "ruler.json"
    _ruler_json(path)
    before = path.read_bytes()
    tok = _FakeTokenizer()
    count = lambda text: len(tok.encode(text, bos=False))  # noqa: E731
    assert is_capped(" a b c", 4, count) and not is_capped(" a b", 4, count)
    report = rescore_files([path], count)
    assert path.read_bytes() == before  # the input is not written
    (f,) = report["files"]
    full, quest = f["rows"]
    assert quest == {"method": "quest", "budget": 16, "error": "budget too small"}
    assert full["capped_items"] == [1, 2] and full["capped"] == 2 and full["cut"] == 2
    assert full["none"] == 1 and full["scores_new"][:2] == [0.0, None]
    # multiquery: no key named, so a list: the cut 35699 dropped, 3 hits of 3 stated, R 3/4
    assert full["scores_new"][2] == pytest.approx(6 / 7)
    assert full["per_task"]["niah_single_essay"] == {"old": 0.0, "new": 0.0, "capped": 1,
                                                     "cut": 1, "none": 1}
    assert full["per_task"]["niah_multiquery"]["new"] == pytest.approx(6 / 7)
    assert full["score_old"] == full["score_old_rules"] == pytest.approx(0.375)
    assert full["score_new"] == pytest.approx(3 / 7)  # (essay 0 + multiquery 6/7) / 2
    assert full["delta"] == pytest.approx(3 / 7 - 0.375)
    assert full["score_cut_only"] == pytest.approx((0 + 6 / 7) / 2)  # set F1, 35699 dropped
    assert full["score_keys_only"] == pytest.approx((0 + 0.75) / 2)  # a list: 3 of 4, P 3/4
    assert report["summary"]["cells"] == 1 and report["summary"]["old_rules_differ"] == 0
    md = markdown(report)
    assert "| full | - | 37.5 | 42.9 | +5.4 |" in md and "| quest | 16 | n/a: budget" in md


def test_rescore_script_output_and_bad_input(tmp_path, monkeypatch, capsys):
    import rocketkv.evals.rescore as rescore
    from scripts.rescore_ruler import main

    path = tmp_path / "ruler.json"
    _ruler_json(path)
    tok_file = tmp_path / "tok.gguf"
    tok_file.write_text("not read: load_tokenizer is replaced")
    monkeypatch.setattr(rescore, "load_tokenizer", lambda p: _FakeTokenizer())
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert main([str(path), "--tokenizer", str(tok_file), "--json", str(out_json),
                 "--md", str(out_md)]) == 0
    data = json.loads(out_json.read_text())
    assert data["files"][0]["rows"][0]["score_new"] == pytest.approx(3 / 7)
    assert out_md.read_text().startswith("# RULER answers rescored")
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"items": [{"task": "vt"}], "rows": []}))
    unknown = tmp_path / "unknown.json"
    res = json.loads(path.read_text())
    res["items"][0]["task"] = "nope"
    unknown.write_text(json.dumps(res))
    for argv in ([str(tmp_path / "missing.json"), "--tokenizer", str(tok_file)],
                 [str(bad), "--tokenizer", str(tok_file)],
                 [str(partial), "--tokenizer", str(tok_file)],
                 [str(unknown), "--tokenizer", str(tok_file)],
                 [str(path), "--tokenizer", str(tmp_path / "no-tokenizer")],
                 [str(path), "--tokenizer", str(tok_file), "--json", str(path)],
                 [str(path), "--tokenizer", str(tok_file), "--md", str(tmp_path / "no/r.md")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err


def test_rescore_script_help_before_torch(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    script = ROOT / "scripts" / "rescore_ruler.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv, rc in ((["--help"], 0), (["x.json"], 2), ([str(tmp_path / "missing.json"),
                                                         "--tokenizer", "t"], 2)):
        p = subprocess.run([sys.executable, "-X", "importtime", str(script), *argv],
                           capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        log = [x for x in p.stderr.splitlines() if x.startswith("import time:")]
        err = [x for x in p.stderr.splitlines() if not x.startswith("import time:")]
        assert p.returncode == rc, p.stderr[-2000:]
        if argv[0] in ("--help", "x.json"):  # the parser's errors come before the engine
            assert not [x for x in log if x.split("|")[-1].strip() == "torch"], argv
        assert (not err) if rc == 0 else (len(err) == 1 and err[0].startswith("error: "))


# --------------------------------------------------------------------------------------------
# Seeds and the paraphrased needle


def test_prompt_seed_is_a_sha256_of_the_parts():
    digest = hashlib.sha256(b"needle\x1feval\x1f0\x1f4096\x1f3").digest()
    assert prompt_seed("needle", "eval", 0, 4096, 3) == int.from_bytes(digest[:8], "big")
    seeds = {prompt_seed("ruler", t, n, j) for t in ("vt", "cwe") for n in (4096, 8192)
             for j in range(5)}
    assert len(seeds) == 20


def _content(text):
    stop = {"the", "a", "an", "of", "to", "is", "was", "are", "this", "that", "which", "what"}
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in stop}


def test_the_paraphrased_question_shares_no_content_word_with_its_needle():
    for seed in range(300):
        f = needle_fact(seed, "paraphrase")
        needle = _content(f["needle"].replace(f["answer"], ""))
        asked = _content(f["question"]) | _content(f["answer_prefix"])
        assert not needle & asked, (f, needle & asked)
    # every synonym pair's words are distinct and no word serves in two pairs
    words = [w for pair in PARAPHRASE_ADJECTIVES + PARAPHRASE_NOUNS for w in pair]
    assert len(words) == len(set(words))
    std = needle_fact(7)
    assert std["key"] in std["question"] and std["key"] in std["needle"]
    assert math.isclose(len(std["answer"]), 7)


def test_tango_interval_by_hand():
    """Tango's paired score interval: with no discordant prompts the closed form
    -/+ z^2 / (n + z^2); at each end the score statistic, computed here from its definition,
    is -/+ z; the estimate inside; 0 inside exactly when |McNemar's z| = |b - c| / sqrt(b + c)
    <= z (its score test at D = 0)."""
    z = 1.959963984540054
    lo, hi = tango_paired_interval(0, 0, 20)
    assert hi == pytest.approx(z * z / (20 + z * z)) and lo == pytest.approx(-hi)

    def score(b, c, n, d):  # Tango (1998), eq. for T and the restricted MLE of "B alone"
        qa, qb, qc = 2 * n, -(b + c) + (2 * n - b + c) * d, -c * d * (1 - d)
        q = (-qb + math.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa)
        return (b - c - n * d) / math.sqrt(n * (2 * q + d * (1 - d)))

    for b, c, n in [(4, 0, 20), (150, 86, 1600), (3, 7, 30), (1, 1, 5)]:
        lo, hi = tango_paired_interval(b, c, n)
        assert lo < (b - c) / n < hi
        assert score(b, c, n, lo) == pytest.approx(z, abs=1e-6)
        assert score(b, c, n, hi) == pytest.approx(-z, abs=1e-6)
        assert (lo <= 0 <= hi) == (abs(b - c) / math.sqrt(b + c) <= z)
    # 4 of 20 discordant, all one way: the interval this project's 4K table quotes
    assert tango_paired_interval(4, 0, 20) == pytest.approx((0.00665, 0.41602), abs=1e-5)
    assert tango_paired_interval(20, 0, 20)[1] == 1.0  # bounded by 1
    with pytest.raises(ValueError):
        tango_paired_interval(15, 10, 20)


def _holm_rejects(pvalues, alpha):
    """Holm's procedure as he stated it: test the sorted p values in turn against alpha / (m -
    i), stopping at the first that fails; the indices rejected."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    rejected = set()
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        rejected.add(i)
    return rejected


def test_holm_adjusted_values_reject_what_the_step_down_procedure_rejects():
    """``stats.holm``: at every level, an adjusted p under it is exactly a hypothesis Holm's
    step-down procedure rejects; never below the raw p, at most 1."""
    import random

    from rocketkv.evals.stats import holm

    rng = random.Random(0)
    for _ in range(200):
        m = rng.randint(1, 12)
        p = [rng.choice([rng.random(), rng.random() / 50, 0.01, 0.02]) for _ in range(m)]
        adj = holm(p)
        assert all(a >= x and a <= 1 for a, x in zip(adj, p))
        for alpha in (0.001, 0.01, 0.02, 0.04, 0.05, 0.1, 0.5):
            assert {i for i, a in enumerate(adj) if a <= alpha} == _holm_rejects(p, alpha), \
                (p, alpha)
    assert holm([]) == []


def test_the_minimum_detectable_difference_has_80_percent_power():
    """At a true mean difference equal to the MDD of normal per-prompt differences, a
    two-sided 5% test of the mean rejects in about 80% of repeated samples (simulated); the
    MDD shrinks as 1/sqrt(n); identical runs get the floor of one discordant prompt."""
    import numpy as np

    from rocketkv.evals.stats import Z95, min_detectable_difference

    rng = np.random.default_rng(0)
    n, sd = 40, 0.3
    mdd = min_detectable_difference(list(rng.normal(0, sd, 10_000)))  # sd known closely
    mdd_n = mdd * np.sqrt(10_000) / np.sqrt(n)
    samples = rng.normal(mdd_n, sd, (20_000, n))
    z = samples.mean(1) / (samples.std(1, ddof=1) / np.sqrt(n))
    power = float((np.abs(z) > Z95).mean())
    assert 0.76 < power < 0.84, power
    assert min_detectable_difference([0.0] * 20) == \
        min_detectable_difference([1.0] + [0.0] * 19)
    with pytest.raises(ValueError):
        min_detectable_difference([0.5])


def test_equivalence_needs_the_90_percent_interval_inside_the_margin():
    """``paired_comparison``'s ``equivalent``: the two one-sided tests at 5 points, i.e. its
    90% interval (the same kind as its 95% one, narrower) inside (-5, +5) points. 200 prompts
    that agree are equivalent; 20 are too few to show it; 200 that differ by 6 points are not."""
    from rocketkv.evals.stats import paired_comparison

    same = paired_comparison([1] * 190 + [0] * 10, [1] * 190 + [0] * 10)
    few = paired_comparison([1] * 19 + [0], [1] * 19 + [0])
    off = paired_comparison([1] * 200, [1] * 188 + [0] * 12)
    assert same["equivalent"] and not few["equivalent"] and not off["equivalent"]
    for r in (same, few, off):
        assert r["ci_low"] <= r["ci90_low"] <= r["ci90_high"] <= r["ci_high"]
    partial = paired_comparison([0.5, 0.7, 0.2, 0.9] * 30, [0.5, 0.6, 0.3, 0.9] * 30)
    assert partial["interval"] == "bootstrap" and partial["ci_low"] <= partial["ci90_low"]
