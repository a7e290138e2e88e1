"""Steps of the fused selection's threshold search, modelled in NumPy (a CPU model, no GPU).

    python tools/selection_steps.py [--trials 20] [--seed 0]

``kernels.sparse._choose`` finds tau, the largest order key whose pages hold at least k slots,
by a bisection over the int32 key range whose bounds snap to the pages' keys; each step is one
block reduction in the kernel, so the step count is its latency's main term. This runs the
same search in NumPy on synthetic page scores (log-normal probabilities, normal logits,
Quest-like bounds, logits rounded to one decimal: many ties) at the selection shapes of the
GPU targets (RocketKV @256 at 128K: 1171 pages of 112 slots; hybrid @256 at 32K: 2736 pages
of 12; SparQ and Exact-TopK: 8192 one-token pages, k 256 and 4096), checks each tau against
a sort, and prints the mean and largest step count per case against the fixed bisection's 32.
Synthetic scores only: no evaluation prompt is used, and nothing here is a time.
"""

from __future__ import annotations

import sys

import _here  # noqa: F401  (this checkout's engine: tools/_here.py)
import numpy as np

from rocketkv.flags import OneLineParser

SHAPES = ((1171, 112, 256), (2736, 12, 256), (8192, 1, 256), (8192, 1, 4096))
SCORES = {
    "log-normal probabilities": lambda rng, n: np.exp(rng.normal(0, 2, n)) / n,
    "normal logits": lambda rng, n: rng.normal(0, 1, n),
    "Quest-like bounds": lambda rng, n: rng.normal(5, 3, n),
    "rounded logits (ties)": lambda rng, n: np.round(rng.normal(0, 1, n), 1),
}


def order_keys(x: np.ndarray) -> np.ndarray:
    """float32 -> int64 keys whose order is the floats' (``kernels.sparse._order_key``)."""
    bits = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def search(key: np.ndarray, cnt: np.ndarray, k: int) -> tuple[int, int]:
    """(tau, steps) of ``_choose``'s search: slots(key >= lo) >= k > slots(key > hi), the
    bounds moved to the smallest key at or above the midpoint or the largest below it."""
    lo, hi, steps = -2**31, 2**31 - 1, 0
    while lo < hi:
        steps += 1
        mid = (lo + hi + 1) // 2
        at = key >= mid
        if cnt[at].sum() >= k:
            lo = int(key[at].min()) if at.any() else hi
        else:
            hi = int(key[~at].max()) if (~at).any() else lo
    return lo, steps


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="random score sets per case")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.trials <= 0:
        print("error: --trials must be positive", file=sys.stderr)
        return 2
    rng = np.random.default_rng(a.seed)
    print("| scores | pages | slots a page | k | steps, mean | steps, most | fixed bisection |")
    print("|---|---|---|---|---|---|---|")
    for name, scores in SCORES.items():
        for n, page, k in SHAPES:
            counts = []
            for _ in range(a.trials):
                key = order_keys(scores(rng, n))
                cnt = np.full(n, page)
                cnt[-1] = max(1, page // 2)  # the newest page, partly written
                tau, steps = search(key, cnt, k)
                order = np.argsort(-key, kind="stable")
                expect = key[order][np.searchsorted(np.cumsum(cnt[order]), k)]
                if tau != expect:
                    raise AssertionError(f"{name}, {n} pages: tau {tau}, a sort gives {expect}")
                counts.append(steps)
            print(f"| {name} | {n} | {page} | {k} | {np.mean(counts):.1f} | {max(counts)} | "
                  "32 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
