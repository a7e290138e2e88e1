"""Answer scoring that a garbled or guessing answer cannot pass: whole numbers, words on word
boundaries, the first value stated for one-answer tasks, and precision with recall for lists.

Why: RULER's ``string_match_all`` (``evals.metrics``, kept as the ``substring`` column) counts
an expected string found anywhere, so "167921525" passes for 1679215 and
"99982250252252502525258" for 9982250, and listing guesses ("9551912, 9551913, 9551914 ...")
earns recall without cost.

Candidates: the values an answer states, by kind (``candidates``), in order, case-insensitive:

* ``number``: maximal runs of 4 or more digits (list numbering and small counts such as "the 4
  numbers" are not answers; a run that merely contains the value is another number);
* ``uuid``: 8-4-4-4-12 hexadecimal groups not inside a longer alphanumeric run;
* ``name``: upper-case words of 5 letters (variable tracking's names);
* ``word``: maximal runs of letters, kept when they are in the task's vocabulary ``vocab``
  (cwe: its word pool; fwe: the made-up consonant-vowel words), so "and" or "the" are ignored.

Scores (``score_answer``):

* one expected value (needle, ``niah_single_*``, ``niah_multikey``): **pass/fail**, 1 when the
  first candidate the answer states is the expected value (a value stated after a wrong one,
  or among distractors listed before it, fails);
* several (``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe``, ``fwe``): **F1** of the
  distinct candidates against the expected set: precision P = hits / distinct candidates,
  recall R = hits / expected, F1 = 2PR / (P + R) (0 without a hit). Listing every word of a
  cwe list gives R = 1 but P = 10 / (words listed).

``matches_whole`` is the boundary test alone: the value occurs with no letter or digit
directly before or after it.
"""

from __future__ import annotations

import re
from collections.abc import Container, Sequence

KINDS = ("number", "uuid", "name", "word")
_PATTERNS = {
    "number": re.compile(r"(?<![0-9])[0-9]{4,}(?![0-9])"),
    "uuid": re.compile(r"(?<![0-9a-z])[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-"
                       r"[0-9a-f]{12}(?![0-9a-z])"),
    "name": re.compile(r"(?<![A-Za-z])[A-Z]{5}(?![A-Za-z])"),
    "word": re.compile(r"[a-z]+"),
}


def matches_whole(prediction: str, value: str) -> bool:
    """Whether ``value`` occurs in ``prediction`` (ignoring case) with neither a letter nor a
    digit directly before or after it: "1679215." matches 1679215, "167921525" does not."""
    pat = r"(?<![0-9a-z])" + re.escape(value.lower()) + r"(?![0-9a-z])"
    return re.search(pat, prediction.lower()) is not None


def candidates(prediction: str, kind: str, vocab: Container[str] | None = None) -> list[str]:
    """The values of ``kind`` that ``prediction`` states, in order, lower case (``name``: upper
    case), repeats kept; ``word`` keeps only words in ``vocab`` (every word when None).

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in _PATTERNS:
        raise ValueError(f"unknown candidate kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind == "name":
        return _PATTERNS[kind].findall(prediction)
    found = _PATTERNS[kind].findall(prediction.lower())
    if kind == "word" and vocab is not None:
        found = [w for w in found if w in vocab]
    return found


def first_value_pass(prediction: str, expected: str, kind: str,
                     vocab: Container[str] | None = None) -> float:
    """1.0 when the first candidate of ``kind`` in ``prediction`` is ``expected`` (ignoring
    case), else 0.0 (also when the answer states none)."""
    got = candidates(prediction, kind, vocab)
    norm = expected if kind == "name" else expected.lower()
    return float(bool(got) and got[0] == norm)


def list_f1(prediction: str, expected: Sequence[str], kind: str,
            vocab: Container[str] | None = None) -> float:
    """F1 of the distinct candidates of ``kind`` in ``prediction`` against the distinct
    ``expected`` values (see the module docstring); 0.0 without a hit.

    Raises:
        ValueError: ``expected`` is empty.
    """
    if not expected:
        raise ValueError("list scoring needs at least one expected value")
    want = {e if kind == "name" else e.lower() for e in expected}
    got = set(candidates(prediction, kind, vocab))
    hits = len(want & got)
    if hits == 0:
        return 0.0
    precision, recall = hits / len(got), hits / len(want)
    return 2 * precision * recall / (precision + recall)


def score_answer(prediction: str, expected: Sequence[str], kind: str,
                 vocab: Container[str] | None = None) -> float:
    """The task score: ``first_value_pass`` for one expected value, ``list_f1`` for several.

    Raises:
        ValueError: ``expected`` is empty or ``kind`` unknown.
    """
    if not expected:
        raise ValueError("scoring needs at least one expected value")
    if len(expected) == 1:
        return first_value_pass(prediction, expected[0], kind, vocab)
    return list_f1(prediction, expected, kind, vocab)
