"""Check bench results against the speed and memory targets, as a Markdown table.

    python tools/check_targets.py results/NVIDIA-H200/bench-*.json
    python tools/check_targets.py results/NVIDIA-H200/bench-*.json \
        results/NVIDIA-H200/profile-*.json --json targets.json

Reads ``scripts/bench.py`` result files (rows of every file together; a later row replaces an
earlier one of the same configuration) and ``scripts/profile_step.py`` files (kernels per
layer), and reports, per target, what was measured, the limit and ``pass`` / ``FAIL`` / ``not
measured`` (the configuration is missing or errored). Rows from the meta device
(``scripts/predict_memory.py``) are never taken as measurements. Exit status 0 when every
target that was measured passed, 1 otherwise, 2 on bad input.

Targets (llama-3.1-8b shape, bf16, batch 1 unless said; the issue that set each limit):

* ``full`` decode step within 1.2x of its roofline (weights + whole KV) at every context (28);
* ``rocketkv`` at budget 256 within 1.25x of its roofline at every context up to 128K (27);
* ``rocketkv`` at 256 at least 3.5x faster than ``gptfast_dense`` at 96K (98304 tokens);
* whole-run peak memory of ``rocketkv`` at 256 at 128K at most 20 GB (1e9 bytes) and at least
  40% below ``full``'s;
* batch 16 at 32K: ``rocketkv`` at 256 at least 4x the tokens/s of ``full`` (27);
* the default sweep (every default configuration of ``bench.py`` in one run) within 600 s,
  none skipped by ``--time-limit``;
* int4 weights (``bench.py --weights int4-g<G>``) with ``rocketkv`` at 256 at 128K at least 6x
  faster than float ``full`` at the same context, whole-run peak under 10 GB (28);
* ``rocketkv`` at 256 at least 1.9x faster per decode step than ``full`` at 128K (27);
* at 32K every selecting method (``rocketkv``, ``hybrid``, ``quest``, ``sparq``,
  ``exact_topk``) at 256 faster than ``full`` (27), and ``rocketkv`` at least 1.2x (27);
* our ``full`` at least 1.3x faster per step than ``transformers``' static cache at 32K, and
  ``rocketkv`` at 256 at least 3x faster than it at 128K, rows of one run (28);
* int4 ``full`` at 32K within 1.3x of its own roofline (28);
* compile and graph capture (``compile_s``) at most 20 s for every row of ours that compiles
  or captures a CUDA graph (28; a peer's own compile is not ours to judge);
* at most 6 kernels per layer in a ``rocketkv`` @256 decode step (a profile file) (27).

A configuration measured with several kernel settings (``bench.py --kernels on``, ``sparse``
or ``off``, ``profile_step.py --kernels off``: comparisons) is judged on the rows that ran
what ``--kernels auto`` runs there today, the engine's step: the sparse kernels, and the dense
ones only where the GPU's tuned table (``rocketkv/kernels/tuned/``) timed them faster than
cuBLAS; the rows that ran the most kernels where no row ran that; the others neither replace
nor count.

Rows are judged per compile regime (``compile_regime``: ``static``, ``dynamic``, ``graphs``,
``eager``; rows from before the field are ``static`` when compiled): the same configuration
measured compiled and as a CUDA graph of the eager step is two measurements, and a table mixing
them would judge neither. One table per regime present; a peer's rows (``transformers``, which
compiles itself) join the tables of their own run's regimes, paired with ours by run as before.
Exit status 1 when any table has a FAIL.

Only rows of the targets' setting count: the llama-3.1-8b shape in bfloat16 on a GPU (not
``cpu``). Rows of another model, dtype or device make every target "not applicable" (with what
the rows are) rather than FAIL; quantized rows count only for the int4 target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: tools/_here.py)

from rocketkv.flags import OneLineParser


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench result JSON files")
    p.add_argument("--json", metavar="PATH", help="write the target results here")
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
from rocketkv.cli.common import write_json
from rocketkv.evals.bench import DEFAULT_BUDGETS, DEFAULT_CONTEXTS, DEFAULT_METHODS, REGIMES
from rocketkv.evals.peers import PEERS
from rocketkv.kernels import tuning

K96, K128, K32 = 98304, 131072, 32768
GB = 1e9
SELECTING = ("rocketkv", "hybrid", "quest", "sparq", "exact_topk")


def regime(r: dict) -> str | None:
    """A row's compile regime: its ``compile_regime``, else ``static`` for a compiled row of
    before the field and ``eager`` for an uncompiled one; None for a peer's row and for an
    errored row that says nothing (they join the regimes of their run)."""
    if r.get("method") in PEERS:
        return None
    if r.get("compile_regime"):
        return r["compile_regime"]
    if r.get("compiled") is not None:
        return "static" if r["compiled"] else "eager"
    return None


def _config(r: dict) -> tuple:
    return (r.get("model"), r.get("dtype"), r.get("weights", "float"), r["method"],
            r.get("budget"), r["context"], r["batch_size"], bool(r.get("profile")), regime(r))


def _kernels(r: dict) -> tuple[bool, bool]:
    """Which of our kernels a row ran: (sparse, dense); (False, False) for the PyTorch path
    and for rows from before the fields."""
    return bool(r.get("fused_kernels")), bool(r.get("dense_kernels"))


def _key(r: dict) -> tuple:
    return _config(r) + _kernels(r)


def default_kernels(device: str | None) -> tuple[bool, bool]:
    """What ``--kernels auto`` runs on the GPU named ``device`` today: (sparse, dense), the
    dense kernels where its tuned table timed them faster (``kernels.tuning``)."""
    return True, bool(device) and tuning.table_for(device).dense_faster


def engine_rows(rows: list[dict]) -> list[dict]:
    """The rows of the engine's own step: of a configuration measured with several kernel
    settings (``--kernels on``, ``sparse`` or ``off``: comparisons, such as the kernel count
    before them), the rows that ran what the default runs there today (``default_kernels``),
    else the rows that ran the most kernels; an errored row counts as the configuration's
    when no row of it ran."""
    ran: dict[tuple, set[tuple[bool, bool]]] = {}
    device: dict[tuple, str | None] = {}
    for r in rows:
        if "error" not in r:
            ran.setdefault(_config(r), set()).add(_kernels(r))
            device.setdefault(_config(r), r.get("device"))
    best = {}
    for config, kinds in ran.items():
        want = default_kernels(device[config])
        best[config] = want if want in kinds else max(kinds)
    return [r for r in rows if _kernels(r) == best.get(_config(r), _kernels(r))]


def _profile_rows(data: dict) -> list[dict]:
    """A ``profile_step.py`` file's results as rows (``profile``: True; batch 1)."""
    meta = {k: data.get(k) for k in ("device", "model", "dtype")}
    return [{**meta, **{k: r.get(k) for k in ("method", "budget", "context",
                                               "kernels_per_layer", "kernels_per_step",
                                               "fused_kernels", "dense_kernels", "compiled",
                                               "compile_regime")},
             "batch_size": 1, "profile": True} for r in data["results"]]


