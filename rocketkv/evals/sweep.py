"""The speed and memory sweep of ``scripts/bench.py`` (its command; its docstring says what
is measured and how): the rows of every configuration, the peers' rows, the charts and the
summary, saved after every row."""

from __future__ import annotations

import datetime as dt
import sys
import time
from pathlib import Path

import torch

from rocketkv import tp
from rocketkv.cli.common import (
    command_line,
    device_fault,
    fault_line,
    release_device,
    row_error,
    rows_exit_status,
    write_json,
)
from rocketkv.compression import METHODS, check_methods, options_for
from rocketkv.engine.generate import CacheRequest, StepConfig, generate, release_caches
from rocketkv.engine.measure import check_memory, check_run_memory, device_name, spread_warning
from rocketkv.engine.provenance import commit_fields
from rocketkv.engine.step import StepMode
from rocketkv.evals.bench import (
    DEFAULT_BUDGETS,
    DEFAULT_CONTEXTS,
    DEFAULT_METHODS,
    measure_bandwidth,
    resolve_run,
    results_dir,
)
from rocketkv.evals.harness import configurations
from rocketkv.evals.peers import PEERS, run_transformers
from rocketkv.flags import named_config
from rocketkv.formats.checkpoint import (
    RANDOM_PREFIX,
    check_creatable,
    checkpoint_args,
    default_gguf_weights,
    is_quantized,
    load_model,
    resolve_checkpoint,
)
from rocketkv.kernels import tuning
from rocketkv.model import CONFIGS, ConfigError
from rocketkv.quantized import check_quantizable, parse_weights, quantize_model


def load_weights(ckpt: str, spec: str, device: torch.device, dtype: torch.dtype):
    """The model of ``ckpt`` with ``spec``'s weights (``parse_weights``), this rank's share
    of it under ``torchrun`` (``tp.py``). A GGUF file's own weights (``float``) load as
    ``generate.py`` loads them (``checkpoint.default_gguf_weights``: its blocks kept quantized
    on the CPU); another mode quantizes its dequantized weights."""
    mode, groupsize = parse_weights(spec)
    gguf_weights = default_gguf_weights(None, ckpt, device) if mode == "float" else "float"
    model = load_model(ckpt, device, dtype, shard=(tp.rank(), tp.world_size()),
                       gguf_weights=gguf_weights)
    if mode != "float" and model.quantization is not None:
        raise ConfigError(f"--weights {spec}: {ckpt} is already quantized; pass --weights "
                          "float (its own weights) or a float checkpoint")
    if mode != "float":  # the rank's share, quantized: int4's groups run along the inputs
        # and a shard keeps whole groups, so this equals sharding the quantized whole
        quantize_model(model, mode, groupsize)
    return model


def run_one(model, batch: int, context: int, method: str, budget, args, bandwidth: float,
            device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.args.vocab_size, (batch, context), generator=gen)
    best = None
    for _ in range(args.repeats):
        opts = options_for(method, args)
        mode = StepMode(args.compile_regime) if args.compile else StepMode.EAGER
        if mode is StepMode.STATIC:
            torch._dynamo.reset()  # this row compiles its own static-shape graph
        r = generate(model, prompt, CacheRequest(method, budget, opts),
                     max_new_tokens=args.max_new_tokens, step=StepConfig.of(mode))
        if best is None or r["decode_ms_median"] < best["decode_ms_median"]:
            best = r
    step_bytes = best["weight_bytes_per_step"] + best["kv_bytes_per_step"]
    return {
        "device": device_name(device), "torch_version": torch.__version__,
        "model": model.args.name, "dtype": best["dtype"], "method": method, "budget": budget,
        "weights": best["weights"],
        "context": context, "batch_size": batch, "new_tokens": args.max_new_tokens,
        "decode_ms_median": best["decode_ms_median"], "decode_ms_p10": best["decode_ms_p10"],
        "decode_ms_p90": best["decode_ms_p90"], "tokens_per_s": best["tokens_per_s"],
        "prefill_s": best["prefill_s"], "compile_s": best["compile_s"],
        "peak_memory_bytes": best["peak_memory_bytes"],
        "peak_memory_kind": best["peak_memory_kind"], "kv_cache_bytes": best["kv_cache_bytes"],
        "kv_bytes_per_step": best["kv_bytes_per_step"], "weight_bytes": best["weight_bytes"],
        "weight_bytes_per_step": best["weight_bytes_per_step"], "bandwidth_gbps": bandwidth,
        "achieved_gbps": best["bandwidth_gbps"],
        "roofline_ms": step_bytes / (bandwidth * 1e9) * 1e3,
        "method_params": best["method_params"], "compiled": best["compiled"],
        "fused_kernels": best["fused_kernels"], "dense_kernels": best["dense_kernels"],
        "kernels": best.get("kernels"),  # family -> what ran (generate: kernels.report)
        "kernel_tuning": tuning.describe(device) if best["fused_kernels"] else None,
        "compile_regime": args.compile_regime if best["compiled"] or best["cuda_graphs"]
        else "eager",
        "kv_ideal_bytes_per_step": best["kv_ideal_bytes_per_step"],
        "ideal_roofline_ms": (best["weight_bytes_per_step"] + best["kv_ideal_bytes_per_step"])
        / (bandwidth * 1e9) * 1e3,
        "warmup_steps": best["warmup_steps"], "decode_steps": best["decode_steps"],
    }


