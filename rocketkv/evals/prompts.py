"""Prompts from real text: texts read from files, cut into sentences, whole sentences up to a
token count, and a made-up fact ("needle") hidden at a depth with a question about it.

Pure functions (no model): ``scripts/make_prompt.py`` builds one document-question prompt with
them, the needle harness (``evals.needle``) and the RULER-style tasks (``evals.ruler``) their
haystacks, the fidelity prompt set (``evals.fidelity``) its documents. Token counts come from
the caller's ``count_tokens`` (a tokenizer's ``len(encode(text, bos=False))``, or
``chars_per_4`` as an estimate).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rocketkv.model import ConfigError

CountTokens = Callable[[str], int]

NEEDLE_TEMPLATE = "Keep this in mind: the hidden code of the {key} archive is {number}."
# Checked with SmolLM2-135M-Instruct (--chat, greedy, full cache, seed 0): answered at depths
# 0.1/0.5/0.9 of 3K-token essay prompts; a longer question ending "Reply with the number only."
# lost it at depth 0.5. At 7K tokens it answered only at depth 0.9.
QUESTION_TEMPLATE = "What is the hidden code of the {key} archive?"
KEY_FIRST = ("amber", "copper", "silent", "northern", "velvet", "hollow", "crimson", "frozen",
             "golden", "quiet", "distant", "scarlet", "emerald", "misty", "iron", "lunar")
KEY_SECOND = ("heron", "lantern", "orchard", "harbor", "falcon", "meadow", "compass", "willow",
              "glacier", "beacon", "thistle", "canyon", "sparrow", "quarry", "pepper", "tide")

# A sentence ends at . ! or ? (a run of them, then closing quotes or brackets) followed by
# whitespace and a character that does not continue a sentence (not lower case: "e.g. the" and
# "etc. and" stay whole); or, with no space, between a lower-case letter or digit and an upper
# case letter ("accelerating.We": the essays lost their paragraph breaks); or at a blank line.
_SENTENCE_END = re.compile(
    r"[.!?]+[\"'\u201d\u2019)\]]*\s+(?=[^\sa-z])"
    r"|(?<=[a-z0-9])[.!?]+[\"'\u201d\u2019)\]]*(?=[A-Z\"\u201c])"
    r"|\n[^\S\n]*\n\s*")


def chars_per_4(text: str) -> int:
    """Token estimate without a tokenizer: characters / 4, rounded up."""
    return -(-len(text) // 4)


def split_sentences(text: str) -> list[str]:
    """``text`` cut into sentences, each with the whitespace that follows it, so that joining
    them gives back ``text`` without its leading whitespace. Whitespace-only text gives []."""
    text = text.lstrip()
    out = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        if m.end() > start:
            out.append(text[start:m.end()])
            start = m.end()
    if start < len(text):
        out.append(text[start:])
    return [s for s in out if s.strip()]


def join_sentences(sentences: Sequence[str]) -> str:
    """The document text of ``sentences`` (their whitespace kept, the ends stripped)."""
    return "".join(sentences).strip()


def _sentences_of(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:  # each source ends a paragraph
        yield from split_sentences(text.strip() + "\n\n")


def take_sentences(texts: Iterable[str], n_tokens: int,
                   count_tokens: CountTokens) -> tuple[list[str], bool]:
    """The most leading sentences of ``texts`` whose joined text counts at most ``n_tokens``,
    and whether the texts ran out before reaching that count.

    Sentences are gathered in growing batches until their text counts more than ``n_tokens``,
    then the longest prefix that fits is found by bisection on the exact count of the joined
    prefix (token counts of pieces do not add up exactly).
    """
    source = _sentences_of(texts)
    pool: list[str] = []
    chars = 0
    want_chars = 6 * n_tokens + 1000
    exhausted = False
    while True:
        for sentence in source:
            pool.append(sentence)
            chars += len(sentence)
            if chars >= want_chars:
                break
        else:
            exhausted = True
        if exhausted or count_tokens(join_sentences(pool)) > n_tokens:
            break
        want_chars *= 2
    if exhausted and count_tokens(join_sentences(pool)) <= n_tokens:
        return pool, True
    lo, hi = 0, len(pool)  # count(pool[:lo]) <= n_tokens < count(pool[:hi])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(join_sentences(pool[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid
    return pool[:lo], False


def build_document(texts: Iterable[str], n_tokens: int,
                   count_tokens: CountTokens = chars_per_4) -> list[str]:
    """The leading whole sentences of ``texts`` (in order; each text ends a paragraph) whose
    joined text (``join_sentences``) counts at most ``n_tokens``; all of them when the texts
    are shorter.

    Raises:
        ConfigError: ``n_tokens`` <= 0, texts without a sentence, or a first sentence longer
            than ``n_tokens``.
    """
    if n_tokens <= 0:
        raise ConfigError(f"the document needs a positive number of tokens, got {n_tokens}")
    sentences, exhausted = take_sentences(texts, n_tokens, count_tokens)
    if not sentences:
        if exhausted:
            raise ConfigError("the text is empty (no sentence in it)")
        raise ConfigError(f"not even the text's first sentence fits in {n_tokens} tokens")
    return sentences


def needle_index(sentences: Sequence[str], depth: float,
                 count_tokens: CountTokens = len) -> int:
    """The sentence boundary (0 .. len(sentences)) nearest ``depth`` of the document, measured
    with ``count_tokens`` summed over sentences (characters by default); ties go to the
    earlier boundary."""
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"depth must lie in [0, 1], got {depth}")
    offsets = [0]
    for s in sentences:
        offsets.append(offsets[-1] + count_tokens(s))
    target = depth * offsets[-1]
    return min(range(len(offsets)), key=lambda i: (abs(offsets[i] - target), i))


def insert_at_depth(sentences: Sequence[str], needle: str, depth: float,
                    count_tokens: CountTokens = len) -> list[str]:
    """``sentences`` with ``needle`` as a sentence of its own at the boundary nearest ``depth``
    (see ``needle_index``). The needle is followed by a space and preceded by one when the
    sentence before it ends without whitespace."""
    needle = needle.strip()
    if not needle:
        raise ConfigError("the needle is empty")
    i = needle_index(sentences, depth, count_tokens)
    piece = needle + " "
    if i > 0 and not sentences[i - 1][-1:].isspace():
        piece = " " + piece
    return [*sentences[:i], piece, *sentences[i:]]


def prompt_seed(*parts: object) -> int:
    """A 64-bit seed derived from ``parts`` (e.g. task, split, base seed, length, sample index):
    the first 8 bytes (big-endian) of the SHA-256 of their ``str`` joined by the unit
    separator U+001F. Stable across processes and Python versions (unlike ``hash``), and
    different parts give unrelated seeds, so prompts of a grid draw independent facts."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def default_needle(seed: int) -> tuple[str, str, str, str]:
    """(needle, question, answer, key) of the made-up fact for ``seed``."""
    rng = random.Random(seed)
    key = f"{rng.choice(KEY_FIRST)} {rng.choice(KEY_SECOND)}"
    number = str(rng.randint(1_000_000, 9_999_999))
    return (NEEDLE_TEMPLATE.format(key=key, number=number),
            QUESTION_TEMPLATE.format(key=key), number, key)


