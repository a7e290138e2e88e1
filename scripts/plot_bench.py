"""Draw ``bench.py``'s charts from result files: several runs merged, one compile regime.

    python scripts/plot_bench.py results/NVIDIA-H100/bench-*.json --regime graphs \
        --prefix results/NVIDIA-H100/grid

The paper's grid (Fig. 5) takes two GPU calls (``gpu_checklist.sh g1`` and ``g2``), each a run
of its own, and a GPU run is made with ``--no-plots`` (the device returns at most 8 files):
this draws the charts afterwards from the committed rows. Rows are merged as
``check_targets.py`` merges them (a later file's row replaces an earlier one of the same
configuration and regime; predictions never count) and kept for one compile regime
(``--regime``; needed when the files hold several, since a compiled row and a CUDA graph of
the eager step are two measurements), one weights mode (``--weights``, default ``float``)
and the smallest batch. Writes ``<prefix>-a_speedup.png`` (decode speedup vs Full-KV and vs
``gptfast_dense`` per budget, the paper's Fig. 5a), ``<prefix>-b_memory.png`` (peak-memory saving
vs Full-KV, Fig. 5b), ``<prefix>-c_latency.png`` (step time and roofline) and
``<prefix>-d_methods.png`` (every method at ``--compare-context``), and prints their paths. Bad
input (no file, no row left, an ambiguous regime) is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import OneLineParser, deprecated_alias


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench.py result JSON files")
    p.add_argument("--prefix", required=True, metavar="PREFIX",
                   help="charts are written as PREFIX-a_speedup.png etc.")
    p.add_argument("--regime", choices=["static", "dynamic", "graphs", "eager"],
                   help="the compile regime to draw (needed when the files hold several)")
    p.add_argument("--weights", default="float", help="weights mode of the rows (float, "
                   "int8, int4-g128, ...)")
    p.add_argument("--compare-context", type=int, default=32768, help="context of chart (d)")
    deprecated_alias(p, "--out", "--prefix")  # --out is a folder elsewhere
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
from rocketkv.evals.sweep import plot
from tools.check_targets import engine_rows, load_rows, regime


def select(rows: list[dict], wanted: str | None, weights: str) -> tuple[list[dict], str]:
    """The rows of one regime (``wanted``, or the only one present) and weights mode, peers'
    rows with them (they compile themselves), profiles left out, and of a configuration
    measured with fewer kernels too (``--kernels sparse``) the rows with the most
    (``check_targets.engine_rows``). Returns the rows and the regime.

    Raises:
        ValueError: no bench row, several regimes and none chosen, or none left."""
    rows = engine_rows([r for r in rows if not r.get("profile")])
    present = sorted({g for r in rows if (g := regime(r)) is not None})
    if not present:
        raise ValueError("no bench rows in these files")
    if wanted is None:
        if len(present) > 1:
            raise ValueError(f"the rows hold the regimes {', '.join(present)}: choose one "
                             "with --regime")
        wanted = present[0]
    kept = [r for r in rows if regime(r) in (wanted, None) and "error" not in r
            and r.get("weights", "float") == weights]
    if not any(regime(r) == wanted for r in kept):
        raise ValueError(f"no measured {weights} row of regime {wanted} (present: "
                         f"{', '.join(present)})")
    return kept, wanted


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(a) -> int:
    """Draw as the parsed arguments ``a`` say; the exit status."""
    try:
        rows, _ = select(load_rows(a.results), a.regime, a.weights)
        out = Path(a.prefix)
        if not out.parent.is_dir():
            raise ValueError(f"no directory {out.parent} for the charts")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in plot(rows, out, a.compare_context):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(run(ARGS))
