"""One layer's decode step per method, timed alone (``scripts/bench_step.py`` is its command;
its docstring says what is measured and how): the cache filled at a context, the step's
operations and kernels counted, the launch constants swept (``--knob``), the rows saved."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rocketkv import kernels
from rocketkv.cli.common import (
    check_json_path,
    command_line,
    device_fault,
    fault_line,
    release_device,
    row_error,
    rows_exit_status,
    write_json,
)
from rocketkv.compression import build_caches, check_methods, options_for
from rocketkv.engine.measure import device_name, percentile, sync
from rocketkv.engine.provenance import commit_fields
from rocketkv.evals.bench import measure_bandwidth, resolve_run, results_dir
from rocketkv.evals.harness import configurations
from rocketkv.kernels import tuning
from rocketkv.model import CONFIGS, ConfigError, ModelArgs

KNOBS = tuple(tuning.CONSTANTS["sparse"])  # kernels.sparse's launch constants --knob sets
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


def knob_error(name: str, values: list[int]) -> str | None:
    """Why ``--knob NAME=V1,...`` (its syntax checked by ``parse_knob``) cannot be set: an
    unknown name, or a value that is not a power of two of at least its minimum in
    ``kernels.tuning.CONSTANTS``; None when it can."""
    if name not in KNOBS:
        return f"{name!r} is not one of {', '.join(KNOBS)}"
    for v in values:
        if (why := tuning.value_error(name, v, tuning.CONSTANTS["sparse"][name])) is not None:
            return why
    return None


def knob_settings(knobs: list[tuple[str, list[int]]]) -> list[dict[str, int]]:
    """Every combination of the ``--knob`` values, as name -> value ([{}] for none).

    Raises:
        ConfigError: a knob given twice."""
    names = [n for n, _ in knobs]
    if len(set(names)) < len(names):
        raise ConfigError(f"--knob {max(names, key=names.count)} given twice")
    settings = [{}]
    for name, vals in knobs:
        settings = [{**s, name: v} for s in settings for v in vals]
    return settings


def best_setting(rows: list[dict], settings: list[dict[str, int]]) -> tuple[dict, list[dict]]:
    """The ``--knob`` setting whose steps are fastest relative to each configuration's best
    (``relative``: the mean over configurations of its median step time / the least any
    setting took there, so each method and context weighs alike, whatever its step time),
    among the settings whose every configuration ran; and each setting's ``relative`` and
    ``step_ms_total`` (None where a row failed). Returns ({}, ...) when none ran whole."""
    def config(r):
        return r["method"], r["budget"], r["context"]

    of = [[r for r in rows if r.get("setting") == i] for i in range(len(settings))]
    whole = [bool(mine) and all("error" not in r for r in mine) for mine in of]
    fastest: dict[tuple, float] = {}  # over the settings that ran whole
    for mine, ok in zip(of, whole):
        for r in mine if ok else []:
            fastest[config(r)] = min(fastest.get(config(r), r["step_ms_median"]),
                                     r["step_ms_median"])
    totals = []
    for setting, mine, ok in zip(settings, of, whole):
        totals.append({"knobs": setting, "rows": len(mine),
                       "step_ms_total": sum(r["step_ms_median"] for r in mine) if ok else None,
                       "relative": sum(r["step_ms_median"] / fastest[config(r)]
                                       for r in mine) / len(mine) if ok else None})
    done = [t for t in totals if t["relative"] is not None]
    best = min(done, key=lambda t: t["relative"])["knobs"] if done else {}
    return best, totals


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
                         max_new_tokens=max(opts.max_new_tokens, n_steps + 2), budget=budget,
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
                if opts.cuda_graphs:  # captured, not run; each later step replays it
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        decode_step(cache, q, k, v, pos)

                    def step(*_, graph=graph):
                        graph.replay()
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
        **commit_fields(),
        "model": args.name, "dtype": str(dtype).removeprefix("torch."), "method": method,
        "budget": budget, "context": context, "batch_size": B, "compiled": bool(opts.compile),
        "compile_regime": "graphs" if opts.cuda_graphs else "static per row" if opts.compile
        else "eager",
        "steps": len(times), "step_ms_median": percentile(times, 50),
        "step_ms_p10": percentile(times, 10), "step_ms_p90": percentile(times, 90),
        "aten_ops": sum(n for op, n in ops.items() if op not in VIEW_OPS),
        "view_ops": sum(n for op, n in ops.items() if op in VIEW_OPS),
        "topk_ops": ops.get("topk", 0) + ops.get("sort", 0),
        "gather_ops": sum(ops.get(n, 0) for n in GATHER_OPS),
        "aten_op_counts": dict(sorted(ops.items())), "cuda_kernels": n_kernels,
        "bytes_read_per_step": read, "ideal_bytes_per_step": ideal,
        "kv_cache_bytes": cache.allocated_bytes(), "bandwidth_gbps": bandwidth,
        "fused_kernels": kernels.in_use(device),
        "split_pages": kernels.ops().SPLIT_PAGES if kernels.in_use(device) else None,
        "knobs": {n: getattr(kernels.ops(), n) for n in KNOBS} if kernels.in_use(device)
        else None,
        "roofline_ms": read / (bandwidth * 1e9) * 1e3,
        "ideal_roofline_ms": ideal / (bandwidth * 1e9) * 1e3,
        "method_params": cache.method_params(),
    }


def summary(rows: list[dict]) -> str:
    """The rows as a Markdown table; the last column is the knobs that differ between rows
    (``--knob``), else the split selection's pages a program."""
    sets = [r["knobs"] for r in rows if r.get("knobs")]
    varied = [n for n in KNOBS if len({k[n] for k in sets}) > 1]
    head = ("| method | budget | context | step ms (p10-p90) | aten ops | top-k | gathers | "
            f"bytes read | ideal bytes | roofline ms | {' '.join(varied) or 'split pages'} |\n"
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
            f"{' '.join(str(r['knobs'][n]) for n in varied) or r['split_pages'] or '-'} |")
    return "\n".join(lines)


