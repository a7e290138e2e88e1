"""One layer's decode step per method: time, operator/kernel counts and bytes, as JSON.

    python scripts/bench_step.py --device cpu --context 32768 --methods full rocketkv \\
        --budgets 256                                 # CPU: eager, float32
    python scripts/bench_step.py                      # CUDA defaults: bf16, compiled (graphs)

The whole-model sweep (``scripts/bench.py``) shows where a step's time goes only in total; at
batch 1 after compression the weights dominate it. This script isolates the attention of one
layer at the real shapes (default llama-3.1-8b: 32 query heads, 8 KV heads, head dim 128):
each method's cache is filled with a random prompt of ``context`` tokens (its prefill-time
eviction included; prefill attention itself is skipped, block-wise methods excepted), then
``--steps`` decode steps of random q, k, v at consecutive positions are timed one by one
(CUDA events on GPU, synchronized wall clock on CPU) after ``--warmup`` untimed ones.

Per row:

* ``step_ms_median/p10/p90``: the cache's ``decode`` (write the new token, select, attend).
* ``aten_ops`` and ``aten_op_counts``: the ATen operators one eager step dispatches (a
  ``TorchDispatchMode`` count), ``aten_ops`` without the metadata-only ones (views, counted
  in ``view_ops``), so each is at least one kernel launch in eager mode; ``topk_ops`` and
  ``gather_ops`` (gather, index, index_select, index_copy, scatter) singled out.
* ``cuda_kernels`` (CUDA only): kernels the profiler sees in one step of the timed function
  (compiled or eager, as timed).
* ``bytes_read_per_step`` (what the step's kernels touch at our layout, 32-byte sectors where a
  gather is strided) and ``ideal_bytes_per_step`` (the paper's Table 1 count), and the
  ``roofline_ms`` of each at the bandwidth a device-to-device copy reaches in the same run.

Compile regime: with ``--compile`` every row compiles its own step with static shapes (the
compile cache is reset between rows), so no row runs a symbolic-shape graph left by another.

``--split-pages N ...`` repeats every configuration with the fused selection split at N pages
a program (``kernels.sparse.SPLIT_PAGES``: one program per KV head up to N pages, above that
the split selection), to choose that constant on a GPU; each row records ``split_pages`` and
``fused_kernels`` (whether the Triton kernels ran: CUDA with triton).

Methods whose layers differ (omnikv, duoattention) have no single representative layer and are
refused; use ``scripts/bench.py``. Results: ``--json`` (default
``results/<device>/bench_step-<timestamp>.json``; ``--out`` is its deprecated spelling).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from cli import DTYPES, OneLineParser, command_line, deprecated_alias, rows_exit_status, write_json
from compression import add_method_options, build_caches, check_methods, options_for
from evals.bench import measure_bandwidth, resolve_run, results_dir
from evals.harness import configurations
from measure import device_name, percentile, sync
from model import CONFIGS, ConfigError, ModelArgs

HETEROGENEOUS = ("omnikv", "duoattention")  # layers differ: no one layer stands for the model
GATHER_OPS = ("gather", "index", "index_select", "index_copy", "index_put", "scatter", "take")
VIEW_OPS = ("view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "transpose", "permute",
            "select", "slice", "t", "alias", "as_strided", "detach", "split", "unbind",
            "_reshape_alias", "lift_fresh")  # metadata only: no kernel


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched inside the ``with`` block (overload names
    dropped: ``aten.topk.default`` -> ``topk``)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0].rstrip("_")] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn, *args) -> Counter:
    """ATen operator counts of one call ``fn(*args)``."""
    with OpCounter() as counter:
        fn(*args)
    return counter.counts


def count_cuda_kernels(fn, *args) -> int:
    """CUDA kernels the profiler records in one call ``fn(*args)``."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)  # outside the trace: lazy initialisation, graph replays already captured
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def fill_cache(cache, args: ModelArgs, batch: int, context: int, dtype, device, gen) -> None:
    """The cache after prefill of a random prompt of ``context`` tokens: its eviction runs on
    random K/V and observation-window queries; prefill attention is skipped (its output is not
    needed), except for block-wise caches whose eviction is part of it."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    k, v = rand(batch, args.n_kv_heads, context, args.head_dim), \
        rand(batch, args.n_kv_heads, context, args.head_dim)
    if cache.prefill_block is not None:
        cache.prefill(rand(batch, args.n_heads, context, args.head_dim), k, v)
    else:  # as if built from a shared prefill (attention sums for the caches that need them)
        sums = torch.rand(batch, args.n_kv_heads, context, generator=gen).to(device) * 4 \
            if cache.needs_attention_sums else None
        q_obs = rand(batch, args.n_heads, min(cache.obs_window, context), args.head_dim)
        cache.store_recorded_prompt(k, v, q_obs, sums, {})


def decode_step(cache, q, k, v, pos):
    """The timed function: one decode step of one layer's cache."""
    return cache.decode(q, k, v, pos)


