"""Needle in a haystack under KV-cache compression: context lengths x depths, every method and
budget, one heatmap per method and budget (RocketKV paper Fig. 12).

    python scripts/eval_needle.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out results/accuracy [--lengths 1024 2048 4096 8000] [--depths 10] [--needles 5] \\
        [--methods ...] [--budgets 128 256 512] [--modes standard question_agnostic] \\
        [--limit N]

Prompts (deterministic under ``--seed``). The haystack is whole sentences of ``--text`` (default
the Paul Graham essays of ``../shared/data/text``), each tokenized on its own with a leading
space, so the token count of every piece is fixed and a needle moves without changing the
length: every prompt of a context length has exactly that many tokens (the last sentence is cut
to fit). Needle j of ``--needles`` draws a made-up fact "Keep this in mind: the hidden code of
the {key} archive is {7-digit number}." from ``seed + j`` and starts its haystack at sentence
``j * n_sentences // needles`` (wrapping around; ``--split dev`` starts half a cycle later and
draws from ``seed + 10000 + j``: the development set for choosing defaults, disjoint from the
evaluation prompts). The needle goes in at the sentence boundary nearest each depth
``i / (depths - 1)`` of the haystack (in tokens); the question "What is the hidden code of the
{key} archive?" follows the document in the chat template's user turn, and the assistant's
reply starts with "The hidden code of the {key} archive is".

Scoring: an answer is right when it contains the number (exact match of the needle's value).
``--needle``/``--question``/``--answer``/``--answer-prefix`` replace the fact; a free-text
answer is scored by ROUGE-1 recall of the expected answer's words.

Modes (``--modes``, default both, sharing each document's prefill): ``standard`` (the question
in the prompt) and ``question_agnostic`` (the document compressed first, the question appended
as the next chunk); see ``scripts/eval_common.py``.

Outputs in ``--out``, per mode: ``needle.json``/``needle_qa.json`` (every prompt's answer and
score, the grid, the run's settings), ``.md`` (accuracy per method and budget) and ``.png``
(heatmaps: depth x length, accuracy averaged over the needles of each cell).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from generate import OneLineParser  # noqa: E402
from model import ConfigError  # noqa: E402
from scripts.eval_common import (  # noqa: E402
    DEV_SEED_OFFSET,
    Item,
    accuracy_table,
    add_common_args,
    chat_pieces,
    check_common,
    configurations,
    evaluate_items,
    load,
    method_options,
    report_modes,
    resume_options,
    rouge1_recall,
    string_match_all,
)
from scripts.make_prompt import (  # noqa: E402
    default_needle,
    read_texts,
    split_sentences,
)
from tokenizer import Tokenizer  # noqa: E402

ESSAYS = ROOT.parent / "shared" / "data" / "text" / "PaulGrahamEssays"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8000)
ANSWER_PREFIX = "The hidden code of the {key} archive is"


def needle_fact(seed: int) -> dict[str, str]:
    """The made-up fact of ``seed`` (``make_prompt.default_needle``): needle, question, answer
    prefix and answer (its number)."""
    needle, question, number, key = default_needle(seed)
    return {"needle": needle, "question": question,
            "answer_prefix": ANSWER_PREFIX.format(key=key), "answer": number}


class Haystack:
    """Sentences of the text, each tokenized once (with a leading space)."""

    def __init__(self, tok: Tokenizer, texts: Sequence[str]):
        self.sentences = [s.strip() for t in texts for s in split_sentences(t)]
        self.sentences = [s for s in self.sentences if s]
        if not self.sentences:
            raise ConfigError("the haystack text has no sentence")
        self.tok = tok
        self._ids: dict[int, list[int]] = {}

    def ids(self, i: int) -> list[int]:
        i %= len(self.sentences)
        if i not in self._ids:
            self._ids[i] = self.tok.encode(" " + self.sentences[i], bos=False)
        return self._ids[i]

    def take(self, start: int, n_tokens: int) -> list[list[int]]:
        """Sentences from ``start`` (wrapping around) holding exactly ``n_tokens`` tokens, the
        last one cut to fit."""
        out, total, i = [], 0, start
        while total < n_tokens:
            piece = self.ids(i)[:n_tokens - total]
            out.append(piece)
            total += len(piece)
            i += 1
            if i - start > 10 * len(self.sentences):
                raise ConfigError("the haystack text is too short")
        return out


def insert_needle(pieces: Sequence[Sequence[int]], needle: Sequence[int],
                  depth: float) -> tuple[list[int], float]:
    """The haystack ids with ``needle`` at the sentence boundary nearest ``depth`` (of the
    haystack's tokens; ties to the earlier boundary), and the depth reached."""
    offsets = [0]
    for p in pieces:
        offsets.append(offsets[-1] + len(p))
    total = offsets[-1]
    i = min(range(len(offsets)), key=lambda j: (abs(offsets[j] - depth * total), j))
    ids = [t for p in pieces[:i] for t in p] + list(needle) + \
        [t for p in pieces[i:] for t in p]
    return ids, offsets[i] / total


def depth_grid(n: int) -> list[float]:
    """``n`` depths from 0 to 1 inclusive (one depth: 0.5)."""
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


def build_items(tok: Tokenizer, hay: Haystack, lengths: Sequence[int], depths: Sequence[float],
                needles: int, seed: int, split: str = "eval",
                fact: dict[str, str] | None = None) -> list[Item]:
    """Every prompt of the grid, needle by needle (each over every length and depth), in
    batches of one needle and length (``meta["group"]``): a run cut short (``--time-limit``)
    has whole needles over the grid. Within a needle the longest context comes first, so
    that with ``--workers`` the batches that start last are the short ones (in the default
    grid run with the shortest first, the last 8K batch ran alone for its final 7 minutes
    while the other worker had nothing left)."""
    n = len(hay.sentences)
    items = []
    for j in range(needles):
        for length in sorted(lengths, reverse=True):
            s = seed + j + (DEV_SEED_OFFSET if split == "dev" else 0)
            f = fact or needle_fact(s)
            head, tail = chat_pieces(tok, f["question"], f["answer_prefix"])
            needle = tok.encode(" " + f["needle"], bos=False)
            hay_tokens = length - len(head) - len(tail) - len(needle)
            if hay_tokens <= 0:
                raise ConfigError(f"context length {length} is too short for the template, "
                                  f"needle and question ({length - hay_tokens} tokens)")
            start = j * n // needles + (n // 2 if split == "dev" else 0)
            pieces = hay.take(start, hay_tokens)
            for d in depths:
                doc, reached = insert_needle(pieces, needle, d)
                items.append(Item(head + doc, tail, (f["answer"],), {
                    "length": length, "depth": d, "depth_reached": reached, "needle": j,
                    "seed": s, "answer": f["answer"], "haystack_start": start % n,
                    "group": (j, length)}, len(head)))
    return items


def score_answer(answer: str, item: Item, rouge: bool) -> float:
    """1/0 for the needle's value in the answer, or ROUGE-1 recall of a free-text answer."""
    if rouge:
        return rouge1_recall(answer, item.outputs[0])
    return string_match_all(answer, item.outputs)


def heatmaps(result: dict[str, Any], path: Path) -> None:
    """One depth x length heatmap per (method, budget): accuracy averaged over needles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("score") is not None]
    lengths, depths = result["lengths"], result["depths"]
    items = result["items"]
    cols = max(1, len(result["budgets"]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(len(methods), cols, figsize=(3.2 * cols, 2.6 * len(methods)),
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for r in rows:
        mi = methods.index(r["method"])
        bi = 0 if r["budget"] is None else result["budgets"].index(r["budget"])
        grid = torch.zeros(len(depths), len(lengths))
        count = torch.zeros(len(depths), len(lengths))
        for it, s in zip(items, r["scores"]):
            if s is None:  # the method rejected this item's budget
                continue
            di, li = depths.index(it["depth"]), lengths.index(it["length"])
            grid[di, li] += s
            count[di, li] += 1
        acc = torch.where(count > 0, grid / count.clamp(min=1), float("nan"))  # NaN: blank
        ax = axes[mi, bi]
        ax.axis("on")
        ax.imshow(acc.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{x // 1024}K" if x % 1024 == 0 else str(x)
                                            for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6)
        budget = "" if r["budget"] is None else f" @{r['budget']}"
        ax.set_title(f"{r['method']}{budget}: {100 * r['score']:.0f}%", fontsize=8)
    mode = "question-agnostic" if result["question_agnostic"] else "question in the prompt"
    fig.suptitle(f"needle in a haystack, {result['model']} ({mode}); x: context, y: depth",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, "results/accuracy")
    p.add_argument("--text", nargs="+", default=[str(ESSAYS)],
                   help="haystack: text files, directories of *.txt or RULER's JSON")
    p.add_argument("--lengths", nargs="+", type=int, default=list(DEFAULT_LENGTHS),
                   help="context lengths in tokens (whole prompt; default 1024 2048 4096 8000)")
    p.add_argument("--depths", type=int, default=10, help="depths from 0 to 1 (default 10)")
    p.add_argument("--needles", type=int, default=5, help="needles per cell (default 5)")
    p.add_argument("--split", choices=["eval", "dev"], default="eval",
                   help="dev: the development prompts for choosing defaults (other needles, "
                        "other haystack starts)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--needle", help="your own needle sentence (with --question and --answer)")
    p.add_argument("--question")
    p.add_argument("--answer", help="expected answer (scored by ROUGE-1 recall)")
    p.add_argument("--answer-prefix", default="", help="start of the reply (with --needle)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_common(args)
        for flag in ("depths", "needles", "max_new_tokens"):
            if getattr(args, flag) <= 0:
                raise ConfigError(f"--{flag.replace('_', '-')} must be positive")
        custom = [args.needle, args.question, args.answer]
        if any(x is not None for x in custom) and not all(x is not None for x in custom):
            raise ConfigError("--needle, --question and --answer go together")
        texts = read_texts(args.text)
        model, tok, device = load(args)
        too_long = [n for n in args.lengths if n + args.max_new_tokens > model.args.max_seq_len]
        if too_long:
            raise ConfigError(f"--lengths {too_long[0]} + --max-new-tokens exceed the model's "
                              f"context ({model.args.max_seq_len} tokens)")
        fact = None if args.needle is None else {
            "needle": args.needle, "question": args.question, "answer": args.answer,
            "answer_prefix": args.answer_prefix}
        depths = depth_grid(args.depths)
        items = build_items(tok, Haystack(tok, texts), args.lengths, depths, args.needles,
                            args.seed, args.split, fact)
        if args.limit:
            items = items[:args.limit]
        budgets = list(dict.fromkeys(args.budgets))
        configs = configurations(list(dict.fromkeys(args.methods)), budgets)
        rouge = fact is not None
        got = evaluate_items(model, tok, items, configs, args.max_new_tokens,
                             lambda a, it: score_answer(a, it, rouge), modes=args.modes,
                             options=method_options(args), batch_size=args.batch_size,
                             progress=not args.no_progress,
                             **resume_options(args, "needle", model, device))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report_modes(args, got, model, "needle", {
        "lengths": sorted({it.meta["length"] for it in items}), "depths": depths,
        "needles": args.needles, "budgets": budgets, "max_new_tokens": args.max_new_tokens,
        "scoring": "rouge1_recall" if rouge else "exact",
        "items": [{k: v for k, v in it.meta.items() if k != "group"} | {"tokens": it.tokens}
                  for it in items]}, t0,
        lambda rows: accuracy_table(rows, budgets), heatmaps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
