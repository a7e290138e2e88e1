"""Decode speed and memory sweep: the RocketKV paper's Fig. 5, measured against the roofline.

    python scripts/bench.py                       # paper defaults: llama-3.1-8b, bf16, CUDA
    python scripts/bench.py --device cpu --config stories260K --context 128 256 \\
        --budgets 64 --max-new-tokens 8           # CPU smoke run (under a minute)

For every (batch size, context, method, budget) the script runs ``generate.generate`` on a
random prompt of ``context`` tokens with random weights at a model's real shapes (``--config``,
default llama-3.1-8b) or real weights (``--checkpoint``) and records, from the repeat with the
median decode step:

* ``decode_ms_median/p10/p90``: per-step latency (CUDA events around each step on GPU,
  synchronized wall clock on CPU) after the first decode steps, which compile the step or find
  it compiled and capture CUDA graphs (their time is ``compile_s``, excluded); ``tokens_per_s``;
  ``prefill_s`` (the prompt is prefilled once per run). Every row of a sweep runs under one
  compile regime (``compile_regime``): ``static`` (default) compiles each row afresh with
  static shapes (the kernels a single run gets; ``compile_s`` is each row's compile cost),
  ``dynamic`` compiles symbolic shapes once per method structure and reuses them for every
  context and budget (cheaper sweeps, possibly slower kernels). Mixing them, as reusing a
  static graph for the first row and a symbolic one for the rest would, makes rows of one
  chart incomparable.
* ``peak_memory_bytes`` {prefill, decode, total} (``torch.cuda.max_memory_allocated`` reset at
  phase boundaries; process peak RSS on CPU), ``kv_cache_bytes``, ``kv_bytes_per_step``,
  ``weight_bytes`` and ``weight_bytes_per_step``.
* ``bandwidth_gbps``: device bandwidth measured in the same run by a large device-to-device
  copy (bytes read + bytes written over the copy time), and ``roofline_ms``: the bytes that
  step must read (weights + ``kv_bytes_per_step``, what the kernels touch at our layout, whole
  32-byte sectors) over that bandwidth; ``ideal_roofline_ms`` the same with
  ``kv_ideal_bytes_per_step`` (the paper's Table 1 count).

``--weights`` adds weight-only quantization (``quantize.py``): ``float`` (default), ``int8``,
``int4-g<G>``; each mode loads the model afresh and quantizes it in place (``quantize_model``:
what loading a ``quantize.py`` checkpoint gives), so rows of several modes come from one run.
Rows carry ``weights``; charts (a)-(d) use the first mode's rows and (e) compares the modes'
per-step latency.

``gptfast_dense`` is the paper's Full-KV baseline as gpt-fast ran it; ``full`` is our Full-KV.
``transformers`` (``evals/peers.py``) is Hugging Face transformers at the same shape with its
static cache, decoding as its documentation recommends (``generate`` with
``cache_implementation="static"``, compiled on CUDA): the engine a user would otherwise pick,
in the same run, timing window and memory meter; its rows record ``transformers_version``.
Results go to ``<out>/<device>/bench-<timestamp>.json``, ``--out`` the current directory by
default (the repository's own measurements are under ``--out results``): a list of rows, the
whole file rewritten after every configuration so a run cut short keeps what it measured;
``--time-limit`` stops starting new configurations after that many seconds; a row that fails
records its ``error`` and the sweep goes on, except after a CUDA error (``cli.device_fault``:
an illegal address makes every later CUDA call fail), which ends the run with the rows after it
listed as not run, one ``error:`` line naming the row, and exit status 1. Four charts: (a)
decode speedup vs Full-KV per context and budget, (b) peak-memory saving (decode phase and
whole run), (c) per-step latency vs context with the roofline, (d) all methods at one context.
Before the weights load, the float weights and the smallest row's full-size KV cache are
checked against the free memory (``measure.check_memory``: one ``error:`` line, exit 2); a row
whose steps vary more than 4x (p90/p10) gets ``generate.py``'s ``warning:`` line
(``measure.spread_warning``).
"""

from __future__ import annotations

import argparse
import sys

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import (
    DTYPE_NAMES,
    OneLineParser,
    add_device_option,
    add_kernels_option,
    add_method_flags,
    add_time_limit_option,
    deprecated_alias,
)


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--config", metavar="NAME",
                       help="named model shape, random weights (default llama-3.1-8b)")
    which.add_argument("--checkpoint",
                       help="weights instead: a checkpoint path, a short name or random:NAME")
    p.add_argument("--methods", nargs="+",
                   help="methods, or 'all'; also 'transformers' (Hugging Face transformers "
                        "with its static cache at the same shape; default: "
                        "evals.bench.DEFAULT_METHODS, full gptfast_dense rocketkv)")
    p.add_argument("--budgets", nargs="+", type=int,
                   help="default: evals.bench.DEFAULT_BUDGETS, 256 to 4096")
    p.add_argument("--context", nargs="+", type=int,
                   help="prompt tokens (default: evals.bench.DEFAULT_CONTEXTS, 16K to 128K)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--weights", nargs="+", default=["float"],
                   help="weight modes: float, int8, int4-g<G> (G = 32, 64, 128, 256)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens decoded per run (default 64)")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (best kept)")
    p.add_argument("--seed", type=int, default=0)
    add_device_option(p)
    p.add_argument("--dtype", choices=DTYPE_NAMES)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on for cuda)")
    add_kernels_option(p)
    p.add_argument("--compile-regime", choices=["static", "dynamic", "graphs"],
                   default="static",
                   help="static (default): every row compiles its own static-shape graph "
                        "(compile cache reset per row); dynamic: one symbolic-shape graph per "
                        "method structure serves every row; graphs: no torch.compile, the "
                        "eager step captured in a CUDA graph per row (seconds, unfused)")
    p.add_argument("--compare-context", type=int, default=32768, help="context of chart (d)")
    p.add_argument("--out", default=".", metavar="DIR",
                   help="results root: files go to DIR/<device>/ (default: the current "
                        "directory; the repository's measurements live under results/)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_method_flags(p.add_argument_group(
        "method options (applied to every method that takes them)"))
    add_time_limit_option(p, "start no configuration after this many seconds (the rest are "
                             "listed as skipped); results are saved after every configuration "
                             "anyway")
    deprecated_alias(p, "--model", "--checkpoint")
    deprecated_alias(p, "--new-tokens", "--max-new-tokens")
    return p


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.sweep import (  # noqa: E402,F401  (re-exported for the tests)
    context_label,
    run,
)

if __name__ == "__main__":
    sys.exit(run(ARGS))