def run_one(args: ModelArgs, method: str, budget: int | None, context: int, opts, dtype,
            device: torch.device, bandwidth: float) -> dict:
    gen = torch.Generator().manual_seed(opts.seed)
    n_steps = 1 + opts.warmup + opts.steps  # the op-counting step, warm-up, timed
    layer_args = dataclasses.replace(args, n_layers=1)
    options = options_for(method, opts)
    cache = build_caches(method, layer_args, batch_size=opts.batch_size, prompt_len=context,
                         max_new_tokens=max(opts.new_tokens, n_steps + 2), budget=budget,
                         dtype=dtype, device=device, **options)[0]
    fill_cache(cache, args, opts.batch_size, context, dtype, device, gen)
    B, H, Hkv, D = opts.batch_size, args.n_heads, args.n_kv_heads, args.head_dim
    q = torch.randn(B, H, 1, D, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, 1, D, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, 1, D, generator=gen).to(device=device, dtype=dtype)
    pos = torch.tensor([context], device=device)

    step = decode_step
    if opts.compile:
        torch._dynamo.reset()  # every row compiles its own static-shape graph
        mode = "reduce-overhead" if device.type == "cuda" else None
        step = torch.compile(decode_step, fullgraph=True, mode=mode)
    ops = None
    times = []
    with torch.no_grad():
        for i in range(n_steps):
            if i == 0:  # an eager step under the op counter (it writes position `context`)
                ops = count_ops(decode_step, cache, q, k, v, pos)
                pos.add_(1)
                continue
            sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), \
                    torch.cuda.Event(enable_timing=True)
                start.record()
                step(cache, q, k, v, pos)
                end.record()
                torch.cuda.synchronize(device)
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step(cache, q, k, v, pos)
                ms = (time.perf_counter() - t0) * 1e3
            pos.add_(1)
            if i > opts.warmup:
                times.append(ms)
        n_kernels = None
        if device.type == "cuda":
            n_kernels = count_cuda_kernels(step, cache, q, k, v, pos)
    read, ideal = cache.bytes_read_per_step(), cache.ideal_bytes_per_step()
    return {
        "device": device_name(device), "torch_version": torch.__version__,
        "model": args.name, "dtype": str(dtype).removeprefix("torch."), "method": method,
        "budget": budget, "context": context, "batch_size": B, "compiled": bool(opts.compile),
        "compile_regime": "static per row" if opts.compile else "eager",
        "steps": len(times), "step_ms_median": percentile(times, 50),
        "step_ms_p10": percentile(times, 10), "step_ms_p90": percentile(times, 90),
        "aten_ops": sum(n for op, n in ops.items() if op not in VIEW_OPS),
        "view_ops": sum(n for op, n in ops.items() if op in VIEW_OPS),
        "topk_ops": ops.get("topk", 0),
        "gather_ops": sum(ops.get(n, 0) for n in GATHER_OPS),
        "aten_op_counts": dict(sorted(ops.items())), "cuda_kernels": n_kernels,
        "bytes_read_per_step": read, "ideal_bytes_per_step": ideal,
        "kv_cache_bytes": cache.allocated_bytes(), "bandwidth_gbps": bandwidth,
        "fused_kernels": kernels.in_use(device),
        "split_pages": kernels.ops().SPLIT_PAGES if kernels.in_use(device) else None,
        "roofline_ms": read / (bandwidth * 1e9) * 1e3,
        "ideal_roofline_ms": ideal / (bandwidth * 1e9) * 1e3,
        "method_params": cache.method_params(),
    }


