"""Which prompt tokens an evicting method keeps at the end of prefill, on needle prompts.

    python scripts/kept_tokens.py \\
        --checkpoint ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --methods keydiff h2o snapkv_pp streamingllm --budgets 128 256 512 --context 2048 \\
        --depths 5 --needles 1 --out results/accuracy/keydiff_omnikv

The prompts are ``scripts/eval_needle.py``'s (``evals/needle.py``: same generator, seed and
split; the question after the document, the standard mode). For each method and budget, every
layer's cache is built from one prefill of the prompt (KeyDiff, whose prefill is block-wise,
prefills itself) and asked which prompt positions each KV head holds
(``evals.probes.kept_positions``): ``read_positions`` for caches that evict inside a capacity
(KeyDiff, H2O, StreamingLLM, DuoAttention), the eviction's own selection for the SnapKV family
(recomputed from the recorded queries, as the fidelity probe does); methods that drop nothing
(OmniKV, Quest, SparQ, hybrid, Exact-TopK) keep every position. Reported,
averaged over layers, KV heads and prompts (shares in %):

* ``needle``: of the needle sentence's tokens;
* ``sinks``: of the first 4 prompt positions;
* ``recent``: of the last 32 prompt positions (the question and the chat template's end);
* ``overall``: of all prompt positions (what keeping tokens at random would give everywhere).

Writes ``DIR/kept.json`` and ``DIR/kept.md``; the table goes to stdout. Bad input: one
``error: ...`` line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)
import torch

from rocketkv.cli.common import OneLineParser, rows_exit_status
from rocketkv.compression import METHODS, given_options, needs_attention_sums, options_for
from rocketkv.engine.generate import CacheRequest, generate
from rocketkv.engine.prefill import prefill_once
from rocketkv.evals.harness import (
    add_common_args,
    check_common,
    load,
    progress_bar,
    run_configurations,
)
from rocketkv.evals.needle import Haystack, add_needle_args, build_items, depth_grid, needle_fact
from rocketkv.evals.probes import kept_positions
from rocketkv.evals.prompts import read_texts
from rocketkv.evals.reports import kept_table, write_outputs
from rocketkv.model import ConfigError

SINKS, RECENT = 4, 32


def build_parser() -> argparse.ArgumentParser:
    """``scripts/eval_needle.py``'s flags: the same prompts (most of its other flags go
    unused)."""
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, "accuracy")
    add_needle_args(p)
    return p


def find(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Start of the first occurrence of ``sub`` in ``seq``."""
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if list(seq[i:i + n]) == list(sub):
            return i
    raise ValueError("needle not found in the prompt")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_common(args)
        texts = read_texts(args.text)
        model, tok, _ = load(args)
        depths = depth_grid(args.depths)
        items = build_items(tok, Haystack(tok, texts), args.context, depths, args.needles,
                            args.seed, args.split)
        if args.limit:
            items = items[:args.limit]
        pairs = [(m, b) for m, b in run_configurations(args)[0] if METHODS[m].budgeted]
        options = given_options(args)
        sums: dict[tuple[str, int], dict[str, float]] = {}
        errors: dict[tuple[str, int], str] = {}
        bar = progress_bar(len(items) * len(pairs), enabled=not args.no_progress,
                           desc="kept tokens")
        for it in items:
            ids = it.doc_ids + it.question_ids
            T = len(ids)
            needle = tok.encode(" " + needle_fact(it.meta["seed"])["needle"], bos=False)
            at = find(ids, needle)
            parts = {"needle": slice(at, at + len(needle)), "sinks": slice(0, SINKS),
                     "recent": slice(T - RECENT, T), "overall": slice(0, T)}
            pre = prefill_once(model, ids,
                               attention_sums=needs_attention_sums(m for m, _ in pairs))
            for method, budget in pairs:
                if bar is not None:
                    bar.update()
                if (method, budget) in errors:
                    continue
                opts = options_for(method, options)
                try:
                    generate(model, ids, CacheRequest(method, budget, options=opts),
                             max_new_tokens=0, prefilled=pre)
                    masks = [kept_positions(c, pre, i, T) for i, c in enumerate(model.caches)]
                except ConfigError as e:
                    errors[(method, budget)] = str(e)
                    continue
                kept = torch.stack(masks).float()  # (L, B, H_kv, T)
                acc = sums.setdefault((method, budget), {"n": 0})
                for name, sl in parts.items():
                    acc[name] = acc.get(name, 0.0) + float(kept[..., sl].mean())
                acc["n"] += 1
        if bar is not None:
            bar.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for method, budget in pairs:
        if (method, budget) in errors:
            rows.append({"method": method, "budget": budget,
                         "error": errors[(method, budget)]})
            continue
        acc = sums[(method, budget)]
        rows.append({"method": method, "budget": budget, "prompts": acc["n"],
                     **{k: 100 * acc[k] / acc["n"]
                        for k in ("needle", "sinks", "recent", "overall")}})
    table = kept_table(rows)
    print(table)
    result = {"task": "kept_tokens", "checkpoint": args.checkpoint, "split": args.split,
              "seed": args.seed, "lengths": args.context, "depths": depths,
              "needles": args.needles, "method_options": options, "rows": rows,
              "sinks": SINKS, "recent": RECENT, "runtime_s": time.perf_counter() - t0,
              "torch_version": torch.__version__, "threads": torch.get_num_threads()}
    if args.out:
        write_outputs(args.out, "kept", result, table, None)
    return rows_exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
