"""The engine as a library: load a checkpoint, generate text, and answer many questions about
one document from a single prefill of it.

    import rocketkv
    engine = rocketkv.load("../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    result = engine.generate(chat, method="rocketkv", budget=256, max_new_tokens=32)
    print(result.text, result.metrics["decode_ms_median"])

``Engine.generate`` checks its settings as ``generate.py`` does (the same ``ConfigError``
wording, before any prefill), encodes the prompt (a message list through the checkpoint's chat
template; a string as plain text, or as one user turn with ``chat=True``), stops at the model's
end of turn and returns a ``Result`` with the text, the token ids and every figure of
``generate.py --json``. ``generate.generate`` stays the low-level call (token ids in, a dict
out).

``Engine.prefill_document`` prefills (and compresses) a document once; each
``Document.ask(question)`` then feeds the question after it (``generate(...,
continue_conversation=True)``), answers, and the next question starts again from the document as
the method left it: the conversation's position is set back (``generate.rewind_conversation``)
and whatever the method's caches changed past the document (H2O's scores and evictions, the
StreamingLLM ring, page summaries, recorded queries) is restored from a snapshot taken after the
document's prefill.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import generate as _g
from checkpoint import checkpoint_args, is_quantized, load_model, resolve_checkpoint
from cli import DTYPES, resolve_device
from kv_cache import CompressedKVCache, FullKVCache, KVCache
from measure import check_memory
from model import ConfigError, Transformer
from tokenizer import Tokenizer

__all__ = ["ConfigError", "Document", "Engine", "Result", "load"]

SEPARATOR = "\n\n"  # between the document and each question (the question's first tokens)
_MARK = "Zq7Question"  # where the question goes in a rendered chat template


@dataclass
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
    """

    text: str | None
    tokens: list[int]
    stop_reason: str
    metrics: dict[str, Any] = field(repr=False)


def _dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    return DTYPES[name]


def load(checkpoint: str, *, device: str | torch.device | None = None,
         dtype: torch.dtype | str | None = None, tokenizer: str | None = None) -> Engine:
    """Load a model and its tokenizer, as ``generate.py --checkpoint`` does.

    Args:
        checkpoint: a checkpoint directory, a ``.gguf`` file, a short name or ``random:NAME``
            (``docs/checkpoints.md``).
        device: ``"cuda"``, ``"cpu"`` or a ``torch.device``; default cuda when available.
        dtype: of the weights and the KV cache (a ``torch.dtype`` or its name); default
            bfloat16 on cuda, float32 on cpu.
        tokenizer: a tokenizer file or directory (default: the checkpoint's own).
    Raises:
        ConfigError: what ``generate.py`` reports for the same checkpoint, device or
            tokenizer (a missing file, an unsupported architecture, no CUDA, weights that do
            not fit in free memory).
    """
    device = resolve_device(None if device is None else str(device))
    dtype = _dtype(dtype, device)
    t0 = time.perf_counter()
    ckpt = resolve_checkpoint(str(checkpoint))
    margs = checkpoint_args(ckpt)
    tok = _g.checkpoint_tokenizer(ckpt, margs, tokenizer)
    if not is_quantized(ckpt):
        check_memory(margs, dtype, device, 1, 1)  # the weights; each run checks its own KV
    model = load_model(ckpt, device, dtype)
    return Engine(model, tok, checkpoint=str(checkpoint), load_s=time.perf_counter() - t0)


def _compile(model: Transformer, compile: bool | None) -> bool | None:
    """``generate.py``'s default: compiled on CUDA where the method's caches allow."""
    if compile is not None:
        return compile
    return None if model.tok_embeddings.weight.device.type == "cuda" else False


