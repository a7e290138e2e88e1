"""The steps of a run before its prefill, shared by ``generate.py``'s command line and the
Python API (``rocketkv/api.py``), so both take them in one order and refuse bad input with the
same words before the slow work: the checkpoint opened without its weights
(``open_checkpoint``), the settings checked (``check_request``), the prompt's fit and the
method's plan (``check_fit``, ``check_document``), then the weights loaded (``load_weights``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rocketkv.compression import METHODS, check_budget, check_method, check_options, plan
from rocketkv.engine.measure import check_memory
from rocketkv.formats.checkpoint import (
    RANDOM_PREFIX,
    checkpoint_args,
    default_checkpoint,
    default_gguf_weights,
    is_quantized,
    load_model,
    resolve_checkpoint,
)
from rocketkv.formats.tokenizer import TOKENIZER_FILES, Tokenizer, has_tokenizer, load_tokenizer
from rocketkv.model import ConfigError, ModelArgs, Transformer

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
              budget: int | None, options: dict[str, Any]) -> tuple[int, str | None]:
    """The room (tokens) the model's context leaves after a ``prompt_len``-token prompt, after
    checking the method's setting for this run (``compression.plan`` with the new tokens that
    fit): everything that needs the prompt's length but no weights; and the note of a run
    ``plan`` leaves uncompressed (a budgeted method whose budget covers the whole sequence),
    or None. The CLI prints the note as ``note: ...``, the API warns with it.

    Raises:
        ConfigError: no room left, or what ``plan`` rejects (a budget too small...).
    """
    room = margs.max_seq_len - prompt_len
    if room <= 0:
        raise ConfigError(f"the prompt ({prompt_len} tokens) leaves no room in the model's "
                          f"context ({margs.max_seq_len} tokens)")
    new = min(max_new_tokens, room)
    params = plan(method, margs, prompt_len=prompt_len, max_new_tokens=new, budget=budget,
                  **options)
    if params is not None or not METHODS[method].budgeted:
        return room, None
    return room, (f"no compression: the budget ({budget}) covers all {prompt_len + new} tokens "
                  f"(prompt {prompt_len} + up to {new} new); {method} runs with the full cache")


def check_document(method: str, margs: ModelArgs, doc_tokens: int, reserve_tokens: int,
                   budget: int | None, options: dict[str, Any]) -> str | None:
    """``check_fit`` for a document (``--questions``, ``rocketkv.Document``): the document plus
    ``reserve_tokens`` for a question and its answer fit the context, the method's setting for
    a ``doc_tokens`` prompt with ``reserve_tokens`` new tokens is valid; ``check_fit``'s note.

    Raises:
        ConfigError: naming the sizes; what ``plan`` rejects.
    """
    if reserve_tokens <= 0:
        raise ConfigError(f"reserve_tokens must be positive, got {reserve_tokens}")
    room, note = check_fit(method, margs, doc_tokens, reserve_tokens, budget, options)
    if reserve_tokens > room:
        raise ConfigError(f"the document ({doc_tokens} tokens) and the room for a question "
                          f"and its answer ({reserve_tokens} tokens) exceed the model's "
                          f"context ({margs.max_seq_len} tokens)")
    return note


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


def open_checkpoint(checkpoint: str | None, tokenizer: str | None = None
                    ) -> tuple[str, ModelArgs, Tokenizer | None]:
    """A run's checkpoint without its weights: the resolved path (``checkpoint`` None: the
    default model, ``checkpoint.default_checkpoint``), its config and its tokenizer
    (``checkpoint_tokenizer``).

    Raises:
        ConfigError: no such checkpoint (or no default one), an unreadable config or
            tokenizer.
    """
    resolved = resolve_checkpoint(default_checkpoint() if checkpoint is None else checkpoint)
    margs = checkpoint_args(resolved)
    return resolved, margs, checkpoint_tokenizer(resolved, margs, tokenizer)


def load_weights(checkpoint: str, margs: ModelArgs, device: torch.device, dtype: torch.dtype, *,
                 gguf_weights: str | None = None, batch_size: int = 1, seq_len: int = 1,
                 shard: tuple[int, int] = (0, 1), local_args: ModelArgs | None = None
                 ) -> Transformer:
    """The model of a resolved ``checkpoint`` on ``device``: a float checkpoint's weights and
    the KV cache of ``batch_size`` sequences of ``seq_len`` tokens are checked against the
    free memory first (``measure.check_memory``, with ``local_args``: a tensor-parallel rank's
    share); a GGUF's weights as ``gguf_weights`` says (default: ``default_gguf_weights``).

    Raises:
        ConfigError: they do not fit; what ``checkpoint.load_model`` raises.
    """
    if not is_quantized(checkpoint):
        check_memory(local_args or margs, dtype, device, batch_size, seq_len)
    return load_model(checkpoint, device, dtype, shard=shard,
                      gguf_weights=default_gguf_weights(gguf_weights, checkpoint, device))
