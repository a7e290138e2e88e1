"""``python -m rocketkv.compression``: print the methods table; ``--update-docs`` rewrites the
tables of README.md and docs/methods.md (``registry.DOC_TABLES``) and the torch-free method
tables (``rocketkv/method_tables.py``) from the registry."""

import argparse
import sys
from pathlib import Path

from rocketkv.compression import methods_table
from rocketkv.compression.registry import (
    DOC_TABLES,
    TORCH_FREE_MODULE,
    render_docs,
    torch_free_tables,
)

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--update-docs", action="store_true",
                   help="rewrite the generated tables in README.md, docs/methods.md and "
                        "rocketkv/method_tables.py")
    args = p.parse_args(argv)
    if not args.update_docs:
        print(methods_table(detailed=True))
        return 0
    files = {rel: (lambda text, tables=tables: render_docs(text, tables))
             for rel, tables in DOC_TABLES.items()}
    files[TORCH_FREE_MODULE] = lambda text: torch_free_tables()
    for rel, render in files.items():
        path = ROOT / rel
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            print(f"updated {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
