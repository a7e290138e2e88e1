"""``serve.py``'s parser, torch-free: ``python serve.py --help`` and its usage errors come
before torch and the engine load (``rocketkv serve`` is the same command)."""

from __future__ import annotations

import argparse

from rocketkv.flags import (
    DTYPE_NAMES,
    GGUF_WEIGHTS,
    METHOD_TABLE,
    OneLineParser,
    add_device_option,
    add_method_flags,
    method_epilog,
)

DESCRIPTION = ("Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
               "/v1/completions, /v1/models, /health, /metrics). Up to --max-batch requests "
               "decode together (continuous batching); the others wait in a queue.")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``serve.py``'s flags: torch-free, so a bad flag is one ``error:`` line
    (exit 2) before the engine loads. ``--method``, ``--budget``, the method options and
    ``--max-new-tokens`` are the defaults of a request that does not set them."""
    p = OneLineParser(description=DESCRIPTION, epilog=method_epilog(),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint",
                   help="checkpoint directory, a .gguf file, a short name or random:NAME "
                        "(default: the SmolLM2-135M-Instruct GGUF of the data directory or "
                        "checkpoints/)")
    p.add_argument("--tokenizer", help="tokenizer file or directory (default: the "
                   "checkpoint's)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model's id in /v1/models and the responses (default: the "
                        "checkpoint's file or folder name)")
    p.add_argument("--method", default="full", choices=[name for name, _ in METHOD_TABLE],
                   metavar="METHOD",
                   help="KV cache method of a request that names none (see below; default full)")
    p.add_argument("--budget", type=int,
                   help="token budget of a request that gives none (with --method): KV pairs "
                        "read per decode step per layer per KV-head group")
    add_method_flags(p.add_argument_group(
        "method options (defaults for requests that use --method and set none)"))
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="generated tokens at most when a request sets no max_tokens "
                        "(default 256)")
    add_device_option(p)
    p.add_argument("--dtype", choices=list(DTYPE_NAMES),
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--gguf-weights", choices=GGUF_WEIGHTS,
                   help="a GGUF's weights as float or kept quantized (default "
                        "quantized-int8-classifier on the CPU, float on CUDA; "
                        "docs/quantization.md)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="requests decoded together at most, each with its own method, budget "
                        "and cache (continuous batching; default 8); 1: one request at a time, "
                        "its decode step compiled when the answer is long enough to repay it")
    p.add_argument("--max-kv-mib", type=float, metavar="MIB",
                   help="with batching, the MiB of KV cache the running requests may hold "
                        "together: a request waits until its cache fits (sized from its method, "
                        "budget, prompt and max_tokens); one that cannot fit alone gets HTTP "
                        "503 (default: no limit)")
    p.add_argument("--max-queue", type=int, metavar="N",
                   help="refuse a request with HTTP 503 (Retry-After: 1) when N requests are "
                        "waiting already (default: no limit)")
    p.add_argument("--prefix-cache-mib", type=int, metavar="MIB",
                   help="keep prompts uncompressed between requests, up to MIB MiB: a request "
                        "whose prompt starts with a kept one (a conversation's next turn, "
                        "another question about the same document) prefills only the rest and "
                        "computes what a fresh run does (default: none kept)")
    return p
