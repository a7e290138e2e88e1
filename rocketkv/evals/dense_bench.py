"""The dense decode kernels (kernels/dense.py) against cuBLAS at a model's projection shapes,
over a grid of launch configurations: which one reads the weights fastest. The library
behind ``scripts/bench_dense.py`` (its command line).

For each projection of one decoder layer (q/k/v with RoPE and the token's write, the output
projection with the residual, gate/up with SwiGLU, down with the residual) and the LM head with
the final norm, at each batch size, one row per launch configuration of ours
(``kernels.dense``'s ``TARGET_PROGRAMS``, ``MAX_BLOCK_N``, ``K_BLOCK_GEMV`` or ``K_BLOCK_DOT``,
``NUM_WARPS``) and one row for ``torch.nn.functional.linear`` of the same weight (cuBLAS on
CUDA; the matmul alone, without the norm and epilogue our kernels include). Each row:
``us_median`` per launch, ``weight_bytes`` read, ``gbps`` (weight bytes / time), its ratio to
the copy bandwidth measured in the same run (``bandwidth_gbps``), and ``vs_reference`` (our
time / the reference's). On CUDA a launch is timed inside a CUDA graph of ``--reps`` launches
replayed ``--iters`` times (CUDA events), so launch overhead is not counted, as in the decode
step's graph; on CPU by wall clock. Rows go to ``--json`` (default
``./<device>/bench_dense-<time>.json`` under the current directory), saved after every shape.
The configuration the decode step launches (``default: true`` rows) is the tuned table's entry
for the launch on this GPU (``rocketkv/kernels/tuned/*.json``, ``tuned: true``) or else the module's
constants; the grid's rows time the constants with the table set aside.

``--tuned PATH`` also writes the fastest configuration of each launch (its ``key``: epilogue,
weight format, one batch row or several, K, N) as a tuned table for this GPU, with the times
behind it; committed as ``rocketkv/kernels/tuned/<name>.json`` it is what the kernels launch on
a GPU of that name from then on (``kernels.dense.launch_knobs``). Tables are read only on CUDA.

``--weights int8 int4-g128`` times the same launches on quantized weights (``quantize.py``'s
formats, dequantized in the kernel), against what the model runs without our kernels:
``Int8Linear`` (int8 converted in the matmul) and ``Int4Linear`` in torch's own int4 layout
(tinygemm on CUDA); ``weight_bytes`` are then the quantized bytes, scales included. Rows carry
``weights``.
"""

from __future__ import annotations

import datetime as dt
import importlib
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

from rocketkv import kernels
from rocketkv.cli.common import check_json_path, command_line, write_json
from rocketkv.engine.measure import device_name, percentile, sync
from rocketkv.engine.provenance import commit_fields
from rocketkv.evals.bench import measure_bandwidth, resolve_run, results_dir
from rocketkv.kernels import tuning
from rocketkv.model import ConfigError, ModelArgs, precompute_rope
from rocketkv.quantized import Int4Linear, Int8Linear, parse_weights, quantize_int4, quantize_int8

GRIDS = {  # (TARGET_PROGRAMS, MAX_BLOCK_N, K block, NUM_WARPS) tried beside the default
    "none": [],
    "quick": [(p, 32, k, w) for p, k, w in itertools.product((256, 1024), (128, 512), (4, 8))],
    "full": list(itertools.product((256, 512, 1024, 2048), (16, 32, 64), (256, 512, 1024),
                                   (4, 8))),
}


