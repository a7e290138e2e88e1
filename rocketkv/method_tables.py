"""The method registry as data, for parsers built before torch loads (``flags.py``).

Generated from ``rocketkv.compression``'s registry by ``python -m rocketkv.compression
--update-docs``: do not edit by hand (tests/test_entry_points.py fails while it differs).
"""

# (name, description), in the registry's order (--method's choices and --help's list)
METHOD_TABLE: tuple[tuple[str, str], ...] = (
    ("full",
     "Full-KV: every token cached and read at every step (no budget)"),
    ("gptfast_dense",
     "benchmark baseline: Full-KV decoded as gpt-fast did (repeated K/V, math SDPA, max_seq^2 "
     "mask)"),
    ("exact_topk",
     "oracle top-k on exact attention scores (k = t), exact attention over them"),
    ("snapkv",
     "SnapKV: per-head observation-window voting; each query head keeps t // G prompt tokens, "
     "evicting more as the answer grows"),
    ("snapkv_pp",
     "SnapKV++: group-shared voting, adaptive max-pool kernel (RocketKV Alg. 1)"),
    ("quest",
     "Quest: page min/max bounds rank tokens, exact attention over the top t/2"),
    ("sparq",
     "SparQ: top-r query dims approximate scores, top-k exact attention (t/2 + t/2)"),
    ("hybrid",
     "hybrid attention (RocketKV Alg. 2) on the full cache (t/2 + t/2)"),
    ("rocketkv",
     "RocketKV: SnapKV++ at prefill, then hybrid attention at every decode step"),
    ("streamingllm",
     "StreamingLLM: attention sinks + a recent window (ring buffer), budget t"),
    ("h2o",
     "H2O: heavy hitters (accumulated attention) + recent tokens, evicting every step"),
    ("duoattention",
     "DuoAttention: retrieval heads keep everything, streaming heads sinks + recent "
     "(--duo-patterns)"),
    ("keydiff",
     "KeyDiff: keeps the most distinct keys (cosine to the mean key), block-wise prefill "
     "within t + block slots"),
    ("omnikv",
     "OmniKV: filter layers select t - 1 tokens for the layers after them, nothing evicted "
     "(--offload: host memory)"),
)

# (name, argparse type name or None for a switch, choices, metavar, help)
METHOD_OPTIONS: tuple[tuple[str, str | None, tuple[str, ...] | None, str | None, str], ...] = (
    ("kernel_size", "int", None, None,
     "SnapKV/SnapKV++/RocketKV pooling kernel (odd; default 7 for snapkv, 63/511 by prompt "
     "length for snapkv_pp and rocketkv)"),
    ("pooling", "str", ("avg", "max"), None,
     "snapkv pooling (default avg)"),
    ("window", "int", None, None,
     "observation window in tokens (default 32)"),
    ("page_size", "int", None, None,
     "quest page size (default max(16, tokens / (budget / 2)))"),
    ("sparq_reallocate", None, None, None,
     "sparq: mix in the mean value by the unselected probability mass"),
    ("sparq_strided_keys", None, None, None,
     "sparq: no dim-major copy of K (storage 1x instead of 1.5x the full cache); the r dims "
     "are then a strided read of every key row"),
    ("rocket_split", "str", ("sqrt", "adaptive"), None,
     "RocketKV budget split between stages (default sqrt: paper v1)"),
    ("sink_size", "int", None, None,
     "streamingllm: attention sinks kept (default 4)"),
    ("heavy_ratio", "float", None, None,
     "h2o: share of the budget for heavy hitters (default 0.5)"),
    ("duo_patterns", "str", None, "PATH",
     "duoattention: head gates, a TSV (layers x KV heads) or a directory with "
     "full_attention_heads.tsv; needed above a 640-token budget (default: the one in patterns/"
     " made for the model, if any)"),
    ("duo_threshold", "float", None, None,
     "duoattention: gates above this retrieve (the pattern's own split, DuoAttention deploys "
     "0.5); default: the budget sets the share"),
    ("block_size", "int", None, None,
     "keydiff: prompt tokens per prefill block (default 128); cache memory stays within budget"
     " + block"),
    ("filter_layers", "layer_list", None, "L1,L2,...",
     "omnikv: filter layers (default: the paper's 2,8,18 for 32 layers, scaled to other "
     "depths)"),
    ("omnikv_selector", "str", ("last", "uniform", "exponential"), None,
     "omnikv: context selector over its observation window (default last)"),
    ("offload", None, None, None,
     "omnikv: keep the sparse layers' K/V in host memory (runs eagerly)"),
    ("skip_layers", "int", None, None,
     "leave the first N layers uncompressed (the paper: 2 for LongChat)"),
)
