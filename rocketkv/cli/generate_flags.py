"""``generate.py``'s command line without the engine: its parser, built from ``flags.py``
alone, so that ``python generate.py --help`` and a usage error come back before ``import
torch`` (a fraction of a second instead of 4-6 s). ``cli/generate.py`` runs what it parses.
"""

from __future__ import annotations

import argparse

from rocketkv.flags import (
    DTYPE_NAMES,
    GGUF_WEIGHTS,
    KNOWN_CHECKPOINTS,
    METHOD_TABLE,
    PROGRESS_TOKENS,
    OneLineParser,
    add_kernels_option,
    add_method_flags,
    deprecated_alias,
    method_epilog,
)

DESCRIPTION = "Generate text with a (compressed) static KV cache and measure latency and memory."


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``generate.py``'s flags (docs/generate.md): torch-free, so a bad flag is
    one ``error:`` line (exit 2) before the engine loads."""
    p = OneLineParser(description=DESCRIPTION, epilog=method_epilog(),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint",
                   help="checkpoint directory (HF layout or converted), a .gguf file, a short "
                        f"name ({', '.join(KNOWN_CHECKPOINTS)}: a local copy in checkpoints/ or "
                        "the Hugging Face cache), or random:NAME with NAME a named config "
                        "(random weights at the real shapes); default: the SmolLM2-135M-Instruct "
                        "GGUF of the data directory or checkpoints/")
    p.add_argument("--tokenizer", help="tokenizer.json, tokenizer.model or .gguf file "
                   "(default: the checkpoint's)")
    p.add_argument("--method", default="full", choices=[name for name, _ in METHOD_TABLE],
                   metavar="METHOD", help="KV cache method (see below; default full)")
    p.add_argument("--budget", type=int, help="token budget: KV pairs read per decode step per "
                   "layer per KV-head group")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="FILE", help="prompt text file, - for stdin")
    src.add_argument("-p", "--prompt-text", metavar="TEXT", help="the prompt text itself")
    src.add_argument("--random-prompt", type=int, metavar="N",
                     help="a prompt of N random token ids, for speed and memory runs (the "
                          "prompt's length, not the context size)")
    deprecated_alias(p, "--context", "--random-prompt")
    deprecated_alias(p, "--prompt-tokens", "--random-prompt")
    add_method_flags(p.add_argument_group(
        "method options (every derived parameter is printed and saved)"))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1,
                   help="copies of the prompt decoded together")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (default: torch's; use the physical cores, not SMT "
                        "threads)")
    p.add_argument("--dtype", choices=list(DTYPE_NAMES),
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--gguf-weights", choices=GGUF_WEIGHTS,
                   help="a GGUF's weights dequantized to float, or kept quantized (4-bit blocks "
                        "as int4, others int8), with an int8 classifier, or that on int8 "
                        "activations (quantized-w8a8, CPU); default quantized-int8-classifier "
                        "on the CPU, float on CUDA (docs/quantization.md)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on for cuda)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="instead of compiling, capture the eager decode step in a CUDA graph "
                        "(about a second instead of a minute's compile; unfused kernels)")
    add_kernels_option(p)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="the prompt is the user message of the checkpoint's chat template; "
                        "generation stops at the template's end-of-turn token (default: when "
                        "the checkpoint has a chat template of its own, as instruct models do; "
                        "--no-chat for plain text)")
    p.add_argument("--system", help="system message (with chat)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print the text as it is decoded (default; batch 1 with a tokenizer). "
                        "A host sync per token: --no-stream for timing runs")
    p.add_argument("--questions", metavar="FILE",
                   help="questions about the --prompt document, one a line (or JSON lines "
                        "with a \"question\" key): the document is prefilled once; each "
                        "question is prefilled after it and the method's cache built with the "
                        "question in the prompt, as a single run computes it (the "
                        "document's whole K/V is kept: question-aware)")
    p.add_argument("--question-agnostic", action="store_true",
                   help="with --questions: compress the document once, before any question "
                        "(less memory and time per question; what an evicting method drops "
                        "is gone for every question)")
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    p.add_argument("--no-progress", action="store_true",
                   help="no prefill progress bar (shown on stderr when it is a terminal and "
                        f"the prompt has at least {PROGRESS_TOKENS} tokens)")
    return p