def load_rows(paths: list[str]) -> list[dict]:
    """Rows of every file (later files replace earlier rows of the same configuration).

    Raises:
        ValueError: a file that is missing, not JSON, or not a list of bench rows.
    """
    rows: dict[tuple, dict] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        if isinstance(data, dict) and isinstance(data.get("results"), list) and all(
                isinstance(r, dict) and "kernels_per_layer" in r for r in data["results"]):
            data = _profile_rows(data)
        if not isinstance(data, list) or not all(
                isinstance(r, dict) and {"method", "context", "batch_size"} <= r.keys()
                for r in data):
            raise ValueError(f"{path} is not a list of bench rows or a kernel profile")
        for r in data:
            if r.get("device") == "meta" or r.get("predicted"):
                continue  # predictions are not measurements
            rows[_key(r)] = r
    return list(rows.values())


def by_regime(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by compile regime (``regime``), in the order first seen. A row without
    one (a peer's; an errored row of before the field) joins every regime of its run (rows
    of its ``date``), or every regime where its run has none."""
    groups: dict[str, list[dict]] = {}
    of_run: dict[object, set[str]] = {}
    for r in rows:
        g = regime(r)
        if g is not None:
            groups.setdefault(g, []).append(r)
            of_run.setdefault(r.get("date"), set()).add(g)
    for r in rows:
        if regime(r) is None:
            for g in of_run.get(r.get("date")) or list(groups) or ["-"]:
                groups.setdefault(g, []).append(r)
    return groups


def _ok(rows, **kw):
    return [r for r in rows if "error" not in r and all(r.get(k) == v for k, v in kw.items())]


def _one(rows, **kw):
    found = _ok(rows, **kw)
    return found[0] if found else None


def _result(target: str, limit: str, measured: str | None, passed: bool = False) -> dict:
    status = "not measured" if measured is None else ("pass" if passed else "FAIL")
    return {"target": target, "limit": limit, "measured": measured, "status": status}


def _roofline_target(rows, method, budget, limit, max_context=None) -> dict:
    pts = sorted(_ok(rows, method=method, budget=budget, batch_size=1),
                 key=lambda r: r["context"])
    pts = [r for r in pts if max_context is None or r["context"] <= max_context]
    name = f"{method}{'' if budget is None else f' @{budget}'} step / roofline, every context"
    ratios = {r["context"]: r["decode_ms_median"] / r["roofline_ms"] for r in pts}
    measured = ", ".join(f"{c}: {x:.2f}x" for c, x in ratios.items()) if pts else None
    return _result(name, f"<= {limit}x", measured, bool(pts) and max(ratios.values()) <= limit)


def run_peak(r: dict) -> int:
    """A configuration's whole-run peak (bytes): the larger of its prefill and decode peaks.
    Its caches are allocated before prefill and live through both, so the set-up is inside.
    A row's ``total`` from before the fix of generate()'s meter (2026-11-22) also counted the
    caches the previous row of the same process still held when this one started."""
    p = r["peak_memory_bytes"]
    return max(p["prefill"], p["decode"])


def _sweep_target(rows: list[dict]) -> dict:
    """The default sweep (``bench.py`` with no configuration flags) within 600 s: judged on a
    run (rows of one ``date``) that holds every default configuration; a configuration that
    ``--time-limit`` skipped fails it."""
    default = {(m, b, c) for c in DEFAULT_CONTEXTS for m in DEFAULT_METHODS
               for b in (DEFAULT_BUDGETS if m == "rocketkv" else (None,))}
    runs: dict[str, list[dict]] = {}
    for r in rows:
        if "date" in r and r["batch_size"] == 1 and r.get("weights", "float") == "float":
            runs.setdefault(r["date"], []).append(r)
    found, passed = [], True
    for date, rs in sorted(runs.items()):
        if not default <= {(r["method"], r.get("budget"), r["context"]) for r in rs}:
            continue
        skipped = sum(str(r.get("error", "")).startswith("skipped") for r in rs)
        elapsed = max(r.get("elapsed_s", 0.0) for r in rs)
        found.append(f"{date}: {elapsed:.0f} s" + (f", {skipped} of {len(default)} "
                                                   "configurations skipped" if skipped else ""))
        passed = passed and not skipped and elapsed <= 600
    return _result(f"the default sweep ({len(default)} configurations) in one run", "<= 600 s",
                   "; ".join(found) or None, bool(found) and passed)


TARGET_MODEL, TARGET_DTYPE = "llama-3.1-8b", "bfloat16"


def applicable(r: dict) -> bool:
    """Whether a row is of the targets' setting (model, dtype, a GPU)."""
    return (r.get("model") == TARGET_MODEL and r.get("dtype") == TARGET_DTYPE
            and r.get("device") not in (None, "cpu", "meta"))


def evaluate(rows: list[dict]) -> list[dict]:
    """One result per target: target, limit, measured (text or None), status (``pass``,
    ``FAIL``, ``not measured`` or ``not applicable``)."""
    fit = [r for r in rows if applicable(r)]
    out = _evaluate(fit)
    if rows and not fit:
        seen = sorted({f"{r.get('model')} {r.get('dtype')} on {r.get('device')}" for r in rows})
        why = (f"rows are {', '.join(seen)}; the targets are for {TARGET_MODEL} "
               f"{TARGET_DTYPE} on a GPU")
        for t in out:
            t.update(status="not applicable", measured=why)
    return out


def _evaluate(every_row: list[dict]) -> list[dict]:
    every_row = engine_rows(every_row)
    profiles = [r for r in every_row if r.get("profile")]
    all_rows = [r for r in every_row if not r.get("profile")]
    rows = [r for r in all_rows if r.get("weights", "float") == "float"]
    out = [_roofline_target(rows, "full", None, 1.2),
           _roofline_target(rows, "rocketkv", 256, 1.25, max_context=K128)]

    a, b = _one(rows, method="rocketkv", budget=256, context=K96, batch_size=1), \
        _one(rows, method="gptfast_dense", context=K96, batch_size=1)
    x = b["decode_ms_median"] / a["decode_ms_median"] if a and b else None
    out.append(_result("rocketkv @256 speedup vs gptfast_dense at 96K", ">= 3.5x",
                       None if x is None else f"{x:.2f}x", x is not None and x >= 3.5))

    big = [r for r in _ok(rows, batch_size=1) if r["context"] >= K128 - 128]
    rocket128 = next((r for r in big if r["method"] == "rocketkv" and r["budget"] == 256), None)
    full128 = next((r for r in big if r["method"] == "full" and r["context"] == (
        rocket128 or {}).get("context")), None)
    measured, passed = None, False
    if rocket128 and full128:
        pa, pb = run_peak(rocket128), run_peak(full128)
        measured = f"{pa / GB:.2f} GB vs {pb / GB:.2f} GB ({100 * (1 - pa / pb):.1f}%)"
        passed = pa <= 20 * GB and 1 - pa / pb >= 0.4
    out.append(_result("whole-run peak memory, rocketkv @256 at 128K (saving vs full)",
                       "<= 20 GB and >= 40%", measured, passed))

    a, b = _one(rows, method="rocketkv", budget=256, context=K32, batch_size=16), \
        _one(rows, method="full", context=K32, batch_size=16)
    x = a["tokens_per_s"] / b["tokens_per_s"] if a and b else None
    out.append(_result("batch 16 at 32K: rocketkv @256 tokens/s vs full", ">= 4x",
                       None if x is None else f"{x:.2f}x", x is not None and x >= 4))

    out.append(_sweep_target(all_rows))

    q = [r for r in all_rows if "error" not in r and r["batch_size"] == 1
         and r.get("weights", "").startswith("int4") and r["method"] == "rocketkv"
         and r["budget"] == 256 and r["context"] >= K128 - 128]
    a = q[0] if q else None
    b = _one(rows, method="full", context=a["context"], batch_size=1) if a else None
    measured, passed = None, False
    if a and b:
        x, peak = b["decode_ms_median"] / a["decode_ms_median"], run_peak(a)
        measured = f"{x:.2f}x, peak {peak / GB:.2f} GB ({a['weights']})"
        passed = x >= 6 and peak < 10 * GB
    out.append(_result("int4 + rocketkv @256 vs float full at 128K (decode step; peak)",
                       ">= 6x and < 10 GB", measured, passed))

    x = full128["decode_ms_median"] / rocket128["decode_ms_median"] \
        if rocket128 and full128 else None
    out.append(_result("rocketkv @256 decode step vs full at 128K", ">= 1.9x",
                       None if x is None else f"{x:.2f}x", x is not None and x >= 1.9))

    full32 = _one(rows, method="full", context=K32, batch_size=1)
    sel = {m: _one(rows, method=m, budget=256, context=K32, batch_size=1) for m in SELECTING}
    got = {m: full32["decode_ms_median"] / r["decode_ms_median"]
           for m, r in sel.items() if r and full32}
    out.append(_result("32K: every selecting method @256 faster than full", "> 1x each",
                       ", ".join(f"{m} {x:.2f}x" for m, x in got.items()) or None,
                       len(got) == len(SELECTING) and min(got.values()) > 1))
    x = got.get("rocketkv")
    out.append(_result("32K: rocketkv @256 speedup vs full", ">= 1.2x",
                       None if x is None else f"{x:.2f}x", x is not None and x >= 1.2))

    for method, budget, context, limit in (("full", None, K32, 1.3),
                                           ("rocketkv", 256, K128, 3.0)):
        peer = [r for r in _ok(rows, method="transformers", batch_size=1)
                if abs(r["context"] - context) <= 128]
        ours = [r for r in _ok(rows, method=method, budget=budget, batch_size=1)
                if peer and r["context"] == peer[0]["context"] and r.get("date") ==
                peer[0].get("date")]
        x = peer[0]["decode_ms_median"] / ours[0]["decode_ms_median"] if ours else None
        label = method + ("" if budget is None else f" @{budget}")
        out.append(_result(f"{label} vs transformers' static cache at {context // 1024}K "
                           "(same run)", f">= {limit}x",
                           None if x is None else f"{x:.2f}x", x is not None and x >= limit))

    q = [r for r in all_rows if "error" not in r and r["batch_size"] == 1
         and r.get("weights", "").startswith("int4") and r["method"] == "full"
         and r["context"] == K32]
    x = q[0]["decode_ms_median"] / q[0]["roofline_ms"] if q else None
    out.append(_result("int4 full at 32K step / its roofline", "<= 1.3x",
                       None if x is None else f"{x:.2f}x ({q[0]['weights']})",
                       x is not None and x <= 1.3))

    compiled = [r for r in all_rows if "error" not in r and r["method"] not in PEERS
                and regime(r) != "eager" and r.get("compile_s") is not None]
    worst = max(compiled, key=lambda r: r["compile_s"], default=None)
    out.append(_result("compile + capture per row of ours (worst)", "<= 20 s",
                       None if worst is None else f"{worst['compile_s']:.1f} s ({worst['method']}"
                       f", {worst['context']})", worst is not None and worst["compile_s"] <= 20))

    prof = [r for r in profiles if r["method"] == "rocketkv" and r.get("budget") == 256]
    worst = max(prof, key=lambda r: r["kernels_per_layer"], default=None)
    fused = "off" if worst is None or not worst.get("fused_kernels") else \
        "all" if worst.get("dense_kernels") else "sparse"
    out.append(_result("kernels per layer, rocketkv @256 decode step", "<= 6",
                       None if worst is None else f"{worst['kernels_per_layer']:.1f} "
                       f"({worst['context']}, fused kernels {fused})",
                       worst is not None and worst["kernels_per_layer"] <= 6))
    return out


def markdown(results: dict[str, list[dict]], rows: list[dict]) -> str:
    """One table per regime (``results``: regime -> ``evaluate``'s results)."""
    devices = sorted({r.get("device", "?") for r in rows}) or ["none"]
    lines = [f"device: {', '.join(devices)}"]
    for g, res in results.items():
        lines += ["", f"rows: {g} ({REGIMES.get(g, 'no rows' if g == '-' else g)})", "",
                  "| target | limit | measured | status |", "|---|---|---|---|"]
        for t in res:
            lines.append(f"| {t['target']} | {t['limit']} | {t['measured'] or '-'} | "
                         f"{t['status']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(a) -> int:
    """Check the rows the parsed arguments ``a`` name; the exit status."""
    try:
        rows = load_rows(a.results)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {g: evaluate(rs) for g, rs in (by_regime(rows) or {"-": []}).items()}
    print(markdown(results, rows))
    if a.json:
        write_json(a.json, [{"regime": g, **t} for g, res in results.items() for t in res])
    return 1 if any(t["status"] == "FAIL" for res in results.values() for t in res) else 0


if __name__ == "__main__":
    sys.exit(run(ARGS))
