"""The engine as a library: load a checkpoint, generate text, and answer many questions about
one document from a single prefill of it.

    import rocketkv
    engine = rocketkv.load("../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    result = engine.generate(chat, method="rocketkv", budget=256, max_new_tokens=32)
    print(result.text, result.metrics["decode_ms_median"])

``Engine.generate`` checks its settings as ``generate.py`` does, before any prefill, and raises
``ConfigError`` (a ``ValueError``) in Python terms: a value of the wrong type is refused at the
call, and the messages name the parameters (``max_new_tokens must be positive``), not the
command line's flags (``python_words``). It encodes the prompt (a message list through the
checkpoint's chat template; a string as one user turn of it when the checkpoint has a chat
template of its own, as instruct models do, else as plain text; ``chat=True``/``False``
decides), stops at the model's end of turn and returns a ``Result`` with the text, the token
ids and every figure of ``generate.py --json``. ``on_text`` streams the answer's text as it is
decoded. A budget that covers the whole sequence means no compression: a ``UserWarning`` says
so. ``generate.generate`` stays the low-level call (token ids in, a
``report.GenerateResult`` dataclass out).

``Engine.prefill_document`` prefills (and compresses) a document once; each
``Document.ask(question)`` then feeds the question after it (``generate(...,
continue_conversation=True)``), answers, and the next question starts again from the document as
the method left it: the conversation's position is set back (``generate.rewind_conversation``)
and whatever the method's caches changed past the document (H2O's scores and evictions, the
StreamingLLM ring, page summaries, recorded queries) is restored from a snapshot taken after the
document's prefill.
"""

from __future__ import annotations

import functools
import numbers
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rocketkv.compression.registry import every_option
from rocketkv.engine import checks
from rocketkv.engine import generate as _g
from rocketkv.engine.device import default_dtype, resolve_device
from rocketkv.engine.documents import (
    CacheSnapshot,
    document_ids,
    prefill_summary,
    question_agnostic_note,
    question_ids,
)
from rocketkv.engine.measure import weights_label
from rocketkv.engine.report import GenerateResult, TextStreamer
from rocketkv.engine.step import default_compile
from rocketkv.formats.tokenizer import Tokenizer
from rocketkv.model import ConfigError, Transformer

__all__ = ["ConfigError", "Document", "Engine", "Result", "load"]


# ---- errors in Python terms

# The checks shared with ``generate.py`` (``checks.py``, the registry, the loaders) word their
# errors with its flags; a Python caller reads them with the parameters' names instead. Phrases
# first (a flag with its value, or a way out the API spells otherwise), then every remaining
# ``--flag-name`` as ``flag_name``: the flags are the parameters' names (``--max-new-tokens``:
# ``max_new_tokens``; a method option's flag: its keyword, ``--page-size``: ``page_size``).
_PHRASES = (
    ("--prompt-text is empty", "the prompt is empty"),
    ("--system needs --chat", "system needs chat=True"),
    ("--chat: the checkpoint has no chat template; run without --chat",
     "chat=True: the checkpoint has no chat template; pass chat=False"),
    ("pass --tokenizer FILE or use --random-prompt N",
     "pass tokenizer=FILE to rocketkv.load, or the prompt's token ids"),
    ("--device cuda requested", "device='cuda' requested"),
    ("--dtype bfloat16", "dtype='bfloat16'"),
    ("use --no-compile", "pass compile=False"),
)
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
_COMMAND = re.compile(r"(python3? \S+\.py[^,;)]*)")


def python_words(message: str) -> str:
    """``message`` (a ``ConfigError``'s, in ``generate.py``'s words) with the parameters'
    names for the command line's flags: ``--max-new-tokens must be positive, got 0`` becomes
    ``max_new_tokens must be positive, got 0``, ``--prompt-text is empty`` ``the prompt is
    empty``."""
    for flag_words, python in _PHRASES:
        message = message.replace(flag_words, python)
    # a command the message quotes (``python scripts/download.py --repo-id ...``) keeps its
    # flags: it is to be run as it stands
    parts = _COMMAND.split(message)
    return "".join(part if i % 2 else _FLAG.sub(lambda m: m.group(1).replace("-", "_"), part)
                   for i, part in enumerate(parts))


