"""The checks of a run that need no weights, and the tokenizer and text of a run: shared by
``generate.py``'s command line and the Python API (``rocketkv.py``), so both refuse bad input
with the same words before the slow work (the weights' load, the prefill).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rocketkv.compression import METHODS, check_budget, check_method, check_options, plan
from rocketkv.formats.checkpoint import RANDOM_PREFIX
from rocketkv.formats.tokenizer import TOKENIZER_FILES, Tokenizer, has_tokenizer, load_tokenizer
from rocketkv.model import ConfigError, ModelArgs

NO_TOKENIZER = ("a text prompt needs a tokenizer: the checkpoint has none ("
                f"{', '.join(TOKENIZER_FILES)} or GGUF tokenizer metadata); pass --tokenizer "
                "FILE or use --random-prompt N")


def check_request(method: str, budget: int | None, options: dict[str, Any], *,
                  max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None) -> None:
    """Every check of a run's settings that needs neither the prompt nor the model: sampling,
    the method's name, budget and options (``compression.check_method``, ``check_budget``,
    ``check_options``: the same functions ``compression.plan`` calls).

    Raises:
        ConfigError: the CLI's wording (``--max-new-tokens must be positive, got 0``).
    """
    for flag, value in (("max-new-tokens", max_new_tokens), ("top-k", top_k)):
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag} must be positive, got {value}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"--top-p must lie in (0, 1], got {top_p}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0, got {temperature}")
    check_method(method)
    check_budget(method, budget)
    check_options(method, options)


def check_fit(method: str, margs: ModelArgs, prompt_len: int, max_new_tokens: int,
              budget: int | None, options: dict[str, Any]) -> int:
    """The room (tokens) the model's context leaves after a ``prompt_len``-token prompt, after
    checking the method's setting for this run (``compression.plan`` with the new tokens that
    fit): everything that needs the prompt's length but no weights.

    Raises:
        ConfigError: no room left, or what ``plan`` rejects (a budget too small...).
    """
    room = margs.max_seq_len - prompt_len
    if room <= 0:
        raise ConfigError(f"the prompt ({prompt_len} tokens) leaves no room in the model's "
                          f"context ({margs.max_seq_len} tokens)")
    plan(method, margs, prompt_len=prompt_len, max_new_tokens=min(max_new_tokens, room),
         budget=budget, **options)
    return room


def budget_note(method: str, budget: int | None, prompt_len: int, new_tokens: int) -> str | None:
    """The note for a run whose budget covers its whole sequence (``prompt_len`` +
    ``new_tokens``, as ``check_fit`` and ``check_document`` pass them to ``compression.plan``):
    ``plan`` then builds the full cache, so nothing is compressed. None otherwise (an
    unbudgeted method, a budget below the sequence). The CLI prints it as ``note: ...``, the
    API warns with it (``UserWarning``)."""
    if budget is None or not METHODS[method].budgeted or budget < prompt_len + new_tokens:
        return None
    return (f"no compression: the budget ({budget}) covers all {prompt_len + new_tokens} "
            f"tokens (prompt {prompt_len} + up to {new_tokens} new); {method} runs with the "
            "full cache")


def check_document(method: str, margs: ModelArgs, doc_tokens: int, reserve_tokens: int,
                   budget: int | None, options: dict[str, Any]) -> None:
    """``check_fit`` for a document (``--questions``, ``rocketkv.Document``): the document plus
    ``reserve_tokens`` for a question and its answer fit the context, the method's setting for
    a ``doc_tokens`` prompt with ``reserve_tokens`` new tokens is valid.

    Raises:
        ConfigError: naming the sizes; what ``plan`` rejects.
    """
    if reserve_tokens <= 0:
        raise ConfigError(f"reserve_tokens must be positive, got {reserve_tokens}")
    room = check_fit(method, margs, doc_tokens, reserve_tokens, budget, options)
    if reserve_tokens > room:
        raise ConfigError(f"the document ({doc_tokens} tokens) and the room for a question "
                          f"and its answer ({reserve_tokens} tokens) exceed the model's "
                          f"context ({margs.max_seq_len} tokens)")


def checkpoint_tokenizer(checkpoint: str, margs: ModelArgs, tokenizer: str | None = None
                         ) -> Tokenizer | None:
    """The tokenizer of a run: ``tokenizer`` (a file or directory) when given, else the
    checkpoint's own (None for ``random:`` and checkpoints without one).

    Raises:
        ConfigError: an unreadable tokenizer, or one with more tokens than the model.
    """
    tok: Tokenizer | None = None
    if tokenizer:
        tok = load_tokenizer(tokenizer)
    elif not checkpoint.startswith(RANDOM_PREFIX) and has_tokenizer(checkpoint):
        tok = load_tokenizer(checkpoint)
    if tok is not None and tok.vocab_size > margs.vocab_size:
        raise ConfigError(f"tokenizer has {tok.vocab_size} tokens, model only "
                          f"{margs.vocab_size}")
    return tok


def chat_mode(chat: bool | None, tok: Tokenizer | None) -> bool:
    """Whether a text prompt goes through the chat template: ``chat`` when given (True or
    False), else (None: auto) whether the tokenizer has a chat template of its own, as an
    instruct checkpoint's has (``Tokenizer.chat_template``; the generic fallback templates of
    SentencePiece and tiktoken tokenizers do not count)."""
    if chat is not None:
        return bool(chat)
    return tok is not None and tok.chat_template is not None


def result_text(tok: Tokenizer | None, token_ids: Sequence[Sequence[int]],
                stop_ids: Sequence[int]) -> list[str] | None:
    """The text of each sequence's generated ``token_ids``, stop tokens left out (None
    without a tokenizer)."""
    if tok is None:
        return None
    stop = set(stop_ids)
    return [tok.decode([t for t in row if t not in stop]) for row in token_ids]
