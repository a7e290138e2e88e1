"""One document, many questions: the pieces below ``generate`` that the Python API
(``rocketkv.Document``) and ``generate.py --questions`` share.

A document is prefilled (and compressed) once; each question is then fed after it as the next
turn of the conversation (``generate(..., continue_conversation=True)``), and before the next
question the caches are set back to the document: the conversation's position
(``generate.rewind_conversation``) and whatever the method changed past the document, restored
from a ``CacheSnapshot`` taken after the document's prefill.

The prompt a question stands for is ``document.rstrip() + SEPARATOR + question.strip()``
(inside one user turn of the chat template with ``chat``): ``document_ids`` are its opening
ids and ``question_ids`` the rest, so document ids + question ids are what a separate run of
that prompt prefills.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rocketkv.cache import CompressedKVCache, FullKVCache, KVCache
from rocketkv.formats.tokenizer import Tokenizer
from rocketkv.model import ConfigError

SEPARATOR = "\n\n"  # between the document and each question (the question's first tokens)
_MARK = "Zq7Question"  # where the question goes in a rendered chat template


def _encode(tok: Tokenizer, text: str, chat: bool, system: str | None) -> list[int]:
    return tok.encode_chat(text, system=system) if chat else tok.encode(text)


def _chat_halves(tok: Tokenizer, document: str, system: str | None) -> tuple[str, str]:
    """The rendered chat template of one user turn ``document`` + a question, split where the
    question goes: (up to the end of the document, after the question)."""
    messages = [{"role": "system", "content": system}] if system else []
    text = tok.apply_chat_template([*messages, {"role": "user", "content": document + _MARK}])
    head, sep, tail = text.rpartition(_MARK)
    if not sep:
        raise ConfigError("the chat template does not render the user's message as given")
    return head, tail


def document_ids(tok: Tokenizer, text: str, chat: bool = False,
                 system: str | None = None) -> list[int]:
    """The token ids of ``text`` (trailing white space dropped) as the opening of a prompt
    whose question follows (``question_ids``): plain text with BOS, or with ``chat`` the chat
    template up to the end of the document inside the user turn.

    Raises:
        ConfigError: an empty document, ``system`` without ``chat``, no chat template.
    """
    if not text.strip():
        raise ConfigError("the document is empty")
    if system is not None and not chat:
        raise ConfigError("--system needs --chat (it is a message of the chat template)")
    text = text.rstrip()  # white space would merge with the separator
    if not chat:
        return tok.encode(text)
    return tok.encode_rendered(_chat_halves(tok, text, system)[0])


def question_ids(tok: Tokenizer, question: str, chat: bool = False, document: str = "",
                 system: str | None = None) -> list[int]:
    """The token ids that follow ``document``'s (``document_ids``): ``SEPARATOR``, the question
    and, with ``chat``, the rest of the template (the end of the user turn and the generation
    prompt).

    They are the ids of the whole prompt ``document.rstrip() + SEPARATOR + question.strip()``
    (as ``tok.encode`` or ``encode_chat`` gives it) after the document's, so that document ids
    + question ids equal the prompt of a separate run. Where the tokenizer merges the
    document's end with the separator (or no ``document`` is given), the question is
    tokenized on its own instead.

    Raises:
        ConfigError: an empty question; as ``document_ids``.
    """
    if not question.strip():
        raise ConfigError("a question is empty")
    question = question.strip()
    if document.strip():
        whole = _encode(tok, document.rstrip() + SEPARATOR + question, chat, system)
        head = document_ids(tok, document, chat, system)
        if whole[:len(head)] == head:
            return whole[len(head):]
    if not chat:
        return tok.encode(SEPARATOR + question, bos=False)
    tail = _chat_halves(tok, document.rstrip() or ".", system)[1]
    return tok.encode_rendered(SEPARATOR + question + tail, first=False)


def position_ordered(cache: KVCache) -> bool:
    """Whether ``cache`` keeps every token in the slot of its position (the full cache, the
    compact cache with its base-class writes): what a question writes lies past the
    document's slots and is overwritten by the next question before it is read, so their K/V
    need no snapshot."""
    kind = type(cache)
    return ((kind.decode, kind.append) in ((FullKVCache.decode, FullKVCache.append),
                                           (CompressedKVCache.decode, CompressedKVCache.append)))


_PLAIN = (int, float, bool, str, type(None))


def _plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN)
                                                                   for x in v))


class CacheSnapshot:
    """Everything a question may change in a model's caches, copied when built (after the
    document's prefill): every buffer of each cache and of its submodules (selectors), the K/V
    of a cache that is not ``position_ordered`` included (H2O's evictions, the StreamingLLM
    ring), and every plain attribute (an int such as KeyDiff's ``filled``). Plain tensor
    attributes (OmniKV's host-side banks under ``--offload``, written in position order) are
    not copied.

    Args:
        caches: the model's caches (``model.caches``).
    """

    def __init__(self, caches: Sequence[KVCache]):
        self.caches = list(caches)
        self.saved = []
        for cache in self.caches:
            skip = {"k_cache", "v_cache"} if position_ordered(cache) else set()
            buffers = {name: b.clone() for name, b in cache.named_buffers()
                       if b is not None and name not in skip}
            attrs = [(m, {k: v for k, v in vars(m).items() if not k.startswith("__")
                          and _plain(v)}) for m in cache.modules()]
            self.saved.append((buffers, attrs))

    def holds(self, caches: Sequence[KVCache]) -> bool:
        """Whether ``caches`` are the caches this snapshot was taken of."""
        return len(caches) == len(self.caches) and all(a is b for a, b in
                                                       zip(caches, self.caches))

    def bytes(self) -> int:
        """Bytes the snapshot holds."""
        return sum(b.numel() * b.element_size() for buffers, _ in self.saved
                   for b in buffers.values())

    def restore(self) -> None:
        """Copy the saved state back, in place (a compiled step's graph keeps its buffers).

        Raises:
            ConfigError: a buffer changed shape or went (the caches were rebuilt).
        """
        for cache, (buffers, attrs) in zip(self.caches, self.saved):
            current = dict(cache.named_buffers())
            for name, saved in buffers.items():
                buf = current.get(name)
                if buf is None or buf.shape != saved.shape or buf.dtype != saved.dtype:
                    raise ConfigError(f"the document's cache changed ({name}): prefill the "
                                      "document again")
                buf.copy_(saved)
            for module, values in attrs:
                for k, v in values.items():
                    setattr(module, k, v)


def question_agnostic_note(method: str, result: dict[str, Any]) -> str | None:
    """The note for a document whose prefill (``result``: ``generate``'s report) evicted
    prompt tokens before any question was seen, or None when every layer kept the whole
    document: an evicting method (the SnapKV family, RocketKV's first stage, the fixed-size
    caches) chose without the question, so what it dropped is gone for every question, where
    one run with the question in the prompt keeps what that question needs (the
    question-agnostic mode of the accuracy grid: docs/evaluation.md)."""
    kept, doc = result.get("prompt_tokens_kept"), result.get("prompt_tokens")
    if not kept or doc is None or kept["min"] >= doc:
        return None
    span = f"{kept['min']:g}" if kept["min"] == kept["max"] else \
        f"{kept['min']:g}-{kept['max']:g}"
    return (f"{method} kept {span} of the document's {doc} tokens "
            "before any question was seen: what it dropped is gone for every question, and "
            "an answer may be worse than one run with the question in the prompt")


def read_questions(path: str) -> list[str]:
    """The questions of ``--questions FILE``: one a line (blank lines skipped), or JSON lines
    (objects with a ``"question"`` string); ``-`` reads stdin.

    Raises:
        ConfigError: the file cannot be read, holds no question, or a JSON line without a
            ``"question"`` string.
    """
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read questions file {path}: {e}") from None
    questions = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                q = json.loads(line).get("question")
            except (ValueError, AttributeError):
                q = None
            if not isinstance(q, str) or not q.strip():
                raise ConfigError(f"--questions {path} line {n}: a JSON line needs a "
                                  "\"question\" string")
            line = q
        questions.append(line)
    if not questions:
        raise ConfigError(f"--questions {path} holds no question")
    return questions


def document_line(method: str, question_aware: bool, tokens: int, held_bytes: int) -> str:
    """The report's line on how a document answers its questions (``api.Document``)."""
    if question_aware:
        return (f"document {tokens} tokens, question-aware: its whole K/V kept "
                f"({held_bytes / 2**20:.1f} MiB); each question builds {method}'s cache with "
                "the question in the prompt")
    return (f"document {tokens} tokens, question-agnostic: {method}'s cache of the document "
            f"kept ({held_bytes / 2**20:.1f} MiB with its snapshot); each question attends to "
            "what it kept")


def prefill_summary(doc_tokens: int, doc_prefill_s: float,
                    records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What one prefill of the document saved over a separate run per question (each of
    which prefills the document again): the document's prefill seconds (paid once), each
    question's own prefill seconds, and ``prefill_saved_s`` = (questions - 1) x the
    document's prefill."""
    return {"document_tokens": doc_tokens, "document_prefill_s": doc_prefill_s,
            "question_prefill_s": [r["prefill_s"] for r in records],
            "prefill_saved_s": (len(records) - 1) * doc_prefill_s}


def summary_line(summary: dict[str, Any]) -> str:
    """``prefill_summary`` as the report's line."""
    n = len(summary["question_prefill_s"])
    return (f"document {summary['document_tokens']} tokens prefilled once in "
            f"{summary['document_prefill_s']:.2f} s; {n} question(s) prefilled in "
            f"{sum(summary['question_prefill_s']):.2f} s; a separate run per question would "
            f"prefill the document {n} times: {summary['prefill_saved_s']:.2f} s saved")
