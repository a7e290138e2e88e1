"""Accuracy of KV-cache compression on a real checkpoint: agreement with the full cache,
perplexity of held-out text, and the bytes each method stores and reads.

    python scripts/eval_accuracy.py --checkpoint checkpoints/stories260K --json eval.json

Prompt set (deterministic). Documents: each text file in order (default
``../shared/data/text/tinystories_sample_cs336.txt``, then ``tinystories_valid_excerpt_30KB.txt``;
``--text`` replaces them) split on ``<|endoftext|>``, each piece stripped of surrounding
whitespace, empty pieces dropped (the five stories of the first file; the excerpt has no
separator, so it is one document).
Each document is tokenized whole with ``tok.encode(text, bos=False)`` and cut into
non-overlapping windows of ``W = T + m - 1`` tokens starting at token 0, W, 2W, ...; a trailing
piece shorter than W is dropped, windows never cross documents. Window i becomes
``[BOS] + window``: the prompt is its first T tokens (BOS included) and the continuation its last
m tokens. With K candidate windows in document order (first file first), the prompts are the
windows ``floor(i * K / N)`` for ``i = 0 .. N-1`` (evenly spread; N = ``--num-prompts``); fewer
than N windows is an error.

Caches. For every (method, budget) the caches are built by ``kv_cache.build_caches`` with
``prompt_len = T`` and ``max_new_tokens = m`` (float32, CPU, batch 1), afresh for every prompt
and every pass below, so the three measurements of a row use identically configured caches.
``full`` ignores the budget and is reported once (budget ``null``). A budget that the method
rejects (``ConfigError``) gives a row with ``"error"`` (the message) and no numbers.

Numbers, per (method, budget), each over the N prompts:

* ``match_prefix``: greedy decoding, ``m`` tokens (the first from the prefill logits, then m - 1
  decode steps feeding the previous token at positions T, T+1, ...; EOS does not stop it), with
  the method's caches and with the full cache; the number of leading tokens of the method's
  continuation equal to the full cache's, averaged over prompts (0..m).
* ``teacher_forced_top1``: the full cache's greedy continuation g_0..g_{m-1} is forced through
  the method's caches (prefill the prompt; decode steps feed g_0..g_{m-2} at positions
  T..T+m-2); the fraction of the N*m predictions (prefill logits, then each decode step's) whose
  argmax equals the next full-cache token g_j. The first prediction comes from prefill, which
  attends over the whole prompt in every method implemented now, so it agrees.
* ``perplexity``: the prompt is prefilled with the method's caches and the m real continuation
  tokens c_0..c_{m-1} of the same text are forced (decode steps feed c_0..c_{m-2} at positions
  T..T+m-2); NLL_j = -log softmax(logits_j)[c_j] with logits_0 from prefill and logits_j from the
  decode step that fed c_{j-1}; the number is exp(mean NLL over all N*m tokens). ``full``'s row
  is the same with the full cache.
* ``kv_cache_bytes``: ``allocated_bytes()`` summed over layers (K/V and auxiliary buffers,
  e.g. page min/max keys); ``kv_bytes_per_step``: ``bytes_read_per_step()`` summed over layers
  (one decode step's K/V and approximation traffic, batch 1). Both are static per configuration.
* ``method_params``: ``caches[-1].method_params()`` (the derived parameters of the last layer).

Argmax ties go to the lowest token id (``torch.argmax``, as ``generate.sample`` does greedily).
Per-prompt values (``match_prefix_per_prompt``, ``teacher_forced_top1_per_prompt``,
``nll_per_token``) are kept in the JSON, with the prompts' token ids, the full cache's greedy
continuations (``reference_continuations``), ``eval_s`` (the evaluation's wall time) and
``runtime_s`` (the whole run, loading included). The markdown table goes to stdout, the progress
bar (tqdm, when installed) to stderr. Torch runs on ``--threads`` CPU threads (default 1).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import compression  # noqa: E402,F401  (registers the compression methods)
from checkpoint import load_model  # noqa: E402
from generate import OneLineParser, generate, write_json  # noqa: E402
from kv_cache import METHODS, KVCache, build_caches  # noqa: E402
from model import ConfigError, Transformer  # noqa: E402
from tokenizer import Tokenizer, load_tokenizer  # noqa: E402

TEXT_DIR = ROOT.parent / "shared" / "data" / "text"
DEFAULT_TEXTS = (TEXT_DIR / "tinystories_sample_cs336.txt",
                 TEXT_DIR / "tinystories_valid_excerpt_30KB.txt")
STORY_SEPARATOR = "<|endoftext|>"
DEFAULT_BUDGETS = (64, 128, 256)
DEFAULT_METHODS = ("full", "exact_topk", "snapkv", "snapkv_pp", "quest", "sparq", "hybrid",
                   "rocketkv")


# --------------------------------------------------------------------------------------------
# Prompt set


@dataclass(frozen=True)
class Prompt:
    """One evaluation window: ``prompt`` (T ids, BOS first) and the ``continuation`` (m ids)
    that follows it in ``source`` (file name), document ``document``, from text token ``start``."""

    source: str
    document: int
    start: int
    prompt: list[int]
    continuation: list[int]


def read_documents(paths: Sequence[str | Path]) -> list[tuple[str, int, str]]:
    """``(file name, index, text)`` of every non-empty ``<|endoftext|>``-separated piece."""
    docs = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read text file {path}: {e}") from None
        pieces = [p.strip() for p in text.split(STORY_SEPARATOR)]
        docs += [(Path(path).name, i, p) for i, p in enumerate(q for q in pieces if q)]
    return docs


def document_windows(tok: Tokenizer, docs: list[tuple[str, int, str]], T: int,
                     m: int) -> list[Prompt]:
    """Every non-overlapping window of T + m - 1 text tokens, with BOS prepended, in order."""
    width = T + m - 1
    windows = []
    for source, index, text in docs:
        ids = tok.encode(text, bos=False)
        for start in range(0, len(ids) - width + 1, width):
            seq = [tok.bos_id] + ids[start:start + width]
            windows.append(Prompt(source, index, start, seq[:T], seq[T:]))
    return windows


def spread_pick(items: list, n: int) -> list:
    """Items ``floor(i * len(items) / n)`` for i = 0..n-1 (n <= len(items))."""
    return [items[i * len(items) // n] for i in range(n)]


def build_prompt_set(tok: Tokenizer, paths: Sequence[str | Path], T: int, m: int,
                     n: int) -> list[Prompt]:
    """The N prompts of the module docstring's rule; ConfigError when the text is too short."""
    windows = document_windows(tok, read_documents(paths), T, m)
    if len(windows) < n:
        raise ConfigError(f"the text holds only {len(windows)} windows of {T + m - 1} tokens "
                          f"(--prompt-tokens {T} + --max-new-tokens {m} - 1), {n} needed; "
                          "lower --num-prompts or --prompt-tokens")
    return spread_pick(windows, n)


