"""Tokenizers: Hugging Face ``tokenizer.json``, GGUF metadata, SentencePiece and Llama 3 tiktoken.

* ``HFTokenizer`` wraps a ``tokenizers.Tokenizer`` built from a ``tokenizer.json`` (with the
  ``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` beside it) or from a
  GGUF file's own metadata (``gguf_tokenizer``), so a GGUF runs with no other file. It encodes and
  decodes as transformers does.
* ``SentencePieceTokenizer`` (Llama 2, Mistral, LongChat, tinyllamas) and ``TiktokenTokenizer``
  (Llama 3 ``tokenizer.model``): the kind is chosen from the file's content, not from its name: a
  tiktoken BPE file is text lines ``<base64 token> <rank>``; anything else is read as a
  SentencePiece model.

Chat templates are Jinja, rendered the way transformers renders them (``Tokenizer.render_chat``):
the checkpoint's own template (``chat_template.jinja``, else tokenizer_config.json's
``chat_template``, as transformers picks them; or the GGUF's ``tokenizer.chat_template``), else a
fallback written here for the tiktoken (Llama 3 headers) and SentencePiece (``[INST] ...
[/INST]``) tokenizers. A tokenizer without a template cannot chat (``ConfigError``).

``tokenizers``, ``jinja2``, ``gguf``, ``sentencepiece`` and ``tiktoken`` are imported only when
needed.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rocketkv.formats.gguf_reader import (  # one reader for model and tokenizer
    is_gguf,
    open_gguf,
)
from rocketkv.model import ConfigError

# files that make a directory have a tokenizer, in the order load_tokenizer prefers them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")

NO_TEMPLATE = ("--chat: the checkpoint has no chat template; run without --chat, or use a "
               "checkpoint whose tokenizer_config.json, chat_template.jinja or GGUF metadata "
               "holds one")

# Fallback templates, used only when the checkpoint has none. Llama 3 (Meta's header format): the
# BOS text starts the conversation, every turn ends with <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}"
    "{{- (message['content'] | trim) + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}"
    "{%- endif -%}"
)
# Llama 2 / Mistral: an optional system message inside the first [INST] block; an answer ends with
# EOS, a later user turn starts with BOS. The first BOS is not text here: ``encode_chat`` prepends
# its id (SentencePiece itself reads '<s>' as plain characters).
LLAMA2_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = '<<SYS>>\n' + (messages[0]['content'] | trim) + '\n<</SYS>>\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = '' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if not loop.first -%}{{- bos_token -}}{%- endif -%}"
    "{{- '[INST] ' + (system if loop.first else '') + (message['content'] | trim) + ' [/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- ' ' + (message['content'] | trim) + ' ' + eos_token -}}"
    "{%- else -%}"
    "{{- raise_exception('this template takes system, user and assistant messages, not '"
    " + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

_ASSISTANT_MARK = "Zq7Answer"  # assistant content whose end chat_stop_ids looks after


def _dedupe(ids) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


class Tokenizer:
    """Common interface.

    ``encode`` adds BOS when the tokenizer does (SentencePiece and tiktoken always; Hugging Face
    tokenizers when their post-processor does); ``decode`` drops special tokens. Chat goes through
    one path for every class: ``render_chat`` renders the Jinja template, ``encode_chat`` tokenizes
    the result with special-token text recognized.

    Attributes:
        bos_id (int | None): the BOS token id (None when the vocabulary has none).
        stop_ids (tuple[int, ...]): generation stops at any of these.
        vocab_size (int): number of token ids, added tokens included.
        chat_template (str | None): the checkpoint's own chat template.
        bos_token (str | None), eos_token (str | None): their texts, as templates see them.
    """

    bos_id: int | None
    stop_ids: tuple[int, ...]
    vocab_size: int
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    # the template used when the checkpoint has none, and whether encode_chat then prepends BOS
    fallback_chat_template: str | None = None
    fallback_prepends_bos: bool = False

    def encode(self, text: str, bos: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_special(self, text: str) -> list[int]:
        """``text`` tokenized with special-token text (e.g. ``<|im_end|>``) read as those tokens
        and no automatic BOS: how a rendered chat template is tokenized."""
        raise NotImplementedError

    def special_tokens(self) -> dict[str, int]:
        """Text -> id of the special (and added) tokens that ``encode_special`` recognizes."""
        raise NotImplementedError

    def template_variables(self) -> dict[str, str]:
        """The special-token strings a chat template sees (``bos_token``, ``eos_token``...)."""
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return {k: v for k, v in names.items() if v is not None}

    @property
    def active_chat_template(self) -> str | None:
        """The checkpoint's template, else this class's fallback, else None."""
        return self.chat_template or self.fallback_chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        """``messages`` (dicts with ``role`` and ``content``) rendered with the chat template, as
        transformers' ``apply_chat_template(..., tokenize=False)`` renders them.

        Raises:
            ConfigError: there is no template, or it does not compile or render (a syntax error,
                ``raise_exception`` in the template, a missing variable).
        """
        template = self.active_chat_template
        if template is None:
            raise ConfigError(NO_TEMPLATE)
        compiled = _compile_template(template)
        try:
            return compiled.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **self.template_variables())
        except Exception as e:  # template code from the checkpoint: any failure is bad input
            raise ConfigError(f"the chat template failed to render: {type(e).__name__}: {e}"
                              ) from None

    def render_chat(self, prompt: str, system: str | None = None) -> str:
        """``prompt`` as one user turn (after ``system``, when given) in the chat template, with
        the generation prompt that opens the assistant's reply.

        Raises:
            ConfigError: no chat template, or the template fails (see ``apply_chat_template``).
        """
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return self.apply_chat_template(messages, add_generation_prompt=True)

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        """Token ids of ``render_chat(prompt, system)``, tokenized as transformers'
        ``apply_chat_template(tokenize=True)`` does (special tokens recognized, no automatic BOS;
        the SentencePiece fallback template's BOS is prepended as an id).

        Raises:
            ConfigError: as ``render_chat``.
        """
        messages = [{"role": "system", "content": system}] if system else []
        return self.encode_messages([*messages, {"role": "user", "content": prompt}])

    def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` (dicts with ``role`` and ``content``) rendered with the chat
        template and the generation prompt, tokenized as ``encode_chat`` tokenizes one turn.

        Raises:
            ConfigError: as ``apply_chat_template``.
        """
        return self.encode_rendered(self.apply_chat_template(messages,
                                                             add_generation_prompt=True))

    def encode_rendered(self, text: str, first: bool = True) -> list[int]:
        """Token ids of ``text``, (a piece of) a rendered chat template: special-token text
        read as those tokens; when ``first`` (the text opens the prompt), the SentencePiece
        fallback template's BOS is prepended as an id."""
        ids = self.encode_special(text)
        if (first and not self.chat_template and self.fallback_prepends_bos
                and self.bos_id is not None):
            ids = [self.bos_id] + ids
        return ids

    @property
    def chat_stop_ids(self) -> tuple[int, ...]:
        """``stop_ids`` plus the chat template's end-of-turn token (e.g. ``<|im_end|>`` for
        ChatML, ``<|eot_id|>`` for Llama 3, ``</s>`` for Llama 2/Mistral): the first special token
        whose text follows an assistant answer in the rendered template. Just ``stop_ids`` when
        there is no template or none is found."""
        if self.active_chat_template is None:
            return self.stop_ids
        try:
            turns = [{"role": "user", "content": "X"},
                     {"role": "assistant", "content": _ASSISTANT_MARK}]
            text = self.apply_chat_template(turns, add_generation_prompt=False)
        except ConfigError:
            return self.stop_ids
        at = text.rfind(_ASSISTANT_MARK)
        if at < 0:
            return self.stop_ids
        rest = text[at + len(_ASSISTANT_MARK):]
        found = [(rest.find(t), -len(t), i) for t, i in self.special_tokens().items()
                 if t and t in rest]
        if not found:
            return self.stop_ids
        return _dedupe((*self.stop_ids, min(found)[2]))


@functools.lru_cache(maxsize=8)
def _compile_template(template: str):
    """A Jinja template compiled as transformers compiles chat templates: sandboxed, immutable,
    ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` that does not escape HTML,
    ``raise_exception`` and ``strftime_now``; ``{% generation %}`` blocks render their body."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat templates need the jinja2 package (pip install jinja2)") from None

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks):
        renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template has a syntax error (line {e.lineno}): {e.message}"
                          ) from None


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece model; chat falls back to the ``[INST] ... [/INST]`` template of Llama 2 and
    Mistral (system message in ``<<SYS>>`` inside the first ``[INST]``)."""

    fallback_chat_template = LLAMA2_CHAT_TEMPLATE
    fallback_prepends_bos = True

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        bos, eos = self.sp.bos_id(), self.sp.eos_id()
        self.bos_id = bos if bos >= 0 else None
        self.stop_ids = (eos,) if eos >= 0 else ()
        self.vocab_size = self.sp.vocab_size()
        self.bos_token = self.sp.id_to_piece(bos) if bos >= 0 else None
        self.eos_token = self.sp.id_to_piece(eos) if eos >= 0 else None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos and self.bos_id is not None else []) + self.sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def special_tokens(self) -> dict[str, int]:
        out = {}
        if self.bos_token is not None:
            out[self.bos_token] = self.bos_id
        if self.eos_token is not None:
            out[self.eos_token] = self.stop_ids[0]
        return out

    def encode_special(self, text: str) -> list[int]:
        """BOS/EOS text (``<s>``, ``</s>``) becomes their ids; each piece between them is
        encoded by SentencePiece (with its dummy-prefix space, as transformers' Llama tokenizer
        does after a special token)."""
        specials = self.special_tokens()
        ids: list[int] = []
        start = pos = 0
        while pos < len(text):
            hit = next((t for t in specials if text.startswith(t, pos)), None)
            if hit is None:
                pos += 1
                continue
            if pos > start:
                ids += self.sp.encode(text[start:pos])
            ids.append(specials[hit])
            pos = start = pos + len(hit)
        if start < len(text):
            ids += self.sp.encode(text[start:])
        return ids


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens that follow the 128000 BPE ranks of Llama 3 / 3.1."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
             "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    rest = [f"<|reserved_special_token_{i}|>"
            for i in range(3, 3 + LLAMA3_NUM_SPECIAL - len(named))]
    return named + rest


