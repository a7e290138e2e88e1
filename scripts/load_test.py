"""Load-test the OpenAI-compatible server: N clients at once, each a thread with its own
``openai`` client, send streamed chat requests that mix KV caches and prompts; every answer must
equal the same request's answer sent alone.

    python scripts/load_test.py --clients 8 --requests 4 --out results/serve

Without ``--url`` the script loads ``--checkpoint`` on the CPU and serves it on 127.0.0.1 (a free
port) in this process. It runs one client first (the single-client tokens/s), then ``--clients``
clients, then each distinct request alone (non-streamed: the reference answers), all greedy and
within ``--time-limit`` seconds. The prompts: ``--prompts`` chunks of the Paul Graham essays,
320 to 1,500 tokens (less on a model with a short context), each followed by a request for a
one-sentence summary. ``rocketkv.evals.load_test`` measures, per request, the time to the first
token and the inter-token latencies; per run, requests lost, answers equal to their single
run, aggregate completion tokens/s, TTFT and inter-token latency p50/p99 (nearest rank).
``load-test.json`` (settings, records, summaries, the ratio of aggregate tokens/s to one
client's, provenance, load average before and after, the command) and ``load-test.md`` (a
table) go into ``--out``. The server started here decodes up to ``--max-batch`` requests
together (continuous batching; 1: one at a time, and the aggregate tokens/s is about one
client's).

Exit status 0 when no request was lost and every answer equals its single run, 1 otherwise, 2 on
bad input (one ``error:`` line, before the model loads).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import OneLineParser


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None,
                   help="model (default: the SmolLM2-135M-Instruct GGUF, as generate.py); "
                   "not read with --url")
    p.add_argument("--url", default=None,
                   help="the base URL of a running server (http://HOST:PORT or .../v1) "
                   "instead of starting one")
    p.add_argument("--clients", type=int, default=8, help="clients sending at once (8)")
    p.add_argument("--requests", type=int, default=4,
                   help="requests per client, one after another (4)")
    p.add_argument("--configs", nargs="+", default=["full", "rocketkv@256", "snapkv_pp@256"],
                   metavar="METHOD[@BUDGET]",
                   help="KV caches the requests mix, budget in tokens (default: full "
                   "rocketkv@256 snapkv_pp@256)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="completion tokens per request at most (the API's max_tokens; 32)")
    p.add_argument("--prompts", type=int, default=4,
                   help="distinct prompts, essay chunks of different lengths (4)")
    p.add_argument("--time-limit", type=float, default=1800.0, metavar="SECONDS",
                   help="bound of the whole run; requests not sent by then count as lost "
                   "(1800)")
    p.add_argument("--seed", type=int, default=0, help="the plan's shuffle (0)")
    p.add_argument("--out", default="results/serve", metavar="DIR",
                   help="folder of load-test.json and load-test.md (results/serve)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="requests the server started here decodes together (8; 1: one at a "
                   "time); not used with --url")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of the served engine (default: torch's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.load_test import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
