"""Fidelity of weight-only quantization (``quantize.py``) on a real checkpoint: next-token
distributions of int8/int4 weights against the float weights on held-out text, with the full KV
cache and with compressed ones (what quantized weights plus RocketKV cost together).

    python scripts/eval_quantized.py \\
        --checkpoint ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --variants int8 int4-g32 int4-g64 --classifier int8 same float \\
        --methods full rocketkv --budgets 256 --context 2048 --num-prompts 4 \\
        --out results/quantization

Variants: ``float`` (always, the reference) and each of ``--variants`` (``int8``,
``int4-g<G>``) once per distinct classifier storage that ``--classifier`` gives
(``quantize.py --classifier``: ``int8``, ``same`` as the layers, ``float``). Each is
``quantized.quantize_model`` applied to a copy of the float model: what loading
``quantize.py``'s checkpoint gives (tests check that both agree). Activations are ``--dtype``
(default float32; the CPU kernels round their input to bfloat16, ``quantized.kernel_dtype``).
A GGUF checkpoint's own quantized loads are variants too with ``--gguf-weights W ...``
(``generate.py --gguf-weights``: ``quantized``, ``quantized-int8-classifier``,
``quantized-w8a8``), each against the float (dequantized) load of the same file; rows named
``gguf W (weights label)``. Without ``--variants`` only those run.

Prompts: ``evals.fidelity.build_prompt_set``'s rule (non-overlapping windows of the essays, T
prompt tokens + m continuation tokens, N spread over the text). ``--split dev`` takes N other
windows (drawn with seed + ``DEV_SEED_OFFSET`` from the windows the eval split does not use):
the development set on which defaults are chosen (``evals.fidelity.split_prompts``). ``--limit
N``: a quick run on at most N prompts.

Per (variant, method, budget), over the N prompts (m = ``--max-new-tokens``;
``evals.fidelity.run_variant``):

* ``kl_vs_float``: mean over the N*m positions of KL(p_float,full || p_variant,method) in nats,
  both teacher-forced on the real continuation (row 0 from the prefill, row j from the decode
  step fed c_{j-1}); ``top1_vs_float``: the fraction of those positions whose argmax equals the
  float full-cache argmax.
* ``perplexity``: exp(mean NLL) of the real continuation in that pass.
* ``match_prefix``: leading tokens of the variant's greedy continuation (m tokens, EOS ignored)
  equal to the float full-cache greedy continuation (0..m), averaged over prompts.
* ``weight_bytes``, ``weight_bytes_per_step`` (``Transformer.weight_bytes*``) and
  ``kv_bytes_per_step``.

Outputs: the table on stdout; ``--out DIR`` writes ``quantization[-dev].json`` / ``.md`` /
``.png`` (KL and perplexity per variant). Bad input: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import copy
import re
import sys
import time
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import (
    CLASSIFIER_CHOICES,
    DTYPE_NAMES,
    GGUF_WEIGHTS,
    OneLineParser,
    deprecated_alias,
)


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="float checkpoint (any format)")
    p.add_argument("--variants", nargs="+",
                   help="int8 and/or int4-g<G> (float is always the reference; default int8 "
                        "int4-g32 int4-g64 without --gguf-weights, none with it)")
    p.add_argument("--gguf-weights", nargs="+", choices=GGUF_WEIGHTS[1:], default=[],
                   metavar="W", help="a GGUF checkpoint's quantized loads "
                   f"({', '.join(GGUF_WEIGHTS[1:])}; generate.py --gguf-weights), each a "
                   "variant against its float (dequantized) load")
    p.add_argument("--classifier", nargs="+", choices=CLASSIFIER_CHOICES,
                   default=list(CLASSIFIER_CHOICES),
                   help="classifier storage(s) per variant (quantize.py --classifier)")
    p.add_argument("--methods", nargs="+", default=["full", "rocketkv"])
    p.add_argument("--budgets", nargs="+", type=int, default=[256])
    p.add_argument("--context", type=int, default=2048, metavar="T",
                   help="prompt tokens T (default 2048)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="m (default 32)")
    p.add_argument("--num-prompts", type=int, default=4, help="N (default 4)")
    p.add_argument("--limit", type=int, help="quick run: at most this many prompts")
    p.add_argument("--split", choices=["eval", "dev"], default="eval")
    p.add_argument("--text", nargs="+", metavar="PATH",
                   help="texts the prompts come from (default: evals.fidelity.DEFAULT_TEXTS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", metavar="DIR")
    p.add_argument("--no-progress", action="store_true")
    deprecated_alias(p, "--prompt-tokens", "--context")
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
import torch

from rocketkv.cli.common import DTYPES, check_positive, command_line, rows_exit_status
from rocketkv.engine.measure import weights_label
from rocketkv.engine.provenance import provenance
from rocketkv.evals.fidelity import DEFAULT_TEXTS, run_variant, split_prompts
from rocketkv.evals.harness import configurations, progress_bar
from rocketkv.evals.prompts import text_files
from rocketkv.evals.reports import quantization_plot, quantization_table, write_outputs
from rocketkv.formats.checkpoint import load_model, resolve_checkpoint
from rocketkv.formats.gguf_reader import is_gguf
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError
from rocketkv.quantized import GROUPSIZES, classifier_mode, quantize_model

VARIANT = re.compile(r"^(int8|int4-g(\d+))$")


def parse_variant(spec: str) -> tuple[str, int | None]:
    """``int8`` -> ("int8", None); ``int4-g64`` -> ("int4", 64). ConfigError otherwise."""
    m = VARIANT.match(spec)
    if not m or (m.group(2) and int(m.group(2)) not in GROUPSIZES):
        raise ConfigError(f"--variants: {spec!r} is not int8 or int4-g<G> with G in "
                          f"{', '.join(map(str, GROUPSIZES))}")
    return ("int8", None) if m.group(1) == "int8" else ("int4", int(m.group(2)))



def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


def run(args, argv=None) -> int:
    """Evaluate as the parsed arguments ``args`` say; the exit status."""
    if args.text is None:
        args.text = [str(t) for t in DEFAULT_TEXTS]
    t0 = time.perf_counter()
    try:
        check_positive(args, "context", "max_new_tokens", "num_prompts", "threads",
                       "limit")
        if min(args.budgets) <= 0:
            raise ConfigError("--budgets must be positive numbers of tokens")
        if args.variants is None:
            args.variants = [] if args.gguf_weights else ["int8", "int4-g32", "int4-g64"]
        variants = [parse_variant(v) for v in dict.fromkeys(args.variants)]
        torch.set_num_threads(args.threads)
        checkpoint = resolve_checkpoint(args.checkpoint)
        text_files(args.text)
        dtype = DTYPES[args.dtype]
        if args.gguf_weights and not is_gguf(checkpoint):
            raise ConfigError(f"--gguf-weights takes a GGUF checkpoint, not {args.checkpoint}")
        float_model = load_model(checkpoint, "cpu", dtype)
        if float_model.quantization is not None:
            raise ConfigError("--checkpoint must be a float checkpoint (this one is quantized)")
        tok = load_tokenizer(checkpoint)
        T, m = args.context, args.max_new_tokens
        if T + m > float_model.args.max_seq_len:
            raise ConfigError(f"--context {T} + --max-new-tokens {m} exceed the model's "
                              f"context ({float_model.args.max_seq_len} tokens)")
        n = min(args.num_prompts, args.limit or args.num_prompts)
        prompts = split_prompts(tok, args.text, T, m, n, args.seed, args.split)
        configs = configurations(list(dict.fromkeys(args.methods)),
                                 list(dict.fromkeys(args.budgets)))
        configs = list(dict.fromkeys([("full", None), *configs]))
        # one run per distinct classifier storage: {(mode, g, storage): --classifier choice}
        runs: dict[tuple, str | None] = {("float", None, "float"): None}
        for mode, g in variants:
            for c in args.classifier:
                runs.setdefault((mode, g, classifier_mode(mode, c) or "float"), c)
        for w in dict.fromkeys(args.gguf_weights):  # (the GGUF's load, its classifier later)
            runs[("gguf", None, w)] = w
        bar = None
        if not args.no_progress:
            bar = progress_bar(len(runs) * len(prompts) * len(configs), unit="it",
                               desc="eval_quantized")
        rows, reference = [], None
        for (mode, g, classifier), choice in runs.items():
            if mode == "float":
                model = float_model
            elif mode == "gguf":
                model = load_model(checkpoint, "cpu", dtype, gguf_weights=choice)
                classifier = model.quantization["classifier"]
            else:
                model = quantize_model(copy.deepcopy(float_model), mode, g, classifier=choice)
            vrows, reference = run_variant(model, prompts, configs, m, reference, bar)
            name = f"gguf {choice} ({weights_label(model)})" if mode == "gguf" else \
                mode if g is None else f"{mode}-g{g}"
            for r in vrows:
                rows.append({"weights": name, "classifier": classifier, **r})
            if model is not float_model:
                del model
        if bar is not None:
            bar.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        r.update(model=float_model.args.name, prompt_tokens=T)
    table = quantization_table(rows, m)
    result = {"model": float_model.args.name, "checkpoint": args.checkpoint, "split": args.split,
              "prompt_tokens": T, "max_new_tokens": m, "num_prompts": len(prompts),
              "dtype": args.dtype, "seed": args.seed, "threads": args.threads,
              "prompts": [{"source": p.source, "document": p.document, "start": p.start}
                          for p in prompts],
              "command": command_line("eval_quantized.py", argv),
              "rows": rows, "torch_version": torch.__version__,
              "runtime_s": time.perf_counter() - t0,
              "provenance": provenance(checkpoint, ["scripts/eval_quantized.py",
                                                    *(sys.argv[1:] if argv is None else argv)])}
    print(table)
    if args.out:
        name = "quantization" if args.split == "eval" else "quantization-dev"
        write_outputs(args.out, name, result, table,
                      lambda path: quantization_plot(rows, path))
    return rows_exit_status(rows)


if __name__ == "__main__":
    sys.exit(run(ARGS))