class TiktokenTokenizer(Tokenizer):
    """Llama 3 tiktoken BPE with its special tokens; stops at ``<|end_of_text|>``/``<|eot_id|>``.
    Chat falls back to Llama 3's header template."""

    fallback_chat_template = LLAMA3_CHAT_TEMPLATE

    def __init__(self, path: str | Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(path))
        self.special = {tok: len(ranks) + i for i, tok in enumerate(llama3_special_tokens())}
        self.enc = tiktoken.Encoding(name=Path(path).name, pat_str=LLAMA3_PATTERN,
                                     mergeable_ranks=ranks, special_tokens=self.special)
        self.bos_id = self.special["<|begin_of_text|>"]
        self.stop_ids = (self.special["<|end_of_text|>"], self.special["<|eot_id|>"])
        self.vocab_size = len(ranks) + len(self.special)
        self.bos_token, self.eos_token = "<|begin_of_text|>", "<|end_of_text|>"

    def encode(self, text: str, bos: bool = True) -> list[int]:
        # special-token text in user input is encoded as plain text, never as control tokens
        return ([self.bos_id] if bos else []) + self.enc.encode(text, disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) < self.bos_id])

    def special_tokens(self) -> dict[str, int]:
        return dict(self.special)

    def encode_special(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` used as transformers uses it.

    ``encode(text, bos)`` is ``tok.encode(text, add_special_tokens=bos).ids``: the post-processor
    decides whether a BOS is added (``add_bos``), and special-token text in ``text`` is read as
    those tokens. ``decode`` skips special tokens.

    Args:
        tok (tokenizers.Tokenizer): the tokenizer.
        bos_token (str | None): BOS text (its id becomes ``bos_id``; must be in the vocabulary).
        eos_token (str | None): EOS text; its id joins ``stop_ids``.
        unk_token, pad_token (str | None): passed to chat templates when given.
        add_bos (bool | None): whether ``encode`` adds BOS; when given the post-processor is made
            to agree, when None it is read from the post-processor.
        add_eos (bool | None): the same for an EOS appended by ``encode``.
        stop_ids (Sequence[int]): EOS ids (the ``eos_token``'s id is added after them).
        chat_template (str | None): the checkpoint's Jinja chat template.
        model_max_length (int | None): context length, saved to ``tokenizer_config.json``.

    Raises:
        ConfigError: ``bos_token`` or ``eos_token`` is not in the vocabulary, or a stop id is
            outside it.
    """

    def __init__(self, tok, bos_token: str | None = None, eos_token: str | None = None, *,
                 unk_token: str | None = None, pad_token: str | None = None,
                 add_bos: bool | None = None, add_eos: bool | None = None,
                 stop_ids: Sequence[int] = (), chat_template: str | None = None,
                 model_max_length: int | None = None):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.bos_id = self._token_id(bos_token, "bos_token")
        eos_id = self._token_id(eos_token, "eos_token")
        ids = _dedupe([*stop_ids, *([eos_id] if eos_id is not None else [])])
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ConfigError(f"EOS id {bad[0]} is outside the vocabulary "
                              f"({self.vocab_size} tokens)")
        self.stop_ids = ids
        if self.eos_token is None and ids:
            self.eos_token = tok.id_to_token(ids[0])
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.add_bos, self.add_eos = self._agree_post_processor(add_bos, eos_id, add_eos)

    def _token_id(self, text: str | None, what: str) -> int | None:
        if text is None:
            return None
        i = self.tok.token_to_id(text)
        if i is None:
            raise ConfigError(f"{what} {text!r} is not in the tokenizer's vocabulary")
        return i

    def _agree_post_processor(self, add_bos: bool | None, eos_id: int | None,
                              add_eos: bool | None) -> tuple[bool, bool]:
        """What the post-processor adds; when ``add_bos``/``add_eos`` say otherwise, replace it
        with a template that adds exactly those."""
        with_special = self.tok.encode("a", add_special_tokens=True).ids
        plain = self.tok.encode("a", add_special_tokens=False).ids
        has_bos = (self.bos_id is not None and with_special[:1] == [self.bos_id]
                   and plain[:1] != [self.bos_id])
        has_eos = (eos_id is not None and with_special[-1:] == [eos_id]
                   and plain[-1:] != [eos_id])
        if self.bos_id is None and len(with_special) > len(plain) and with_special[0] not in plain:
            # a post-processor that prepends a token we were not told about: that is the BOS
            self.bos_id = with_special[0]
            self.bos_token = self.tok.id_to_token(self.bos_id)
            has_bos = True
        want_bos = has_bos if add_bos is None else bool(add_bos) and self.bos_id is not None
        want_eos = has_eos if add_eos is None else bool(add_eos) and eos_id is not None
        if (want_bos, want_eos) != (has_bos, has_eos):
            self.tok.post_processor = _template_processor(
                (self.bos_token, self.bos_id) if want_bos else None,
                (self.tok.id_to_token(eos_id), eos_id) if want_eos else None)
        return want_bos, want_eos

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        """The tokenizer of a ``tokenizer.json``, with ``tokenizer_config.json`` (special tokens,
        ``add_bos_token``, chat template), ``chat_template.jinja``, ``generation_config.json`` and
        ``config.json`` (EOS ids) read from the same directory when present.

        Stop ids are the union, in this order, of generation_config.json's ``eos_token_id`` (an
        int or a list), tokenizer_config.json's ``eos_token`` and config.json's ``eos_token_id``.

        Raises:
            ConfigError: the tokenizers package is missing, a file does not parse, or its special
                tokens are not in the vocabulary.
        """
        path = Path(path)
        _require_tokenizers("reading tokenizer.json")
        from tokenizers import Tokenizer as RustTokenizer

        try:
            tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exception for any bad file
            raise ConfigError(f"cannot parse tokenizer.json {path}: {e}") from None
        folder = path.parent
        tcfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        cfg = _read_json(folder / "config.json")

        def named(key: str, config_key: str) -> str | None:
            if key in tcfg:  # an explicit null means "none", not "look elsewhere"
                return _token_text(tcfg[key], f"tokenizer_config.json {key}")
            for source in (gen, cfg):
                i = source.get(config_key)
                if isinstance(i, int) and not isinstance(i, bool):
                    return tok.id_to_token(i)
            return None

        stop: list[int] = _id_list(gen.get("eos_token_id"), "generation_config.json eos_token_id")
        eos_token = _token_text(tcfg.get("eos_token"), "tokenizer_config.json eos_token")
        if eos_token is not None and tok.token_to_id(eos_token) is not None:
            stop.append(tok.token_to_id(eos_token))
        else:
            eos_token = None
        stop += _id_list(cfg.get("eos_token_id"), "config.json eos_token_id")
        template = _config_chat_template(tcfg, folder)
        flags = {}
        for key in ("add_bos_token", "add_eos_token"):
            value = tcfg.get(key)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"tokenizer_config.json {key} must be true or false, "
                                  f"not {value!r}")
            flags[key] = value
        max_len = tcfg.get("model_max_length")
        return cls(tok, _present(tok, named("bos_token", "bos_token_id")), eos_token,
                   unk_token=_present(tok, named("unk_token", "unk_token_id")),
                   pad_token=_present(tok, named("pad_token", "pad_token_id")),
                   add_bos=flags["add_bos_token"], add_eos=flags["add_eos_token"],
                   stop_ids=stop, chat_template=template,
                   model_max_length=max_len if isinstance(max_len, int) else None)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=bos).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_special(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self.tok.get_added_tokens_decoder().items()}

    def template_variables(self) -> dict[str, str]:
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {k: v for k, v in names.items() if v is not None}

    def save(self, out_dir: str | Path) -> list[Path]:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` to ``out_dir`` so that
        ``transformers.AutoTokenizer.from_pretrained(out_dir)`` gives the same ids, the same
        decoded text and the same ``apply_chat_template`` text. Files are written under temporary
        names and renamed when all are written: none is ever half-written.

        Args:
            out_dir (str | Path): directory (created when missing).

        Returns:
            list[Path]: the files written.

        Raises:
            ConfigError: ``out_dir`` cannot be created or written.
        """
        out = Path(out_dir)
        added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                          "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
                 for i, t in sorted(self.tok.get_added_tokens_decoder().items())}
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
        }
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        texts = {"tokenizer.json": self.tok.to_str(pretty=True),
                 "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n"}
        return _write_files(out, texts)


def _require_tokenizers(what: str) -> None:
    """Raises ConfigError (not ImportError) when the tokenizers package is missing."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs the tokenizers package (pip install tokenizers)"
                          ) from None