def shapes(args: ModelArgs, batch: int, device, dtype, seed: int, weights: str = "float"
           ) -> list[tuple]:
    """(name, K, weight rows, weight bytes, call, reference) per projection: ``call()`` runs
    our kernel, ``reference()`` the plain matmul of the same weight (for quantized
    ``weights``, the model's quantized layer without our kernels)."""
    g = torch.Generator(device=device).manual_seed(seed)
    mode, group = parse_weights(weights)

    def rand(*size):
        return (torch.randn(*size, generator=g, device=device) / size[-1] ** 0.5).to(dtype)

    def layer(w):
        """(weight, scales, groupsize) for our kernel, the reference on x, weight bytes."""
        if mode == "float":
            return (w, None, 0), lambda x: F.linear(x, w), w.numel() * w.element_size()
        if mode == "int8":
            ref = Int8Linear(*quantize_int8(w), dtype)
            ours = (ref.weight, ref.scales, 0)
        else:
            packed, sz = quantize_int4(w, group)
            previous = kernels.set_mode("off")  # torch's own int4 layout for the reference
            try:
                ref = Int4Linear(packed, sz, group, device, dtype)
            finally:
                kernels.set_mode(previous)
            ours = (packed, sz.to(dtype).contiguous(), group)
        return ours, ref, sum(t.numel() * t.element_size() for t in ours[:2])

    H, Hkv, D, dim, inter = (args.n_heads, args.n_kv_heads, args.head_dim, args.dim,
                             args.intermediate_size)
    x, res = rand(batch, 1, dim), rand(batch, 1, dim)
    y, g_in = rand(batch, 1, H * D), rand(batch, 1, inter)
    norm = torch.ones(dim, device=device, dtype=dtype)
    (wqkv, sqkv, gqkv), r_qkv, b_qkv = layer(rand((H + 2 * Hkv) * D, dim))
    (wo, so, go), r_o, b_o = layer(rand(dim, H * D))
    (w13, s13, g13), r_13, b_13 = layer(rand(2 * inter, dim))
    (w2, s2, g2), r_2, b_2 = layer(rand(dim, inter))
    (head, sh, gh), r_h, b_h = layer(rand(args.vocab_size, dim))
    k_cache = torch.zeros(batch, Hkv, 64, D, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.tensor([17], device=device)
    rope = precompute_rope(args, 64, device)[pos]
    store = (k_cache, v_cache, pos, None, *kernels.no_aux(k_cache))
    eps = args.norm_eps
    return [
        ("qkv_store", dim, (H + 2 * Hkv) * D, b_qkv,
         lambda: kernels.qkv_store(x, norm, eps, wqkv, None, rope, store, H, sqkv, gqkv),
         lambda: r_qkv(x)),
        ("wo+residual", H * D, dim, b_o,
         lambda: kernels.linear(y, wo, residual=res, scales=so, groupsize=go), lambda: r_o(y)),
        ("w13+swiglu", dim, 2 * inter, b_13,
         lambda: kernels.linear(x, w13, norm, eps, swiglu=True, scales=s13, groupsize=g13),
         lambda: r_13(x)),
        ("w2+residual", inter, dim, b_2,
         lambda: kernels.linear(g_in, w2, residual=res, scales=s2, groupsize=g2),
         lambda: r_2(g_in)),
        ("lm_head", dim, args.vocab_size, b_h,
         lambda: kernels.linear(x, head, norm, eps, scales=sh, groupsize=gh), lambda: r_h(x)),
    ]


def time_us(fn, device: torch.device, iters: int, reps: int) -> float:
    """Median microseconds per call of ``fn``: on CUDA from a graph of ``reps`` calls replayed
    ``iters`` times (after a warm-up call that compiles the kernel), else wall clock."""
    fn()
    sync(device)
    times = []
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / reps)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return percentile(times, 50)


def launch_key(call, dense) -> str:
    """The tuned-table key (``dense.launch_key``) of the one launch ``call`` makes."""
    keys, original = [], dense.launch_key

    def spy(*a):
        keys.append(original(*a))
        return keys[-1]

    dense.launch_key = spy
    try:
        call()
    finally:
        dense.launch_key = original
    if len(keys) != 1:
        raise RuntimeError(f"expected one dense launch, saw {len(keys)}")
    return keys[0]


