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

Two options of ``score_answer``, off by default (the scores above are then unchanged):

* ``capped=True``: the answer stopped at its token cap, not at a stop token, so its last value
  may be cut ("... 5. 4784516\\n6. 54092" for 5409226). When the **last** candidate ends at the
  very end of the prediction (nothing after it: no punctuation, no whitespace), it is dropped
  as possibly cut: it is neither right nor wrong. One exception: a **number** that no
  expected value starts with is kept, as the wrong value it is whatever digits would have
  followed ("79755555555555555555555" for 7975559, a runaway repetition); a UUID, name or
  word is always dropped, since more characters could make it no candidate at all. A list
  is then scored on the remaining candidates (precision over the complete values; recall
  still over every expected value, so a cut value that was expected is a miss); a one-value
  task is scored on its first complete candidate, and when the dropped candidate was the
  only one the score is **None** (no verdict: callers leave it out of their means). A
  complete value whose cap fell right after its last character is dropped too: the text
  alone cannot tell it from a cut one.
* ``keys`` (``niah_multiquery``: the keys asked, in the order the question asks them; ``keys[i]``
  has exactly one expected value ``expected[i]``): a value counts only under its own key.
  A **mention** is an occurrence of a key in the prediction (whole key string, ignoring case,
  with no letter or digit directly before or after it; the longest key wins where two could
  start at one place). When the prediction mentions at least one key, each candidate belongs
  to the key of the last mention that ends at or before the candidate's start; candidates
  before the first mention belong to no key, and candidates inside a mention (a key's own
  words, for the ``word`` kind) are not stated values. The answer states the distinct (key,
  candidate) pairs (a pair with no key included); a hit is a key i with the pair (``keys[i]``,
  ``expected[i]``) stated. P = hits / distinct pairs stated, R = hits / ``len(keys)``, F1 =
  2PR / (P + R), 0.0 without a hit (or without a candidate). A right value under the wrong
  key, or before any key, is no hit and costs precision. When no candidate is stated under
  a key (the answer names no key, as a bare numbered list does, or names the keys only after
  the values), nothing ties a value to a key, so the values are scored as a list (``list_f1``,
  in any order): only a value stated under a wrong key is held against the answer.
  ``capped`` drops a cut last candidate before the assignment (a number is kept only when no
  key's expected value starts with it).

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


def _scanned(prediction: str, kind: str) -> str:
    """The text candidates of ``kind`` are found in: the prediction itself for names, else
    the prediction in lower case."""
    if kind not in _PATTERNS:
        raise ValueError(f"unknown candidate kind {kind!r}; choose from {', '.join(KINDS)}")
    return prediction if kind == "name" else prediction.lower()


def _spans(text: str, kind: str, vocab: Container[str] | None) -> list[tuple[str, int, int]]:
    """(value, start, end) of each candidate of ``kind`` in ``text`` (from ``_scanned``)."""
    found = [(m.group(), m.start(), m.end()) for m in _PATTERNS[kind].finditer(text)]
    if kind == "word" and vocab is not None:
        found = [f for f in found if f[0] in vocab]
    return found


def candidates(prediction: str, kind: str, vocab: Container[str] | None = None) -> list[str]:
    """The values of ``kind`` that ``prediction`` states, in order, lower case (``name``: upper
    case), repeats kept; ``word`` keeps only words in ``vocab`` (every word when None).

    Raises:
        ValueError: an unknown kind.
    """
    return [v for v, _, _ in _spans(_scanned(prediction, kind), kind, vocab)]


def _cut(text: str, spans: Sequence[tuple[str, int, int]], kind: str,
         expected: Sequence[str] | None) -> bool:
    """Whether the last of ``spans`` is possibly cut (module docstring, ``capped``)."""
    if not spans or spans[-1][2] != len(text):
        return False
    if kind == "number" and expected is not None:  # more digits only make another number
        return any(_norm(e, kind).startswith(spans[-1][0]) for e in expected)
    return True


def cut_candidate(prediction: str, kind: str, vocab: Container[str] | None = None,
                  expected: Sequence[str] | None = None) -> str | None:
    """The value ``score_answer(capped=True)`` drops as possibly cut: the last candidate of
    ``kind`` when it ends at the very end of ``prediction`` (nothing, not even punctuation or
    whitespace, after it) and, for a number with ``expected`` given, some expected value
    starts with it; None otherwise (also without a candidate).

    Raises:
        ValueError: an unknown kind.
    """
    text = _scanned(prediction, kind)
    spans = _spans(text, kind, vocab)
    return spans[-1][0] if _cut(text, spans, kind, expected) else None


def _norm(value: str, kind: str) -> str:
    return value if kind == "name" else value.lower()


def _pass(got: Sequence[str], expected: str, kind: str) -> float:
    return float(bool(got) and got[0] == _norm(expected, kind))


def _f1(hits: int, stated: int, wanted: int) -> float:
    if hits == 0:
        return 0.0
    precision, recall = hits / stated, hits / wanted
    return 2 * precision * recall / (precision + recall)


def first_value_pass(prediction: str, expected: str, kind: str,
                     vocab: Container[str] | None = None) -> float:
    """1.0 when the first candidate of ``kind`` in ``prediction`` is ``expected`` (ignoring
    case), else 0.0 (also when the answer states none)."""
    return _pass(candidates(prediction, kind, vocab), expected, kind)


def _list_f1(got: Sequence[str], expected: Sequence[str], kind: str) -> float:
    want = {_norm(e, kind) for e in expected}
    stated = set(got)
    return _f1(len(want & stated), len(stated), len(want))


def list_f1(prediction: str, expected: Sequence[str], kind: str,
            vocab: Container[str] | None = None) -> float:
    """F1 of the distinct candidates of ``kind`` in ``prediction`` against the distinct
    ``expected`` values (see the module docstring); 0.0 without a hit.

    Raises:
        ValueError: ``expected`` is empty.
    """
    if not expected:
        raise ValueError("list scoring needs at least one expected value")
    return _list_f1(candidates(prediction, kind, vocab), expected, kind)


def _mentions(text: str, keys: Sequence[str]) -> list[tuple[int, int, int]]:
    """(start, end, key index) of each mention of a key in ``text``, left to right, not
    overlapping; ignoring case, whole key strings (no letter or digit on either side)."""
    index = {k.lower(): i for i, k in enumerate(keys)}
    alternation = "|".join(re.escape(k) for k in sorted(index, key=lambda k: (-len(k), k)))
    pat = re.compile(r"(?<![0-9a-z])(?:" + alternation + r")(?![0-9a-z])", re.IGNORECASE)
    return [(m.start(), m.end(), index[m.group().lower()]) for m in pat.finditer(text)]


def _keyed_f1(text: str, spans: Sequence[tuple[str, int, int]], keys: Sequence[str],
              expected: Sequence[str], kind: str) -> float:
    mentions = _mentions(text, keys)
    pairs: set[tuple[int | None, str]] = set()
    for value, start, end in spans:
        if any(s < end and start < e for s, e, _ in mentions):
            continue  # a key's own words are not a stated value
        owner = None
        for _, e, i in mentions:
            if e > start:
                break
            owner = i
        pairs.add((owner, value))
    if all(owner is None for owner, _ in pairs):  # no value stated under a key: nothing to
        # hold against a key, so the values are scored as a list (in any order)
        return _list_f1([v for _, v in pairs], expected, kind)
    hits = sum((i, _norm(e, kind)) in pairs for i, e in enumerate(expected))
    return _f1(hits, len(pairs), len(keys))


def _check_keys(keys: Sequence[str], expected: Sequence[str]) -> None:
    if isinstance(keys, str):
        raise ValueError("keys must be a sequence of key strings, not one string")
    if len(keys) != len(expected):
        raise ValueError(f"keys name one expected value each: {len(keys)} keys for "
                         f"{len(expected)} expected values")
    if not all(isinstance(k, str) and k.strip() for k in keys):
        raise ValueError("every key must be a non-empty string")
    if len({k.lower() for k in keys}) != len(keys):
        raise ValueError(f"keys must differ (ignoring case): {list(keys)}")


def score_answer(prediction: str, expected: Sequence[str], kind: str,
                 vocab: Container[str] | None = None, *, capped: bool = False,
                 keys: Sequence[str] | None = None) -> float | None:
    """The task score (rules in the module docstring): ``first_value_pass`` for one expected
    value, ``list_f1`` for several; with ``keys``, F1 of the (key, value) pairs stated.

    Args:
        prediction: the answer's text.
        expected: the expected values (at least one).
        kind: the candidates' kind (``KINDS``).
        vocab: the ``word`` kind's vocabulary (None: every word).
        capped: the answer stopped at its token cap: a last candidate ending at the very end
            of ``prediction`` is dropped as possibly cut (a number only when some expected
            value starts with it).
        keys: the keys asked, in the question's order, one per expected value (``keys[i]``
            owns ``expected[i]``): a value counts only under its own key.

    Returns:
        A score in [0, 1]; None only for a one-value task (without ``keys``) whose only
        candidate was dropped as cut (``capped``): neither right nor wrong.

    Raises:
        ValueError: ``expected`` is empty, ``kind`` unknown, or ``keys`` not one distinct
            non-empty string per expected value.
    """
    if not expected:
        raise ValueError("scoring needs at least one expected value")
    if keys is not None:
        _check_keys(keys, expected)
    text = _scanned(prediction, kind)
    spans = _spans(text, kind, vocab)
    cut = capped and _cut(text, spans, kind, expected)
    if cut:
        spans = spans[:-1]
    if keys is not None:
        return _keyed_f1(text, spans, keys, expected, kind)
    got = [v for v, _, _ in spans]
    if len(expected) == 1:
        return None if cut and not got else _pass(got, expected[0], kind)
    return _list_f1(got, expected, kind)