class Engine:
    """A loaded model and its tokenizer (``load``). Build one around a model already loaded
    with ``Engine(model, tokenizer)``.

    One engine drives one set of caches: a ``generate`` or ``prefill_document`` call replaces
    what the previous one left, so only the latest ``Document`` answers (an older one raises
    ``ConfigError``). Calling ``generate.generate`` on ``engine.model`` directly does the same
    without the check.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, *,
                 checkpoint: str | None = None, load_s: float | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.checkpoint, self.load_s = checkpoint, load_s
        self._document: Document | None = None  # the document the caches hold now

    # ---- prompts

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The default stop tokens: the tokenizer's EOS and its chat template's end-of-turn
        token (``Tokenizer.chat_stop_ids``); none without a tokenizer."""
        return () if self.tokenizer is None else self.tokenizer.chat_stop_ids

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ConfigError(_g.NO_TOKENIZER)
        return self.tokenizer

    def encode(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int], *,
               chat: bool = False, system: str | None = None) -> list[int]:
        """The token ids of ``prompt``: a list of messages (dicts with ``role`` and
        ``content``) through the chat template with the generation prompt; a string as plain
        text (with BOS where the tokenizer adds one), or with ``chat`` as one user turn (after
        ``system``, when given) as ``generate.py --chat`` encodes it; token ids as given.

        Raises:
            ConfigError: an empty prompt, a text prompt without a tokenizer, ``system``
                without ``chat``, no chat template, a malformed message list.
        """
        if system is not None and not chat:
            raise ConfigError("--system needs --chat (it is a message of the chat template)")
        if isinstance(prompt, str):
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
            return prompt
        raise ConfigError("a prompt is a string, a list of messages (dicts with 'role' and "
                          "'content') or a list of token ids")

    # ---- one prompt

    def generate(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int], *,
                 method: str = "full", budget: int | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = 0, chat: bool = False, system: str | None = None,
                 stop_ids: Sequence[int] | None = None, compile: bool | None = None,
                 on_token=None, **method_options) -> Result:
        """Generate an answer to ``prompt`` (see ``encode``) with the KV cache of ``method``.

        Args:
            method, budget: the cache (``compression.METHODS``; ``docs/methods.md``), budget in
                tokens read per decode step, per layer, per KV-head group.
            max_new_tokens: generated tokens at most.
            temperature, top_k, top_p, seed: sampling (temperature 0: greedy).
            chat, system: encode a string as a user turn of the chat template.
            stop_ids: the tokens that end the answer; default ``stop_ids`` (EOS and the
                template's end of turn), ``()`` to run to ``max_new_tokens``.
            compile: compile the decode step; default as ``generate.py`` (on CUDA when the
                method allows, never on CPU).
            on_token: called with the tokens so far, (1, n) int64, after each one (streaming).
            method_options: the method's options by their flag names (``page_size=16``,
                ``rocket_split="adaptive"``: ``docs/methods.md``).
        Returns:
            a ``Result``.
        Raises:
            ConfigError: with ``generate.py``'s wording, before any prefill: a bad sampling
                setting, an unknown method, a bad or missing budget, an option the method does
                not read, a prompt that does not fit the context, a budget too small for it.
        """
        options = _options(method_options)
        _g.check_request(method, budget, options, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p)
        ids = self.encode(prompt, chat=chat, system=system)
        _g.check_fit(method, self.model.args, len(ids), max_new_tokens, budget, options)
        stop = self.stop_ids if stop_ids is None else tuple(stop_ids)
        self._document = None
        r = _g.generate(self.model, ids, method=method, budget=budget,
                        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, stop_ids=stop,
                        compile=_compile(self.model, compile), method_options=options,
                        on_token=on_token)
        return self._result(r, stop)

    def _result(self, r: dict[str, Any], stop: Sequence[int]) -> Result:
        """The CLI's JSON record of a run (``text``, ``checkpoint``, ``model``, ``load_s``
        added) as a ``Result``."""
        texts = _g.result_text(self.tokenizer, r["token_ids"], stop)
        r["text"] = texts
        r["checkpoint"], r["model"], r["load_s"] = self.checkpoint, self.model.args.name, \
            self.load_s
        r["world_size"] = 1
        r["interrupted"] = r["stop_reason"] == "interrupted"
        return Result(None if texts is None else texts[0], list(r["token_ids"][0]),
                      r["stop_reason"], r)

    # ---- one document, many questions

    def document_ids(self, text: str, *, chat: bool = False,
                     system: str | None = None) -> list[int]:
        """The token ids of ``text`` (trailing white space dropped) as the opening of a
        prompt whose question follows (``question_ids``): plain text with BOS, or with
        ``chat`` the chat template up to the end of the document inside the user turn."""
        if not text.strip():
            raise ConfigError("the document is empty")
        if system is not None and not chat:
            raise ConfigError("--system needs --chat (it is a message of the chat template)")
        tok, text = self._tok(), text.rstrip()  # white space merges with the separator
        if not chat:
            return tok.encode(text)
        return tok.encode_rendered(_chat_halves(tok, text, system)[0])

    def question_ids(self, question: str, *, chat: bool = False, document: str = "",
                     system: str | None = None) -> list[int]:
        """The token ids that follow a document's (``document_ids``): ``SEPARATOR``, the
        question and, with ``chat``, the rest of the template (the end of the user turn and
        the generation prompt).

        Document ids + question ids are the prompt a separate run of the question prefills,
        the text ``document.rstrip() + SEPARATOR + question.strip()`` (as ``encode`` gives it,
        ``chat`` alike): the question's ids are that prompt's after the document's. Where the
        tokenizer merges the document's end with the separator (or ``document`` is not
        given), the question is tokenized on its own instead.
        """
        if not question.strip():
            raise ConfigError("a question is empty")
        tok, question = self._tok(), question.strip()
        if document.strip():
            whole = self.encode(document.rstrip() + SEPARATOR + question, chat=chat,
                                system=system)
            head = self.document_ids(document, chat=chat, system=system)
            if whole[:len(head)] == head:
                return whole[len(head):]
        if not chat:
            return tok.encode(SEPARATOR + question, bos=False)
        tail = _chat_halves(tok, document.rstrip() or ".", system)[1]
        return tok.encode_rendered(SEPARATOR + question + tail, first=False)

    def prefill_document(self, text: str | Sequence[int], *, method: str = "full",
                         budget: int | None = None, reserve_tokens: int = 1024,
                         chat: bool = False, system: str | None = None,
                         compile: bool | None = None, **method_options) -> Document:
        """Prefill (and compress) a document once, for any number of ``Document.ask`` calls.

        Args:
            text: the document (or its token ids, as ``document_ids`` gives them).
            method, budget, method_options: the cache, as for ``generate``. The method
                compresses the document before any question is known: what an evicting
                method drops is dropped for every question (docs/generate.md).
            reserve_tokens: cache room after the document for one question and its answer
                (question tokens + ``max_new_tokens`` - 1 at most); the budget's new tokens.
            chat, system: the document opens a user turn of the chat template (each question
                ends it).
        Raises:
            ConfigError: as ``generate``; the document and the reserve do not fit the
                context.
        """
        options = _options(method_options)
        _g.check_request(method, budget, options, max_new_tokens=1)
        if reserve_tokens <= 0:
            raise ConfigError(f"reserve_tokens must be positive, got {reserve_tokens}")
        ids = self.document_ids(text, chat=chat, system=system) if isinstance(text, str) \
            else self.encode(text)
        check_document(method, self.model.args, len(ids), reserve_tokens, budget, options)
        self._document = None
        r = _g.generate(self.model, ids, method=method, budget=budget, max_new_tokens=0,
                        reserve_tokens=reserve_tokens, compile=_compile(self.model, compile),
                        method_options=options)
        doc = Document(self, ids, r, chat=chat, system=system,
                       text=text if isinstance(text, str) else "", compile=compile)
        self._document = doc
        return doc


