"""CPU decode and prefill speed of our engine against llama.cpp's ``llama-bench`` on the same
GGUF file, in one run, alternating.

    python scripts/bench_cpu.py --checkpoint ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/bench_cpu.py --checkpoint qwen2.5-0.5b-instruct-q4_k_m.gguf \\
        --context 0 4096 16384 32768 --repeats 5 --time-limit 14400

Peers, on ``--threads`` threads each (default: the physical cores this process may run on):

* llama.cpp: ``llama-bench`` from ``PATH`` or ``--llama-bench PATH`` (build it with
  ``tools/build_llama_cpp.sh``), one process per measurement, ``-r 1 -o json``: prefill is
  ``-p C -n 0`` (C tokens from an empty cache, ``--no-warmup``: one prefill of C tokens
  timed, as ours is), decode is ``-p 0 -n N -d C`` (N tokens after a context of C tokens,
  which it prefills untimed; its own 1-token warm-up first). Tokens/s are llama-bench's
  ``avg_ts`` (tokens over the timed wall time). Without ``llama-bench`` the peer's rows say
  ``llama.cpp not found (build: tools/build_llama_cpp.sh)`` and ours still run; a checkpoint
  that is not a GGUF file runs ours only, the peer's rows saying why (llama.cpp reads GGUF).
* ours, in this process: ``checkpoint.load_model`` (a GGUF with ``--gguf-weights``, default
  ``default``: what ``generate.py`` loads without the flag on this CPU,
  ``checkpoint.default_gguf_weights``; ``docs/quantization.md``; several modes load one model
  each, measured in turn within each repeat), float32 activations, the decode step eager
  (what a short ``generate.py`` run does) unless ``--compile`` (``--compile both``: each
  weights mode eager, then compiled, two rows); per method (``--methods``, default ``full
  rocketkv``; compressing methods at each of ``--budgets``, default 256) one
  ``generate.generate`` of a random prompt of C token ids (``--seed``; one token at context
  0) and ``--warmup-steps`` + N decode steps, no stop tokens: decode tokens/s the N timed
  steps over their summed time (the warm-up steps left out). Where two or more methods build
  their caches from one prefill of the whole prompt (``Method.shared_prefill``: Full-KV,
  RocketKV and every method but KeyDiff), each repeat prefills the C tokens once
  (``prefill.prefill_once``, timed: the ``shared prefill`` row, prefill tokens/s C over its
  seconds, H2O's attention sums included when H2O runs) and every method's run builds its
  caches from it (``build_s``: its prompt compression) before decoding: at 32K a prefill is
  minutes of this CPU, the decode seconds. A method that prefills its own way, or one
  method alone, times its own prefill in its row (prefill and the first token's argmax).

Context 0 is a short chat: decode only (llama.cpp at depth 0, ours after a 1-token prompt),
no prefill figure. Contexts beyond the model's (less the decode steps) are capped to it with a
``note:``; the default is 0, 4096, 16384 and 32768 up to the model's context (SmolLM2-135M:
0, 4096 and its 8K, capped).

Alternation: for each context, for each repeat r = 1..R (``--repeats``), llama.cpp's prefill
and decode runs, then ours per method, so that a change in the machine's load hits both;
every run records the 1-minute load average just before it. One untimed warm-up of each peer
comes first (a 16-token llama-bench run, which also gives llama.cpp's build; a short
generation per method). Per (context, peer, method) the summary gives the median, min and
max of decode and prefill tokens/s over the repeats and, for ours, the ratio of time per token
ours / llama.cpp of the medians (``ours_over_llama_time_decode``, ``..._prefill``: above 1
ours is slower).

Output: ``--json`` (default ``<--out>/cpu/bench_cpu-<timestamp>.json``, ``--out`` the current
directory): {"provenance", "settings", "runs", "summary"}, rewritten after every run, so a
crash, Ctrl-C or ``--time-limit SECONDS`` (no run starts after it; the rest are listed as
skipped) keeps what was measured. Provenance: commit and dirty flag, torch version, CPU model,
threads, llama-bench's ``build_commit`` and ``build_number``, the GGUF's sha256 and size, the
command line. A chart beside the JSON (``-decode.png``: decode and prefill tokens/s against
context, a bar from min to max) unless ``--no-plots``, and a markdown table on stdout. Bad
input is one ``error:`` line and exit status 2 before anything loads; exit status 1 when a run
failed (its row says why), 130 after Ctrl-C.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import GGUF_WEIGHTS, OneLineParser, add_time_limit_option

COMPILE_CHOICES = ("off", "on", "both")


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="the weights: a GGUF file (both peers) or any checkpoint of ours "
                        "(ours only: llama.cpp reads GGUF)")
    p.add_argument("--llama-bench", metavar="PATH",
                   help="llama.cpp's llama-bench executable (default: llama-bench on PATH)")
    p.add_argument("--context", nargs="+", type=int, metavar="N",
                   help="context lengths in tokens (default 0 4096 16384 32768, up to the "
                        "model's context)")
    p.add_argument("--methods", nargs="+", default=["full", "rocketkv"], metavar="METHOD",
                   help="our KV cache methods (default: full rocketkv)")
    p.add_argument("--budgets", nargs="+", type=int, default=[256], metavar="N",
                   help="token budgets of the compressing methods (default 256)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="decode tokens timed per run, both peers (llama-bench -n; default 32)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="our decode steps run before the timed ones, left out (default 2)")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternating runs of each peer per context (default 3)")
    p.add_argument("--threads", type=int,
                   help="CPU threads of both peers (torch.set_num_threads, llama-bench -t; "
                        "default: the physical cores)")
    p.add_argument("--gguf-weights", choices=("default", *GGUF_WEIGHTS), nargs="+",
                   default=["default"], metavar="W",
                   help="our weights of a GGUF, one model each, measured in turn: default (what "
                   "generate.py loads without --gguf-weights on this CPU), "
                   f"{', '.join(GGUF_WEIGHTS)} (docs/quantization.md)")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=COMPILE_CHOICES,
                   help="our decode step eager (off, the default: what a short generate.py "
                        "run does), compiled (on; --compile alone), or each weights mode both "
                        "ways (both)")
    p.add_argument("--seed", type=int, default=0, help="seed of our random prompt ids")
    p.add_argument("--out", default=".", metavar="DIR",
                   help="results folder: files go to DIR/cpu/ (default: the current directory)")
    p.add_argument("--json", metavar="PATH",
                   help="the results file (default DIR/cpu/bench_cpu-<timestamp>.json)")
    p.add_argument("--no-plots", action="store_true", help="no chart")
    add_time_limit_option(p, "start no run after this many seconds (the rest are listed as "
                             "skipped); results are saved after every run anyway")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.cpu_bench import (  # noqa: E402,F401  (the rest re-exported for the tests)
    LLAMA_NOT_FOUND,
    SHARED,
    format_table,
    llama_info,
    parse_llama_bench,
    plan_contexts,
    run,
    summarize,
)

if __name__ == "__main__":
    sys.exit(run(ARGS))
