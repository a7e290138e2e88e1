"""Needle in a haystack: the prompts of a grid of context lengths x depths x needles, and
their scores.

Prompts (deterministic under the seed). The haystack is whole sentences of the text (default
the Paul Graham essays, ``evals.data.ESSAYS``), each tokenized on its own with a leading space,
so the token count of every piece is fixed and a needle moves without changing the length:
every prompt of a context length has exactly that many tokens (the last sentence is cut to
fit). Every prompt (length, needle j, depth i) draws its own made-up fact and haystack start
from a seed hashed from them (``needle_seed``: SHA-256 of the variant, split, base seed,
length, j and i), and a fact whose key or number already occurs in the grid is redrawn: no two
prompts of a grid share a fact, and lengths and depths are independent samples. The ``dev``
split (the development set for choosing defaults) hashes another split name.

Facts (``needle_fact``), ``--variant``:

* ``standard``: "Keep this in mind: the hidden code of the {key} archive is {7-digit
  number}.", asked "What is the hidden code of the {key} archive?";
* ``paraphrase``: "Remember this: the {adjective noun} was given the code {number}.", asked
  "Which number was the {synonym synonym} assigned?" (e.g. "crimson automobile" / "red car"):
  the question shares no content word with the needle, the failure reported for methods that
  keep what the question's words attend to (SnapKV-like observation windows).

Depths: the needle goes in at the sentence boundary nearest each depth ``i / (depths - 1)`` of
the haystack (in tokens). Depth 0 puts it right after the chat template (inside the first
``SINK_TOKENS`` = 64 tokens) and depth 1 right before the question (inside the last
``RECENT_TOKENS`` = 256): each item's ``region`` says "sink", "middle" or "recent" from its
``tokens_before`` and ``tokens_after``; with ``--depths 10`` at 4K-32K tokens the 8 interior
depths are "middle". The question follows the document in the chat template's user turn, and
the assistant's reply starts with the answer prefix.

Scoring (``score_answer``): pass/fail, 1 when the first number of 4 or more digits the answer
states is the needle's value (whole numbers: "167921525" is not 1679215,
``evals.scoring``); ``substring_score`` keeps the old substring match for comparison. A fact of
the caller's own is scored by ROUGE-1 recall of the expected answer's words.
``scripts/eval_needle.py`` runs the grid, ``scripts/kept_tokens.py`` probes what the caches
keep of it.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from rocketkv.data import ESSAYS
from rocketkv.evals.harness import Item, chat_pieces
from rocketkv.evals.metrics import rouge1_recall, string_match_all
from rocketkv.evals.prompts import (
    KEY_FIRST,
    NEEDLE_TEMPLATE,
    QUESTION_TEMPLATE,
    prompt_seed,
    split_sentences,
)
from rocketkv.evals.ruler import WORD_POOL
from rocketkv.evals.scoring import first_value_pass
from rocketkv.flags import deprecated_alias
from rocketkv.formats.tokenizer import Tokenizer
from rocketkv.model import ConfigError

DEFAULT_LENGTHS = (1024, 2048, 4096, 8000)
ANSWER_PREFIX = "The hidden code of the {key} archive is"
VARIANTS = ("standard", "paraphrase")
SINK_TOKENS = 64  # a needle starting in the prompt's first 64 tokens is in the "sink" region
RECENT_TOKENS = 256  # ... ending within its last 256 (the grid's budget) in the "recent" one
MAX_REDRAWS = 100

# Keys of the standard needle: an adjective and a noun (32 x 590 = 18,880 keys).
ADJECTIVES = KEY_FIRST + ("bronze", "hidden", "narrow", "pale", "rapid", "silver", "solemn",
                          "sunken", "tawny", "twisted", "vivid", "wild", "windy", "woven",
                          "yellow", "young")
# The paraphrased needle: (needle word, question word) pairs of synonyms sharing no word, so
# the question shares no content word with the needle sentence.
PARAPHRASE_ADJECTIVES = (
    ("crimson", "red"), ("azure", "blue"), ("emerald", "green"), ("tiny", "small"),
    ("enormous", "huge"), ("ancient", "old"), ("swift", "fast"), ("silent", "quiet"),
    ("frozen", "icy"), ("wealthy", "rich"), ("damp", "wet"), ("gloomy", "dark"),
    ("cheerful", "happy"), ("furious", "angry"), ("weary", "tired"), ("courageous", "brave"),
    ("sluggish", "slow"), ("spotless", "clean"), ("filthy", "dirty"), ("timid", "shy"),
    ("gigantic", "big"), ("brilliant", "bright"), ("rapid", "quick"), ("peculiar", "odd"))
PARAPHRASE_NOUNS = (
    ("automobile", "car"), ("ship", "boat"), ("physician", "doctor"), ("residence", "house"),
    ("feline", "cat"), ("canine", "dog"), ("infant", "baby"), ("boulder", "rock"),
    ("stream", "brook"), ("forest", "woods"), ("road", "street"), ("present", "gift"),
    ("sofa", "couch"), ("attorney", "lawyer"), ("cellar", "basement"), ("pupil", "student"),
    ("chef", "cook"), ("jacket", "coat"), ("sack", "bag"), ("steed", "horse"),
    ("bucket", "pail"), ("pillar", "column"), ("trousers", "pants"), ("sailor", "mariner"),
    ("lorry", "truck"), ("cemetery", "graveyard"), ("lantern", "lamp"),
    ("wizard", "sorcerer"), ("journey", "trip"), ("hound", "mutt"))
PARAPHRASE_NEEDLE = "Remember this: the {adj} {noun} was given the code {number}."
PARAPHRASE_QUESTION = "Which number was the {adj} {noun} assigned?"
PARAPHRASE_PREFIX = "The {adj} {noun} was assigned the number"


def needle_fact(seed: int, variant: str = "standard") -> dict[str, str]:
    """The made-up fact of ``seed``: needle, question, answer prefix, answer (a 7-digit number)
    and key (the words naming the fact in the needle), all drawn from ``random.Random(seed)``.

    ``standard``: "Keep this in mind: the hidden code of the {adjective noun} archive is
    {number}." asked "What is the hidden code of the {adjective noun} archive?" (``ADJECTIVES``
    x ``evals.ruler.WORD_POOL``). ``paraphrase``: "Remember this: the {adjective noun} was
    given the code {number}." asked "Which number was the {synonym synonym} assigned?"
    (``PARAPHRASE_ADJECTIVES`` x ``PARAPHRASE_NOUNS``): the question and the answer prefix
    share no content word with the needle, so finding it takes more than matching words.

    Raises:
        ConfigError: an unknown variant.
    """
    rng = random.Random(seed)
    number = str(rng.randint(1_000_000, 9_999_999))
    if variant == "standard":
        key = f"{rng.choice(ADJECTIVES)} {rng.choice(WORD_POOL)}"
        return {"needle": NEEDLE_TEMPLATE.format(key=key, number=number),
                "question": QUESTION_TEMPLATE.format(key=key),
                "answer_prefix": ANSWER_PREFIX.format(key=key), "answer": number, "key": key}
    if variant == "paraphrase":
        (a1, a2), (n1, n2) = rng.choice(PARAPHRASE_ADJECTIVES), rng.choice(PARAPHRASE_NOUNS)
        return {"needle": PARAPHRASE_NEEDLE.format(adj=a1, noun=n1, number=number),
                "question": PARAPHRASE_QUESTION.format(adj=a2, noun=n2),
                "answer_prefix": PARAPHRASE_PREFIX.format(adj=a2, noun=n2), "answer": number,
                "key": f"{a1} {n1}"}
    raise ConfigError(f"unknown needle variant {variant!r}; choose from {', '.join(VARIANTS)}")


def needle_seed(length: int, needle: int, depth_index: int, seed: int = 0,
                split: str = "eval", variant: str = "standard", attempt: int = 0) -> int:
    """The seed of one needle prompt: ``evals.prompts.prompt_seed`` of ("needle", variant,
    split, seed, length, needle, depth_index, attempt)."""
    return prompt_seed("needle", variant, split, seed, length, needle, depth_index, attempt)


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


def region(tokens_before: int, tokens_after: int) -> str:
    """Where a needle sits: "sink" when it starts within the prompt's first ``SINK_TOKENS``,
    "recent" when it ends within the last ``RECENT_TOKENS`` (the question and answer prefix
    included), else "middle": the part no method keeps by position alone at budget 256."""
    if tokens_before < SINK_TOKENS:
        return "sink"
    return "recent" if tokens_after < RECENT_TOKENS else "middle"


def build_items(tok: Tokenizer, hay: Haystack, lengths: Sequence[int], depths: Sequence[float],
                needles: int, seed: int, split: str = "eval",
                fact: dict[str, str] | None = None, variant: str = "standard") -> list[Item]:
    """Every prompt of the grid, needle by needle (each over every length and depth), in
    batches of one needle index and length (``meta["group"]``): a run cut short
    (``--time-limit``) has whole needles over the grid. Within a needle the longest context
    comes first, so that with ``--workers`` the batches that start last are the short ones.

    Each prompt (length, needle j, depth i) draws its own fact from
    ``needle_seed(length, j, i, seed, split, variant)`` and its haystack start from
    ``prompt_seed(that seed, "haystack")``; a fact whose key or number was drawn
    before in this grid is redrawn with ``attempt`` 1, 2, ..., so no two prompts of a grid
    share a key or a number (``fact``, the caller's own, is the same in every prompt). The
    prompt's ``meta`` records ``seed`` (``needle_fact(seed, variant)`` gives its fact),
    ``tokens_before``/``tokens_after`` the needle and its ``region``.

    Raises:
        ConfigError: a length too short for the template, needle and question, or no new fact
            in ``MAX_REDRAWS`` draws (a grid larger than the variant's keys).
    """
    n = len(hay.sentences)
    items = []
    used: set[str] = set()
    for j in range(needles):
        for length in sorted(lengths, reverse=True):
            for di, d in enumerate(depths):
                for attempt in range(MAX_REDRAWS):
                    s = needle_seed(length, j, di, seed, split, variant, attempt)
                    f = fact or needle_fact(s, variant)
                    if fact is not None or not used & {f["key"], f["answer"]}:
                        break
                else:
                    raise ConfigError(f"no needle with a new key and number in {MAX_REDRAWS} "
                                      f"draws: the grid is too large for the {variant} keys")
                if fact is None:
                    used.update((f["key"], f["answer"]))
                head, tail = chat_pieces(tok, f["question"], f["answer_prefix"])
                needle = tok.encode(" " + f["needle"], bos=False)
                hay_tokens = length - len(head) - len(tail) - len(needle)
                if hay_tokens <= 0:
                    raise ConfigError(f"context length {length} is too short for the template, "
                                      f"needle and question ({length - hay_tokens} tokens)")
                start = random.Random(prompt_seed(s, "haystack")).randrange(n)
                pieces = hay.take(start, hay_tokens)
                doc, reached = insert_needle(pieces, needle, d)
                before = len(head) + round(reached * hay_tokens)
                after = length - before - len(needle)
                items.append(Item(head + doc, tail, (f["answer"],), {
                    "length": length, "depth": d, "depth_reached": reached, "needle": j,
                    "seed": s, "variant": variant, "answer": f["answer"], "key": f.get("key"),
                    "haystack_start": start, "tokens_before": before, "tokens_after": after,
                    "region": region(before, after), "group": (j, length)}, len(head)))
    return items


def score_answer(answer: str, item: Item, rouge: bool) -> float:
    """Pass/fail: 1 when the first number of 4+ digits the answer states is the needle's
    value (``evals.scoring.first_value_pass``: "167921525" is not 1679215); or ROUGE-1 recall
    of a free-text answer (a fact of one's own)."""
    if rouge:
        return rouge1_recall(answer, item.outputs[0])
    return first_value_pass(answer, item.outputs[0], "number")


def substring_score(answer: str, item: Item) -> float:
    """The old score, for comparison: RULER's ``string_match_all`` (the value anywhere in the
    answer as a substring, ignoring case)."""
    return string_match_all(answer, item.outputs)


def add_needle_args(p: argparse.ArgumentParser) -> None:
    """The grid's flags (after ``evals.harness.add_common_args``): --text, --context, --depths,
    --needles, --split, --max-new-tokens and a fact of one's own (--needle, --question,
    --answer, --answer-prefix)."""
    p.add_argument("--text", nargs="+", default=[str(ESSAYS)],
                   help="haystack: text files, directories of *.txt or RULER's JSON")
    p.add_argument("--context", nargs="+", type=int, default=list(DEFAULT_LENGTHS),
                   metavar="N",
                   help="context lengths in tokens (whole prompt; default 1024 2048 4096 8000)")
    deprecated_alias(p, "--lengths", "--context")
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