def _write_files(out: Path, texts: dict[str, str]) -> list[Path]:
    """Write every file under a temporary name, then rename them all; clean up on failure."""
    written: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            tmp = out / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            written.append(tmp)
        for name in texts:
            os.replace(out / f".{name}.tmp", out / name)
    except OSError as e:
        for tmp in written:
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write the tokenizer to {out}: {e}") from None
    return [out / name for name in texts]


def _template_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    """A post-processor adding ``bos`` before and ``eos`` after each sequence (either may be
    None)."""
    from tokenizers import processors

    pre = [f"{bos[0]}:0"] if bos else []
    post = [f"{eos[0]}:0"] if eos else []
    single = [*pre, "$A:0", *post]
    pair = [*single, *(s.replace(":0", ":1") for s in pre), "$B:1",
            *(s.replace(":0", ":1") for s in post)]
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[t for t in (bos, eos) if t])


def _read_json(path: Path) -> dict:
    """A JSON object file, or {} when the file is absent.

    Raises:
        ConfigError: the file exists but is not a JSON object.
    """
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot parse {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def _token_text(value: Any, what: str) -> str | None:
    """A special token given as a string or as an AddedToken dict ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ConfigError(f"{what} must be a string or a {{\"content\": ...}} object, not {value!r}")


def _id_list(value: Any, what: str) -> list[int]:
    """An int or a list of ints (None: empty)."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{what} must be an integer or a list of integers, not {value!r}")
    return list(values)