def run_peer(model, batch: int, context: int, method: str, args, bandwidth: float,
             device: torch.device, dtype: torch.dtype) -> dict:
    """A row of another engine (``evals.peers``) at ``model``'s shape in ``dtype`` on
    ``device``, with the fields of ``run_one``'s rows (best of ``--repeats``). The peers run
    after every row of ours, with our weights freed (``free_weights``): the whole device is
    theirs."""
    free_weights(model, device)
    # its float weights and a full-size static cache
    check_memory(model.args, dtype, device, batch, context + args.max_new_tokens)
    best = None
    for _ in range(args.repeats):
        r = run_transformers(model.args, batch, context, args.max_new_tokens, device=device,
                             dtype=dtype, seed=args.seed, compile=args.compile)
        if best is None or r["decode_ms_median"] < best["decode_ms_median"]:
            best = r
    step_bytes = best["weight_bytes_per_step"] + best["kv_bytes_per_step"]
    roofline = step_bytes / (bandwidth * 1e9) * 1e3
    return {**best, "torch_version": torch.__version__, "model": model.args.name,
            "method": method, "budget": None, "context": context, "batch_size": batch,
            "new_tokens": args.max_new_tokens, "bandwidth_gbps": bandwidth,
            "achieved_gbps": step_bytes / (best["decode_ms_median"] * 1e-3) / 1e9,
            "roofline_ms": roofline, "ideal_roofline_ms": roofline,
            # transformers compiles its static-cache forward itself, whatever our regime
            "compile_regime": "static" if best["compiled"] else "eager"}


def free_weights(model, device: torch.device) -> None:
    """Our model's caches and weights given back to ``device`` (moved to the meta device:
    the shapes stay for the peers' rows, which come after ours)."""
    release_caches(model)
    model.to("meta")
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _find(rows, **kw):
    return next((r for r in rows if all(r.get(k) == v for k, v in kw.items())), None)


NOISE_PCT = 1.0  # chart (b): memory differences within this many percent are noise
LEGEND_PT = 9  # legend and tick-label font size (points)


def context_label(tokens: int) -> str:
    """``16K`` for 16384, ``128K`` for 131008 (within 0.1K of a whole K), ``1.5K``, ``512``."""
    if tokens < 1024:
        return str(tokens)
    k = tokens / 1024
    return f"{round(k)}K" if abs(k - round(k)) < 0.1 else f"{k:.1f}K"