def tuned_entries(rows: list[dict]) -> list[dict]:
    """Per launch key, the fastest of our rows: its knobs (``config``) and the times behind
    the choice (the default's and the reference's, microseconds)."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["kernel"] != "ours" or "error" in r:
            continue
        e = out.setdefault(r["key"], {"key": r["key"], "shape": r["shape"],
                                      "weights": r["weights"], "batch_size": r["batch_size"],
                                      "us": float("inf")})
        if r["default"]:
            e["default_us"], e["reference_us"] = r["us_median"], r["reference_us"]
        if r["us_median"] < e["us"]:
            e["config"], e["us"] = r["config"], r["us_median"]
    return list(out.values())


def run(args, argv=None) -> int:
    """Time the launches as the parsed arguments ``args`` say (``argv``: the command recorded,
    the process's own when None); the exit status."""
    args.compile, args.kernels = None, None  # resolve_run's other flags: not read here
    try:
        device, dtype = resolve_run(args)
        for flag in ("iters", "reps"):
            if getattr(args, flag) <= 0:
                raise ConfigError(f"--{flag} must be positive")
        if any(b <= 0 for b in args.batch_sizes):
            raise ConfigError("--batch-sizes must be positive")
        for spec in args.weights:
            parse_weights(spec)
        check_json_path(args.json)
        check_json_path(args.tuned, "--tuned")
        previous = kernels.set_mode("force")  # the kernels on this device, whatever it is
        if kernels.ops() is None:
            raise ConfigError(f"the kernels need triton: {kernels.missing()}")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("on CPU the kernels run only in Triton's interpreter: set "
                              "TRITON_INTERPRET=1")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dense = importlib.import_module("rocketkv.kernels.dense")  # imported by kernels.ops() above

    knobs = dense.launch_knobs
    margs = ModelArgs.from_name(args.config)
    bandwidth = measure_bandwidth(device)
    rows = []
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.json:
        path = args.json
    else:  # under the current directory, not the repository's results/
        (out_dir := results_dir(".", device)).mkdir(parents=True, exist_ok=True)
        path = str(out_dir / f"bench_dense-{stamp}.json")

    meta = {"device": device_name(device), "torch_version": torch.__version__,
            "model": args.config, "dtype": str(dtype).removeprefix("torch."),
            "command": command_line("bench_dense.py", argv),
            **commit_fields()}

    def save() -> None:  # after every shape: a run cut off keeps the rows it has
        write_json(path, {**meta, "results": rows})
        if args.tuned:
            write_json(args.tuned, {**meta, "device": tuning.table_device(device), "rows": path,
                                    "launches": tuned_entries(rows)})

    with torch.no_grad():
        for spec, batch in itertools.product(args.weights, args.batch_sizes):
            configs = [{"TARGET_PROGRAMS": dense.TARGET_PROGRAMS, "MAX_BLOCK_N": dense.MAX_BLOCK_N,
                        "K_BLOCK": dense.K_BLOCK_GEMV if batch == 1 else dense.K_BLOCK_DOT,
                        "NUM_WARPS": dense.NUM_WARPS}]  # the module's constants
            configs += [dict(zip(dense.KNOBS, c)) for c in GRIDS[args.grid]]
            for name, K, n_rows, nbytes, call, reference in shapes(margs, batch, device, dtype,
                                                                   args.seed, spec):
                ref_us = time_us(reference, device, args.iters, args.reps)
                key = launch_key(call, dense)
                tuned = dense.tuned_table(device).get(key)
                # the decode step launches the table's knobs where it has them: the default's
                launches = [dict(tuned) if tuned else configs[0], *configs[1:]]
                base = {"shape": name, "weights": spec, "batch_size": batch, "K": K,
                        "weight_rows": n_rows, "weight_bytes": nbytes, "key": key,
                        "bandwidth_gbps": bandwidth, "reference_us": ref_us}
                ref_name = "F.linear" if spec == "float" else f"torch {spec}"
                rows.append({**base, "kernel": ref_name, "us_median": ref_us,
                             "gbps": nbytes / ref_us / 1e3,
                             "of_bandwidth": nbytes / ref_us / 1e3 / bandwidth})
                mine = []
                for i, config in enumerate(launches):
                    dense.launch_knobs = lambda *_, c=config: c  # this launch's knobs
                    try:
                        us = time_us(call, device, args.iters, args.reps)
                    except Exception as e:  # noqa: BLE001 (a configuration that fails is a row)
                        rows.append({**base, "kernel": "ours", "config": config,
                                     "default": i == 0, "error": f"{type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''}"})
                        continue
                    finally:
                        dense.launch_knobs = knobs
                    mine.append({**base, "kernel": "ours", "config": config, "default": i == 0,
                                 "tuned": i == 0 and tuned is not None,
                                 "us_median": us, "gbps": nbytes / us / 1e3,
                                 "of_bandwidth": nbytes / us / 1e3 / bandwidth,
                                 "vs_reference": us / ref_us})
                    rows.append(mine[-1])
                best = min(mine, key=lambda r: r["us_median"], default=None)
                dflt = next((r for r in mine if r["default"]), None)
                print(f"{name:12s} {spec:9s} batch {batch:3d}: {ref_name} {ref_us:8.1f} us"
                      + (f"  ours (default) {dflt['us_median']:8.1f} us" if dflt else "")
                      + (f"  best {best['us_median']:8.1f} us {best['config']}" if best else ""),
                      flush=True)
                save()
    kernels.set_mode(previous)
    print(f"rows: {path}")
    return 1 if any("error" in r for r in rows) else 0