def _in_python_words(fn: Callable) -> Callable:
    """``fn`` with its ``ConfigError`` reworded by ``python_words`` (the same exception, its
    traceback kept)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            e.args = (python_words(str(e)),)
            raise
    return call


def _refuse(name: str, what: str, value: Any) -> ConfigError:
    return ConfigError(f"{name} must be {what}, got {value!r}")


def _int(name: str, value: Any, *, minimum: int | None = 1, optional: bool = False,
         what: str | None = None) -> int | None:
    """``value`` as an int (numpy's included), or ConfigError for another type (a bool, a
    float, a string); ``optional``: None passes. The range is left to the shared checks, which
    word it as the CLI does (``checks.check_request``), unless ``what`` says it here."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = what or ("an int" if minimum is None else
                        "a positive int" if minimum == 1 else f"an int >= {minimum}")
        raise _refuse(name, what, value)
    return int(value)


def _real(name: str, value: Any, what: str, *, optional: bool = False) -> float | None:
    """``value`` as a float (an int or a float, numpy's included), or ConfigError for another
    type; ``optional``: None passes."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refuse(name, what, value)
    return float(value)


def _options(method_options: dict[str, Any]) -> dict[str, Any]:
    """The method options given (None and False: unset), each of its option's type (an int
    option an int, a float option a number, a switch a bool); names no method reads are left
    to ``check_options``."""
    known = every_option()
    given = {}
    for name, value in method_options.items():
        if value is None or value is False:
            continue
        option = known.get(name)
        kind = None if option is None else option.type
        if kind is int:
            value = _int(name, value, minimum=None)
        elif kind is float:
            value = _real(name, value, "a number")
        elif option is not None and kind is None and value is not True:
            raise _refuse(name, "True or False", value)
        given[name] = value
    return given


def _sampling(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any,
              seed: Any) -> tuple[int, float, int | None, float | None, int | None]:
    """The sampling settings' types checked (their ranges: ``checks.check_request``)."""
    return (_int("max_new_tokens", max_new_tokens),
            _real("temperature", temperature, "a number >= 0"),
            _int("top_k", top_k, optional=True, what="a positive int"),
            _real("top_p", top_p, "a number in (0, 1]", optional=True),
            _int("seed", seed, minimum=None, optional=True, what="an int"))


def _warn_uncompressed(note: str | None) -> None:
    """The budget covers the whole sequence: say so to the caller of ``generate`` or
    ``prefill_document`` (``warnings``' ``stacklevel``: through ``_in_python_words``)."""
    if note is not None:
        warnings.warn(note, UserWarning, stacklevel=4)


# ---- results


@dataclass(repr=False)
class Result:
    """One answer.

    Attributes:
        text: the generated text, stop tokens left out.
        tokens: the generated token ids, the stop token included when one ended the answer.
        stop_reason: ``eos`` (a stop token), ``max_new_tokens``, ``context_length``,
            ``reserve`` (a document's room ran out) or ``interrupted``.
        metrics: every figure ``generate.py --json`` writes for the run (``prefill_s``,
            ``decode_ms_median``, ``tokens_per_s``, ``peak_memory_bytes``, ``kv_cache_bytes``,
            ``method_params``, ``prompt_token_ids``...); for an answer about a document also
            ``document_prefill_s``, the document's prefill paid once.

    Its repr shows the text, the first ids (with their count when there are more than
    ``REPR_TOKENS``) and the stop reason; not the metrics.
    """

    REPR_TOKENS = 8

    text: str | None
    tokens: list[int]
    stop_reason: str
    metrics: dict[str, Any] = field(repr=False)

    def __repr__(self) -> str:
        ids = self.tokens
        if len(ids) > self.REPR_TOKENS:
            head = ", ".join(map(str, ids[:self.REPR_TOKENS - 2]))
            tokens = f"[{head}, ... {len(ids)} ids]"
        else:
            tokens = repr(ids)
        return (f"Result(text={self.text!r}, tokens={tokens}, "
                f"stop_reason={self.stop_reason!r})")