def _options(method_options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in method_options.items() if v is not None and v is not False}


def _chat_halves(tok: Tokenizer, document: str, system: str | None) -> tuple[str, str]:
    """The rendered chat template of one user turn ``document`` + a question, split where the
    question goes: (up to the end of the document, after the question)."""
    messages = [{"role": "system", "content": system}] if system else []
    text = tok.apply_chat_template([*messages, {"role": "user", "content": document + _MARK}])
    head, sep, tail = text.rpartition(_MARK)
    if not sep:
        raise ConfigError("the chat template does not render the user's message as given")
    return head, tail


def check_document(method: str, margs, doc_tokens: int, reserve_tokens: int,
                   budget: int | None, options: dict[str, Any]) -> None:
    """The checks of a document run that need no weights: the document plus its reserve fit
    the context, and the method's setting for a ``doc_tokens`` prompt with ``reserve_tokens``
    new tokens (``compression.plan``).

    Raises:
        ConfigError: naming the sizes.
    """
    room = _g.check_fit(method, margs, doc_tokens, reserve_tokens, budget, options)
    if reserve_tokens > room:
        raise ConfigError(f"the document ({doc_tokens} tokens) and its questions' reserve "
                          f"({reserve_tokens} tokens) exceed the model's context "
                          f"({margs.max_seq_len} tokens)")