def _context_axis(ax, contexts) -> None:
    """Log-scale context axis with a tick at each measured context, labelled 16K, 32K..."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_xticks(list(contexts), [context_label(c) for c in contexts])
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot(rows: list[dict], out_prefix: Path, compare_context: int) -> list[Path]:
    """Draw the four charts; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in rows if "error" not in r]
    batch = min(r["batch_size"] for r in ok)
    ok = [r for r in ok if r["batch_size"] == batch]
    contexts = sorted({r["context"] for r in ok})
    budgets = sorted({r["budget"] for r in ok if r["budget"] is not None})
    methods = sorted({r["method"] for r in ok if r["budget"] is not None})
    title = f"{ok[0]['model']} {ok[0]['dtype']} batch {batch} on {ok[0]['device']}"
    # charts (a)-(c) draw a series only where it has a line (chart (d) shows one context)
    min_points = 2 if len(contexts) > 1 else 1

    def speedups(method, budget, base):
        xs, ys = [], []
        for c in contexts:
            a, b = _find(ok, method=method, budget=budget, context=c), \
                _find(ok, method=base, context=c)
            if a and b:
                xs.append(c)
                ys.append(b["decode_ms_median"] / a["decode_ms_median"])
        return xs, ys

    fig, ax = plt.subplots(figsize=(10, 4.5))  # (a)
    for m in methods:
        for t in budgets:
            for base, style in (("full", "-o"), ("gptfast_dense", "--s")):
                xs, ys = speedups(m, t, base)
                if len(xs) >= min_points:
                    ax.plot(xs, ys, style, label=f"{m} t={t} vs {base}")
    _context_axis(ax, contexts)
    ax.set(xlabel="context (tokens)", ylabel="decode speedup (x)",
           title=f"(a) decode speedup vs Full-KV\n{title}")
    ax.axhline(1, color="gray", lw=0.5)
    ax.legend(fontsize=LEGEND_PT, loc="center left", bbox_to_anchor=(1.01, 0.5))
    paths.append(_save(fig, out_prefix, "a_speedup"))

    fig, ax = plt.subplots(figsize=(10, 4.5))  # (b)
    for m in methods:
        for t in budgets:
            for phase, style in (("decode", "-o"), ("total", "--s")):
                xs, ys = [], []
                for c in contexts:
                    a, b = _find(ok, method=m, budget=t, context=c), \
                        _find(ok, method="full", context=c)
                    if a and b:
                        xs.append(c)
                        ys.append(100 * (1 - a["peak_memory_bytes"][phase]
                                         / b["peak_memory_bytes"][phase]))
                if len(xs) >= min_points:
                    ax.plot(xs, ys, style, label=f"{m} t={t} ({phase} phase)")
    _context_axis(ax, contexts)
    ax.axhspan(-NOISE_PCT, NOISE_PCT, color="0.85", zorder=0,
               label=f"within +-{NOISE_PCT:g}%: measurement noise, not a difference")
    ax.axhline(0, color="gray", lw=0.5)
    ax.set(xlabel="context (tokens)", ylabel="peak memory saving vs full (%)",
           title=f"(b) peak-memory saving\n{title}")
    ax.legend(fontsize=LEGEND_PT, loc="center left", bbox_to_anchor=(1.01, 0.5))
    paths.append(_save(fig, out_prefix, "b_memory"))

    fig, ax = plt.subplots(figsize=(10, 4.5))  # (c)
    for r_method in sorted({r["method"] for r in ok}):
        for t in (budgets if r_method in METHODS and METHODS[r_method].budgeted else [None]):
            pts = [(c, _find(ok, method=r_method, budget=t, context=c)) for c in contexts]
            pts = [(c, r) for c, r in pts if r]
            if len(pts) < min_points:
                continue
            label = r_method if t is None else f"{r_method} t={t}"
            line = ax.plot([c for c, _ in pts], [r["decode_ms_median"] for _, r in pts], "-o",
                           label=label)[0]
            ax.plot([c for c, _ in pts], [r["roofline_ms"] for _, r in pts], ":",
                    color=line.get_color(), label=f"{label} roofline")
    _context_axis(ax, contexts)
    ax.set(yscale="log", xlabel="context (tokens)", ylabel="decode step (ms, log scale)",
           title=f"(c) per-token latency and roofline\n{title}")
    ax.legend(fontsize=LEGEND_PT, loc="center left", bbox_to_anchor=(1.01, 0.5))
    paths.append(_save(fig, out_prefix, "c_latency"))

    ctx = compare_context if compare_context in contexts else contexts[len(contexts) // 2]
    fig, ax = plt.subplots(figsize=(8, 4.5))  # (d)
    bars = [(r["method"] if r["budget"] is None else f"{r['method']}\nt={r['budget']}",
             r["decode_ms_median"], r["roofline_ms"]) for r in ok if r["context"] == ctx]
    ax.bar(range(len(bars)), [b[1] for b in bars], label="measured")
    ax.scatter(range(len(bars)), [b[2] for b in bars], color="k", marker="_", s=200,
               label="roofline", zorder=3)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=LEGEND_PT, rotation=60)
    ax.set(ylabel="decode step (ms)",
           title=f"(d) all methods at {context_label(ctx)} tokens\n{title}")
    ax.legend(fontsize=LEGEND_PT)
    paths.append(_save(fig, out_prefix, "d_methods"))
    return paths


