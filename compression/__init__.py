"""Compression methods: how a token budget becomes each method's parameters, and their caches.

The token budget ``t`` means one thing for every method (RocketKV paper Sec. 3.5): key+value
pairs read per decode step, per layer, per KV-head group, approximation traffic included. With
prompt length T, ``max_new_tokens`` m and capacity C = T + m (d = head_dim):

==============  ==============================================================================
method          parameters from t
==============  ==============================================================================
exact_topk      k = t (oracle, scoring not counted)
snapkv          prompt budget P = t - m, per query head P // G (GQA baseline), window 32,
                kernel 7 (avg pooling unless --pooling max)
snapkv_pp       prompt budget P = t - m shared by the group, window 32, max pooling, kernel
                511 if the config has RoPE scaling and T >= 3 * max_seq_len // 8, else 63
                (``snapkv.snapkv_pp_kernel``; --kernel-size overrides)
quest           k = t // 2 tokens (token-level top-k on page-constant bounds),
                page_size = max(16, ceil(C / (t - k))) unless --page-size;
                traffic ceil(C / page_size) + k pairs
sparq           k = t // 2, r = floor(t * d / C) clamped to [1, d]; K also stored dim-major
                (storage 1.5x the full cache, Table 1 counts 2) unless --sparq-strided-keys;
                traffic C r / (2 d) + k pairs (<= t whenever t d / C >= 1)
hybrid          c = C / t, page_size = min(floor(c), ceil(sqrt(c))),
                r = round(d * page_size / c) clamped to [1, d], k = t // 2;
                traffic ceil(C / page_size) r / (2 d) + k pairs
rocketkv        c = T / t; stage 1 SnapKV++ keeps T / sqrt(c) prompt tokens (``sqrt`` split,
                paper v1) or T / c^alpha with alpha = min(0.2 + 0.06 log2 c, 0.8)
                (``adaptive``), kernel as snapkv_pp; stage 2 hybrid on the kept tokens + m
streamingllm    capacity t: sink = 4 (--sink-size) + recent window t - sink (ring buffer)
h2o             capacity t: heavy = int(t * 0.5) (--heavy-ratio) heavy hitters + recent t - heavy
duoattention    t > 640: streaming heads keep 128 sinks + 512 recent, retrieval heads all C;
                the int(N (t - 640) / (C - 640)) KV heads (N over the model) with the largest
                gates retrieve (--duo-threshold: gates above it instead); t <= 640: every head
                streams, sink 128 if t > 256 else int(0.2 t), recent t - sink
                (``eviction.duo_split``; RocketKV App. A.3)
keydiff         keeps t - 1 tokens per KV head (a step reads them + the new one), most distinct
                keys (cosine to the mean key); block-wise prefill of 128 tokens
                (--block-size), so cache memory stays within t - 1 + block slots
omnikv          nothing evicted; filter layers (--filter-layers; default
                ``omnikv.default_filter_layers``) select t - 1 earlier tokens per step
                (--omnikv-selector last|uniform|exponential), later layers read them + the
                new token; layers before the first filter and right after each read all C;
                traffic averaged over layers (``omnikv.omnikv_traffic``); --offload keeps the
                sparse layers' K/V in host memory
==============  ==============================================================================

Quest, SparQ, hybrid and RocketKV report ``traffic_tokens`` (KV pairs read per step per layer
per KV group, approximation included; SparQ's optional mean value vector not counted) and, when
that exceeds t, ``budget_overshoot`` = traffic_tokens / t (> 1): SparQ at t d / C < 1 (r cannot
go below one dimension), hybrid when the released code's rounding of r overshoots, Quest with a
small --page-size. The paper reports these methods at such budgets (e.g. 256 at 96K tokens), so
they run there and say by how much they exceed it.

A budget of at least T + m means nothing needs compressing: the run uses the full cache and the
parameters say so. A budget for which no valid setting exists (k = t // 2 < 1, a prompt budget
not above the observation window) raises ``ConfigError`` naming the smallest valid budget.
``skip_layers`` leaves the first layers uncompressed (LongChat in the paper).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from compression.eviction import (
    H2O_HEAVY_RATIO,
    STREAMING_SINK,
    H2OCache,
    SinkRecentCache,
    duo_retrieval_heads,
    duo_split,
    duo_traffic,
    load_duo_pattern,
)
from compression.keydiff import KEYDIFF_BLOCK, KeyDiffCache
from compression.omnikv import (
    OMNIKV_WINDOW,
    SELECTORS,
    build_omnikv,
    default_filter_layers,
    layer_roles,
    omnikv_traffic,
)
from compression.snapkv import (
    SNAPKV_KERNEL,
    WINDOW,
    snapkv_pp_kernel,
    snapkv_pp_select,
    snapkv_select,
)
from compression.sparse import ExactTopK, Hybrid, Quest, SparQ
from kv_cache import (
    CompressedKVCache,
    FullKVCache,
    KVCache,
    Selector,
    _build_full,
    _build_gptfast_dense,
)
from model import ConfigError, ModelArgs


class BudgetError(ConfigError):
    """A budget the method cannot honour."""


def hybrid_split(capacity: int, t: int, head_dim: int) -> dict[str, Any]:
    """Stage-2 (hybrid attention) parameters, released-code split (RocketKV Sec. 3.4, App. A.3).

    c = capacity / t; page_size = min(floor(c), ceil(sqrt(c))) (at least 1); r = round(d *
    page_size / c) clamped to [1, d]; k = t // 2. c <= 1 means dense attention over the cache.
    Traffic (KV pairs) = ceil(capacity / page_size) * r / (2 d) + k.

    Raises:
        BudgetError: k = t // 2 < 1 (no valid setting).
    """
    c = capacity / t
    if c <= 1:
        return {"c2": c, "page_size": 1, "r": head_dim, "k": capacity, "dense": True,
                "traffic_tokens": float(capacity)}
    if t // 2 < 1:
        raise BudgetError("k = t // 2 rounds to zero")
    page = max(1, min(math.floor(c), math.ceil(math.sqrt(c))))
    r = min(head_dim, max(1, round(head_dim * page / c)))
    k = t // 2
    traffic = math.ceil(capacity / page) * r / (2 * head_dim) + k
    return {"c2": c, "page_size": page, "r": r, "k": k, "dense": False,
            "traffic_tokens": traffic}


def _report_overshoot(p: dict[str, Any], t: int) -> None:
    """Add ``budget_overshoot`` = traffic_tokens / t when the traffic exceeds the budget."""
    if p["traffic_tokens"] > t:
        p["budget_overshoot"] = p["traffic_tokens"] / t


def derive(method: str, t: int, T: int, m: int, args: ModelArgs,
           options: dict[str, Any]) -> dict[str, Any]:
    """Every parameter of ``method`` at budget ``t`` for a prompt of T tokens and m new tokens.

    Formulas: the module docstring's table. Quest, SparQ, hybrid and RocketKV also give
    ``traffic_tokens`` (float, KV pairs read per step per layer per KV group) and, when it
    exceeds t, ``budget_overshoot`` (traffic_tokens / t).

    Raises:
        BudgetError: no valid setting exists at this budget (the reason, without the minimum).
    """
    d, G = args.head_dim, args.group_size
    cap = T + m
    window = options.get("window") or WINDOW
    p: dict[str, Any] = {"budget": t, "compression_ratio": T / t}
    if method in ("snapkv", "snapkv_pp", "rocketkv") and t < window:
        raise BudgetError(f"below the observation window ({window} tokens)")
    if method == "exact_topk":
        p["k"] = t
    elif method in ("snapkv", "snapkv_pp"):
        prompt_budget = t - m
        if prompt_budget <= 0:
            raise BudgetError(f"the prompt budget t - max_new_tokens = {prompt_budget} is not "
                              "positive")
        p.update(window=window, prompt_budget=prompt_budget)
        if method == "snapkv":
            per_head = prompt_budget // G
            if per_head <= window:
                raise BudgetError(f"the per-head prompt budget (t - m) // G = {per_head} does "
                                  f"not exceed the observation window ({window})")
            p.update(per_head_budget=per_head, pooling=options.get("pooling") or "avg",
                     kernel_size=options.get("kernel_size") or SNAPKV_KERNEL,
                     keep=min(T, G * (per_head - window) + window), evict=T > per_head)
        else:
            if prompt_budget <= window:
                raise BudgetError(f"the prompt budget t - m = {prompt_budget} does not exceed "
                                  f"the observation window ({window})")
            p.update(kernel_size=options.get("kernel_size") or snapkv_pp_kernel(args, T),
                     pooling="max", keep=min(T, prompt_budget), evict=T > prompt_budget)
    elif method == "quest":
        k = t // 2
        if k < 1:
            raise BudgetError("k = t // 2 rounds to zero")
        page = options.get("page_size") or max(16, math.ceil(cap / max(1, t - k)))
        pages = math.ceil(cap / page)  # min and max keys: one KV pair's worth each
        p.update(k=k, page_size=page, pages_scored=pages, traffic_tokens=float(pages + k))
        _report_overshoot(p, t)
    elif method == "sparq":
        k = t // 2
        if k < 1:
            raise BudgetError("k = t // 2 rounds to zero")
        r = min(d, max(1, t * d // cap))  # floor: r * C <= t * d, within budget when >= 1
        p.update(k=k, r=r, reallocate=bool(options.get("sparq_reallocate")),
                 dim_major=not options.get("sparq_strided_keys"),
                 traffic_tokens=cap * r / (2 * d) + k)
        _report_overshoot(p, t)
    elif method == "hybrid":
        p.update(hybrid_split(cap, t, d))
        _report_overshoot(p, t)
    elif method == "rocketkv":
        split = options.get("rocket_split") or "sqrt"
        c = T / t
        if split == "sqrt":
            alpha = 0.5
        elif split == "adaptive":
            alpha = min(0.2 + 0.06 * math.log2(c), 0.8) if c > 1 else 0.0
        else:
            raise ConfigError(f"--rocket-split must be sqrt or adaptive, got {split!r}")
        keep = T if c <= 1 else min(T, round(T / c ** alpha))
        if keep < T and keep <= window:
            raise BudgetError(f"stage 1 would keep {keep} tokens, not more than the "
                              f"observation window ({window})")
        p.update(split=split, alpha=alpha, c1=T / keep, window=window, keep=keep,
                 evict=keep < T, pooling="max",
                 kernel_size=options.get("kernel_size") or snapkv_pp_kernel(args, T))
        p.update(hybrid_split(keep + m, t, d))
        _report_overshoot(p, t)
    elif method == "streamingllm":
        sink = STREAMING_SINK if options.get("sink_size") is None else options["sink_size"]
        if t <= sink:
            raise BudgetError(f"no room for a recent window beside {sink} sink tokens")
        p.update(sink=sink, recent=t - sink, capacity=t, traffic_tokens=float(t))
    elif method == "h2o":
        ratio = options.get("heavy_ratio") or H2O_HEAVY_RATIO
        heavy = int(t * ratio)
        if heavy < 1 or t - heavy < 1:
            raise BudgetError(f"{heavy} heavy hitters and {t - heavy} recent tokens (each "
                              "needs at least one)")
        p.update(heavy=heavy, recent=t - heavy, heavy_ratio=ratio, capacity=t,
                 traffic_tokens=float(t))
    elif method == "duoattention":
        N = args.n_layers * args.n_kv_heads
        p.update(duo_split(t, cap, N, options.get("duo_threshold")))
        if p["retrieval_heads"] is not None:
            p["traffic_tokens"] = duo_traffic(p["retrieval_heads"], N, cap, p["sink"],
                                              p["recent"])
    elif method == "keydiff":
        if t < 2:
            raise BudgetError("keydiff keeps t - 1 tokens beside the new one: t must be >= 2")
        block = options.get("block_size") or KEYDIFF_BLOCK
        p.update(capacity=t - 1, block_size=block, cache_slots=t - 1 + block,
                 traffic_tokens=float(t))
    elif method == "omnikv":
        if t < 2:
            raise BudgetError("omnikv selects t - 1 tokens beside the new one: t must be >= 2")
        layers = options.get("filter_layers")
        layers = list(layers) if layers else default_filter_layers(args.n_layers)
        if any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 or \
                layers[-1] >= args.n_layers:
            raise ConfigError(f"--filter-layers must be increasing layer indices in [0, "
                              f"{args.n_layers - 1}], got {layers}")
        roles = layer_roles(args.n_layers, layers)
        selector = options.get("omnikv_selector") or "last"
        if selector not in SELECTORS:
            raise ConfigError(f"--omnikv-selector must be one of {', '.join(SELECTORS)}, got "
                              f"{selector!r}")
        p.update(filter_layers=layers, sparse_layers=roles.count("sparse"),
                 k_select=t - 1, selector=selector,
                 selector_window=1 if selector == "last" else OMNIKV_WINDOW,
                 offload=bool(options.get("offload")),
                 traffic_tokens=omnikv_traffic(roles, cap, t))
        if not roles.count("sparse"):
            p["note"] = ("no sparse layer: every layer attends fully (the filter layers and "
                         "the layers after them leave none)")
        _report_overshoot(p, t)
    else:
        raise ConfigError(f"unknown method {method!r}")
    return p


def smallest_budget(method: str, T: int, m: int, args: ModelArgs, options: dict) -> int | None:
    """The smallest budget ``derive`` accepts (None if none below the whole sequence)."""
    for t in range(1, T + m):
        try:
            derive(method, t, T, m, args, options)
            return t
        except BudgetError:
            continue
    return None


def _selector(method: str, p: dict[str, Any]) -> Selector:
    if method == "exact_topk":
        return ExactTopK(p["k"])
    if method == "quest":
        return Quest(p["page_size"], p["k"])
    if method == "sparq":
        return SparQ(p["r"], p["k"], p["reallocate"], p["dim_major"])
    if method in ("hybrid", "rocketkv") and not p["dense"]:
        return Hybrid(p["page_size"], p["r"], p["k"])
    return Selector()  # dense over what is kept (SnapKV family; stage 2 within budget)


def _evictor(method: str, p: dict[str, Any]) -> Callable | None:
    if not p.get("evict"):
        return None
    window, kernel, keep = p["window"], p["kernel_size"], p["keep"]
    if method == "snapkv":
        per_head, pooling = p["per_head_budget"], p["pooling"]
        return lambda q, k: snapkv_select(q, k, keep, per_head, window, kernel, pooling)
    return lambda q, k: (snapkv_pp_select(q, k, keep, window, kernel), None)


# the method options (besides skip_layers, which every compressed method takes) each method reads
OPTIONS_BY_METHOD: dict[str, tuple[str, ...]] = {
    "exact_topk": (), "snapkv": ("kernel_size", "pooling", "window"),
    "snapkv_pp": ("kernel_size", "window"), "quest": ("page_size",),
    "sparq": ("sparq_reallocate", "sparq_strided_keys"), "hybrid": (),
    "rocketkv": ("kernel_size", "window", "rocket_split"),
    "streamingllm": ("sink_size",), "h2o": ("heavy_ratio",),
    "duoattention": ("duo_patterns", "duo_threshold"),
    "keydiff": ("block_size",), "omnikv": ("filter_layers", "omnikv_selector", "offload"),
}

NEEDS_ATTENTION_SUMS = ("h2o",)  # methods whose caches need prefill_once(attention_sums=True)


def check_options(method: str, options: dict[str, Any]) -> None:
    """ConfigError naming an option that ``method`` does not read (given: not None/False).

    Raises:
        ConfigError: e.g. ``--rocket-split`` with ``quest``; the message lists what the
            method takes.
    """
    taken = OPTIONS_BY_METHOD.get(method, ())
    for name, value in options.items():
        if value is not None and value is not False and name not in taken:
            flags = ", ".join(f"--{o.replace('_', '-')}" for o in (*taken, "skip_layers"))
            raise ConfigError(f"--{name.replace('_', '-')} does not apply to method {method} "
                              f"(its options: {flags})")


def build_method(method: str, args: ModelArgs, *, batch_size: int, prompt_len: int,
                 max_new_tokens: int, budget: int | None, dtype: torch.dtype, device,
                 skip_layers: int = 0, **options) -> list[KVCache]:
    """Caches of ``method`` for every layer (the first ``skip_layers`` stay uncompressed).

    Raises:
        ConfigError: missing budget, a budget too small (naming the smallest valid one), or a
            bad option.
    """
    T, m = prompt_len, max_new_tokens
    if budget is None:
        raise ConfigError(f"method {method} needs --budget (tokens per decode step)")
    check_options(method, options)
    if not 0 <= skip_layers <= args.n_layers:
        raise ConfigError(f"--skip-layers must lie in [0, {args.n_layers}], got {skip_layers}")
    for name in ("kernel_size", "page_size", "window", "block_size"):
        if options.get(name) is not None and options[name] <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if options.get("kernel_size") is not None and options["kernel_size"] % 2 == 0:
        raise ConfigError("--kernel-size must be odd (pooling keeps the sequence length)")
    if options.get("sink_size") is not None and options["sink_size"] < 0:
        raise ConfigError(f"--sink-size must not be negative, got {options['sink_size']}")
    if options.get("heavy_ratio") is not None and not 0 < options["heavy_ratio"] < 1:
        raise ConfigError(f"--heavy-ratio must lie strictly between 0 and 1, got "
                          f"{options['heavy_ratio']}")

    def full(i: int, note: str) -> FullKVCache:
        return FullKVCache(i, args, batch_size, dtype, device, T + m,
                           params={"compressed": False, "note": note})

    if budget >= T + m:
        note = (f"budget {budget} >= the whole sequence ({T} prompt + {m} new tokens): "
                "no compression")
        return [full(i, note) for i in range(args.n_layers)]
    try:
        p = derive(method, budget, T, m, args, options)
    except BudgetError as e:
        t_min = smallest_budget(method, T, m, args, options)
        hint = (f"the smallest valid budget here is {t_min}" if t_min is not None else
                f"the smallest valid budget here is {T + m} (the whole sequence, uncompressed)")
        raise ConfigError(f"{method}: budget {budget} is too small: {e}; {hint} (prompt {T} "
                          f"tokens, max_new_tokens {m})") from None
    p.update(method=method, skip_layers=skip_layers, compressed=True)
    if method == "omnikv":
        if skip_layers:
            raise ConfigError("omnikv takes no --skip-layers: the layers before the first "
                              "filter layer attend fully (--filter-layers)")
        return build_omnikv(args, batch_size=batch_size, prompt_len=T, max_new_tokens=m,
                            budget=budget, dtype=dtype, device=device,
                            filter_layers=p["filter_layers"], selector=p["selector"],
                            offload=p["offload"], params=p)
    heads = [[] for _ in range(args.n_layers)]  # DuoAttention's retrieval heads per layer
    if method == "duoattention":
        heads = _duo_heads(p, args, T + m, budget, options)
    caches: list[KVCache] = []
    for i in range(args.n_layers):
        if i < skip_layers:
            caches.append(full(i, "layer skipped (--skip-layers)"))
            continue
        params = {k: v for k, v in p.items() if k not in ("evict", "dense", "needs_pattern")}
        if method in ("streamingllm", "duoattention"):
            caches.append(SinkRecentCache(
                i, args, batch_size, dtype, device, prompt_len=T, max_new_tokens=m,
                sink=p["sink"], recent=p["recent"], retrieval_heads=heads[i],
                params={**params, "layer_retrieval_heads": heads[i]}
                if method == "duoattention" else params))
            continue
        if method == "keydiff":
            caches.append(KeyDiffCache(i, args, batch_size, dtype, device, prompt_len=T,
                                       max_new_tokens=m, capacity=p["capacity"],
                                       block=p["block_size"], params=params))
            continue
        if method == "h2o":
            caches.append(H2OCache(i, args, batch_size, dtype, device, prompt_len=T,
                                   max_new_tokens=m, heavy=p["heavy"], recent=p["recent"],
                                   params=params))
            continue
        caches.append(CompressedKVCache(
            i, args, batch_size, dtype, device, prompt_len=T,
            prompt_capacity=p.get("keep", T), max_new_tokens=m, selector=_selector(method, p),
            evict=_evictor(method, p), per_head=method == "snapkv" and bool(p.get("evict")),
            obs_window=p.get("window", 0), params=params))
    return caches


def _duo_heads(p: dict[str, Any], args: ModelArgs, capacity: int, t: int,
               options: dict[str, Any]) -> list[list[int]]:
    """DuoAttention's retrieval KV heads per layer from ``--duo-patterns``; completes ``p``
    (``retrieval_heads``, ``traffic_tokens``, ``budget_overshoot`` when over t).

    Raises:
        ConfigError: the budget needs retrieval heads and no pattern was given, or a bad
            pattern file (``load_duo_pattern``).
    """
    path = options.get("duo_patterns")
    if not p["needs_pattern"]:
        if path is not None:
            p["note"] = f"--duo-patterns unused: at budget {t} every head streams"
        return [[] for _ in range(args.n_layers)]
    if path is None:
        raise ConfigError(f"duoattention at budget {t} (above {p['sink'] + p['recent']} "
                          f"tokens) keeps {p['retrieval_heads']} retrieval heads and needs "
                          "their gates: --duo-patterns PATH (a TSV of layers x KV heads; "
                          "scripts/duo_identify.py makes one for any model)")
    gates = load_duo_pattern(path, args)
    heads = duo_retrieval_heads(gates, p["retrieval_heads"], options.get("duo_threshold"))
    n_ret = sum(len(h) for h in heads)
    N = args.n_layers * args.n_kv_heads
    p.update(retrieval_heads=n_ret, retrieval_share=n_ret / N, duo_patterns=str(path),
             traffic_tokens=duo_traffic(n_ret, N, capacity, p["sink"], p["recent"]))
    _report_overshoot(p, t)
    return heads


# method name -> (one-line description for --help, factory building one cache per layer)
METHODS: dict[str, tuple[str, Callable[..., list[KVCache]]]] = {
    "full": ("Full-KV: every token cached and read at every step (no budget)", _build_full),
    "gptfast_dense": ("benchmark baseline: Full-KV decoded as gpt-fast did (repeated K/V, math "
                      "SDPA, max_seq^2 mask)", _build_gptfast_dense),
}


UNBUDGETED = ("full", "gptfast_dense")  # methods that take no token budget


def check_methods(names: list[str]) -> None:
    """Raises ConfigError naming every name in ``names`` that is not a method of ``METHODS``."""
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown methods {', '.join(unknown)}; known: {', '.join(METHODS)}")


def build_caches(method: str, args: ModelArgs, *, batch_size: int, prompt_len: int,
                 max_new_tokens: int, budget: int | None, dtype: torch.dtype, device,
                 **options) -> list[KVCache]:
    """One cache per layer for ``method``.

    Args:
        method: a key of ``METHODS``.
        prompt_len, max_new_tokens: tokens; static buffers are sized from them.
        budget: token budget (KV pairs read per decode step per layer per KV group), or None.
        options: method-specific settings.
    Raises:
        ConfigError: unknown method, or a budget that is not a positive integer.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if budget is not None and budget <= 0:
        raise ConfigError(f"--budget must be a positive number of tokens, got {budget}")
    return METHODS[method][1](args, batch_size=batch_size, prompt_len=prompt_len,
                              max_new_tokens=max_new_tokens, budget=budget, dtype=dtype,
                              device=device, **options)


