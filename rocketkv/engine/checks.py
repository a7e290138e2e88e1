"""The steps of a run before its prefill, shared by ``generate.py``'s command line and the
Python API (``rocketkv/api.py``), so both take them in one order and refuse bad input with the
same words before the slow work: the checkpoint opened without its weights
(``open_checkpoint``), the settings checked and typed (``check_request``), the prompt encoded
(``encode_prompt``), its fit and the method's plan, made once (``plan_run``,
``plan_document``: a ``Run``), then the weights loaded (``load_weights``); ``api.Engine.run``
runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rocketkv.engine.measure import check_memory
from rocketkv.engine.request import CachePlan, CacheRequest
from rocketkv.engine.step import Sampling, StepConfig, default_compile
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
                  top_p: float | None = None, seed: int | None = None,
                  reserve_tokens: int = 0) -> tuple[CacheRequest, Sampling]:
    """Every check of a run's settings that needs neither the prompt nor the model, in one
    order: ``max_new_tokens``, sampling (``Sampling``), the method's name, budget and options
    (``CacheRequest``); the typed settings.

    Raises:
        ConfigError: the CLI's wording (``--max-new-tokens must be positive, got 0``).
    """
    if max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    sampling = Sampling(temperature, top_k, top_p, seed)
    return CacheRequest(method, budget, options, reserve_tokens), sampling


@dataclass(frozen=True)
class Run:
    """One run checked and planned before the weights load (``plan_run``, ``plan_document``):
    what ``api.Engine.run`` executes, for the command line and the Python API alike.

    Attributes:
        ids: the prompt's token ids (one sequence; ``batch_size`` copies run).
        plan: the KV cache planned for it (``request.CachePlan``: the method is not planned
            again when the caches are built).
        sampling: ``step.Sampling``.
        max_new_tokens: generated tokens at most (0: a document's prefill only).
        stop_ids: the tokens that end a sequence.
        compile, cuda_graphs: the decode step (``step.StepConfig``; ``compile`` after
            ``step.default_compile``).
        batch_size: copies of the prompt decoded together.
        compile_default: ``compile`` is the default's (the caller chose none), so a measured
            cached compile that pays may turn it on (``api.Engine.resolve_compile``).
    """

    ids: list[int]
    plan: CachePlan
    sampling: Sampling = Sampling()
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    compile: bool | None = False
    cuda_graphs: bool = False
    batch_size: int = 1
    compile_default: bool = False

    @property
    def note(self) -> str | None:
        """``no compression: ...`` (``CachePlan.note``) or None."""
        return self.plan.note

    @property
    def step(self) -> StepConfig:
        return StepConfig(compile=self.compile, cuda_graphs=self.cuda_graphs)


def plan_run(args: ModelArgs, ids: Sequence[int], cache: CacheRequest, sampling: Sampling, *,
             max_new_tokens: int, stop_ids: Sequence[int], compile: bool | None,
             device: torch.device, batch_size: int = 1, cuda_graphs: bool = False) -> Run:
    """The run of ``ids`` on a model of config ``args``: the method planned once for the
    prompt and the new tokens that fit (``CacheRequest.plan``: everything that needs the
    prompt's length but no weights), the step's default (``step.default_compile`` for the
    decode steps the context leaves room for).

    Raises:
        ConfigError: no room left in the context, or what the plan rejects (a budget too
            small...).
    """
    plan = cache.plan(args, prompt_len=len(ids), max_new_tokens=max_new_tokens)
    return Run(list(ids), plan, sampling, max_new_tokens, tuple(stop_ids),
               default_compile(compile, device, plan.new_tokens - cache.reserve_tokens),
               cuda_graphs, batch_size, compile_default=compile is None)


def plan_document(args: ModelArgs, ids: Sequence[int], cache: CacheRequest, *,
                  compile: bool | None, device: torch.device) -> Run:
    """``plan_run`` for a document (``--questions``, ``rocketkv.Document``): its prefill only,
    with ``cache.reserve_tokens`` of room after it for a question and its answer.

    Raises:
        ConfigError: no reserve, or the document and the reserve exceed the context (naming
            the sizes); what the plan rejects.
    """
    reserve = cache.reserve_tokens
    if reserve <= 0:
        raise ConfigError(f"reserve_tokens must be positive, got {reserve}")
    cache.room(args, len(ids))
    if len(ids) + reserve > args.max_seq_len:
        raise ConfigError(f"the document ({len(ids)} tokens) and the room for a question "
                          f"and its answer ({reserve} tokens) exceed the model's "
                          f"context ({args.max_seq_len} tokens)")
    plan = cache.plan(args, prompt_len=len(ids), max_new_tokens=0)
    return Run(list(ids), plan, Sampling(), 0, (), default_compile(compile, device, 0))


def encode_prompt(tok: Tokenizer | None, text: str, chat: bool | None,
                  system: str | None = None) -> list[int]:
    """The ids of a text prompt: a user turn of the chat template (after ``system``) when
    ``chat`` (None: when the tokenizer has a template of its own, ``chat_mode``), else plain
    text.

    Raises:
        ConfigError: ``system`` without chat; an empty prompt; no tokenizer.
    """
    chat = chat_mode(chat, tok)
    if system is not None and not chat:
        raise ConfigError("--system needs --chat (it is a message of the chat template)")
    if not text.strip():
        raise ConfigError("--prompt-text is empty")
    if tok is None:
        raise ConfigError(NO_TOKENIZER)
    return tok.encode_chat(text, system=system) if chat else tok.encode(text)


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
