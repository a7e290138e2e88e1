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

``Engine.prefill_document`` prefills a document once; each ``Document.ask(question)`` then
prefills the question after it and answers. Question-aware (the default when the budget
compresses), the document's whole K/V is kept and the method's caches are built per question
from document + question (``prefill.extend_prefilled``, ``generate(prefilled=...)``): the
computation of a single run, the question prefilled as its own chunk (the same answer with
float weights; quantized matmuls round a short chunk differently, so an answer can part at a
near tie). Question-agnostic, the method compresses the document once and the
question attends to what it kept (``generate(..., continue_conversation=True)``); the next
question starts again from the document as the method left it: the conversation's position is
set back (``generate.rewind_conversation``) and whatever the method's caches changed past the
document (H2O's scores and evictions, the StreamingLLM ring, page summaries, recorded queries)
is restored from a snapshot taken after the document's prefill.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import numbers
import re
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rocketkv.compression import METHODS
from rocketkv.compression.registry import every_option
from rocketkv.engine import checks
from rocketkv.engine import generate as _g
from rocketkv.engine.batch import PREFILL_LAYERS, Batcher
from rocketkv.engine.device import default_dtype, resolve_device
from rocketkv.engine.documents import (
    CacheSnapshot,
    document_ids,
    prefill_summary,
    question_agnostic_note,
    question_ids,
)
from rocketkv.engine.measure import weights_label
from rocketkv.engine.prefill import (
    PrefilledPrompt,
    extend_prefilled,
    prefill_once,
)
from rocketkv.engine.prefix_cache import PrefixCache
from rocketkv.engine.provenance import cpu_fields
from rocketkv.engine.report import GenerateResult, TextStreamer
from rocketkv.engine.request import CacheRequest
from rocketkv.engine.session import release_caches
from rocketkv.engine.step import Sampling, StepConfig, cpp_compiler_found, default_compile
from rocketkv.engine.step_ledger import StepLedger, step_key
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


_WORDS = contextvars.ContextVar("rocketkv_api_words", default="python")


@contextlib.contextmanager
def command_line_words():
    """Within it, the API's errors keep the command line's words (``--max-new-tokens``):
    ``generate.py`` runs on ``Engine`` and speaks to a shell user."""
    token = _WORDS.set("command line")
    try:
        yield
    finally:
        _WORDS.reset(token)


def _in_python_words(fn: Callable) -> Callable:
    """``fn`` with its ``ConfigError`` reworded by ``python_words`` (the same exception, its
    traceback kept), outside ``command_line_words``."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            if _WORDS.get() == "python":
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


_cpu_fields = functools.cache(cpu_fields)  # /proc/cpuinfo read once a process (step keys)


def _warn_uncompressed(note: str | None, depth: int = 0) -> None:
    """The budget covers the whole sequence: say so to the caller of ``generate``,
    ``submit``, ``generate_batch`` or ``prefill_document`` (``warnings``' ``stacklevel``:
    through ``_in_python_words``, and ``depth`` more frames of the engine's own)."""
    if note is not None:
        warnings.warn(note, UserWarning, stacklevel=4 + depth)


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
         gguf_weights: str | None = None, prefix_cache_mib: int | None = None) -> Engine:
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
            default ``"quantized-int8-classifier"`` on the CPU, ``"float"`` on CUDA
            (``checkpoint.default_gguf_weights``).
        prefix_cache_mib: keep prompts uncompressed between runs, up to this many MiB
            (``prefix_cache.PrefixCache``): a run whose prompt starts with a kept one (a
            conversation's next turn, another question after the same document) prefills only
            the rest, and computes what a run prefilled from scratch does (the rest prefilled as
            its own chunk: see ``prefix_cache``). Each run then records
            its prompt's whole K/V before the method's caches are built from it (up to twice
            the KV memory during the prefill). Default None: none kept.
    Raises:
        ConfigError: what ``generate.py`` reports for the same checkpoint, device or
            tokenizer (a missing file, an unsupported architecture, no CUDA, weights that do
            not fit in free memory), naming the parameters.
    """
    prefix_cache_mib = _int("prefix_cache_mib", prefix_cache_mib, minimum=0, optional=True,
                            what="an int >= 0")
    if prefix_cache_mib is not None and prefix_cache_mib < 0:
        raise _refuse("prefix_cache_mib", "an int >= 0", prefix_cache_mib)
    device = resolve_device(None if device is None else str(device))
    dtype = default_dtype(dtype, device)
    t0 = time.perf_counter()
    ckpt, margs, tok = checks.open_checkpoint(None if checkpoint is None else str(checkpoint),
                                       tokenizer)
    # the weights; each run checks its own KV
    model = checks.load_weights(ckpt, margs, device, dtype, gguf_weights=gguf_weights)
    return Engine(model, tok, checkpoint=str(checkpoint or ckpt),
                  load_s=time.perf_counter() - t0,
                  prefix_cache=PrefixCache(prefix_cache_mib * 2**20) if prefix_cache_mib
                  else None)


def _compile(model: Transformer, compile: bool | None, decode_steps: int) -> bool | None:
    """``generate.py``'s default (``step.default_compile``) for the model's device and a run of
    ``decode_steps`` (its ``max_new_tokens``)."""
    return default_compile(compile, model.device, decode_steps)


class Engine:
    """A loaded model and its tokenizer (``load``). Build one around a model already loaded
    with ``Engine(model, tokenizer)``.

    One engine drives one set of caches: a ``generate`` or ``prefill_document`` call replaces
    what the previous one left, so only the latest question-agnostic ``Document`` answers (an
    older one raises ``ConfigError``; a question-aware one holds its own K/V and answers
    any time). A ``generate.generate`` call on ``engine.model`` itself is noticed when
    it rebuilt the caches (other shapes), not when it reused them.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, *,
                 checkpoint: str | None = None, load_s: float | None = None,
                 prefix_cache: PrefixCache | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.checkpoint, self.load_s = checkpoint, load_s
        self.prefix_cache = prefix_cache
        self._document: Document | None = None  # the document the caches hold now
        self._batcher: Batcher | None = None  # ``start_batching``

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
            return checks.encode_prompt(self.tokenizer, prompt, chat, system)
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
        run = self._plan(prompt, method=method, budget=budget, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         chat=chat, system=system, stop_ids=stop_ids, compile=compile,
                         **method_options)
        return self.run(run, on_token=on_token, on_text=on_text)

    def _plan(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int], *,
              method: str = "full", budget: int | None = None, max_new_tokens: int = 256,
              temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
              seed: int | None = 0, chat: bool | None = None, system: str | None = None,
              stop_ids: Sequence[int] | None = None, compile: bool | None = None,
              **method_options) -> checks.Run:
        """``generate``'s arguments checked, the prompt encoded and the run planned
        (``checks.plan_run``); a budget that compresses nothing warned about."""
        budget = _int("budget", budget, optional=True)
        max_new_tokens, temperature, top_k, top_p, seed = _sampling(
            max_new_tokens, temperature, top_k, top_p, seed)
        cache, sampling = checks.check_request(
            method, budget, _options(method_options), max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = self.encode(prompt, chat=chat, system=system)
        run = checks.plan_run(self.model.args, ids, cache, sampling,
                              max_new_tokens=max_new_tokens,
                              stop_ids=self.stop_ids if stop_ids is None else tuple(stop_ids),
                              compile=compile, device=self.model.device)
        _warn_uncompressed(run.note, depth=1)  # called by generate, submit, generate_batch
        return run

    @_in_python_words
    def run(self, run: checks.Run, *, on_token: Callable[[torch.Tensor], Any] | None = None,
            on_text: Callable[[str], Any] | None = None,
            on_prefill_layer: Callable[[int], Any] | None = None) -> Result:
        """Run ``run`` (``checks.plan_run``: settings checked and the method planned before
        the weights loaded, as ``generate.py`` does) on this engine's model: ``generate``'s
        work once its arguments are checked and encoded; ``on_prefill_layer`` is called with
        i after prefill layer i. The caches are replaced (an older question-agnostic
        ``Document`` stops answering).

        With a ``prefix_cache`` (a ``prefix_cache.PrefixCache``; not for batches, nor for a
        method whose caches prefill their own way), the prompt's longest kept prefix is not
        prefilled again: the rest is prefilled against its K/V, the whole prompt is kept for
        later runs and the method's caches are built from it (a run prefilled from scratch,
        the rest as its own chunk: see ``prefix_cache``); ``metrics["prefix_tokens_reused"]``
        counts the tokens not prefilled again and ``metrics["prefill_s"]`` is the rest's
        prefill plus the caches' build.

        Raises:
            ConfigError: the run was planned for another model's config.
        """
        self._not_batching()
        run = self.resolve_compile(run)
        prompt = run.ids if run.batch_size == 1 else [run.ids] * run.batch_size
        on_token, streamer = self._streaming(on_token, on_text, run.stop_ids)
        self._document = None
        method = METHODS[run.plan.request.method]
        if self.prefix_cache is None or run.batch_size != 1 or not method.shared_prefill:
            r = _g.generate(self.model, prompt, run.plan, max_new_tokens=run.max_new_tokens,
                            stop_ids=run.stop_ids, sampling=run.sampling, step=run.step,
                            on_token=on_token, on_prefill_layer=on_prefill_layer)
            self._learn(run, r)
            return self._result(r, run.stop_ids, streamer)
        pre, reused, prefill_s = self._kept_prefill(run, on_prefill_layer)
        try:
            r = _g.generate(self.model, prompt, run.plan, max_new_tokens=run.max_new_tokens,
                            stop_ids=run.stop_ids, sampling=run.sampling, step=run.step,
                            prefilled=pre, on_token=on_token)
        finally:
            pre.memos = [{} for _ in pre.k]  # kept for its K/V, not this run's scores
        self._learn(run, r)
        return self._result(r, run.stop_ids, streamer, prefill_s=prefill_s + r.prefill_s,
                            prefix_tokens_reused=reused)

    # ---- the CPU step's compile, learned per machine (``engine.step_ledger``)

    def step_key(self, run: checks.Run) -> str:
        """The step shape of ``run`` on this engine (``step_ledger.step_key``)."""
        request = run.plan.request
        return step_key({"model": self.model.args.to_dict(), "weights": weights_label(self.model),
                         "dtype": str(self.model.dtype), "method": request.method,
                         "budget": request.budget, "options": dict(request.options),
                         "prompt": len(run.ids), "new": run.plan.new_tokens,
                         "batch": run.batch_size, "torch": torch.__version__,
                         "cpu": _cpu_fields()})

    def resolve_compile(self, run: checks.Run) -> checks.Run:
        """``run`` with the CPU step compiled where this machine measured that it pays: the
        caller chose no ``compile``, the default said eager (a short run), and the ledger
        (``step_ledger.StepLedger.worth_compiling``) has this step shape's cached compile,
        compiled and eager step times, with the run's decode steps repaying the compile.
        Otherwise ``run`` as it is."""
        if (not run.compile_default or run.compile is not False
                or self.model.device.type != "cpu" or not cpp_compiler_found()):
            return run  # (compile None: a method whose caches cannot be compiled runs eager)
        steps = run.plan.new_tokens - run.plan.request.reserve_tokens
        if StepLedger().worth_compiling(self.step_key(run), steps):
            return dataclasses.replace(run, compile=None)
        return run

    def _learn(self, run: checks.Run, r: GenerateResult) -> None:
        """Record a CPU run's compile and step time in the ledger (eager or compiled)."""
        if self.model.device.type != "cpu" or r.cuda_graphs:
            return
        request = run.plan.request
        StepLedger().record(
            self.step_key(run), compiled=r.compiled, compile_s=r.compile_s,
            step_ms=r.decode_ms_median,
            label=f"{self.model.args.name} {request.method} {request.budget} "
                  f"{len(run.ids)}+{run.plan.new_tokens} x{run.batch_size}")

    def _not_batching(self) -> None:
        """Refuse a run of its own while the batcher drives the model (its thread)."""
        if self._batcher is not None:
            raise ConfigError("this engine is batching (start_batching): use submit, or "
                              "close_batching first")

    def _kept_prefill(self, run: checks.Run, on_layer: Callable[[int], Any] | None = None
                      ) -> tuple[PrefilledPrompt, int, float]:
        """The prompt of ``run`` recorded whole through the prefix cache: its longest kept
        prefix extended by the rest (or a prefill from scratch), kept for later runs. Returns
        the recording, the tokens reused and the seconds this prefill took."""
        window, sums = run.plan.request.recording
        kept = self.prefix_cache.longest(run.ids, obs_window=window, attention_sums=sums)
        if kept is None:
            pre = prefill_once(self.model, run.ids, obs_window=window, attention_sums=sums,
                               on_layer=on_layer)
            reused, prefill_s = 0, pre.prefill_s
        else:
            reused = kept.tokens.shape[1]
            pre = extend_prefilled(self.model, kept, run.ids[reused:])
            prefill_s = pre.prefill_s - kept.prefill_s
        self.prefix_cache.add(pre)
        return pre, reused, prefill_s

    # ---- many prompts decoded together (continuous batching)

    def start_batching(self, max_batch: int = 8, prefill_layers: int = PREFILL_LAYERS,
                       max_kv_bytes: int | None = None) -> Batcher:
        """Decode the requests given to ``submit`` together from now on: a ``batch.Batcher``
        (a thread of its own) over this engine's model, up to ``max_batch`` requests per
        decode step, a new prompt's prefill ``prefill_layers`` layers at a time between steps
        (``batch.BatchDecoder``), the running requests' KV caches within ``max_kv_bytes``
        bytes together (a request waits until it fits; None: no limit). Returns the batcher
        (``close_batching`` stops it).

        Raises:
            ConfigError: batching started already, ``max_batch`` or ``max_kv_bytes`` not
                positive, a model under tensor parallelism.
        """
        if self._batcher is not None:
            raise ConfigError("batching has started already")
        self._batcher = Batcher(self.model, max_batch=max_batch, prefill_layers=prefill_layers,
                                max_kv_bytes=max_kv_bytes)
        return self._batcher

    def close_batching(self, wait: bool = True) -> None:
        """Stop the batcher: queued requests are cancelled; with ``wait``, return once the
        running ones have finished."""
        if self._batcher is not None:
            self._batcher.close(wait)
            self._batcher = None

    @_in_python_words
    def submit(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int], *,
               method: str = "full", budget: int | None = None, max_new_tokens: int = 256,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = 0, chat: bool | None = None, system: str | None = None,
               stop_ids: Sequence[int] | None = None,
               on_token: Callable[[torch.Tensor], Any] | None = None,
               on_text: Callable[[str], Any] | None = None, **method_options) -> Future:
        """``generate``'s request, decoded with the others submitted (continuous batching,
        ``start_batching``; started with its defaults on first use): returns at once a
        ``concurrent.futures.Future`` whose result is the ``Result`` (``future.result()``
        waits), or the exception that ended the request (one ``on_token`` raised, for one).
        ``future.cancel()`` withdraws a request not yet admitted. The arguments are
        ``generate``'s (without ``compile``: the batched step runs eagerly) and are checked
        here, before anything is queued.

        Each request keeps caches of its own: any mix of methods, budgets and prompt lengths
        decodes together. A greedy answer equals ``generate``'s when the model's matrix
        products are batch-invariant (``batch``'s docstring); a sampled one draws from a
        generator of its own, seeded with ``seed``. With a ``prefix_cache``, a prompt's kept
        prefix is reused as in ``run``.

        Raises:
            ConfigError: as ``generate``, before anything is queued;
                ``batch.KVCapacityError`` (a ``ConfigError``) when the request's KV cache
                alone exceeds the batcher's ``max_kv_bytes``.
        """
        run = self._plan(prompt, method=method, budget=budget, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         chat=chat, system=system, stop_ids=stop_ids, compile=False,
                         **method_options)
        return self.submit_run(run, on_token=on_token, on_text=on_text)

    def submit_run(self, run: checks.Run, *,
                   on_token: Callable[[torch.Tensor], Any] | None = None,
                   on_text: Callable[[str], Any] | None = None) -> Future:
        """``submit`` for a run already checked and planned (``checks.plan_run``)."""
        if self._batcher is None:
            self.start_batching()
        on_token, streamer = self._streaming(on_token, on_text, run.stop_ids)
        self._document = None  # the batch replaces the model's own caches
        shared = (self.prefix_cache is not None
                  and METHODS[run.plan.request.method].shared_prefill)
        extra: dict[str, Any] = {}

        def prepare(on_layer: Callable[[int], Any]) -> PrefilledPrompt | None:
            if not shared:
                return None
            pre, extra["prefix_tokens_reused"], extra["prefill_s"] = \
                self._kept_prefill(run, on_layer)
            extra["pre"] = pre
            return pre

        def finish(r: GenerateResult) -> Result:
            pre = extra.pop("pre", None)
            if pre is not None:
                pre.memos = [{} for _ in pre.k]
                extra["prefill_s"] += r.prefill_s
            return self._result(r, run.stop_ids, streamer, **extra)

        return self._batcher.submit(run, on_token=on_token, prepare=prepare, finish=finish)

    @_in_python_words
    def generate_batch(self, prompts: Sequence[str | Sequence[dict[str, Any]] | Sequence[int]],
                       **kwargs: Any) -> list[Result]:
        """``generate`` for each of ``prompts``, decoded together (``submit``, then every
        result waited for); ``kwargs`` are ``submit``'s, the same for every prompt.

            engine.generate_batch(["What is RoPE?", "Name three fruits."], max_new_tokens=64)

        Raises:
            ConfigError: a prompt or setting ``generate`` refuses (before any is queued).
        """
        if isinstance(prompts, str):
            raise ConfigError("prompts is a list of prompts (one string is one prompt: "
                              "use generate)")
        if "compile" in kwargs or "on_token" in kwargs or "on_text" in kwargs:
            raise ConfigError("generate_batch takes generate's settings but compile, on_token "
                              "and on_text (use submit for a request's own callbacks)")
        runs = []
        for p in prompts:  # every prompt checked first (a loop: the warnings' frame)
            runs.append(self._plan(p, **kwargs))
        futures = [self.submit_run(run) for run in runs]
        return [f.result() for f in futures]

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
                         compile: bool | None = None, question_aware: bool | None = None,
                         **method_options) -> Document:
        """Prefill a document once, for any number of ``Document.ask`` calls.

        Args:
            text: the document (trailing white space dropped), or its token ids
                (``documents.document_ids``).
            method, budget, method_options: the cache, as for ``generate``.
            question_aware: True: the document's whole K/V is kept (its bytes are
                ``Document.held_bytes``) and each question builds the method's caches from it
                with the question in the prompt (``prefill.extend_prefilled``, then
                ``generate(prefilled=...)``: the question is prefilled, the document is not),
                the computation of a single run of document + question, the question
                prefilled as its own chunk (the same answer with float weights; quantized
                matmuls round a short chunk differently, so an answer can part at a near
                tie). False
                (question-agnostic): the method compresses the document once, before any
                question is known; each question attends to what it kept (less memory and
                time per question; what an evicting method dropped is gone for every
                question). None (default): question-aware when the budget compresses and the
                method's caches can be built from a shared prefill (all but KeyDiff, whose
                blocks prefill their own way), else question-agnostic.
            reserve_tokens: room after the document for one question and its answer
                (question tokens + ``max_new_tokens`` - 1 at most); question-agnostic, it
                sizes the cache's buffers (the method's parameters follow the tokens in the
                cache).
            chat, system: the document opens a user turn of the chat template (each question
                ends it): None (default) when the checkpoint has a chat template of its own
                (``Engine.chat``), True or False to decide.
        Warns:
            UserWarning: the budget covers the whole sequence; or, question-agnostic, the
                method evicted part of the document before any question was seen
                (``question_agnostic_note``).
        Returns:
            a ``Document``.
        Raises:
            ConfigError: as ``generate``; the document and the reserve do not fit the
                context; ``question_aware=True`` for a method that cannot rebuild its caches
                from a shared prefill.
        """
        budget = _int("budget", budget, optional=True)
        reserve_tokens = _int("reserve_tokens", reserve_tokens)
        cache, _ = checks.check_request(method, budget, _options(method_options),
                                        max_new_tokens=1, reserve_tokens=reserve_tokens)
        chat = checks.chat_mode(chat, self.tokenizer)
        ids = document_ids(self._tok(), text, chat, system) if isinstance(text, str) \
            else self.encode(text)
        run = checks.plan_document(self.model.args, ids, cache, compile=compile,
                                   device=self.model.device)
        _warn_uncompressed(run.note)
        doc = self.open_document(run, chat=chat, system=system,
                                 text=text if isinstance(text, str) else "", compile=compile,
                                 question_aware=question_aware)
        _warn_uncompressed(doc.note)
        return doc

    @_in_python_words
    def open_document(self, run: checks.Run, *, chat: bool, system: str | None = None,
                      text: str = "", compile: bool | None = None,
                      question_aware: bool | None = None,
                      on_prefill_layer: Callable[[int], Any] | None = None) -> Document:
        """``prefill_document``'s work once checked and planned (``checks.plan_document``):
        the document's prefill and its ``Document``. Question-aware (``question_aware``, as
        ``prefill_document`` decides it), the whole K/V is recorded (``prefill.prefill_once``)
        and the engine's caches are released; question-agnostic, the method's caches hold
        the compressed document and ``Document.note`` says when it evicted part of it before
        any question (``question_agnostic_note``). ``chat``, ``system`` and ``text`` are how
        its questions are encoded (``documents.question_ids``); ``compile`` the answers'
        step (``generate``'s default when None).

        Raises:
            ConfigError: ``question_aware=True`` for a method whose caches prefill their own
                way (KeyDiff).
        """
        self._not_batching()
        request = run.plan.request
        method = METHODS[request.method]
        if question_aware and not method.shared_prefill:
            raise ConfigError(f"{request.method} prefills the prompt in blocks of its own and "
                              "cannot rebuild its cache per question: pass "
                              "question_aware=False (the document compressed once)")
        cannot = run.plan.params is not None and not method.shared_prefill
        if question_aware is None:
            question_aware = run.plan.params is not None and method.shared_prefill
        self._document = None
        if question_aware:
            release_caches(self.model)
            window, sums = request.recording
            pre = prefill_once(self.model, run.ids, obs_window=window, attention_sums=sums,
                               on_layer=on_prefill_layer)
            metrics = {"method": request.method, "budget": request.budget,
                       "question_aware": True, "prompt_tokens": len(run.ids),
                       "prefill_s": pre.prefill_s, "document_kv_bytes": pre.nbytes(),
                       "conversation": {"room": self.model.args.max_seq_len - len(run.ids)}}
            doc = Document(self, run.ids, metrics, chat=chat, system=system, text=text,
                           compile=compile, prefilled=pre,
                           request=request.replace(reserve_tokens=0))  # caches per answer
        else:
            r = self.run(run, on_prefill_layer=on_prefill_layer)
            doc = Document(self, run.ids, r.metrics, chat=chat, system=system, text=text,
                           compile=compile)
            if cannot and doc.note is not None:  # say why it is not question-aware
                doc.note = (f"{doc.note} ({request.method} prefills in blocks of its own and "
                            "cannot rebuild its cache per question: question-agnostic)")
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
        question_aware: whether each answer rebuilds the method's caches from the
            document's whole K/V with its question in the prompt (``prefill_document``).
        held_bytes: bytes the document holds between questions: question-aware, its whole
            K/V (``PrefilledPrompt.nbytes``); question-agnostic, the method's caches and the
            snapshot.
        snapshot_bytes: bytes of the cache state copied to rewind to the document
            (question-agnostic; 0 otherwise).
        note: what the method evicted from the document before any question was seen
            (``question_agnostic_note``), or None.
        chat: whether the document and its questions are a user turn of the chat template.
        answers: the ``metrics`` of each answer so far.
    """

    def __init__(self, engine: Engine, ids: list[int], metrics: dict[str, Any], *, chat: bool,
                 system: str | None, text: str, compile: bool | None,
                 prefilled: PrefilledPrompt | None = None, request: CacheRequest | None = None):
        self.engine, self.ids, self.metrics = engine, ids, metrics
        self.prefill_s = metrics["prefill_s"]
        self.method, self.budget = metrics["method"], metrics["budget"]
        self.chat = chat
        self._system, self._text, self._compile = system, text, compile
        self.room = metrics["conversation"]["room"]
        self.question_aware = prefilled is not None
        self._prefilled, self._request = prefilled, request
        if self.question_aware:
            self.note = None
            self._snapshot = None
            self.snapshot_bytes = 0
            self.held_bytes = prefilled.nbytes()
        else:
            self.note = question_agnostic_note(self.method, metrics)
            self._snapshot = CacheSnapshot(engine.model.caches)
            self.snapshot_bytes = self._snapshot.bytes()
            self.held_bytes = metrics["kv_cache_bytes"] + self.snapshot_bytes
        self.answers: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return (f"Document(tokens={len(self.ids)}, method={self.method!r}, "
                f"budget={self.budget!r}, chat={self.chat}, "
                f"question_aware={self.question_aware}, "
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
        """Answer ``question`` about the document. The question's tokens are prefilled after
        the document's, which are not prefilled again.

        Question-aware (``question_aware``): the question is prefilled against the document's
        whole K/V (``prefill.extend_prefilled``) and the method's caches are built from
        document + question (``generate(prefilled=...)``), with the question in the method's
        observation window: the computation of a single run of document + question, the
        question prefilled as its own chunk (the same answer with float weights; see
        ``prefill_document``). Question-agnostic: the question attends to the cache as the
        method left it after the document's prefill (earlier questions and answers rewound
        away: the position, and the method's state from a snapshot; ``generate(...,
        continue_conversation=True)``); with ``full`` that is a single run's computation too.

        Args: as ``Engine.generate``'s (the method and budget are the document's; ``on_text``
            streams the answer's text).
        Returns:
            a ``Result`` whose ``metrics["prefill_s"]`` is the question's own prefill (and,
            question-aware, the caches' build) and ``metrics["document_prefill_s"]`` the
            document's, paid once.
        Raises:
            ConfigError: a bad sampling setting; a question and ``max_new_tokens`` that do
                not fit the document's room (the reserve; question-aware, the context);
                question-agnostic, the engine's caches were replaced by a later ``generate``
                or ``prefill_document`` call; question-aware, a budget too small for document
                + question.
        """
        engine = self.engine
        max_new_tokens, temperature, top_k, top_p, seed = _sampling(
            max_new_tokens, temperature, top_k, top_p, seed)
        if max_new_tokens <= 0:
            raise ConfigError(f"--max-new-tokens must be positive, got {max_new_tokens}")
        sampling = Sampling(temperature, top_k, top_p, seed)
        if engine._document is not self and not self.question_aware:
            raise ConfigError("this document's cache was replaced by a later generate() or "
                              "prefill_document() call: prefill it again")
        ids = self.question_ids(question)
        if len(ids) + max_new_tokens - 1 > self.room:
            where = ("the room the model's context leaves after the document"
                     if self.question_aware else "the document's reserve")
            raise ConfigError(f"the question ({len(ids)} tokens) and max_new_tokens "
                              f"{max_new_tokens} exceed {where} ({self.room} tokens)"
                              + ("" if self.question_aware else
                                 ": pass a larger reserve_tokens to prefill_document"))
        stop = engine.stop_ids if stop_ids is None else tuple(stop_ids)
        on_token, streamer = engine._streaming(on_token, on_text, stop)
        step = StepConfig(compile=_compile(engine.model, self._compile, max_new_tokens))
        extra: dict[str, Any] = {}
        if self.question_aware:
            model = engine.model
            if engine._document is not self:
                engine._document = None  # the engine's caches are rebuilt for this answer
            pre = extend_prefilled(model, self._prefilled, ids)  # the question's prefill
            plan = self._request.plan(model.args, prompt_len=len(self.ids) + len(ids),
                                      max_new_tokens=max_new_tokens)
            r = _g.generate(model, self.ids + ids, plan, max_new_tokens=max_new_tokens,
                            stop_ids=stop, sampling=sampling, step=step, prefilled=pre,
                            on_token=on_token)
            # the question's prefill, then the caches built from document + question
            extra = {"prefill_s": pre.prefill_s - self.prefill_s + r.prefill_s,
                     "question_aware": True}
            del pre
        else:
            _g.rewind_conversation(engine.model, len(self.ids), self._snapshot)
            r = _g.generate(engine.model, ids, continue_conversation=True,
                            max_new_tokens=max_new_tokens, stop_ids=stop, sampling=sampling,
                            step=step, on_token=on_token)
        result = engine._result(r, stop, streamer, **extra,
                                question=question if isinstance(question, str) else None,
                                question_tokens=len(ids),
                                document_tokens=len(self.ids), document_prefill_s=self.prefill_s)
        self.answers.append(result.metrics)
        return result

    def prefill_summary(self) -> dict[str, Any]:
        """The prefill paid once against a separate run per question asked so far
        (``documents.prefill_summary``: ``document_prefill_s``, ``question_prefill_s``,
        ``prefill_saved_s``)."""
        return prefill_summary(len(self.ids), self.prefill_s, self.answers)
