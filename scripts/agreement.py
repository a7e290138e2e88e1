"""Compare two harness result files of the same prompts, prompt by prompt: per configuration
the identical answers and scores, each run's mean score, the prompts whose scores differ.

    python scripts/agreement.py OLD/ruler.json NEW/ruler.json [--markdown OUT.md]

What a change of commit, machine or dtype does to the answers, apart from what a method does
(``rocketkv/evals/agreement.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.evals.agreement import agreement, markdown
from rocketkv.flags import OneLineParser


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="the first result file (a harness JSON)")
    p.add_argument("b", help="the second")
    p.add_argument("--markdown", metavar="PATH", help="write the table here (default: stdout)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
        names = [f"@{r['commit'][:7]}" if r.get("commit") else Path(p).parent.name
                 for r, p in ((a, args.a), (b, args.b))]
        text = markdown(agreement(a, b), *names)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.markdown:
        Path(args.markdown).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
