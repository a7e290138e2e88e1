"""The command of ``scripts/predict_memory.py``: ``engine.memory_model.predict`` (how the memory
is predicted, and what it does not count, is that module's docstring) for every tensor-parallel
world, context, method and budget asked for, the rows as a Markdown table and a JSON file."""

from __future__ import annotations

import sys
from pathlib import Path

from rocketkv import tp
from rocketkv.cli.common import DTYPES, command_line, rows_exit_status, write_json
from rocketkv.compression import check_methods
from rocketkv.engine.memory_model import predict
from rocketkv.evals.harness import configurations
from rocketkv.model import CONFIGS, ConfigError, ModelArgs

GB = 1e9
H100_BYTES = 78 * 2**30  # what an H100 80GB leaves a program (the GPU machine's 78 GiB)


def summary(rows: list[dict]) -> str:
    """The rows as a Markdown table; with tensor-parallel rows (``world_size`` > 1) the
    figures are per rank, with a column saying whether that fits on H100s."""
    tp_rows = any(r.get("world_size", 1) > 1 for r in rows)
    head = ["method", "budget", "context", "weights GB", "KV cache GB", "prefill act. GB",
            "peak prefill GB", "peak decode GB", "peak total GB", "saving vs full"]
    if tp_rows:
        head[1:1] = ["ranks"]
        head.append("fits on H100s (78 GiB each)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full = {(r["context"], r["batch_size"], r.get("world_size", 1)): r for r in rows
            if r["method"] == "full" and "error" not in r}
    for r in rows:
        ranks = [str(r.get("world_size", 1))] if tp_rows else []
        if "error" in r:
            lines.append("| " + " | ".join([r["method"], *ranks, str(r["budget"]),
                                            str(r["context"]), f"error: {r['error']}"])
                         + " |" * (len(head) - 3 - len(ranks)))
            continue
        pk = r["peak_memory_bytes"]
        base = full.get((r["context"], r["batch_size"], r.get("world_size", 1)))
        saving = f"{100 * (1 - pk['total'] / base['peak_memory_bytes']['total']):.1f}%" \
            if base and r is not base else "-"
        cells = [r["method"], *ranks, str(r["budget"] or "-"), str(r["context"]),
                 f"{r['weight_bytes'] / GB:.2f}", f"{r['kv_cache_bytes'] / GB:.2f}",
                 f"{r['prefill_activation_peak_bytes'] / GB:.2f}", f"{pk['prefill'] / GB:.2f}",
                 f"{pk['decode'] / GB:.2f}", f"{pk['total'] / GB:.2f}", saving]
        if tp_rows:
            n = r.get("world_size", 1)
            cells.append(f"yes, {n}" if pk["total"] <= H100_BYTES else f"no ({n})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(a, argv=None) -> int:
    """Predict as the parsed arguments ``a`` say; the exit status."""
    if a.config not in CONFIGS:  # (the parser, built before torch, lists none)
        print(f"error: --config: unknown model shape {a.config!r} (choose from "
              f"{', '.join(CONFIGS)})", file=sys.stderr)
        return 2
    try:
        check_methods(a.methods)
        for name in ("budgets", "context"):
            if min(getattr(a, name)) <= 0:
                raise ConfigError(f"--{name} must be positive")
        if a.max_new_tokens <= 0 or a.batch_size <= 0:
            raise ConfigError("--max-new-tokens and --batch-size must be positive")
        if a.json and not Path(a.json).resolve().parent.is_dir():
            raise ConfigError(f"--json: directory {Path(a.json).resolve().parent} does not exist")
        args = ModelArgs.from_name(a.config)
        for n in a.tp:
            if n <= 0:
                raise ConfigError("--tp must be positive")
            tp.check_world(args, n)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for world in a.tp:
        for context in a.context:
            for method, budget in configurations(a.methods, a.budgets):
                try:
                    rows.append(predict(args, method, budget, context, a.max_new_tokens,
                                        a.batch_size, DTYPES[a.dtype], world=world))
                except ConfigError as e:
                    rows.append({"device": "meta", "predicted": True, "model": args.name,
                                 "method": method, "budget": budget, "context": context,
                                 "batch_size": a.batch_size, "world_size": world,
                                 "error": str(e)})
    command = command_line("predict_memory.py", argv)
    for r in rows:
        r["command"] = command
    print(summary(rows))
    print("predicted on the meta device (tensor storage only), not measured on a GPU")
    if a.json:
        write_json(a.json, rows)
        print(f"wrote {a.json}")
    return rows_exit_status(rows)