@_in_python_words
def load(checkpoint: str | None = None, *, device: str | torch.device | None = None,
         dtype: torch.dtype | str | None = None, tokenizer: str | None = None,
         gguf_weights: str | None = None) -> Engine:
    """Load a model and its tokenizer, as ``generate.py --checkpoint`` does.

    Args:
        checkpoint: a checkpoint directory, a ``.gguf`` file, a short name or ``random:NAME``
            (``docs/checkpoints.md``); default (None): SmolLM2-135M-Instruct, from the data
            directory or ``checkpoints/`` (``checkpoint.default_checkpoint``).
        device: ``"cuda"``, ``"cpu"`` or a ``torch.device``; default cuda when available.
        dtype: of the weights and the KV cache (a ``torch.dtype`` or its name); default
            bfloat16 on cuda, float32 on cpu.
        tokenizer: a tokenizer file or directory (default: the checkpoint's own).
        gguf_weights: a GGUF's weights ``"float"`` (dequantized), ``"quantized"``,
            ``"quantized-int8-classifier"`` or ``"quantized-w8a8"`` (that on int8
            activations, CPU only) (``generate.py --gguf-weights``, ``gguf_quantized``);
            default ``"quantized"`` on the CPU, ``"float"`` on CUDA
            (``checkpoint.default_gguf_weights``).
    Raises:
        ConfigError: what ``generate.py`` reports for the same checkpoint, device or
            tokenizer (a missing file, an unsupported architecture, no CUDA, weights that do
            not fit in free memory), naming the parameters.
    """
    device = resolve_device(None if device is None else str(device))
    dtype = default_dtype(dtype, device)
    t0 = time.perf_counter()
    ckpt, margs, tok = checks.open_checkpoint(None if checkpoint is None else str(checkpoint),
                                       tokenizer)
    # the weights; each run checks its own KV
    model = checks.load_weights(ckpt, margs, device, dtype, gguf_weights=gguf_weights)
    return Engine(model, tok, checkpoint=str(checkpoint or ckpt),
                  load_s=time.perf_counter() - t0)


def _compile(model: Transformer, compile: bool | None, decode_steps: int) -> bool | None:
    """``generate.py``'s default (``step.default_compile``) for the model's device and a run of
    ``decode_steps`` (its ``max_new_tokens``)."""
    return default_compile(compile, model.device, decode_steps)


