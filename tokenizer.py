"""Tokenizers: SentencePiece (Llama 2, Mistral, LongChat, tinyllamas) and Llama 3 tiktoken.

The kind is chosen from the file's content, not from the directory name: a tiktoken BPE file is
text lines ``<base64 token> <rank>``; anything else is read as a SentencePiece model.
"""

from __future__ import annotations

import base64
from pathlib import Path

from model import ConfigError

TOKENIZER_FILES = ("tokenizer.model", "original/tokenizer.model")


class Tokenizer:
    """Common interface. ``encode`` prepends BOS; ``decode`` drops special tokens."""

    bos_id: int
    stop_ids: tuple[int, ...]  # generation stops at any of these
    vocab_size: int

    def encode(self, text: str, bos: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def encode_chat(self, prompt: str) -> list[int]:
        """``prompt`` as one user turn in the model's instruct template, ready for the reply."""
        raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece model; chat uses the ``[INST] ... [/INST]`` template of Llama 2/Mistral."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.bos_id = self.sp.bos_id()
        self.stop_ids = (self.sp.eos_id(),)
        self.vocab_size = self.sp.vocab_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos else []) + self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def encode_chat(self, prompt: str) -> list[int]:
        return self.encode(f"[INST] {prompt.strip()} [/INST]")


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
    """Llama 3 tiktoken BPE with its special tokens; stops at ``<|end_of_text|>``/``<|eot_id|>``."""

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

    def encode(self, text: str, bos: bool = True) -> list[int]:
        # special-token text in user input is encoded as plain text, never as control tokens
        return ([self.bos_id] if bos else []) + self.enc.encode(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) < self.bos_id])

    def encode_chat(self, prompt: str) -> list[int]:
        s = self.special
        return ([self.bos_id, s["<|start_header_id|>"]] + self.encode("user", bos=False)
                + [s["<|end_header_id|>"]] + self.encode("\n\n" + prompt.strip(), bos=False)
                + [s["<|eot_id|>"], s["<|start_header_id|>"]]
                + self.encode("assistant", bos=False) + [s["<|end_header_id|>"]]
                + self.encode("\n\n", bos=False))


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


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Tokenizer from a file, or from a checkpoint directory holding ``tokenizer.model`` or
    ``original/tokenizer.model``.

    Raises:
        ConfigError: no tokenizer file, or one that neither library can read.
    """
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
        if not found:
            raise ConfigError(f"no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)})")
        path = found[0]
    if not path.is_file():
        raise ConfigError(f"tokenizer file not found: {path}")
    try:
        if _is_tiktoken_file(path):
            return TiktokenTokenizer(path)
        return SentencePieceTokenizer(path)
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"cannot read tokenizer {path}: {e}") from None
