"""Where one decode step's time goes: the kernels of the compiled decode step by GPU time.
The library behind ``scripts/profile_step.py`` (its command line).

For each method (and budget) a random-weight model at a named shape prefills ``--context``
tokens, decodes through ``generate()`` exactly as ``bench.py`` does (compiled, CUDA graphs on
GPU; ``--compile-regime graphs``: the eager step captured in a CUDA graph, as ``bench.py
--compile-regime graphs``), and ``torch.profiler`` records ``--steps`` decode steps after the
warm-up (compilation and graph capture are not recorded; the host waits for the device
before the profiler starts and before it stops, so the trace holds exactly those steps).
Kernels are grouped by name and ranked by their device time per step (microseconds). Writes
``profile-<context>.json`` (every kernel) and ``profile-<context>.md`` (the ``--top`` kernels
per method, with the share of the step each takes) under ``--out``, both rewritten whole after
every method, so a run cut off keeps the methods it finished. A method that fails is a row with
its ``error`` (the run goes on; exit status 1 at the end); a CUDA error (``cli.device_fault``:
an illegal address leaves every later CUDA call failing) ends the run there, the methods after
it listed as not run, with one ``error:`` line naming the method and exit status 1.

On CPU (tests, no GPU) the profiler records CPU operators instead of kernels; the figures are
then CPU times and the files say so (``activity: cpu``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from rocketkv.cli.common import (
    check_json_path,
    command_line,
    device_fault,
    release_device,
    row_error,
    rows_exit_status,
    write_json,
)
from rocketkv.compression import check_methods, options_for
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.engine.measure import device_name
from rocketkv.engine.provenance import commit_fields
from rocketkv.evals.bench import REGIMES, resolve_run
from rocketkv.evals.harness import configurations
from rocketkv.formats.checkpoint import RANDOM_PREFIX, load_model
from rocketkv.kernels import tuning
from rocketkv.model import CONFIGS, ConfigError


def _device_us(event, cuda: bool) -> float:
    """Total time of a ``key_averages()`` entry in us: device time on CUDA (the attribute is
    ``device_time_total`` from torch 2.4, ``cuda_time_total`` before), self CPU time on CPU."""
    if not cuda:
        return event.self_cpu_time_total
    for name in ("self_device_time_total", "device_time_total", "cuda_time_total"):
        if hasattr(event, name):
            return getattr(event, name)
    raise RuntimeError("torch.profiler event has no device time attribute")


def profile_one(model, method: str, budget, context: int, steps: int, args, device) -> dict:
    """Profile ``steps`` decode steps of ``method``; kernels sorted by time per step (us)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.args.vocab_size, (1, context), generator=gen)
    graphs = args.compile and args.compile_regime == "graphs"
    if args.compile and not graphs:
        torch._dynamo.reset()  # this configuration's own static graph, as bench.py's rows
    warm = (2 if graphs else 3) + 2  # generate()'s warm-up, then two untimed steps: unrecorded
    prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])

    def window(tokens):  # the host waits for the device at both edges: exactly `steps` steps
        n = tokens.shape[1]  # tokens so far: n - 1 decode steps have run
        if n - 1 in (warm, warm + steps):
            if cuda:
                torch.cuda.synchronize(device)
            if n - 1 == warm:
                prof.start()
            else:
                prof.stop()

    r = generate(model, prompt, CacheRequest(method, budget, options=options_for(method, args)),
                 max_new_tokens=warm + steps + 2,
                 step=StepConfig(compile=args.compile and not graphs, cuda_graphs=graphs),
                 on_token=window)
    kernels = {}
    for e in prof.key_averages():
        us = _device_us(e, cuda)
        if us > 0:
            k = kernels.setdefault(e.key, {"name": e.key, "us_per_step": 0.0, "calls_per_step": 0})
            k["us_per_step"] += us / steps
            k["calls_per_step"] += e.count / steps
    rows = sorted(kernels.values(), key=lambda k: -k["us_per_step"])
    total = sum(k["us_per_step"] for k in rows)
    launches = sum(k["calls_per_step"] for k in rows)  # kernels (operators on CPU) per step
    for k in rows:
        k["share"] = k["us_per_step"] / total if total else 0.0
    return {"method": method, "budget": budget, "context": context, "steps": steps,
            "activity": "cuda" if cuda else "cpu", "total_us_per_step": total,
            "decode_ms_median": r["decode_ms_median"], "compiled": r["compiled"],
            "compile_regime": "graphs" if graphs else "static" if r["compiled"] else "eager",
            "fused_kernels": r["fused_kernels"], "dense_kernels": r["dense_kernels"],
            "kernel_tuning": tuning.describe(device) if r["fused_kernels"] else None,
            "kernels_per_step": launches,
            "kernels_per_layer": launches / model.args.n_layers, "kernels": rows}