def run(opts, argv=None) -> int:
    """The rows the parsed arguments ``opts`` ask for (``argv``: the command recorded, the
    process's own when None); the exit status."""
    try:
        if opts.config not in CONFIGS:
            raise ConfigError(f"--config: unknown model shape {opts.config!r} (choose from "
                              f"{', '.join(CONFIGS)})")
        for name in ("context", "budgets"):
            if min(getattr(opts, name)) <= 0:
                raise ConfigError(f"--{name} must be positive")
        for name in ("steps", "batch_size", "max_new_tokens"):
            if getattr(opts, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if opts.warmup < 0:
            raise ConfigError("--warmup must not be negative")
        check_methods(opts.methods)
        bad = [m for m in opts.methods if m in HETEROGENEOUS]
        if bad:
            raise ConfigError(f"{', '.join(bad)}: its layers differ, so one layer does not "
                              "stand for the step; use scripts/bench.py")
        if opts.cuda_graphs and opts.compile:
            raise ConfigError("--cuda-graphs captures the eager step: drop --compile")
        device, dtype = resolve_run(opts)
        if opts.cuda_graphs:
            if device.type != "cuda":
                raise ConfigError(f"--cuda-graphs needs a CUDA device, not {device.type}")
            opts.compile = False
        args = ModelArgs.from_name(opts.config)
        if opts.split_pages:
            opts.knob.append(("SPLIT_PAGES", opts.split_pages))
        settings = knob_settings(opts.knob)
        if opts.tuned and not opts.knob:
            raise ConfigError("--tuned chooses among --knob settings: give --knob")
        check_json_path(opts.tuned, "--tuned")
        if opts.knob:
            if not kernels.in_use(device):
                raise ConfigError("--knob and --split-pages set the fused kernels' launch "
                                  f"constants, and the kernels do not run on {device.type} "
                                  f"({kernels.missing() or 'CUDA with triton only'})")
            limit = kernels.ops().SELECT_REGISTER_PAGES
            if not all(0 < s.get("SPLIT_PAGES", 1) <= limit for s in settings):
                raise ConfigError(f"SPLIT_PAGES must be 1 to {limit} (pages a program "
                                  "chooses over in registers)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(opts.json) if opts.json else results_dir(".", device) / \
        f"bench_step-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    if out.suffix != ".json":
        print(f"error: --json must name a .json file, got {out}", file=sys.stderr)
        return 2
    try:
        if opts.json:
            check_json_path(opts.json)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bandwidth = measure_bandwidth(device)
    command = command_line("bench_step.py", argv)
    rows = []
    module = kernels.ops() if kernels.in_use(device) else None
    default = {n: getattr(module, n) for n in KNOBS} if module is not None else {}
    name = device_name(device)  # asked once: after a CUDA error no CUDA call is safe
    fault = None  # (the failing row's label, its error) once the device is unusable
    for index, setting in enumerate(settings):
        for knob, value in setting.items():
            setattr(module, knob, value)
        try:
            for context in opts.context:
                for method, budget in configurations(opts.methods, opts.budgets):
                    base = {"method": method, "budget": budget, "context": context,
                            "split_pages": setting.get("SPLIT_PAGES"),
                            "knobs": {**default, **setting} if module else None}
                    if fault is not None:
                        row = {**base, "error": "skipped: not run after the CUDA error of "
                               f"{fault[0]}"}
                    else:
                        try:
                            row = run_one(args, method, budget, context, opts, dtype, device,
                                          bandwidth)
                        except Exception as e:  # noqa: BLE001 (a failed row: row_error)
                            row = {**base, "error": row_error(e)}
                            # nothing here may raise: after a CUDA error every CUDA call does
                            broken = e if device_fault(e) else release_device(device)
                            if broken is not None:
                                fault = (row_label(row, setting if len(settings) > 1
                                                   else {}), broken)
                    row.update(command=command, setting=index)
                    rows.append(row)
                    write_json(out, rows)
        finally:
            for knob, value in default.items():
                setattr(module, knob, value)
    if opts.tuned and fault is None:
        best, totals = best_setting(rows, settings)
        write_json(opts.tuned, {"device": tuning.table_device(device), "command": command,
                                "rows": str(out),
                                "constants": {"sparse": best} if best else {},
                                "settings": totals})
    print(summary(rows))
    print(f"copy bandwidth {bandwidth:.1f} GB/s on {name}")
    print(f"wrote {out}")
    if fault is not None:
        print(fault_line(fault, rows, out), file=sys.stderr)
        return 1
    return rows_exit_status(rows)


def row_label(row: dict, setting: dict[str, int]) -> str:
    """``rocketkv @256 at 32768 tokens`` (with the ``--knob`` setting when there are several):
    the configuration of a row, as an error line names it."""
    budget = f" @{row['budget']}" if row.get("budget") is not None else ""
    knobs = "".join(f", {k}={v}" for k, v in setting.items())
    return f"{row['method']}{budget} at {row['context']} tokens{knobs}"
