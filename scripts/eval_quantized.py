"""Fidelity of weight-only quantization (``quantize.py``) on a real checkpoint: next-token
distributions of int8/int4 weights against the float weights on held-out text, with the full KV
cache and with compressed ones (what quantized weights plus RocketKV cost together).

    python scripts/eval_quantized.py \\
        --checkpoint ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --variants int8 int4-g32 int4-g64 --classifier int8 same float \\
        --methods full rocketkv --budgets 256 --prompt-tokens 2048 --num-prompts 4 \\
        --out results/quantization

Variants: ``float`` (always, the reference) and each of ``--variants`` (``int8``,
``int4-g<G>``) once per distinct classifier storage that ``--classifier`` gives
(``quantize.py --classifier``: ``int8``, ``same`` as the layers, ``float``). Each is
``quantize.quantize_model`` applied to a copy of the float model: what loading
``quantize.py``'s checkpoint gives (tests check that both agree). Activations are ``--dtype``
(default float32; the CPU kernels round their input to bfloat16, ``quantize.kernel_dtype``).

Prompts: ``eval_accuracy.build_prompt_set``'s rule (non-overlapping windows of the essays, T
prompt tokens + m continuation tokens, N spread over the text). ``--split dev`` takes N other
windows (drawn with seed + ``DEV_SEED_OFFSET`` from the windows the eval split does not use):
the development set on which defaults are chosen.

Per (variant, method, budget), over the N prompts (m = ``--max-new-tokens``):

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

import argparse
import copy
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from checkpoint import load_model, resolve_checkpoint  # noqa: E402
from compression import UNBUDGETED  # noqa: E402
from generate import (  # noqa: E402
    DTYPES,
    OneLineParser,
    check_positive,
    prefill_once,
    weight_bytes,
    weight_bytes_per_step,
)
from model import ConfigError, Transformer  # noqa: E402
from quantize import CLASSIFIER_CHOICES, GROUPSIZES, classifier_mode, quantize_model  # noqa: E402
from scripts.eval_accuracy import (  # noqa: E402
    DEFAULT_TEXTS,
    build_from_prefill,
    document_windows,
    greedy_continuation,
    kl_rows,
    matching_prefix,
    read_documents,
    seeded_pick,
    teacher_forced_logprobs,
    token_nlls,
)
from scripts.eval_common import DEV_SEED_OFFSET, write_outputs  # noqa: E402
from scripts.make_prompt import text_files  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

VARIANT = re.compile(r"^(int8|int4-g(\d+))$")


def parse_variant(spec: str) -> tuple[str, int | None]:
    """``int8`` -> ("int8", None); ``int4-g64`` -> ("int4", 64). ConfigError otherwise."""
    m = VARIANT.match(spec)
    if not m or (m.group(2) and int(m.group(2)) not in GROUPSIZES):
        raise ConfigError(f"--variants: {spec!r} is not int8 or int4-g<G> with G in "
                          f"{', '.join(map(str, GROUPSIZES))}")
    return ("int8", None) if m.group(1) == "int8" else ("int4", int(m.group(2)))


def split_prompts(tok, texts, T: int, m: int, n: int, seed: int, split: str):
    """The eval prompts (``seeded_pick``) or, for ``dev``, n windows disjoint from them."""
    windows = document_windows(tok, read_documents(texts), T, m)
    need = n if split == "eval" else 2 * n
    if len(windows) < need:
        raise ConfigError(f"the text holds only {len(windows)} windows of {T + m} tokens, "
                          f"{need} needed for --split {split}; lower --num-prompts or "
                          "--prompt-tokens")
    chosen = seeded_pick(windows, n, seed)
    if split == "eval":
        return chosen
    rest = [w for w in windows if w not in chosen]
    return seeded_pick(rest, n, seed + DEV_SEED_OFFSET)


def run_variant(model: Transformer, prompts, configs, m: int, reference: dict | None,
                bar=None) -> tuple[list[dict], dict]:
    """Rows for one model over ``configs`` [(method, budget)]; ``reference`` holds the float
    full-cache log-probs and greedy tokens per prompt (None: this is the float model, whose
    full-cache pass becomes the reference, returned)."""
    acc = {c: {"kl": [], "top1": [], "nll": [], "match": [], "kv": None} for c in configs}
    ref = reference or {"logprobs": [], "greedy": []}
    for i, p in enumerate(prompts):
        pre = prefill_once(model, p.prompt)
        for method, budget in configs:
            a = acc[(method, budget)]
            report = build_from_prefill(model, pre, method, budget, m)
            a["kv"] = report["kv_bytes_per_step"]
            lp = teacher_forced_logprobs(model, p.prompt, p.continuation, first_logits=pre.logits)
            greedy = greedy_continuation(model, method, budget, p.prompt, m,
                                         prefilled=pre)["token_ids"][0]
            if reference is None and method == "full":
                ref["logprobs"].append(lp)
                ref["greedy"].append(greedy)
            a["nll"] += token_nlls(lp, p.continuation)
            a["kl"] += kl_rows(ref["logprobs"][i], lp)
            a["top1"].append(float((lp.argmax(-1) == ref["logprobs"][i].argmax(-1))
                                   .float().mean()))
            a["match"].append(matching_prefix(greedy, ref["greedy"][i]))
            if bar is not None:
                bar.update(1)
    rows = []
    for (method, budget), a in acc.items():
        rows.append({
            "method": method, "budget": budget,
            "kl_vs_float": sum(a["kl"]) / len(a["kl"]),
            "top1_vs_float": sum(a["top1"]) / len(a["top1"]),
            "perplexity": math.exp(sum(a["nll"]) / len(a["nll"])),
            "match_prefix": sum(a["match"]) / len(a["match"]),
            "match_prefix_per_prompt": a["match"], "kv_bytes_per_step": a["kv"],
            "weight_bytes": weight_bytes(model),
            "weight_bytes_per_step": weight_bytes_per_step(model)})
    return rows, ref


def format_table(rows: Sequence[dict], m: int) -> str:
    lines = ["| weights | classifier | method | budget | KL vs float (nats) | top-1 vs float | "
             f"perplexity | greedy match (of {m}) | weights read/step MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['weights']} | {r['classifier']} | {r['method']} | "
                     f"{r['budget'] or '-'} | {r['kl_vs_float']:.4f} | "
                     f"{r['top1_vs_float']:.3f} | {r['perplexity']:.3f} | "
                     f"{r['match_prefix']:.1f} | {r['weight_bytes_per_step'] / 2**20:.1f} |")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['weights']}\ncls {r['classifier']}\n{r['method']}"
              + (f"@{r['budget']}" if r["budget"] else "") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, len(rows) * 0.9), 4.5))
    for ax, key, name in ((axes[0], "kl_vs_float", "KL vs float full (nats)"),
                          (axes[1], "perplexity", "perplexity of the real continuation")):
        ax.bar(range(len(rows)), [r[key] for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=60)
        ax.set_ylabel(name)
        if key == "kl_vs_float":
            ax.set_yscale("symlog", linthresh=1e-3)
    fig.suptitle(f"{rows[0]['model']}: quantized weights x KV methods "
                 f"({rows[0]['prompt_tokens']} prompt tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="float checkpoint (any format)")
    p.add_argument("--variants", nargs="+", default=["int8", "int4-g32", "int4-g64"],
                   help="int8 and/or int4-g<G> (float is always the reference)")
    p.add_argument("--classifier", nargs="+", choices=CLASSIFIER_CHOICES,
                   default=list(CLASSIFIER_CHOICES),
                   help="classifier storage(s) per variant (quantize.py --classifier)")
    p.add_argument("--methods", nargs="+", default=["full", "rocketkv"])
    p.add_argument("--budgets", nargs="+", type=int, default=[256])
    p.add_argument("--prompt-tokens", type=int, default=2048, help="T (default 2048)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="m (default 32)")
    p.add_argument("--num-prompts", type=int, default=4, help="N (default 4)")
    p.add_argument("--split", choices=["eval", "dev"], default="eval")
    p.add_argument("--text", nargs="+", default=[str(t) for t in DEFAULT_TEXTS])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", metavar="DIR")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_positive(args, "prompt_tokens", "max_new_tokens", "num_prompts", "threads")
        if min(args.budgets) <= 0:
            raise ConfigError("--budgets must be positive numbers of tokens")
        variants = [parse_variant(v) for v in dict.fromkeys(args.variants)]
        torch.set_num_threads(args.threads)
        checkpoint = resolve_checkpoint(args.checkpoint)
        text_files(args.text)
        dtype = DTYPES[args.dtype]
        float_model = load_model(checkpoint, "cpu", dtype)
        if float_model.quantization is not None:
            raise ConfigError("--checkpoint must be a float checkpoint (this one is quantized)")
        tok = load_tokenizer(checkpoint)
        T, m = args.prompt_tokens, args.max_new_tokens
        if T + m > float_model.args.max_seq_len:
            raise ConfigError(f"--prompt-tokens {T} + --max-new-tokens {m} exceed the model's "
                              f"context ({float_model.args.max_seq_len} tokens)")
        prompts = split_prompts(tok, args.text, T, m, args.num_prompts, args.seed, args.split)
        configs = [(meth, None) if meth in UNBUDGETED else (meth, b)
                   for meth in dict.fromkeys(args.methods)
                   for b in ([None] if meth in UNBUDGETED else dict.fromkeys(args.budgets))]
        configs = list(dict.fromkeys([("full", None), *configs]))
        # one run per distinct classifier storage: {(mode, g, storage): --classifier choice}
        runs = {("float", None, "float"): None}
        for mode, g in variants:
            for c in args.classifier:
                runs.setdefault((mode, g, classifier_mode(mode, c) or "float"), c)
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(runs) * len(prompts) * len(configs), desc="eval_quantized",
                       file=sys.stderr)
        rows, reference = [], None
        for (mode, g, classifier), choice in runs.items():
            if mode == "float":
                model = float_model
            else:
                model = quantize_model(copy.deepcopy(float_model), mode, g, classifier=choice)
            vrows, reference = run_variant(model, prompts, configs, m, reference, bar)
            name = mode if g is None else f"{mode}-g{g}"
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
    table = format_table(rows, m)
    result = {"model": float_model.args.name, "checkpoint": args.checkpoint, "split": args.split,
              "prompt_tokens": T, "max_new_tokens": m, "num_prompts": len(prompts),
              "dtype": args.dtype, "seed": args.seed, "threads": args.threads,
              "prompts": [{"source": p.source, "document": p.document, "start": p.start}
                          for p in prompts],
              "command": " ".join(["python scripts/eval_quantized.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "rows": rows, "torch_version": torch.__version__,
              "runtime_s": time.perf_counter() - t0}
    print(table)
    if args.out:
        name = "quantization" if args.split == "eval" else "quantization-dev"
        write_outputs(args.out, name, result, table, lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