def _present(tok, text: str | None) -> str | None:
    return text if text is not None and tok.token_to_id(text) is not None else None


def _config_chat_template(tcfg: dict, folder: Path) -> str | None:
    """The chat template of a Hugging Face directory, found as transformers finds it: a
    ``chat_template.jinja`` file (which takes priority), else tokenizer_config.json's
    ``chat_template`` (a string, or a list of {name, template}: the "default" one), else None.

    Raises:
        ConfigError: the template file is unreadable, or the config entry is not a template.
    """
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {jinja_file}: {e}") from None
    template = tcfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"tokenizer_config.json chat_template in {folder} must be a string or "
                          "a list of {name, template}")
    return template or None


# ---------------------------------------------------------------------------------------------
# GGUF: the tokenizer from the file's own metadata (llama.cpp's key names)

# tokenizer.ggml.token_type values
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# GPT-2's split regex (llama.cpp's, plus the final \s+ that only names its leftover whitespace)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre values grouped by the pre-tokenization llama.cpp applies to them
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone",
                    "minerva-7b")
GPT2_ONLY = ("gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe")
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3")  # also ignores merges, adds BOS
LLAMA3_REGEX_PRE = ("dbrx", "smaug-bpe")
QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez")  # llama.cpp's QWEN2 type
LLAMA_CPP_DEFAULT = ("default",)  # and a file without tokenizer.ggml.pre
SUPPORTED_PRE = (DIGITS_THEN_GPT2 + GPT2_ONLY + LLAMA3_PRE + LLAMA3_REGEX_PRE + QWEN2_PRE
                 + LLAMA_CPP_DEFAULT)
