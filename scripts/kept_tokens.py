"""Which prompt tokens an evicting method keeps at the end of prefill, on needle prompts.

    python scripts/kept_tokens.py \\
        --checkpoint ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --methods keydiff h2o snapkv_pp streamingllm --budgets 128 256 512 --lengths 2048 \\
        --depths 5 --needles 1 --out results/accuracy/keydiff_omnikv

The prompts are ``eval_needle.py``'s (same generator, seed and split; the question after the
document, the standard mode). For each method and budget, every layer's cache is built from
one prefill of the prompt (KeyDiff, whose prefill is block-wise, prefills itself) and asked
which prompt positions each KV head holds: ``read_positions`` for caches that evict inside a
capacity (KeyDiff, H2O, StreamingLLM, DuoAttention), the eviction's own selection for the
SnapKV family (recomputed from the recorded queries, as the fidelity probe does); methods that
drop nothing (OmniKV, Quest, SparQ, hybrid, Exact-TopK) keep every position. Reported,
averaged over layers, KV heads and prompts (shares in %):

* ``needle``: of the needle sentence's tokens;
* ``sinks``: of the first 4 prompt positions;
* ``recent``: of the last 32 prompt positions (the question and the chat template's end);
* ``overall``: of all prompt positions (what keeping tokens at random would give everywhere).

Writes ``DIR/kept.json`` and ``DIR/kept.md``; the table goes to stdout. Bad input: one
``error: ...`` line, exit 2.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from compression import OPTIONS_BY_METHOD, UNBUDGETED  # noqa: E402
from compression.omnikv import OmniKVSparseCache  # noqa: E402
from generate import generate, prefill_once  # noqa: E402
from kv_cache import CompressedKVCache  # noqa: E402
from model import ConfigError  # noqa: E402
from scripts.eval_common import check_common, load, method_options, write_outputs  # noqa: E402
from scripts.eval_needle import (  # noqa: E402
    Haystack,
    build_items,
    build_parser,
    depth_grid,
    needle_fact,
    read_texts,
)

SINKS, RECENT = 4, 32


def kept_positions(cache, pre, layer: int, T: int) -> Tensor:
    """(B, H_kv, T) bool: the prompt positions ``cache`` holds after prefill.

    Raises:
        ConfigError: a cache that cannot say (no eviction state to read).
    """
    B, Hkv = pre.k[layer].shape[:2]
    out = torch.zeros(B, Hkv, T, dtype=torch.bool)
    if isinstance(cache, CompressedKVCache | OmniKVSparseCache):
        if not isinstance(cache, CompressedKVCache) or cache.evict is None:  # nothing dropped
            out[:] = True
            return out
        q_obs = pre.q_obs[layer]
        idx, _ = cache.evict(q_obs[:, :, q_obs.shape[2] - min(cache.obs_window,
                                                              q_obs.shape[2]):], pre.k[layer])
        return out.scatter_(-1, idx.cpu(), True)
    if not hasattr(cache, "read_positions"):
        if getattr(cache, "max_seq_len", 0) >= T:  # a full cache (a layer left uncompressed)
            out[:] = True
            return out
        raise ConfigError(f"{type(cache).__name__} does not say which positions it keeps")
    pos = cache.read_positions(T - 1).cpu()  # (B, H_kv, n), -1 empty
    valid = (pos >= 0) & (pos < T)
    return out.scatter_(-1, pos.clamp(min=0, max=T - 1), valid)


def find(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Start of the first occurrence of ``sub`` in ``seq``."""
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if list(seq[i:i + n]) == list(sub):
            return i
    raise ValueError("needle not found in the prompt")


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    p.description = __doc__.split("\n\n")[0]
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_common(args)
        texts = read_texts(args.text)
        model, tok, _ = load(args)
        depths = depth_grid(args.depths)
        items = build_items(tok, Haystack(tok, texts), args.lengths, depths, args.needles,
                            args.seed, args.split)
        if args.limit:
            items = items[:args.limit]
        methods = [m for m in dict.fromkeys(args.methods) if m not in UNBUDGETED]
        budgets = list(dict.fromkeys(args.budgets))
        options = method_options(args)
        sums: dict[tuple[str, int], dict[str, float]] = {}
        errors: dict[tuple[str, int], str] = {}
        for it in items:
            ids = it.doc_ids + it.question_ids
            T = len(ids)
            needle = tok.encode(" " + needle_fact(it.meta["seed"])["needle"], bos=False)
            at = find(ids, needle)
            parts = {"needle": slice(at, at + len(needle)), "sinks": slice(0, SINKS),
                     "recent": slice(T - RECENT, T), "overall": slice(0, T)}
            pre = prefill_once(model, ids, attention_sums="h2o" in methods)
            for method in methods:
                for budget in budgets:
                    if (method, budget) in errors:
                        continue
                    opts = {k: v for k, v in options.items()
                            if k == "skip_layers" or k in OPTIONS_BY_METHOD[method]}
                    try:
                        generate(model, ids, method=method, budget=budget, max_new_tokens=0,
                                 method_options=opts, prefilled=pre)
                        masks = [kept_positions(c, pre, i, T)
                                 for i, c in enumerate(model.caches)]
                    except ConfigError as e:
                        errors[(method, budget)] = str(e)
                        continue
                    kept = torch.stack(masks).float()  # (L, B, H_kv, T)
                    acc = sums.setdefault((method, budget), {"n": 0})
                    for name, sl in parts.items():
                        acc[name] = acc.get(name, 0.0) + float(kept[..., sl].mean())
                    acc["n"] += 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for method in methods:
        for budget in budgets:
            if (method, budget) in errors:
                rows.append({"method": method, "budget": budget,
                             "error": errors[(method, budget)]})
                continue
            acc = sums[(method, budget)]
            rows.append({"method": method, "budget": budget, "prompts": acc["n"],
                         **{k: 100 * acc[k] / acc["n"]
                            for k in ("needle", "sinks", "recent", "overall")}})
    lines = ["| method | budget | needle | sinks | recent | overall |", "|---" * 6 + "|"]
    for r in rows:
        cells = ["n/a"] * 4 if "error" in r else \
            [f"{r[k]:.1f}" for k in ("needle", "sinks", "recent", "overall")]
        lines.append(f"| {r['method']} | {r['budget']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    result = {"task": "kept_tokens", "checkpoint": args.checkpoint, "split": args.split,
              "seed": args.seed, "lengths": args.lengths, "depths": depths,
              "needles": args.needles, "method_options": options, "rows": rows,
              "sinks": SINKS, "recent": RECENT, "runtime_s": time.perf_counter() - t0,
              "torch_version": torch.__version__, "threads": torch.get_num_threads()}
    if args.out:
        write_outputs(args.out, "kept", result, table, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