def _position_ordered(cache: KVCache) -> bool:
    """Whether ``cache`` keeps every token in the slot of its position (the full cache, the
    compact cache with its base-class writes): what a question writes lies past the document's
    slots and is overwritten by the next question before it is read, so K/V need no
    snapshot."""
    kind = type(cache)
    return ((kind.decode, kind.append) in ((FullKVCache.decode, FullKVCache.append),
                                           (CompressedKVCache.decode, CompressedKVCache.append)))


_PLAIN = (int, float, bool, str, type(None))


class _CacheSnapshot:
    """Everything a question may change in a model's caches, copied after the document's
    prefill: every buffer (the K/V of a cache that is not ``_position_ordered`` included) and
    every plain attribute (an int such as KeyDiff's ``filled``) of each cache and its
    submodules (selectors). Plain tensor attributes (OmniKV's host-side banks under
    ``--offload``, written in position order) are not copied."""

    def __init__(self, caches: Sequence[KVCache]):
        self.caches = list(caches)
        self.saved = []
        for cache in self.caches:
            skip = {"k_cache", "v_cache"} if _position_ordered(cache) else set()
            buffers = {name: b.clone() for name, b in cache.named_buffers()
                       if b is not None and name not in skip}
            attrs = [(m, {k: v for k, v in vars(m).items() if not k.startswith("__")
                          and _plain(v)}) for m in cache.modules()]
            self.saved.append((buffers, attrs))

    def bytes(self) -> int:
        """Bytes the snapshot holds."""
        return sum(b.numel() * b.element_size() for buffers, _ in self.saved
                   for b in buffers.values())

    def restore(self) -> None:
        for cache, (buffers, attrs) in zip(self.caches, self.saved):
            current = dict(cache.named_buffers())
            for name, saved in buffers.items():
                buf = current.get(name)
                if buf is not None and buf.shape == saved.shape and buf.dtype == saved.dtype:
                    buf.copy_(saved)  # in place: a compiled step's graph keeps its buffers
                else:
                    raise ConfigError(f"the document's cache changed shape ({name}): prefill "
                                      "the document again")
            for module, values in attrs:
                for k, v in values.items():
                    setattr(module, k, v)


def _plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN)
                                                                   for x in v))