def plot_weights(rows: list[dict], out_prefix: Path) -> Path:
    """(e): per-step latency against context for every weights mode x method x budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    batch = min(r["batch_size"] for r in ok)
    ok = [r for r in ok if r["batch_size"] == batch]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    keys = sorted({(r["weights"], r["method"], r["budget"] or 0) for r in ok})
    for w, m, t in keys:
        pts = sorted((r["context"], r["decode_ms_median"]) for r in ok
                     if (r["weights"], r["method"], r["budget"] or 0) == (w, m, t))
        ax.plot([c for c, _ in pts], [v for _, v in pts], "-o" if w == "float" else "--s",
                label=f"{w} {m}" + (f" t={t}" if t else ""))
    _context_axis(ax, sorted({r["context"] for r in ok}))
    ax.set(yscale="log", xlabel="context (tokens)", ylabel="decode step (ms, log scale)",
           title=f"(e) weights: float vs quantized\n{ok[0]['model']} {ok[0]['dtype']} batch "
                 f"{batch} on {ok[0]['device']}")
    ax.legend(fontsize=LEGEND_PT, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, out_prefix, "e_weights")


def _save(fig, prefix: Path, name: str) -> Path:
    path = prefix.parent / f"{prefix.name}-{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def summary(rows: list[dict]) -> str:
    head = ("| weights | batch | context | method | budget | step ms (p10-p90) | roofline ms | "
            "tok/s | peak decode GiB | peak total GiB | KV MiB |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('weights', 'float')} | {r['batch_size']} | {r['context']} | "
                         f"{r['method']} | {r['budget']} | error: {r['error']} | | | | | |")
            continue
        pk = r["peak_memory_bytes"]
        lines.append(
            f"| {r['weights']} | {r['batch_size']} | {r['context']} | {r['method']} | "
            f"{r['budget'] or '-'} | "
            f"{r['decode_ms_median']:.3f} ({r['decode_ms_p10']:.3f}-{r['decode_ms_p90']:.3f}) | "
            f"{r['roofline_ms']:.3f} | {r['tokens_per_s']:.1f} | {pk['decode'] / 2**30:.2f} | "
            f"{pk['total'] / 2**30:.2f} | {r['kv_cache_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def run(args, argv=None) -> int:
    """The sweep the parsed arguments ``args`` ask for (``argv``: the command recorded, the
    process's own when None); the exit status."""
    for name, default in (("methods", DEFAULT_METHODS), ("budgets", DEFAULT_BUDGETS),
                          ("context", DEFAULT_CONTEXTS)):
        if getattr(args, name) is None:
            setattr(args, name, list(default))
    try:
        device, dtype = resolve_run(args)
        StepMode(args.compile_regime).check_device(device, "--compile-regime graphs")
        rank, world = tp.init(device.type)  # under torchrun: one rank of the model
        if args.methods == ["all"]:
            args.methods = list(METHODS)
        check_methods([m for m in args.methods if m not in PEERS])
        for name in ("budgets", "context", "batch_sizes"):
            if min(getattr(args, name)) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        args.config = named_config(args, CONFIGS, "llama-3.1-8b")
        ckpt = RANDOM_PREFIX + args.config if args.config else \
            resolve_checkpoint(args.checkpoint)
        if world > 1 and any(m in PEERS for m in args.methods):
            raise ConfigError("transformers rows run on one GPU: drop them under torchrun")
        args.weights = list(dict.fromkeys(args.weights))
        for spec in args.weights:
            parse_weights(spec)
        check_out_dir(args.out)
        margs = checkpoint_args(ckpt)  # the header alone: no weights read
        for spec in args.weights:  # quantize_model's checks (a group size that divides)
            mode, groupsize = parse_weights(spec)
            if mode != "float":
                check_quantizable(margs, mode, groupsize)
        check_context(margs.max_seq_len, args.context, args.max_new_tokens)
        if not is_quantized(ckpt):  # the float weights and the smallest row's full cache
            check_memory(tp.local_args(margs, world), dtype, device,
                         min(args.batch_sizes), min(args.context) + args.max_new_tokens)
        model = load_weights(ckpt, args.weights[0], device, dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:
        from tqdm import tqdm
    except ImportError:  # random-weight benchmarks need torch alone (the GPU machine)
        def tqdm(items, **_):
            return items

    bandwidth = measure_bandwidth(device)
    out_dir = results_dir(args.out, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    prefix = out_dir / f"bench-{stamp}"
    command = command_line("bench.py", argv)
    provenance = commit_fields()  # once a run
    rows = []
    start = time.perf_counter()
    ours = configurations([m for m in args.methods if m not in PEERS], args.budgets)
    pairs = ours + [(m, None) for m in args.methods if m in PEERS]
    configs = [(w, batch, context, method, budget) for w in args.weights
               for batch in args.batch_sizes for context in args.context
               for method, budget in pairs if method not in PEERS or w == "float"]
    configs.sort(key=lambda c: c[3] in PEERS)  # the peers last: our weights freed for them
    name = device_name(device)  # asked once: after a CUDA error no CUDA call is safe
    fault = None  # (the failing row's label, its error) once the device is unusable
    for weights, batch, context, method, budget in tqdm(configs, desc="bench", unit="config",
                                                         disable=args.no_progress):
        base = {"device": name, "model": model.args.name, "method": method, "budget": budget,
                "context": context, "batch_size": batch, "weights": weights}
        if fault is not None:
            row = {**base, "error": f"skipped: not run after the CUDA error of {fault[0]}"}
        elif args.time_limit is not None and time.perf_counter() - start > args.time_limit:
            row = {**base, "error": f"skipped: --time-limit {args.time_limit:g} s reached"}
        else:
            if method not in PEERS and getattr(model, "_bench_weights", args.weights[0]) \
                    != weights:
                del model
                release_device(device)
                try:
                    model = load_weights(ckpt, weights, device, dtype)
                except ConfigError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
            model._bench_weights = weights
            try:
                if method not in PEERS:  # (a peer's row checks its own memory)
                    check_run_memory(model, method, batch=batch, prompt_len=context,
                                     new_tokens=args.max_new_tokens, budget=budget,
                                     options=options_for(method, args))
                row = run_peer(model, batch, context, method, args, bandwidth, device, dtype) \
                    if method in PEERS else \
                    run_one(model, batch, context, method, budget, args, bandwidth, device)
            except Exception as e:  # noqa: BLE001 (a row that fails is a row: row_error)
                if world > 1 and not isinstance(e, (ConfigError, torch.OutOfMemoryError)):
                    raise  # under torchrun the other ranks wait in a collective: end them all
                row = {**base, "error": row_error(e)}
                # nothing here may raise: a CUDA error makes every later CUDA call raise
                broken = e if device_fault(e) else release_device(device)
                if broken is not None:
                    fault = (row_label(row), broken)
        row.setdefault("compile_regime", args.compile_regime if args.compile else "eager")
        row.update(date=stamp, command=command, **provenance,
                   elapsed_s=round(time.perf_counter() - start, 1), world_size=world)
        if world > 1:  # every rank's share of the row (all ranks take part); rank 0 writes
            keys = ("kv_cache_bytes", "kv_bytes_per_step", "weight_bytes", "peak_memory_bytes")
            row["per_rank"] = tp.gather({k: row.get(k) for k in keys})
        rows.append(row)
        if rank == 0:
            write_json(prefix.with_suffix(".json"), rows)
    if rank != 0:
        tp.shutdown()
        return rows_exit_status(rows)

    first = [r for r in rows if r["weights"] == args.weights[0]]
    pngs = [] if args.no_plots or not any("error" not in r for r in first) else \
        plot(first, prefix, args.compare_context)
    if pngs and len(args.weights) > 1:
        pngs.append(plot_weights(rows, prefix))
    print(summary(rows))
    for r in rows:  # the report's warning (generate.py), one line per noisy row
        if "error" not in r and (w := spread_warning(r["decode_ms_p10"], r["decode_ms_p90"])):
            print(f"warning: {row_label(r)}: {w.removeprefix('warning: ')}", file=sys.stderr)
    print(f"measured copy bandwidth {bandwidth:.1f} GB/s")
    print(f"wrote {prefix.with_suffix('.json')}" + "".join(f"\n      {p}" for p in pngs))
    if fault is not None:
        print(fault_line(fault, rows, prefix.with_suffix(".json")), file=sys.stderr)
        return 1
    tp.shutdown()
    return rows_exit_status(rows)


def check_out_dir(out: str) -> None:
    """Fail before the load when the results root ``out`` cannot hold the results: a file in
    its place, or a folder where nothing can be created (``checkpoint.check_creatable``).

    Raises:
        ConfigError: naming ``--out`` and the path.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out}: not a directory")
    check_creatable(out, path)


def check_context(max_seq_len: int, contexts, new_tokens: int) -> None:
    """Fail before the load when a ``--context`` with ``--max-new-tokens`` decoded after it
    exceeds the model's context (read from the checkpoint's header), as the other tools do:
    every row decodes the same number of steps, so none may be cut short.

    Raises:
        ConfigError: naming the first such context and the model's context.
    """
    too_long = [c for c in contexts if c + new_tokens > max_seq_len]
    if too_long:
        raise ConfigError(f"--context {too_long[0]} + {new_tokens} new tokens exceed the "
                          f"model's context ({max_seq_len} tokens)")


def row_label(row: dict) -> str:
    """``rocketkv @256 at 32768 tokens, batch 1`` (with ``, int8 weights`` when not float): the
    configuration of a row, as an error line names it."""
    budget = f" @{row['budget']}" if row.get("budget") is not None else ""
    weights = f", {row['weights']} weights" if row.get("weights", "float") != "float" else ""
    return f"{row['method']}{budget} at {row['context']} tokens, batch {row['batch_size']}" \
        + weights
