"""``python -m rocketkv.compression``: print the methods table; ``--update-docs`` rewrites the
tables of README.md and docs/methods.md from the registry (``registry.DOC_TABLES``)."""

import argparse
import sys
from pathlib import Path

from rocketkv.compression import methods_table
from rocketkv.compression.registry import DOC_TABLES, render_docs

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--update-docs", action="store_true",
                   help="rewrite the generated tables in README.md and docs/methods.md")
    args = p.parse_args(argv)
    if not args.update_docs:
        print(methods_table(detailed=True))
        return 0
    for rel, tables in DOC_TABLES.items():
        path = ROOT / rel
        text = path.read_text()
        new = render_docs(text, tables)
        if new != text:
            path.write_text(new)
            print(f"updated {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