# --------------------------------------------------------------------------------------------
# Runs through a cache


def attach_caches(model: Transformer, method: str, budget: int | None, T: int,
                  m: int) -> list[KVCache]:
    """Fresh caches of ``method`` at ``budget`` for a T-token prompt and m new tokens, attached
    to ``model``. Raises ConfigError for a budget the method rejects."""
    caches = build_caches(method, model.args, batch_size=1, prompt_len=T, max_new_tokens=m,
                          budget=budget, dtype=model.tok_embeddings.weight.dtype,
                          device=model.tok_embeddings.weight.device)
    model.setup_caches(caches, T + m)
    model._cache_spec = None  # generate.generate must not mistake these caches for its own
    return caches


@torch.no_grad()
def teacher_forced_logprobs(model: Transformer, prompt: Sequence[int],
                            continuation: Sequence[int]) -> torch.Tensor:
    """Log-probabilities (len(continuation), vocab), float32, through the model's caches: row j
    predicts ``continuation[j]`` from the prompt and ``continuation[:j]`` (row 0 from prefill,
    row j from the decode step that fed ``continuation[j - 1]`` at position T + j - 1)."""
    device = model.tok_embeddings.weight.device
    T = len(prompt)
    rows = [model.prefill(torch.tensor([list(prompt)], device=device))]
    for j, token in enumerate(continuation[:-1]):
        rows.append(model(torch.tensor([[token]], device=device),
                          torch.tensor([T + j], device=device)))
    return torch.cat(rows).float().log_softmax(dim=-1)


