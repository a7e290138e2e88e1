"""The GGUF file reader that checkpoints (``checkpoint.py``) and tokenizers (``tokenizer.py``)
share: the magic check, a cached ``gguf.GGUFReader`` and metadata fields.

The ``gguf`` package is imported only when a GGUF file is opened.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from model import ConfigError

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic (not judged by its name)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def open_gguf(path: str | Path):
    """``gguf.GGUFReader`` over ``path`` (memory-mapped; tensors are read when used).

    Parsing the metadata of a 49K-token vocabulary takes seconds, so the last two readers are
    kept (keyed by path, size and modification time) for the model and the tokenizer to share.

    Raises:
        ConfigError: the ``gguf`` package is missing, or the file is unreadable, not GGUF,
            truncated or corrupt.
    """
    try:
        import gguf
    except ImportError:
        raise ConfigError("loading a GGUF checkpoint needs the gguf package "
                          "(pip install -r requirements.txt)") from None
    path = Path(path).resolve()
    if not is_gguf(path):
        raise ConfigError(f"{path} is not a GGUF file (no GGUF magic)")
    stat = path.stat()
    return _gguf_reader(gguf.GGUFReader, path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _gguf_reader(reader_cls, path: Path, size: int, mtime_ns: int):
    try:
        return reader_cls(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ConfigError(f"cannot read GGUF file {path}: truncated or corrupt ({e})") from None


MISSING = object()  # gguf_field: no default given


def gguf_field(reader, name: str, default: Any = MISSING) -> Any:
    """The value of metadata field ``name`` (a Python scalar, string or list).

    Raises:
        ConfigError: the field is absent and no default is given.
    """
    field = reader.fields.get(name)
    if field is None:
        if default is MISSING:
            raise ConfigError(f"GGUF file lacks the metadata field {name!r}")
        return default
    return field.contents()