class Engine:
    """A loaded model and its tokenizer (``load``). Build one around a model already loaded
    with ``Engine(model, tokenizer)``.

    One engine drives one set of caches: a ``generate`` or ``prefill_document`` call replaces
    what the previous one left, so only the latest ``Document`` answers (an older one raises
    ``ConfigError``). A ``generate.generate`` call on ``engine.model`` itself is noticed when
    it rebuilt the caches (other shapes), not when it reused them.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, *,
                 checkpoint: str | None = None, load_s: float | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.checkpoint, self.load_s = checkpoint, load_s
        self._document: Document | None = None  # the document the caches hold now

    def __repr__(self) -> str:
        dtype = str(self.model.dtype).removeprefix("torch.")
        return (f"Engine(checkpoint={self.checkpoint!r}, model={self.model.args.name!r}, "
                f"device={self.model.device}, dtype={dtype}, "
                f"weights={weights_label(self.model)})")

    # ---- prompts

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The default stop tokens: the tokenizer's EOS and its chat template's end-of-turn
        token (``Tokenizer.chat_stop_ids``); none without a tokenizer."""
        return () if self.tokenizer is None else self.tokenizer.chat_stop_ids

    @property
    def chat(self) -> bool:
        """Whether a text prompt is a user turn of the chat template by default (``chat=None``):
        the tokenizer has a chat template of its own (``checks.chat_mode``), as an instruct
        checkpoint's has."""
        return checks.chat_mode(None, self.tokenizer)

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ConfigError(checks.NO_TOKENIZER)
        return self.tokenizer

    @_in_python_words
    def encode(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int], *,
               chat: bool | None = None, system: str | None = None) -> list[int]:
        """The token ids of ``prompt``: a list of messages (dicts with ``role`` and
        ``content``) through the chat template with the generation prompt; a string as one user
        turn (after ``system``, when given) as ``generate.py --chat`` encodes it, or as plain
        text (with BOS where the tokenizer adds one): ``chat`` True or False, or None (the
        default) for a user turn when the checkpoint has a chat template of its own
        (``Engine.chat``); token ids as given.

        Raises:
            ConfigError: an empty prompt, a text prompt without a tokenizer, ``system``
                without chat, no chat template, a malformed message list.
        """
        if isinstance(prompt, str):
            chat = checks.chat_mode(chat, self.tokenizer)
            if system is not None and not chat:
                raise ConfigError("--system needs --chat (it is a message of the chat "
                                  "template)")
            if not prompt.strip():
                raise ConfigError("--prompt-text is empty")
            tok = self._tok()
            return tok.encode_chat(prompt, system=system) if chat else tok.encode(prompt)
        prompt = list(prompt)
        if not prompt:
            raise ConfigError("the prompt is empty")
        if all(isinstance(m, dict) for m in prompt):
            if any("role" not in m or "content" not in m for m in prompt):
                raise ConfigError("each message needs a 'role' and a 'content'")
            messages = ([{"role": "system", "content": system}] if system else []) + prompt
            return self._tok().encode_messages(messages)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if system is not None:
                raise ConfigError("system applies to a text or message prompt, not to ids")
            return prompt
        raise ConfigError("a prompt is a string, a list of messages (dicts with 'role' and "
                          "'content') or a list of token ids")

    def _streaming(self, on_token: Callable | None, on_text: Callable[[str], Any] | None,
                   stop: Sequence[int]) -> tuple[Callable | None, TextStreamer | None]:
        """The ``on_token`` to pass to ``generate.generate``: the caller's, and with
        ``on_text`` a ``TextStreamer`` that passes each new piece of decoded text to it."""
        if on_text is None:
            return on_token, None
        streamer = TextStreamer(self._tok(), stop, emit=on_text)
        if on_token is None:
            return streamer, streamer

        def both(tokens: torch.Tensor) -> None:
            streamer(tokens)
            on_token(tokens)
        return both, streamer

    # ---- one prompt

    @_in_python_words
    def generate(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int], *,
                 method: str = "full", budget: int | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = 0, chat: bool | None = None, system: str | None = None,
                 stop_ids: Sequence[int] | None = None, compile: bool | None = None,
                 on_token: Callable[[torch.Tensor], Any] | None = None,
                 on_text: Callable[[str], Any] | None = None, **method_options) -> Result:
        """Generate an answer to ``prompt`` (see ``encode``) with the KV cache of ``method``.

        Args:
            method, budget: the cache (``compression.METHODS``; ``docs/methods.md``), budget in
                tokens read per decode step, per layer, per KV-head group (a positive int).
                A budget that covers the whole sequence (prompt + max_new_tokens) compresses
                nothing: a ``UserWarning`` says so.
            max_new_tokens: generated tokens at most.
            temperature, top_k, top_p, seed: sampling (temperature 0: greedy).
            chat, system: a string prompt as a user turn of the chat template (after the
                ``system`` message): None (default) when the checkpoint has a chat template of
                its own (``Engine.chat``), True or False to decide.
            stop_ids: the tokens that end the answer; default ``stop_ids`` (EOS and the
                template's end of turn), ``()`` to run to ``max_new_tokens``.
            compile: compile the decode step; default as ``generate.py`` (on CUDA when the
                method allows; on CPU from ``step.CPU_COMPILE_MIN_STEPS`` max_new_tokens when
                a C++ compiler is found).
            on_token: called with the tokens so far, (1, n) int64, after each one.
            on_text: called with each new piece of the answer's text as it is decoded (whole
                characters: a token that ends inside one waits for the next); the pieces
                joined are ``Result.text``.
            method_options: the method's options by their flag names (``page_size=16``,
                ``rocket_split="adaptive"``: ``docs/methods.md``).
        Returns:
            a ``Result``.
        Raises:
            ConfigError: before any prefill, naming the parameter: a setting of the wrong type
                or range, an unknown method, a bad or missing budget, an option the method
                does not read, a prompt that does not fit the context, a budget too small for
                it.
        """
        budget = _int("budget", budget, optional=True)
        max_new_tokens, temperature, top_k, top_p, seed = _sampling(
            max_new_tokens, temperature, top_k, top_p, seed)
        options = _options(method_options)
        checks.check_request(method, budget, options, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p)
        ids = self.encode(prompt, chat=chat, system=system)
        _, note = checks.check_fit(method, self.model.args, len(ids), max_new_tokens, budget,
                                  options)
        stop = self.stop_ids if stop_ids is None else tuple(stop_ids)
        on_token, streamer = self._streaming(on_token, on_text, stop)
        _warn_uncompressed(note)
        self._document = None
        r = _g.generate(self.model, ids, method=method, budget=budget,
                        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, stop_ids=stop,
                        compile=_compile(self.model, compile, max_new_tokens),
                        method_options=options, on_token=on_token)
        return self._result(r, stop, streamer)

    def _result(self, r: GenerateResult, stop: Sequence[int], streamer: TextStreamer | None,
                **extra: Any) -> Result:
        """The CLI's JSON record of a run (``r.to_dict()``, then ``extra``, ``text``,
        ``checkpoint``, ``model``, ``load_s`` added) as a ``Result``; the text ``streamer``
        has not passed on yet passed on."""
        texts = checks.result_text(self.tokenizer, r.token_ids, stop)
        record = {**r.to_dict(), **extra, "text": texts, "checkpoint": self.checkpoint,
                  "model": self.model.args.name, "load_s": self.load_s, "world_size": 1,
                  "interrupted": r.stop_reason == "interrupted"}
        if streamer is not None and texts is not None:
            streamer.flush(texts[0])
        return Result(None if texts is None else texts[0], list(r.token_ids[0]),
                      r.stop_reason, record)

    # ---- one document, many questions

    @_in_python_words
    def prefill_document(self, text: str | Sequence[int], *, method: str = "full",
                         budget: int | None = None, reserve_tokens: int = 1024,
                         chat: bool | None = None, system: str | None = None,
                         compile: bool | None = None, **method_options) -> Document:
        """Prefill (and compress) a document once, for any number of ``Document.ask`` calls.

        Args:
            text: the document (trailing white space dropped), or its token ids
                (``documents.document_ids``).
            method, budget, method_options: the cache, as for ``generate``. The method
                compresses the document before any question is known: what an evicting
                method drops is dropped for every question (docs/generate.md).
            reserve_tokens: cache room after the document for one question and its answer
                (question tokens + ``max_new_tokens`` - 1 at most); it sizes the buffers and
                leaves the method's parameters as they are (they follow the cache).
        Warns:
            UserWarning: the budget covers the whole sequence; or the method evicted part of
                the document before any question was seen (``question_agnostic_note``).
            chat, system: the document opens a user turn of the chat template (each question
                ends it): None (default) when the checkpoint has a chat template of its own
                (``Engine.chat``), True or False to decide.
        Returns:
            a ``Document``.
        Raises:
            ConfigError: as ``generate``; the document and the reserve do not fit the
                context.
        """
        budget = _int("budget", budget, optional=True)
        reserve_tokens = _int("reserve_tokens", reserve_tokens)
        options = _options(method_options)
        checks.check_request(method, budget, options, max_new_tokens=1)
        chat = checks.chat_mode(chat, self.tokenizer)
        ids = document_ids(self._tok(), text, chat, system) if isinstance(text, str) \
            else self.encode(text)
        _warn_uncompressed(checks.check_document(method, self.model.args, len(ids),
                                                reserve_tokens, budget, options))
        self._document = None
        r = _g.generate(self.model, ids, method=method, budget=budget, max_new_tokens=0,
                        reserve_tokens=reserve_tokens, compile=_compile(self.model, compile, 0),
                        method_options=options)
        _warn_uncompressed(question_agnostic_note(method, r.to_dict()))
        doc = Document(self, ids, r.to_dict(), chat=chat, system=system,
                       text=text if isinstance(text, str) else "", compile=compile)
        self._document = doc
        return doc