def greedy_continuation(model: Transformer, method: str, budget: int | None,
                        prompt: Sequence[int], m: int) -> list[int]:
    """m greedy tokens from ``generate.generate`` with fresh caches of ``method`` (the first
    from prefill, then m - 1 decode steps; no stop token)."""
    return generate(model, list(prompt), method=method, budget=budget,
                    max_new_tokens=m)["token_ids"][0]


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def top1_matches(logprobs: torch.Tensor, targets: Sequence[int]) -> int:
    """Rows of ``logprobs`` whose argmax is the target token."""
    return int((logprobs.argmax(dim=-1) == torch.tensor(list(targets))).sum())


def token_nlls(logprobs: torch.Tensor, targets: Sequence[int]) -> list[float]:
    """-log p(target) per row."""
    idx = torch.tensor(list(targets))[:, None]
    return (-logprobs.gather(1, idx)[:, 0]).tolist()


def perplexity(nlls: Sequence[Sequence[float]]) -> float:
    """exp of the mean NLL over every token of every prompt."""
    flat = [x for row in nlls for x in row]
    return math.exp(sum(flat) / len(flat))


def cache_bytes(caches: Sequence[KVCache]) -> tuple[int, int]:
    """(allocated bytes, bytes read per decode step), summed over layers."""
    return (sum(c.allocated_bytes() for c in caches),
            sum(c.bytes_read_per_step() for c in caches))


# --------------------------------------------------------------------------------------------
# Evaluation


def reference_continuations(model: Transformer, prompts: Sequence[Prompt],
                            m: int) -> list[list[int]]:
    """The full cache's greedy continuation of every prompt."""
    refs = []
    for p in prompts:
        refs.append(greedy_continuation(model, "full", None, p.prompt, m))
    return refs


def evaluate_config(model: Transformer, method: str, budget: int | None,
                    prompts: Sequence[Prompt], refs: Sequence[Sequence[int]], m: int,
                    tick=lambda: None) -> dict[str, Any]:
    """One row: agreement with ``refs``, perplexity of the real continuations, bytes, params.
    A budget the method rejects gives ``{"method", "budget", "error"}``."""
    row: dict[str, Any] = {"method": method, "budget": budget}
    T = len(prompts[0].prompt)
    try:
        caches = attach_caches(model, method, budget, T, m)
    except ConfigError as e:
        row["error"] = str(e)
        return row
    row["kv_cache_bytes"], row["kv_bytes_per_step"] = cache_bytes(caches)
    row["method_params"] = caches[-1].method_params()
    prefix, top1, nlls = [], [], []
    for p, ref in zip(prompts, refs):
        prefix.append(matching_prefix(greedy_continuation(model, method, budget, p.prompt, m),
                                      ref))
        attach_caches(model, method, budget, T, m)
        top1.append(top1_matches(teacher_forced_logprobs(model, p.prompt, ref), ref) / m)
        attach_caches(model, method, budget, T, m)
        lp = teacher_forced_logprobs(model, p.prompt, p.continuation)
        nlls.append(token_nlls(lp, p.continuation))
        tick()
    row.update(match_prefix=sum(prefix) / len(prefix), match_prefix_per_prompt=prefix,
               teacher_forced_top1=sum(top1) / len(top1), teacher_forced_top1_per_prompt=top1,
               perplexity=perplexity(nlls), nll_per_token=nlls)
    return row


def configurations(methods: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, Any]]:
    """(method, budget) pairs in table order; ``full`` once, with budget None."""
    return [(m, None) if m == "full" else (m, b)
            for m in methods for b in ([None] if m == "full" else budgets)]


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="prompt", disable=not enabled, file=sys.stderr)