def make_prompt(texts: Sequence[str], n_tokens: int, count_tokens: CountTokens = chars_per_4, *,
                depth: float = 0.5, seed: int = 0, needle: str | None = None,
                question: str | None = None, answer: str | None = None
                ) -> tuple[str, dict[str, Any]]:
    """The prompt (document with the needle, blank line, question) of at most ``n_tokens``
    tokens by ``count_tokens``, and a dict describing it.

    Without ``needle`` and ``question`` the fact and its question come from ``seed`` (the
    answer is its 7-digit number); give both to use your own (``answer``: the expected reply,
    optional). The dict has ``answer``, ``needle``, ``question``, ``key`` (default needle),
    ``depth`` (asked), ``needle_depth`` (tokens before the needle / tokens of the document
    without it),
    ``needle_sentence`` (its index among ``sentences``), ``prompt_tokens``,
    ``document_tokens``, ``requested_tokens``, ``text_exhausted`` and ``seed``.

    Raises:
        ConfigError: ``n_tokens`` <= 0, depth outside [0, 1], only one of needle and question,
            empty text, or ``n_tokens`` too small for the needle, the question and a sentence.
    """
    if n_tokens <= 0:
        raise ConfigError(f"--tokens must be positive, got {n_tokens}")
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"--depth must lie in [0, 1], got {depth}")
    key = None
    if needle is None and question is None:
        needle, question, answer, key = default_needle(seed)
    elif needle is None or question is None:
        raise ConfigError("--needle and --question go together (the default question asks "
                          "about the default needle)")
    needle, question = needle.strip(), question.strip()
    if not needle or not question:
        raise ConfigError("the needle and the question must not be empty")

    def prompt_of(doc: list[str]) -> tuple[str, list[str]]:
        with_needle = insert_at_depth(doc, needle, depth, count_tokens)
        return join_sentences(with_needle) + "\n\n" + question, with_needle

    overhead = count_tokens(prompt_of([])[0])  # needle, blank line and question alone
    if overhead >= n_tokens:
        raise ConfigError(f"--tokens {n_tokens} is too small: the needle and the question "
                          f"alone take {overhead} tokens")
    sentences, exhausted = take_sentences(texts, n_tokens - overhead, count_tokens)
    if not sentences:
        if exhausted:
            raise ConfigError("the text is empty (no sentence in it)")
        raise ConfigError(f"--tokens {n_tokens} is too small: no whole sentence of the text "
                          f"fits beside the needle and the question ({overhead} tokens)")
    prompt, with_needle = prompt_of(sentences)
    while count_tokens(prompt) > n_tokens and len(sentences) > 1:  # joins may add a token
        sentences = sentences[:-1]
        prompt, with_needle = prompt_of(sentences)
    i = needle_index(sentences, depth, count_tokens)
    document = join_sentences(with_needle)
    before = join_sentences(with_needle[:i])
    doc_tokens = count_tokens(document)
    haystack_tokens = count_tokens(join_sentences(sentences))  # the document without needle
    info = {
        "answer": answer,
        "needle": needle,
        "question": question,
        "key": key,
        "depth": depth,
        "needle_depth": min(1.0, count_tokens(before) / haystack_tokens),
        "needle_sentence": i,
        "sentences": len(sentences),
        "prompt_tokens": count_tokens(prompt),
        "document_tokens": doc_tokens,
        "requested_tokens": n_tokens,
        "text_exhausted": exhausted,
        "seed": seed,
    }
    return prompt, info