_DESCRIPTIONS = {
    "exact_topk": "oracle top-k on exact attention scores (k = t), exact attention over them",
    "snapkv": "SnapKV: per-head observation-window voting evicts prompt tokens (budget t - m)",
    "snapkv_pp": "SnapKV++: group-shared voting, adaptive max-pool kernel (RocketKV Alg. 1)",
    "quest": "Quest: page min/max bounds rank tokens, exact attention over the top t/2",
    "sparq": "SparQ: top-r query dims approximate scores, top-k exact attention (t/2 + t/2)",
    "hybrid": "hybrid attention (RocketKV Alg. 2) on the full cache (t/2 + t/2)",
    "rocketkv": "RocketKV: SnapKV++ at prefill, then hybrid attention at every decode step",
    "streamingllm": "StreamingLLM: attention sinks + a recent window (ring buffer), budget t",
    "h2o": "H2O: heavy hitters (accumulated attention) + recent tokens, evicting every step",
    "duoattention": "DuoAttention: retrieval heads keep everything, streaming heads sinks + "
                    "recent (--duo-patterns)",
    "keydiff": "KeyDiff: keeps the most distinct keys (cosine to the mean key), block-wise "
               "prefill within t + block slots",
    "omnikv": "OmniKV: filter layers select t - 1 tokens for the layers after them, nothing "
              "evicted (--offload: host memory)",
}


def _factory(method: str) -> Callable[..., list[KVCache]]:
    return lambda args, **kw: build_method(method, args, **kw)


for _name, _desc in _DESCRIPTIONS.items():
    METHODS[_name] = (_desc, _factory(_name))