def evaluate(model: Transformer, prompts: Sequence[Prompt], methods: Sequence[str],
             budgets: Sequence[int], m: int, progress: bool = False) -> dict[str, Any]:
    """Every row for ``methods`` x ``budgets`` on ``prompts`` (m new tokens each)."""
    configs = configurations(methods, budgets)
    bar = _progress(len(prompts) * (len(configs) + 1), progress)
    tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    t0 = time.perf_counter()
    refs = reference_continuations(model, prompts, m)
    if bar is not None:
        bar.update(len(prompts))
    rows = []
    for method, budget in configs:
        if bar is not None:
            bar.set_description(f"{method} {budget if budget is not None else ''}".strip())
        row = evaluate_config(model, method, budget, prompts, refs, m, tick)
        if "error" in row and bar is not None:
            bar.update(len(prompts))
        rows.append(row)
    if bar is not None:
        bar.close()
    return {"model": model.args.name, "prompt_tokens": len(prompts[0].prompt),
            "max_new_tokens": m, "num_prompts": len(prompts), "methods": list(methods),
            "budgets": list(budgets), "rows": rows, "reference_continuations": refs,
            "prompts": [asdict(p) for p in prompts], "eval_s": time.perf_counter() - t0,
            "torch_version": torch.__version__}


# --------------------------------------------------------------------------------------------
# Report


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def format_params(params: dict[str, Any]) -> str:
    """``key=value`` pairs (floats to 3 significant digits), method and budget left out."""
    return ", ".join(f"{k}={_fmt(v)}" for k, v in params.items()
                     if k not in ("method", "budget"))


def format_table(result: dict[str, Any]) -> str:
    """Markdown table of ``result["rows"]``."""
    m = result["max_new_tokens"]
    lines = [f"| method | budget | match prefix (of {m}) | teacher-forced top-1 | perplexity "
             "| KV bytes | KV bytes/step | params |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        budget = "-" if r["budget"] is None else str(r["budget"])
        if "error" in r:
            msg = r["error"].replace("|", "\\|")
            cells = ["n/a"] * 5 + [f"n/a: {msg}"]
        else:
            cells = [f"{r['match_prefix']:.2f}", f"{r['teacher_forced_top1']:.3f}",
                     f"{r['perplexity']:.3f}", f"{r['kv_cache_bytes']:,}",
                     f"{r['kv_bytes_per_step']:,}",
                     format_params(r["method_params"]).replace("|", "\\|")]
        lines.append("| " + " | ".join([r["method"], budget, *cells]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (converted or HF)")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's)")
    p.add_argument("--text", nargs="+", default=[str(t) for t in DEFAULT_TEXTS], metavar="FILE",
                   help="text files for the prompt set (default: the two TinyStories files)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   choices=list(METHODS), metavar="METHOD",
                   help=f"any of {', '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS),
                   metavar="N", help="token budgets (default 64 128 256)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="m (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=400, help="T, BOS included (default 400)")
    p.add_argument("--num-prompts", type=int, default=8, help="N (default 8)")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: the model is tiny, more threads mostly "
                        "add overhead)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(args: argparse.Namespace) -> None:
    """ConfigError for values no run can use."""
    for flag in ("max_new_tokens", "prompt_tokens", "num_prompts", "threads"):
        value = getattr(args, flag)
        if value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    bad = [b for b in args.budgets if b <= 0]
    if bad:
        raise ConfigError(f"--budgets must be positive numbers of tokens, got {bad[0]}")
    if args.json:
        parent = Path(args.json).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"--json: directory {parent} does not exist")
    for path in args.text:
        if not Path(path).is_file():
            raise ConfigError(f"text file not found: {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_args(args)
        torch.set_num_threads(args.threads)
        model = load_model(args.checkpoint, "cpu", torch.float32)
        tok = load_tokenizer(args.tokenizer or args.checkpoint)
        if tok.vocab_size > model.args.vocab_size:
            raise ConfigError(f"tokenizer has {tok.vocab_size} tokens, model only "
                              f"{model.args.vocab_size}")
        T, m = args.prompt_tokens, args.max_new_tokens
        if T + m > model.args.max_seq_len:
            raise ConfigError(f"--prompt-tokens {T} + --max-new-tokens {m} exceed the model's "
                              f"context ({model.args.max_seq_len} tokens)")
        prompts = build_prompt_set(tok, args.text, T, m, args.num_prompts)
        budgets = list(dict.fromkeys(args.budgets))
        methods = list(dict.fromkeys(args.methods))
        result = evaluate(model, prompts, methods, budgets, m, progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(checkpoint=args.checkpoint, text_files=list(args.text),
                  runtime_s=time.perf_counter() - t0)
    print(format_table(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