def summary(rows: list[dict]) -> str:
    head = ("| method | budget | context | step ms (p10-p90) | aten ops | top-k | gathers | "
            "bytes read | ideal bytes | roofline ms | split pages |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['budget']} | {r['context']} | {r['error']} "
                         "| | | | | | | |")
            continue
        lines.append(
            f"| {r['method']} | {r['budget'] or '-'} | {r['context']} | "
            f"{r['step_ms_median']:.3f} ({r['step_ms_p10']:.3f}-{r['step_ms_p90']:.3f}) | "
            f"{r['aten_ops']} | {r['topk_ops']} | {r['gather_ops']} | "
            f"{r['bytes_read_per_step'] / 2**20:.2f} MiB | "
            f"{r['ideal_bytes_per_step'] / 2**20:.2f} MiB | {r['roofline_ms']:.4f} | "
            f"{r['split_pages'] or '-'} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="llama-3.1-8b", choices=list(CONFIGS),
                   metavar="NAME", help="named config: the shapes of the layer (default "
                   "llama-3.1-8b)")
    p.add_argument("--context", type=int, nargs="+", default=[32768], help="prompt tokens")
    p.add_argument("--methods", nargs="+", default=["full", "exact_topk", "quest", "sparq",
                                                    "hybrid", "rocketkv"])
    p.add_argument("--budgets", type=int, nargs="+", default=[256])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=64,
                   help="slots reserved for generated tokens (at least the steps run)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=list(DTYPES))
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the step (default: on for cuda, with CUDA graphs)")
    p.add_argument("--json", metavar="PATH",
                   help="rows JSON (default results/<device>/bench_step-<time>.json)")
    p.add_argument("--split-pages", type=int, nargs="+", metavar="N",
                   help="repeat each configuration with the fused selection split at N pages "
                        "a program (kernels.sparse.SPLIT_PAGES; where the kernels run)")
    add_method_options(p.add_argument_group("method options"))
    deprecated_alias(p, "--model", "--checkpoint")
    deprecated_alias(p, "--out", "--json")
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        for name in ("context", "budgets"):
            if min(getattr(opts, name)) <= 0:
                raise ConfigError(f"--{name} must be positive")
        for name in ("steps", "batch_size", "new_tokens"):
            if getattr(opts, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if opts.warmup < 0:
            raise ConfigError("--warmup must not be negative")
        check_methods(opts.methods)
        bad = [m for m in opts.methods if m in HETEROGENEOUS]
        if bad:
            raise ConfigError(f"{', '.join(bad)}: its layers differ, so one layer does not "
                              "stand for the step; use scripts/bench.py")
        device, dtype = resolve_run(opts)
        args = ModelArgs.from_name(opts.checkpoint)
        if opts.split_pages:
            if not kernels.in_use(device):
                raise ConfigError("--split-pages sets the fused selection's split, and the "
                                  f"kernels do not run on {device.type} "
                                  f"({kernels.missing() or 'CUDA with triton only'})")
            limit = kernels.ops().SELECT_REGISTER_PAGES
            if not all(0 < n <= limit for n in opts.split_pages):
                raise ConfigError(f"--split-pages must be 1 to {limit} (pages a program "
                                  "chooses over in registers)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(opts.json) if opts.json else results_dir("results", device) / \
        f"bench_step-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    if out.suffix != ".json":
        print(f"error: --json must name a .json file, got {out}", file=sys.stderr)
        return 2
    bandwidth = measure_bandwidth(device)
    command = command_line("bench_step.py", argv)
    rows = []
    default = kernels.ops().SPLIT_PAGES if kernels.in_use(device) else None
    for split_pages in opts.split_pages or [default]:
        if split_pages is not None:
            kernels.ops().SPLIT_PAGES = split_pages
        try:
            for context in opts.context:
                for method, budget in configurations(opts.methods, opts.budgets):
                    try:
                        row = run_one(args, method, budget, context, opts, dtype, device,
                                      bandwidth)
                    except (ConfigError, torch.OutOfMemoryError) as e:
                        row = {"method": method, "budget": budget, "context": context,
                               "split_pages": split_pages, "error": str(e).splitlines()[0]}
                    row["command"] = command
                    rows.append(row)
                    write_json(out, rows)
        finally:
            if default is not None:
                kernels.ops().SPLIT_PAGES = default
    print(summary(rows))
    print(f"copy bandwidth {bandwidth:.1f} GB/s on {device_name(device)}")
    print(f"wrote {out}")
    return rows_exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