# Qwen2's split (its tokenizer.json; llama.cpp's QWEN2 pre-tokenizer): Llama 3's, but each digit
# alone. No NFC normalization (tokenizer.json has one): llama.cpp and transformers' GGUF
# tokenizer apply none
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _bpe_pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer reproducing llama.cpp's split for ``tokenizer.ggml.pre``.

    llama.cpp applies a list of regexes in turn, each splitting every piece the previous ones
    left (matches and the text between them both become pieces), then byte-level BPE.

    Raises:
        ConfigError: a pre-tokenizer this module does not implement.
    """
    from tokenizers import Regex, pre_tokenizers

    def split(pattern: str):
        return pre_tokenizers.Split(Regex(pattern), behavior="isolated")

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in DIGITS_THEN_GPT2:  # \p{N} (each digit alone), then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                 use_regex=True)])
    if pre in GPT2_ONLY:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in LLAMA3_PRE + LLAMA3_REGEX_PRE:
        return pre_tokenizers.Sequence([split(LLAMA3_PATTERN), byte_level])
    if pre in QWEN2_PRE:
        return pre_tokenizers.Sequence([split(QWEN2_PATTERN), byte_level])
    if pre in LLAMA_CPP_DEFAULT:  # llama.cpp's default BPE pre-tokenization
        return pre_tokenizers.Sequence([split(r"[\p{P}\$\+<=>\^~\|]+"), split(GPT2_PATTERN),
                                        split(r"\p{N}+"), split(r"[0-9][0-9][0-9]"), byte_level])
    raise ConfigError(f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                      f"supported: {', '.join(SUPPORTED_PRE)}")


class _GGUFFields:
    """Typed access to a GGUF reader's metadata fields."""

    def __init__(self, reader, where: str):
        self.reader, self.where = reader, where

    def get(self, name: str, default: Any = None) -> Any:
        field = self.reader.fields.get(name)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:  # gguf raises whatever numpy does on a corrupt field
            raise ConfigError(f"GGUF {self.where}: field {name} is unreadable ({e})") from None

    def typed(self, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.get(name, default)
        if value is not default and not isinstance(value, kind):
            raise ConfigError(f"GGUF {self.where}: field {name} has the wrong type "
                              f"({type(value).__name__})")
        return value

    def token_id(self, name: str, n: int) -> int | None:
        value = self.typed(name, int)
        if value is not None and not 0 <= value < n:
            raise ConfigError(f"GGUF {self.where}: {name} {value} is outside the vocabulary "
                              f"({n} tokens)")
        return value


def gguf_tokenizer(path_or_reader) -> HFTokenizer:
    """The tokenizer described by a GGUF file's metadata, so the file runs without any other.

    ``tokenizer.ggml.model`` ``gpt2`` is byte-level BPE (vocabulary, merges, and the
    pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre``); ``llama`` is SentencePiece BPE
    (merges derived from the scores, byte fallback, ``▁`` for spaces). Control tokens become
    special added tokens, user-defined ones plain added tokens. Stop ids are the EOS, EOT and EOM
    ids; the chat template is ``tokenizer.chat_template``.

    Args:
        path_or_reader (str | Path | gguf.GGUFReader): the file, or a reader already open on it.

    Returns:
        HFTokenizer: the tokenizer.

    Raises:
        ConfigError: unreadable or truncated file, no tokenizer in it, an unknown tokenizer
            model, an unsupported pre-tokenizer, or inconsistent tokenizer fields.
    """
    _require_tokenizers("the tokenizer of a GGUF file")
    if isinstance(path_or_reader, (str, Path)):

        reader, where = open_gguf(path_or_reader), str(path_or_reader)
    else:
        reader, where = path_or_reader, str(getattr(path_or_reader, "path", "reader"))
    f = _GGUFFields(reader, where)
    model = f.typed("tokenizer.ggml.model", str)
    tokens = f.typed("tokenizer.ggml.tokens", list)
    if model is None or not tokens:
        raise ConfigError(f"GGUF {where} has no tokenizer (tokenizer.ggml.model and "
                          "tokenizer.ggml.tokens are required)")
    if not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"GGUF {where}: tokenizer.ggml.tokens must be strings")
    n = len(tokens)
    types = f.typed("tokenizer.ggml.token_type", list) or [TOKEN_NORMAL] * n
    if len(types) != n:
        raise ConfigError(f"GGUF {where}: {len(types)} token types for {n} tokens")
    tokens = _unique_tokens(tokens)
    if model == "gpt2":
        tok, pre = _gguf_bpe(f, tokens, types, where)
        add_bos_default = pre in LLAMA3_PRE
    elif model == "llama":
        tok = _gguf_sentencepiece(f, tokens, types, where)
        add_bos_default = True
    else:
        raise ConfigError(f"GGUF {where}: tokenizer model {model!r} (tokenizer.ggml.model) is "
                          "not supported; supported: 'gpt2' (byte-level BPE), 'llama' "
                          "(SentencePiece)")
    _add_tokens(tok, [t for t, k in zip(tokens, types) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)],
                [t for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])

    # llama.cpp's defaults for a SentencePiece vocabulary whose file names no special ids
    defaults = {"bos": 1, "eos": 2, "unknown": 0} if model == "llama" else {}

    def token_id(name: str) -> int | None:
        i = f.token_id(f"tokenizer.ggml.{name}_token_id", n)
        if i is None and defaults.get(name, n) < n:
            i = defaults[name]
        return i

    def text(name: str) -> str | None:
        i = token_id(name)
        return None if i is None else tokens[i]

    stops = [token_id(k) for k in ("eos", "eot", "eom")]
    add_bos = f.typed("tokenizer.ggml.add_bos_token", bool, add_bos_default)
    add_eos = f.typed("tokenizer.ggml.add_eos_token", bool, False)
    bos = text("bos")
    arch = f.typed("general.architecture", str)
    ctx = f.typed(f"{arch}.context_length", int) if arch else None
    return HFTokenizer(tok, bos, text("eos"), unk_token=text("unknown"),
                       pad_token=text("padding"), add_bos=add_bos and bos is not None,
                       add_eos=add_eos, stop_ids=[i for i in stops if i is not None],
                       chat_template=f.typed("tokenizer.chat_template", str),
                       model_max_length=ctx)