def label(res: dict) -> str:
    """``rocketkv @256`` or ``full``: a row's method and budget."""
    return res["method"] + (f" @{res['budget']}" if res["budget"] is not None else "")


def markdown(results: list[dict], top: int, header: str) -> str:
    lines = [header, ""]
    for res in results:
        if "error" in res:
            lines += [f"### {label(res)}, context {res['context']}: error: {res['error']}", ""]
            continue
        unit = "kernel" if res["activity"] == "cuda" else "CPU operator"
        fused = "all fused kernels" if res.get("dense_kernels") else \
            "sparse fused kernels" if res.get("fused_kernels") else "PyTorch path"
        lines += [f"### {label(res)}, context {res['context']}: "
                  f"{res['total_us_per_step']:.0f} us of {unit} time per step (decode median "
                  f"{res['decode_ms_median']:.3f} ms)", "",
                  f"{res['kernels_per_step']:.0f} {unit}s per step, "
                  f"{res['kernels_per_layer']:.1f} per layer ({fused}; "
                  f"{REGIMES[res.get('compile_regime', 'static')]}).", "",
                  f"| {unit} | us / step | calls / step | share |", "|---|---|---|---|"]
        for k in res["kernels"][:top]:
            name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
            name = name.replace("|", "\\|")
            lines.append(f"| `{name}` | {k['us_per_step']:.1f} | {k['calls_per_step']:.1f} | "
                         f"{100 * k['share']:.1f}% |")
        lines.append("")
    return "\n".join(lines)


def run(args, argv=None) -> int:
    """Profile as the parsed arguments ``args`` say (``argv``: the command recorded, the
    process's own when None); the exit status."""
    try:
        device, dtype = resolve_run(args)
        if args.compile_regime == "graphs" and device.type != "cuda":
            raise ConfigError(f"--compile-regime graphs needs a CUDA device, not {device.type}")
        if args.config not in CONFIGS:
            raise ConfigError(f"--config: unknown model shape {args.config!r} (choose from "
                              f"{', '.join(CONFIGS)})")
        check_methods(args.methods)
        for flag in ("context", "steps", "top"):
            if getattr(args, flag) <= 0:
                raise ConfigError(f"--{flag} must be positive")
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {out}: {e.strerror or e}") from None
        check_json_path(str(out / f"profile-{args.context}.json"), "--out")
        model = load_model(RANDOM_PREFIX + args.config, device, dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = command_line("profile_step.py", argv)
    meta = {"device": device_name(device), "torch_version": torch.__version__,
            "model": args.config, "dtype": str(dtype).removeprefix("torch."),
            "command": command, **commit_fields()}
    header = (f"Kernels of one decode step by time, {meta['device']}, torch "
              f"{meta['torch_version']}, {meta['model']} random weights, {meta['dtype']}, batch 1, "
              f"mean over {args.steps} steps.\n\n`{command}`")
    results, fault = [], None  # fault: (the failing row's label, its error): the device broke

    def save():  # every finished row on disk at once: a run cut off later keeps it
        write_json(out / f"profile-{args.context}.json", {**meta, "results": results})
        md = out / f"profile-{args.context}.md"
        tmp = md.with_name(md.name + ".tmp")
        tmp.write_text(markdown(results, args.top, header) + "\n")
        os.replace(tmp, md)

    for method, budget in configurations(args.methods, args.budgets):
        base = {"method": method, "budget": budget, "context": args.context}
        if fault is not None:
            results.append({**base, "error": f"skipped: not run after the CUDA error of "
                                             f"{fault[0]}"})
            continue
        try:
            results.append(profile_one(model, method, budget, args.context, args.steps, args,
                                       device))
        except Exception as e:  # noqa: BLE001 (a method that fails is a row: row_error)
            results.append({**base, "error": row_error(e)})
            # nothing here may raise: a CUDA error makes every later CUDA call raise
            broken = e if device_fault(e) else release_device(device)
            if broken is not None:
                fault = (label(results[-1]) + f" at {args.context} tokens", broken)
        save()
    if fault is not None:  # the rows after the fault, listed as not run
        save()
    print(markdown(results, args.top, header))
    if fault is not None:
        e = fault[1]
        print(f"error: {fault[0]}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}; "
              f"the device is unusable after it, so the run stopped (rows so far saved in "
              f"{out / f'profile-{args.context}.json'})", file=sys.stderr)
        return 1
    return rows_exit_status(results, "methods")

