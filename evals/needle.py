"""Needle in a haystack: the prompts of a grid of context lengths x depths x needles, and
their scores.

Prompts (deterministic under the seed). The haystack is whole sentences of the text (default
the Paul Graham essays, ``evals.data.ESSAYS``), each tokenized on its own with a leading space,
so the token count of every piece is fixed and a needle moves without changing the length:
every prompt of a context length has exactly that many tokens (the last sentence is cut to
fit). Needle j of ``needles`` draws a made-up fact "Keep this in mind: the hidden code of the
{key} archive is {7-digit number}." from ``seed + j`` (``evals.prompts.default_needle``) and
starts its haystack at sentence ``j * n_sentences // needles`` (wrapping around; the ``dev``
split starts half a cycle later and draws from ``seed + 10000 + j``: the development set for
choosing defaults, disjoint from the evaluation prompts). The needle goes in at the sentence
boundary nearest each depth ``i / (depths - 1)`` of the haystack (in tokens); the question
"What is the hidden code of the {key} archive?" follows the document in the chat template's
user turn, and the assistant's reply starts with "The hidden code of the {key} archive is".

Scoring: an answer is right when it contains the number (exact match of the needle's value);
a fact of the caller's own is scored by ROUGE-1 recall of the expected answer's words.
``scripts/eval_needle.py`` runs the grid, ``scripts/kept_tokens.py`` probes what the caches
keep of it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from evals.data import ESSAYS
from evals.harness import DEV_SEED_OFFSET, Item, chat_pieces
from evals.metrics import rouge1_recall, string_match_all
from evals.prompts import default_needle, split_sentences
from model import ConfigError
from tokenizer import Tokenizer

DEFAULT_LENGTHS = (1024, 2048, 4096, 8000)
ANSWER_PREFIX = "The hidden code of the {key} archive is"


def needle_fact(seed: int) -> dict[str, str]:
    """The made-up fact of ``seed`` (``evals.prompts.default_needle``): needle, question, answer
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


def add_needle_args(p: argparse.ArgumentParser) -> None:
    """The grid's flags (after ``evals.harness.add_common_args``): --text, --lengths, --depths,
    --needles, --split, --max-new-tokens and a fact of one's own (--needle, --question,
    --answer, --answer-prefix)."""
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
