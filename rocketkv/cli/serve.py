"""Serve a model over an OpenAI-compatible HTTP API (``rocketkv/serve/app.py``).

    python serve.py --checkpoint model.gguf [--host 127.0.0.1] [--port 8000]
                    [--method rocketkv --budget 256] [--max-new-tokens 256] [--max-batch 8]

The same command as ``rocketkv serve`` (installed). One uvicorn worker, one ``Engine``: up to
``--max-batch`` requests decode together (continuous batching), the others wait in a queue.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import uvicorn

from rocketkv.api import load
from rocketkv.cli.serve_flags import build_parser
from rocketkv.method_tables import METHOD_OPTIONS
from rocketkv.model import ConfigError
from rocketkv.serve.app import ServeDefaults, create_app


def defaults_of(args: argparse.Namespace) -> ServeDefaults:
    """The request defaults the command line sets (``--method``, ``--budget``, the method
    options, ``--max-new-tokens``)."""
    options = {row[0]: getattr(args, row[0]) for row in METHOD_OPTIONS
               if getattr(args, row[0], None) not in (None, False)}
    return ServeDefaults(method=args.method, budget=args.budget,
                         max_new_tokens=args.max_new_tokens, method_options=options)


def run(args: argparse.Namespace) -> int:
    """Load the checkpoint and serve it until interrupted; the exit status (2: bad input, one
    ``error:`` line)."""
    if args.max_new_tokens <= 0:
        print(f"error: --max-new-tokens must be positive, got {args.max_new_tokens}",
              file=sys.stderr)
        return 2
    if args.max_queue is not None and args.max_queue < 0:
        print(f"error: --max-queue must not be negative, got {args.max_queue}",
              file=sys.stderr)
        return 2
    if args.max_batch < 1:
        print(f"error: --max-batch must be positive, got {args.max_batch}", file=sys.stderr)
        return 2
    if args.max_kv_mib is not None and (args.max_kv_mib <= 0 or args.max_batch == 1):
        print("error: --max-kv-mib must be positive, got " f"{args.max_kv_mib:g}"
              if args.max_kv_mib <= 0 else
              "error: --max-kv-mib applies to batching (--max-batch above 1)", file=sys.stderr)
        return 2
    if args.prefix_cache_mib is not None and args.prefix_cache_mib < 0:
        print(f"error: --prefix-cache-mib must not be negative, got {args.prefix_cache_mib}",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = load(args.checkpoint, device=args.device, dtype=args.dtype,
                      tokenizer=args.tokenizer, gguf_weights=args.gguf_weights,
                      prefix_cache_mib=args.prefix_cache_mib)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(engine, defaults_of(args), model_name=args.model_name,
                     max_queue=args.max_queue, max_batch=args.max_batch,
                     max_kv_mib=args.max_kv_mib)
    print(f"serving {app.state.model} ({engine!r}) on http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, workers=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``serve.py`` in this process: the exit status."""
    return run(build_parser().parse_args(argv))


def entry(args: argparse.Namespace | None = None) -> None:
    """``python serve.py`` and the ``rocketkv serve`` console command."""
    if args is None:
        args = build_parser().parse_args()
    sys.exit(run(args))
