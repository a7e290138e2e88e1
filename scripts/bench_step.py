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
  in ``view_ops``), so each is at least one kernel launch in eager mode; ``topk_ops`` (topk
  and sort: the top-r dims are a stable sort, ``compression.selection.top_r_dims``) and
  ``gather_ops`` (gather, index, index_select, index_copy, scatter) singled out.
* ``cuda_kernels`` (CUDA only): kernels the profiler sees in one step of the timed function
  (compiled or eager, as timed).
* ``bytes_read_per_step`` (what the step's kernels touch at our layout, 32-byte sectors where a
  gather is strided) and ``ideal_bytes_per_step`` (the paper's Table 1 count), and the
  ``roofline_ms`` of each at the bandwidth a device-to-device copy reaches in the same run.

Compile regime: with ``--compile`` every row compiles its own step with static shapes (the
compile cache is reset between rows), so no row runs a symbolic-shape graph left by another;
with ``--cuda-graphs`` (CUDA only) the eager step is captured in a CUDA graph once per row
(about a second, no compile) and the timed steps replay it.

``--knob NAME=V1,V2,...`` (repeatable) repeats every configuration at each combination of the
fused kernels' launch constants (``kernels.sparse``: ``SPLIT_PAGES``, the pages one program
chooses over before the selection splits; ``PREFIX_SPLIT`` and ``PREFIX_PROGRAMS``, the
split of Full-KV's attention over the sequence; ``ATTEND_TOKENS``, slots an attention loop
iteration loads; ``SPLIT_TOKENS``, selections that attend in one program; ``SCORE_BLOCK``,
pages a scoring iteration takes; ``PREFIX_WARPS``, warps of Full-KV's attention;
``NUM_WARPS``, of the other sparse kernels), to choose them on a GPU; ``--split-pages N
...`` is ``--knob SPLIT_PAGES=N,...``. Each row records ``knobs`` (every constant's value as
it ran), ``setting`` (its combination's index), ``split_pages`` and ``fused_kernels`` (whether
the Triton kernels ran: CUDA with triton). ``--tuned PATH`` also writes the combination whose
steps are fastest relative to each configuration's best (``best_setting``; among those whose
every row ran) as a tuned table for this GPU, with every combination's figures; committed
under ``rocketkv/kernels/tuned/`` its constants are what ``kernels.sparse`` runs with on a GPU
of that name (``kernels.tuning``).

Methods whose layers differ (omnikv, duoattention) have no single representative layer and are
refused; use ``scripts/bench.py``. Results: ``--json`` (default
``./<device>/bench_step-<timestamp>.json`` under the current directory; ``--out`` is its
deprecated spelling), rewritten after every row. A row that fails records its ``error`` and
the run goes on, except after a CUDA error (``cli.device_fault``: every later CUDA call fails),
which ends the run as in ``bench.py``: the rows after it listed as not run, one ``error:`` line
naming the row (``cli.fault_line``), no ``--tuned`` table, exit status 1.
"""

from __future__ import annotations

import argparse
import sys

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import (
    DTYPE_NAMES,
    OneLineParser,
    add_config_option,
    add_device_option,
    add_method_flags,
    deprecated_alias,
)


def parse_knob(text: str) -> tuple[str, list[int]]:
    """``NAME=V1,V2,...`` -> (NAME, [V1, V2, ...]) for ``--knob`` (the name and the values are
    checked once the kernels' constants are known: ``knob_error``).

    Raises:
        argparse.ArgumentTypeError: a value that is not an integer."""
    name, _, values = text.partition("=")
    try:
        vals = [int(v) for v in values.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: values must be integers, as "
                                         f"{name}=256,512") from None
    return name, list(dict.fromkeys(vals))


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_option(p, help="named model shape: the shapes of the layer (default "
                              "llama-3.1-8b)")
    p.add_argument("--context", type=int, nargs="+", default=[32768], metavar="N",
                   help="prompt tokens")
    p.add_argument("--methods", nargs="+", default=["full", "exact_topk", "quest", "sparq",
                                                    "hybrid", "rocketkv"])
    p.add_argument("--budgets", type=int, nargs="+", default=[256])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="slots reserved for generated tokens (at least the steps run)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps")
    p.add_argument("--seed", type=int, default=0)
    add_device_option(p)
    p.add_argument("--dtype", choices=DTYPE_NAMES)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the step (default: on for cuda, with CUDA graphs)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="no compile: the eager step captured in a CUDA graph, replayed (CUDA)")
    p.add_argument("--json", metavar="PATH",
                   help="rows JSON (default ./<device>/bench_step-<time>.json)")
    p.add_argument("--split-pages", type=int, nargs="+", metavar="N",
                   help="repeat each configuration with the fused selection split at N pages "
                        "a program (kernels.sparse.SPLIT_PAGES; where the kernels run)")
    p.add_argument("--tuned", metavar="PATH", help="also write the --knob setting whose steps "
                   "ran fastest (relative to each configuration's best) as a table for "
                   "rocketkv/kernels/tuned/")
    p.add_argument("--knob", type=parse_knob, action="append", default=[],
                   metavar="NAME=V1,V2", help="repeat each configuration at every combination "
                   "of these launch constants of the fused kernels (kernels.sparse's, "
                   "as listed above; where the kernels run)")
    add_method_flags(p.add_argument_group("method options"))
    deprecated_alias(p, "--new-tokens", "--max-new-tokens")
    deprecated_alias(p, "--out", "--json")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    check_knobs(parser, opts)
    return run(opts, argv)


def check_knobs(parser: OneLineParser, opts) -> None:
    """A ``--knob`` the kernels do not take is a usage error (argparse's, exit status 2)."""
    for name, values in opts.knob:
        if (why := knob_error(name, values)) is not None:
            parser.error(f"argument --knob: {why}")  # as argparse says it


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.layer_step import (  # noqa: E402,F401  (re-exported for the tests)
    best_setting,
    knob_error,
    run,
)

if __name__ == "__main__":
    check_knobs(build_parser(), ARGS)
    sys.exit(run(ARGS))