# --------------------------------------------------------------------------------------------
# Text sources


def text_files(paths: Sequence[str | Path]) -> list[Path]:
    """``paths`` in order, each directory replaced by its ``*.txt`` files sorted by name.

    Raises:
        ConfigError: a path that does not exist, or a directory without ``*.txt`` files.
    """
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.glob("*.txt") if p.is_file())
            if not found:
                raise ConfigError(f"no *.txt files in directory {path}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"text file not found: {path}")
    return files


def read_text_file(path: Path, what: str = "") -> str:
    """The UTF-8 text of ``path``.

    Raises:
        ConfigError: ``cannot read {what}{path}: {reason}`` (missing, unreadable, not UTF-8).
    """
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what}{path}: {e}") from None


def source_text(path: Path, what: str = "") -> str:
    """The text of one source file: a ``.json`` file's ``"text"`` field (RULER's essay
    haystack format), else the file's UTF-8 text.

    Raises:
        ConfigError: unreadable (``read_text_file``), invalid JSON, no ``"text"`` string.
    """
    raw = read_text_file(path, what)
    if path.suffix.lower() != ".json":
        return raw
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise ConfigError(f'{path} has no "text" string field')
    return obj["text"]


def read_texts(paths: Sequence[str]) -> list[str]:
    """Texts of the sources in order: a ``.json`` file's ``"text"`` field, each ``*.txt`` of a
    directory (sorted by name), or a text file."""
    texts = [source_text(f) for f in text_files(paths)]
    if not any(t.strip() for t in texts):
        raise ConfigError(f"the text is empty: {', '.join(paths)}")
    return texts