class Document:
    """A document prefilled once (``Engine.prefill_document``); ``ask`` answers questions
    about it from its cache.

    Attributes:
        ids: the document's token ids.
        prefill_s: seconds of the document's prefill (paid once).
        metrics: the document prefill's figures (``generate.generate``'s dict, no tokens
            generated): ``prompt_tokens_kept``, ``kv_cache_bytes``, ``method_params``...
        snapshot_bytes: bytes of the cache state copied to rewind after each answer.
    """

    def __init__(self, engine: Engine, ids: list[int], metrics: dict[str, Any], *, chat: bool,
                 system: str | None, text: str, compile: bool | None):
        self.engine, self.ids, self.metrics = engine, ids, metrics
        self.prefill_s = metrics["prefill_s"]
        self.method, self.budget = metrics["method"], metrics["budget"]
        self._chat, self._system, self._text, self._compile = chat, system, text, compile
        self.position = metrics["conversation"]["position"]
        self.room = metrics["conversation"]["room"]  # positions for a question and answer
        self._snapshot = _CacheSnapshot(engine.model.caches)
        self.snapshot_bytes = self._snapshot.bytes()
        self.questions = 0  # questions answered

    def question_ids(self, question: str | Sequence[int]) -> list[int]:
        """The ids ``ask`` feeds after the document (``Engine.question_ids``)."""
        if isinstance(question, str):
            return self.engine.question_ids(question, chat=self._chat, document=self._text,
                                            system=self._system)
        return self.engine.encode(question)

    def ask(self, question: str | Sequence[int], *, max_new_tokens: int = 256,
            temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
            seed: int | None = 0, stop_ids: Sequence[int] | None = None,
            on_token=None) -> Result:
        """Answer ``question`` from the document's cache as the method left it after the
        document's prefill (earlier questions and answers rewound away). The question's
        tokens are prefilled after the document's (``generate(...,
        continue_conversation=True)``); with ``full`` the answer is the one a separate run of
        document + question gives.

        Args: as ``Engine.generate``'s (the method and budget are the document's).
        Returns:
            a ``Result`` whose ``metrics["prefill_s"]`` is the question's own prefill and
            ``metrics["document_prefill_s"]`` the document's, paid once.
        Raises:
            ConfigError: a bad sampling setting; a question and ``max_new_tokens`` that do
                not fit the document's ``reserve_tokens``; the engine's caches were replaced
                by a later ``generate`` or ``prefill_document`` call.
        """
        engine = self.engine
        _g.check_request(self.method, self.budget, {}, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p)
        if engine._document is not self or any(
                a is not b for a, b in zip(self._snapshot.caches, engine.model.caches)):
            raise ConfigError("this document's cache was replaced by a later generate() or "
                              "prefill_document() call: prefill it again")
        ids = self.question_ids(question)
        if len(ids) + max_new_tokens - 1 > self.room:
            raise ConfigError(f"the question ({len(ids)} tokens) and --max-new-tokens "
                              f"{max_new_tokens} exceed the document's reserve "
                              f"({self.room} tokens): pass a larger reserve_tokens to "
                              "prefill_document")
        self._snapshot.restore()
        _g.rewind_conversation(engine.model, self.position)
        stop = engine.stop_ids if stop_ids is None else tuple(stop_ids)
        r = _g.generate(engine.model, ids, continue_conversation=True,
                        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, stop_ids=stop,
                        compile=_compile(engine.model, self._compile), on_token=on_token)
        self.questions += 1
        r["document_tokens"] = len(self.ids)
        r["document_prefill_s"] = self.prefill_s
        return engine._result(r, stop)


# --------------------------------------------------------------------------------------------
# generate.py --questions


