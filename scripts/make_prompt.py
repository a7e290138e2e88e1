"""Build a document-question prompt: real text with one fact ("needle") hidden in it.

    python scripts/make_prompt.py --text ../shared/data/text/PaulGrahamEssays --tokens 3000 \\
        --out prompt.txt [--tokenizer ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf] \\
        [--depth 0.5] [--seed 0] [--answer-json answer.json]
    python generate.py --checkpoint SmolLM2.gguf --chat --method rocketkv --budget 256 \\
        --prompt prompt.txt

The document is whole sentences of the text, in order: a ``.txt`` file, every ``*.txt`` file of
a directory (sorted by name), or a JSON file with a ``"text"`` field (RULER's haystack); several
``--text`` sources are read one after the other, each ending a paragraph. Sentences are taken
from the start until the whole prompt (document, needle, blank line, question) holds at most
``--tokens`` tokens, so it falls short of that by less than one sentence. Tokens are counted with
``--tokenizer`` (``encode(text, bos=False)``: no BOS, no chat template) or, without one,
estimated as characters / 4; a line on stderr says which.

The needle goes in at the sentence boundary nearest ``--depth`` (0 = start, 1 = end) of the
document, measured in tokens. The default needle is a made-up fact with a 7-digit number and a
key phrase, both drawn from ``--seed``; the question after the document asks for the number.
``--needle``/``--question`` (and ``--answer``, the expected reply) replace them.

Output: the prompt file (document, blank line, question, final newline) and, with
``--answer-json``, the expected answer with the needle, the depth asked for and the depth
reached, the token counts and the seed. Both files are written whole (temporary file, then
rename). Bad input prints one ``error: ...`` line and exits with status 2.

``split_sentences``, ``build_document``, ``insert_at_depth`` and ``make_prompt`` are pure
functions for a needle-in-a-haystack evaluation to import.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from generate import OneLineParser  # noqa: E402
from model import ConfigError  # noqa: E402

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
# CLI


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


def read_texts(paths: Sequence[str]) -> list[str]:
    """Texts of the sources in order: a ``.json`` file's ``"text"`` field, each ``*.txt`` of a
    directory (sorted by name), or a text file."""
    texts = []
    for f in text_files(paths):
        try:
            raw = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {f}: {e}") from None
        if f.suffix.lower() == ".json":
            try:
                obj = json.loads(raw)
            except ValueError as e:
                raise ConfigError(f"{f} is not valid JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ConfigError(f'{f} has no "text" string field')
            raw = obj["text"]
        texts.append(raw)
    if not any(t.strip() for t in texts):
        raise ConfigError(f"the text is empty: {', '.join(paths)}")
    return texts


def _check_writable(path: str, flag: str) -> None:
    if path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"{flag}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{flag}: {path} is not writable")


def write_outputs(outputs: Sequence[tuple[str, str]]) -> None:
    """Write each (path, text) whole: every temporary file first, then the renames, so a
    failure leaves no output half-written. Path ``-`` is stdout."""
    pending = []
    try:
        for path, text in outputs:
            if path == "-":
                continue
            tmp = Path(f"{path}.tmp")
            pending.append((tmp, path))
            tmp.write_text(text, encoding="utf-8")
        for tmp, path in pending:
            os.replace(tmp, path)
    except OSError as e:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {e.filename or 'output'}: {e.strerror or e}") from None
    for path, text in outputs:
        if path == "-":
            sys.stdout.write(text)


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", nargs="+", required=True, metavar="PATH",
                   help="text source(s): a .txt file, a directory of .txt files (sorted), or "
                        'a JSON file with a "text" field')
    p.add_argument("--tokens", type=int, default=3000,
                   help="prompt length in tokens, at most (default 3000)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="count tokens with this tokenizer (a file or checkpoint directory); "
                        "default: estimate characters / 4")
    p.add_argument("--depth", type=float, default=0.5,
                   help="where the needle goes: 0 = start of the document, 1 = end (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="draws the default needle (default 0)")
    p.add_argument("--needle", help="your own fact sentence (with --question)")
    p.add_argument("--question", help="your own question about it (with --needle)")
    p.add_argument("--answer", help="the expected answer to your own question (for --answer-json)")
    p.add_argument("--out", required=True, metavar="PATH", help="prompt text file (- for stdout)")
    p.add_argument("--answer-json", metavar="PATH",
                   help="write the expected answer, depth, token count and seed here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.tokens <= 0:
            raise ConfigError(f"--tokens must be positive, got {args.tokens}")
        if not 0.0 <= args.depth <= 1.0:
            raise ConfigError(f"--depth must lie in [0, 1], got {args.depth}")
        if args.answer is not None and args.needle is None:
            raise ConfigError("--answer goes with --needle and --question")
        _check_writable(args.out, "--out")
        if args.answer_json:
            _check_writable(args.answer_json, "--answer-json")
            if args.answer_json != "-" and Path(args.answer_json).resolve() == \
                    Path(args.out).resolve():
                raise ConfigError("--out and --answer-json name the same file")
        texts = read_texts(args.text)
        if args.tokenizer:
            from tokenizer import load_tokenizer

            tok = load_tokenizer(args.tokenizer)

            def count(text: str) -> int:
                return len(tok.encode(text, bos=False))

            counter = f"tokenizer {args.tokenizer}"
            how = (f"tokens counted with the tokenizer {args.tokenizer} (no BOS, no chat "
                   "template)")
        else:
            count = chars_per_4
            counter = "characters/4"
            how = "tokens estimated as characters / 4 (give --tokenizer for exact counts)"
        prompt, info = make_prompt(texts, args.tokens, count, depth=args.depth, seed=args.seed,
                                   needle=args.needle, question=args.question,
                                   answer=args.answer)
        info.update(token_counter=counter, sources=list(args.text), prompt_file=args.out)
        outputs = [(args.out, prompt + "\n")]
        if args.answer_json:
            outputs.append((args.answer_json, json.dumps(info, indent=1) + "\n"))
        write_outputs(outputs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(how, file=sys.stderr)  # after the checks: a bad input gets one error line only
    if info["text_exhausted"]:
        print(f"note: the text ran out: the prompt has {info['prompt_tokens']} tokens, fewer "
              f"than --tokens {args.tokens}", file=sys.stderr)
    print(f"wrote {args.out}: {info['prompt_tokens']} tokens ({counter}), {info['sentences']} "
          f"sentences, needle at depth {info['needle_depth']:.3f} (asked {args.depth:g}); "
          f"answer: {info['answer']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
