"""RocketKV (Behnam et al. 2025): SnapKV++ at the end of prefill, then hybrid sparse attention.

Stage 1 (Sec. 3.3, Alg. 1) evicts prompt tokens with SnapKV++ (``snapkv_pp.py``); stage 2
(Sec. 3.4, Alg. 2) runs hybrid attention (``hybrid.py``) over the kept tokens and the generated
ones at every decode step.

Token budget ``t`` (Sec. 3.5): with prompt length T, compression ratio c = T / t is split
between the stages. Stage 1 keeps T / c^alpha prompt tokens: alpha = 1/2 (``sqrt``, the paper's
v1 split, the default) or alpha = min(0.2 + 0.06 log2 c, 0.8) (``adaptive``,
``--rocket-split``); the SnapKV++ kernel follows ``snapkv_pp.snapkv_pp_kernel``. Stage 2 is
hybrid attention at budget t over the kept tokens and the answer so far (``hybrid.hybrid_at``:
its parameters follow the cache's length, never the number of tokens asked for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rocketkv.compression.hybrid import (
    HybridSplit,
    hybrid_params_at,
    hybrid_selector,
    hybrid_start,
    split_fields,
)
from rocketkv.compression.registry import BudgetError, CompressedMethod, Option, Params, register
from rocketkv.compression.snapkv import KERNEL_SIZE, WINDOW_OPTION, observation_window
from rocketkv.compression.snapkv_pp import SnapKVPPEviction, snapkv_pp_evictor, snapkv_pp_kernel

SPLITS = ("sqrt", "adaptive")
ROCKET_SPLIT = Option("rocket_split", "RocketKV budget split between stages (default sqrt: "
                      "paper v1)", type=str, choices=SPLITS)


def stage1_alpha(split: str, c: float) -> float:
    """The exponent alpha of stage 1's share T / c^alpha for compression ratio c = T / t."""
    if split == "sqrt":
        return 0.5
    return min(0.2 + 0.06 * math.log2(c), 0.8) if c > 1 else 0.0


@dataclass(frozen=True, kw_only=True)
class RocketKVParams(SnapKVPPEviction, HybridSplit, Params):
    """RocketKV at budget t: stage 1 SnapKV++ keeps ``keep`` = T / c1 prompt tokens (``split``,
    exponent ``alpha``); stage 2 is hybrid attention (``HybridSplit``) over them and the new
    tokens."""

    split: str
    alpha: float
    c1: float


@register
class RocketKVMethod(CompressedMethod):
    name = "rocketkv"
    description = "RocketKV: SnapKV++ at prefill, then hybrid attention at every decode step"
    budget_rule = ("c = T / t; stage 1 keeps T / sqrt(c) tokens (`--rocket-split sqrt`) or T / "
                   "c^alpha, alpha = min(0.2 + 0.06 log2 c, 0.8) (`adaptive`); stage 2 as hybrid "
                   "on the kept tokens and the answer so far")
    options = (KERNEL_SIZE, WINDOW_OPTION, ROCKET_SPLIT)
    source = "RocketKV Sec. 3.3-3.5, Alg. 1-2, App. A.3"

    def derive(self, budget, prompt_len, args, options):
        window = observation_window(budget, options)
        split = options.get("rocket_split") or "sqrt"
        T, c = prompt_len, prompt_len / budget
        alpha = stage1_alpha(split, c)
        keep = T if c <= 1 else min(T, round(T / c ** alpha))
        if keep < T and keep <= window:
            raise BudgetError(f"stage 1 would keep {keep} tokens, not more than the "
                              f"observation window ({window})")
        return RocketKVParams(
            budget=budget, compression_ratio=c, split=split, alpha=alpha, c1=T / keep,
            window=window, keep=keep, evict=keep < T, pooling="max",
            kernel_size=options.get("kernel_size") or snapkv_pp_kernel(args, T),
            **split_fields(hybrid_start(keep, budget, args.head_dim)))

    def at_length(self, params, length, args):
        return hybrid_params_at(params, length, args)

    def evictor(self, params):
        return snapkv_pp_evictor(params)

    def selector(self, params):
        return hybrid_selector(params)
