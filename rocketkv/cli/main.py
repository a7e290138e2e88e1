"""The ``rocketkv`` console command: ``rocketkv generate ...``, ``rocketkv quantize ...`` and
``rocketkv serve ...`` take exactly the flags of ``python generate.py``, ``python quantize.py``
and ``python serve.py`` (``rocketkv COMMAND --help``). ``python -m rocketkv`` is the same
command."""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = {
    "generate": "generate text with a compressed KV cache and measure speed and memory",
    "quantize": "write a weight-only int8 or int4 checkpoint",
    "serve": "serve a model over an OpenAI-compatible HTTP API",
}


def usage() -> str:
    rows = "\n".join(f"  {name:<10} {what}" for name, what in COMMANDS.items())
    return (f"usage: rocketkv COMMAND [FLAGS]\n\ncommands:\n{rows}\n\n"
            "rocketkv COMMAND --help lists a command's flags")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command ``argv[0]`` with the rest of ``argv`` (default ``sys.argv[1:]``); exits
    with its status, 2 (after one ``error:`` line) for an unknown command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{usage()}\nerror: unknown command {command!r} (choose from "
              f"{', '.join(COMMANDS)})", file=sys.stderr)
        sys.exit(2)
    if command == "generate":
        from rocketkv.cli.generate_flags import build_parser
    elif command == "serve":
        from rocketkv.cli.serve_flags import build_parser
    else:
        from rocketkv.cli.quantize_flags import build_parser
    parser = build_parser()
    parser.prog = f"rocketkv {command}"
    args = parser.parse_args(rest)  # --help and usage errors before torch loads
    if command == "generate":
        from rocketkv.cli.generate import entry
    elif command == "serve":
        from rocketkv.cli.serve import entry
    else:
        from rocketkv.cli.quantize import entry
    entry(args)