def read_questions(path: str) -> list[str]:
    """The questions of ``--questions FILE``: one a line (blank lines skipped), or JSON lines
    (objects with a ``"question"`` string; ``-`` reads stdin).

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


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3] + "..."


def questions_cli(args, *, checkpoint: str, margs, tok: Tokenizer | None, text: str | None,
                  device: torch.device, dtype: torch.dtype, options: dict[str, Any],
                  compile: bool | None, t_load: float) -> int:
    """``generate.py --prompt DOC --questions FILE``: the document prefilled once, then one
    answer block per question on stdout (``==> question i: ... <==``), one line per answer and
    the prefill paid once on stderr, and with ``--json`` one record per question
    (``questions``) beside the document's (``document``). Checks everything before the
    weights load.

    Raises:
        ConfigError: no text document, a batch, unreadable questions, a document and
            reserve that do not fit the context, a bad method setting for them.
    """
    if text is None:
        raise ConfigError("--questions needs a text document (--prompt or --prompt-text)")
    if tok is None:
        raise ConfigError(_g.NO_TOKENIZER)
    if args.batch_size != 1:
        raise ConfigError("--questions answers one sequence: --batch-size must be 1")
    questions = read_questions(args.questions)
    draft = Engine(None, tok)  # tokenizes before the weights load
    doc_ids = draft.document_ids(text, chat=args.chat, system=args.system)
    q_ids = [draft.question_ids(q, chat=args.chat, document=text, system=args.system)
             for q in questions]
    reserve = max(len(q) for q in q_ids) + args.max_new_tokens - 1
    reserve = min(reserve, margs.max_seq_len - len(doc_ids))
    check_document(args.method, margs, len(doc_ids), max(reserve, 1), args.budget, options)
    if not is_quantized(checkpoint):
        check_memory(margs, dtype, device, 1, len(doc_ids) + reserve)
    model = _g.load_model(checkpoint, device, dtype)
    engine = Engine(model, tok, checkpoint=args.checkpoint, load_s=time.perf_counter() - t_load)
    doc = engine.prefill_document(doc_ids, method=args.method, budget=args.budget,
                                  reserve_tokens=max(reserve, 1), compile=compile, **options)
    stop = () if args.ignore_eos else (tok.chat_stop_ids if args.chat else tok.stop_ids)
    records, interrupted = [], False
    for i, (q, ids) in enumerate(zip(questions, q_ids), 1):
        print(f"==> question {i}: {_short(q)} <==", flush=True)
        streamer = _g.TextStreamer(tok, stop) if args.stream else None
        res = doc.ask(ids, max_new_tokens=min(args.max_new_tokens, doc.room - len(ids) + 1),
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, stop_ids=stop, on_token=streamer)
        if streamer is not None:
            streamer.finish(res.text)
        else:
            print(res.text, flush=True)
        r = res.metrics
        r["question"] = q
        records.append(r)
        print(f"question {i}: {r['prompt_tokens']} tokens prefilled in "
              f"{r['prefill_s'] * 1e3:.1f} ms, {r['new_tokens']} generated "
              f"({r['stop_reason']})" + (f", decode median {r['decode_ms_median']:.2f} ms"
                                         if r["decode_steps"] else ""), file=sys.stderr)
        if res.stop_reason == "interrupted":
            interrupted = True
            break
    summary = prefill_summary(doc, records)
    print(summary["line"], file=sys.stderr)
    if args.json:
        out = {"checkpoint": args.checkpoint, "model": model.args.name,
               "load_s": engine.load_s, "document": doc.metrics,
               **{k: v for k, v in summary.items() if k != "line"}, "questions": records}
        try:
            _g.write_json(args.json, out)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 130 if interrupted else 0


def prefill_summary(doc: Document, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What one prefill of the document saved: its seconds (paid once), each question's own
    prefill, and ``prefill_saved_s`` = (questions - 1) x the document's prefill (a separate
    run per question prefills the document each time), with a report ``line``."""
    n = len(records)
    per_question = [r["prefill_s"] for r in records]
    saved = (n - 1) * doc.prefill_s
    return {
        "document_tokens": len(doc.ids),
        "document_prefill_s": doc.prefill_s,
        "question_prefill_s": per_question,
        "prefill_saved_s": saved,
        "line": (f"document {len(doc.ids)} tokens prefilled once in {doc.prefill_s:.2f} s "
                 f"({doc.method}, {doc.metrics['prompt_tokens_kept']['mean']:.0f} kept per "
                 f"layer); {n} question(s) prefilled in {sum(per_question):.2f} s; a separate "
                 f"run per question would prefill the document {n} times: {saved:.2f} s "
                 "saved"),
    }
