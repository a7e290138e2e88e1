"""Which accuracy cells did making parameters follow the cache (commit 2c99e07) change?

    python scripts/affected_cells.py results/accuracy/qwen2.5-coder-0.5b-rerun/*/ruler.json \\
        results/accuracy/qwen2.5-coder-0.5b-rerun/*/needle*.json

Before that commit a method derived its parameters once from the prompt plus the tokens asked
for (T + m); since, from the tokens in its cache at each decode step (``decode_horizon``,
``Method.at_length``). For each result file's prompts (their T and m) and each (method, budget)
row, a prompt's answer is unchanged when every decode step (cache lengths kept + 1 .. kept +
m - 1) has the same selection parameters under both rules: quest, sparq, hybrid and rocketkv
compare (page size, r, k, dense); duoattention its number of retrieval heads; snapkv and
snapkv_pp keep other prompt tokens under the new rule whenever they evict (always changed then);
every other method derives nothing from m. Prints,
per file and row, how many prompts' answers the change can have moved.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.compression import METHODS, derive
from rocketkv.compression.duoattention import duo_split, first_capacity
from rocketkv.compression.hybrid import hybrid_split
from rocketkv.model import ModelArgs

RETUNED = ("quest", "sparq", "hybrid", "rocketkv")


def old_params(method: str, t: int, T: int, m: int, args: ModelArgs) -> tuple | None:
    """(page, r, k, dense) under the rule before 2c99e07 (C = T + m; RocketKV: keep + m)."""
    d = args.head_dim
    if t >= T + m:
        return None  # the full cache
    if method == "quest":
        k = t // 2
        page = max(16, math.ceil((T + m) / max(1, t - k)))
        return (page, None, k, False)
    if method == "sparq":
        return (None, min(d, max(1, t * d // (T + m))), t // 2, False)
    keep = derive(method, t, T, args, {}).keep if method == "rocketkv" else T
    s = hybrid_split(min(T, keep) + m, t, d)
    return (s.page_size, s.r if not s.dense else None, s.k if not s.dense else None, s.dense)


def new_params(p) -> tuple:
    page = getattr(p, "page_size", None)
    r = getattr(p, "r", None)
    if p.dense:
        return (page if p.method != "quest" else p.page_size, None, None, True)
    return (page, r, p.k, False)


def changed(method: str, t: int, T: int, m: int, args: ModelArgs) -> bool:
    if method == "duoattention":  # retrieval heads from C = T + m before, T + 1 rounded now
        N = args.n_layers * args.n_kv_heads
        return duo_split(t, T + m, N)["retrieval_heads"] != \
            duo_split(t, first_capacity(T), N)["retrieval_heads"]
    if method in ("snapkv", "snapkv_pp"):
        return T > t - m  # evicting under either rule: other prompt tokens kept
    if method not in RETUNED or t >= T + m:
        return False
    base = derive(method, t, T, args, {}).replace(method=method)
    kept = min(T, getattr(base, "keep", T)) if method == "rocketkv" else T
    before = old_params(method, t, T, m, args)
    for n in range(kept + 1, kept + m):  # every decode step's cache length
        p, _ = METHODS[method].at_length(base, n, args)
        now = new_params(p)
        if now[3] or before[3]:
            if now[3] != before[3]:
                return True
            continue
        if method == "sparq" and now[1:3] != before[1:3]:
            return True
        if method != "sparq" and now[:3] != before[:3]:
            return True
    return False


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="needle.json / ruler.json result files")
    p.add_argument("--config", default="qwen2.5-0.5b",
                   help="the model's config name (default qwen2.5-0.5b; smollm2-135m)")
    opts = p.parse_args(argv)
    args = ModelArgs.from_name(opts.config)
    for path in opts.results:
        d = json.load(open(path))
        items = d["items"]
        print(f"{path}: {len(items)} prompts")
        for row in d["rows"]:
            method, t = row["method"], row["budget"]
            if t is None:
                continue
            n = sum(changed(method, t, it["tokens"],
                            it.get("max_new_tokens", d.get("max_new_tokens")), args)
                    for it in items)
            print(f"  {method:>12} @{t}: {n} of {len(items)} prompts' parameters changed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