def _add_tokens(tok, special: list[str], user: list[str]) -> None:
    """Add ``special`` as special tokens and ``user`` as plain added tokens (both matched whole
    in the raw text, as llama.cpp matches them)."""
    from tokenizers import AddedToken

    if special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _unique_tokens(tokens: list[str]) -> list[str]:
    """Empty or repeated token texts renamed (as llama.cpp names empty ones) so that every id
    keeps its own vocabulary entry."""
    seen: set[str] = set()
    out = []
    for i, t in enumerate(tokens):
        if not t:
            t = f"[EMPTY_{i}]"
        if t in seen:
            t = f"[DUPLICATE_{i}]"
        seen.add(t)
        out.append(t)
    return out


def _gguf_bpe(f: _GGUFFields, tokens: list[str], types: list[int], where: str):
    """Byte-level BPE (``tokenizer.ggml.model`` gpt2): the tokens are already in GPT-2's
    byte-to-unicode spelling; merges are ``'a b'`` strings."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models

    merges = f.typed("tokenizer.ggml.merges", list)
    if not merges:
        raise ConfigError(f"GGUF {where}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    pairs = []
    for m in merges:
        at = m.find(" ", 1) if isinstance(m, str) else -1
        if at < 0:
            raise ConfigError(f"GGUF {where}: merge {m!r} is not two tokens separated by a space")
        pairs.append((m[:at], m[at + 1:]))
    pre = f.typed("tokenizer.ggml.pre", str, "default")
    pre_tokenizer = _bpe_pre_tokenizer(pre)
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        model = models.BPE(vocab, pairs, ignore_merges=pre in LLAMA3_PRE)
    except Exception as e:  # e.g. a merge of tokens missing from the vocabulary
        raise ConfigError(f"GGUF {where}: inconsistent BPE vocabulary and merges ({e})") from None
    tok = RustTokenizer(model)
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok, pre


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float],
                         types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece BPE's scores.

    SentencePiece merges, at each step, the adjacent pair whose concatenation is the
    highest-scoring piece. As ranked merges: every split of a normal piece into two normal pieces
    is a merge, ranked by the merged piece's score (higher first), ties by the merged piece's id
    then the split position (a piece's two splits can never compete at the same place, so any
    fixed tie order gives SentencePiece's result).
    """
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == TOKEN_NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _gguf_sentencepiece(f: _GGUFFields, tokens: list[str], types: list[int], where: str):
    """SentencePiece BPE (``tokenizer.ggml.model`` llama) as a ``tokenizers`` BPE: merges from the
    scores, byte fallback for characters outside the vocabulary, spaces as ``▁`` with a leading
    one added (``tokenizer.ggml.add_space_prefix``, default true)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers

    n = len(tokens)
    scores = f.typed("tokenizer.ggml.scores", list)
    if scores is None or len(scores) != n:
        raise ConfigError(f"GGUF {where}: a llama tokenizer needs one score per token "
                          "(tokenizer.ggml.scores)")
    unk = f.token_id("tokenizer.ggml.unknown_token_id", n)
    if unk is None:
        unk = next((i for i, k in enumerate(types) if k == TOKEN_UNKNOWN), None)
    if unk is None and n and tokens[0] == "<unk>":  # llama.cpp's default unknown id 0
        unk = 0
    merges = sentencepiece_merges(tokens, scores, types)
    model = models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                       unk_token=None if unk is None else tokens[unk], byte_fallback=True,
                       fuse_unk=True)
    tok = RustTokenizer(model)
    prefix = f.typed("tokenizer.ggml.add_space_prefix", bool, True)
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix
                      else replace)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


# ---------------------------------------------------------------------------------------------


def _is_tiktoken_file(path: Path) -> bool:
    with open(path, "rb") as f:
        line = f.readline(4096).strip()
    parts = line.split()
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except ValueError:
        return False
    return True


def _looks_like_json(path: Path) -> bool:
    """Whether the file starts (after whitespace) with '{': a tokenizer.json under another name
    (SentencePiece models start with a protobuf tag, tiktoken files with base64)."""
    try:
        with open(path, "rb") as f:
            return f.read(64).lstrip().startswith(b"{")
    except OSError:
        return False


# byte sizes of GGUF's scalar value types (uint8, int8, uint16, int16, uint32, int32, float32,
# bool, -, -, uint64, int64, float64); 8 is a string, 9 an array
def has_tokenizer(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding one of ``TOKENIZER_FILES``, or a GGUF file whose
    metadata holds a tokenizer (``tokenizer.ggml.tokens``; an unreadable GGUF counts as having
    one, so that loading it reports what is wrong)."""

    path = Path(path)
    if path.is_dir():
        return any((path / name).is_file() for name in TOKENIZER_FILES)
    if not is_gguf(path):
        return False
    try:
        return "tokenizer.ggml.tokens" in open_gguf(path).fields  # the model's reader, kept
    except ConfigError:
        return True


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a file or a checkpoint directory.

    A directory gives its ``tokenizer.json``, else ``tokenizer.model``, else
    ``original/tokenizer.model``. A file is read by content: GGUF (magic ``b'GGUF'``; the
    tokenizer in its metadata), Hugging Face ``tokenizer.json`` (a ``*.json`` name, or JSON
    content under any name), a tiktoken BPE file or a SentencePiece model. SentencePiece and
    tiktoken tokenizers take the chat template of a ``chat_template.jinja`` or
    ``tokenizer_config.json`` beside them (or above ``original/``), when there is one.

    Raises:
        ConfigError: no tokenizer file, or one that cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
        if not found:
            raise ConfigError(f"no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)})")
        path = found[0]
    if not path.is_file():
        raise ConfigError(f"tokenizer file not found: {path}")

    if is_gguf(path):
        return gguf_tokenizer(path)
    if path.suffix.lower() == ".gguf":
        raise ConfigError(f"{path} is not a GGUF file (no GGUF magic)")
    if path.suffix.lower() == ".json" or _looks_like_json(path):
        return HFTokenizer.from_file(path)
    try:
        tok: Tokenizer = (TiktokenTokenizer(path) if _is_tiktoken_file(path)
                          else SentencePieceTokenizer(path))
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"cannot read tokenizer {path}: {e}") from None
    folder = path.parent.parent if path.parent.name == "original" else path.parent
    tok.chat_template = _config_chat_template(_read_json(folder / "tokenizer_config.json"),
                                              folder)
    return tok