class Document:
    """A document prefilled once (``Engine.prefill_document``); ``ask`` answers questions
    about it from its cache.

    Attributes:
        ids: the document's token ids.
        prefill_s: seconds of the document's prefill (paid once).
        metrics: the document prefill's figures (``generate.generate``'s result as its JSON
            record, ``to_dict()``; no tokens generated): ``prompt_tokens_kept``,
            ``kv_cache_bytes``, ``method_params``...
        room: positions after the document for a question and its answer.
        snapshot_bytes: bytes of the cache state copied to rewind to the document.
        chat: whether the document and its questions are a user turn of the chat template.
        answers: the ``metrics`` of each answer so far.
    """

    def __init__(self, engine: Engine, ids: list[int], metrics: dict[str, Any], *, chat: bool,
                 system: str | None, text: str, compile: bool | None):
        self.engine, self.ids, self.metrics = engine, ids, metrics
        self.prefill_s = metrics["prefill_s"]
        self.method, self.budget = metrics["method"], metrics["budget"]
        self.chat = chat
        self._system, self._text, self._compile = system, text, compile
        self.room = metrics["conversation"]["room"]
        self._snapshot = CacheSnapshot(engine.model.caches)
        self.snapshot_bytes = self._snapshot.bytes()
        self.answers: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return (f"Document(tokens={len(self.ids)}, method={self.method!r}, "
                f"budget={self.budget!r}, chat={self.chat}, "
                f"questions_asked={len(self.answers)})")

    @_in_python_words
    def question_ids(self, question: str | Sequence[int]) -> list[int]:
        """The ids ``ask`` feeds after the document (``documents.question_ids``; token ids as
        given)."""
        if isinstance(question, str):
            return question_ids(self.engine._tok(), question, self.chat, self._text,
                                self._system)
        return self.engine.encode(question)

    @_in_python_words
    def ask(self, question: str | Sequence[int], *, max_new_tokens: int = 256,
            temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
            seed: int | None = 0, stop_ids: Sequence[int] | None = None,
            on_token: Callable[[torch.Tensor], Any] | None = None,
            on_text: Callable[[str], Any] | None = None) -> Result:
        """Answer ``question`` from the document's cache as the method left it after the
        document's prefill (earlier questions and answers rewound away: the position, and
        the method's state from a snapshot). The question's tokens are prefilled after the
        document's (``generate(..., continue_conversation=True)``); with ``full`` the answer
        is the one a separate run of document + question gives.

        Args: as ``Engine.generate``'s (the method and budget are the document's; ``on_text``
            streams the answer's text).
        Returns:
            a ``Result`` whose ``metrics["prefill_s"]`` is the question's own prefill and
            ``metrics["document_prefill_s"]`` the document's, paid once.
        Raises:
            ConfigError: a bad sampling setting; a question and ``max_new_tokens`` that do
                not fit the document's ``reserve_tokens``; the engine's caches were replaced
                by a later ``generate`` or ``prefill_document`` call.
        """
        engine = self.engine
        max_new_tokens, temperature, top_k, top_p, seed = _sampling(
            max_new_tokens, temperature, top_k, top_p, seed)
        checks.check_request(self.method, self.budget, {}, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p)
        if engine._document is not self:
            raise ConfigError("this document's cache was replaced by a later generate() or "
                              "prefill_document() call: prefill it again")
        ids = self.question_ids(question)
        if len(ids) + max_new_tokens - 1 > self.room:
            raise ConfigError(f"the question ({len(ids)} tokens) and max_new_tokens "
                              f"{max_new_tokens} exceed the document's reserve "
                              f"({self.room} tokens): pass a larger reserve_tokens to "
                              "prefill_document")
        stop = engine.stop_ids if stop_ids is None else tuple(stop_ids)
        on_token, streamer = engine._streaming(on_token, on_text, stop)
        _g.rewind_conversation(engine.model, len(self.ids), self._snapshot)
        r = _g.generate(engine.model, ids, continue_conversation=True,
                        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, stop_ids=stop,
                        compile=_compile(engine.model, self._compile, max_new_tokens),
                        on_token=on_token)
        result = engine._result(r, stop, streamer,
                                question=question if isinstance(question, str) else None,
                                document_tokens=len(self.ids), document_prefill_s=self.prefill_s)
        self.answers.append(result.metrics)
        return result

    def prefill_summary(self) -> dict[str, Any]:
        """The prefill paid once against a separate run per question asked so far
        (``documents.prefill_summary``: ``document_prefill_s``, ``question_prefill_s``,
        ``prefill_saved_s``)."""
        return prefill_summary(len(self.ids), self.prefill_s, self.answers)
