"""The GGUF file reader that checkpoints (``checkpoint.py``) and tokenizers (``tokenizer.py``)
share: the magic check, a cached ``gguf.GGUFReader`` and metadata fields.

The ``gguf`` package is imported only when a GGUF file is opened.
"""

from __future__ import annotations

import functools
import mmap
from pathlib import Path
from typing import Any

from rocketkv.model import ConfigError

GGUF_MAGIC = b"GGUF"


class _Truncated(Exception):
    """The file ends before what its header describes (``_reader_class``' reader raises it;
    ``_gguf_reader`` words it as a ConfigError)."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


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


@functools.cache
def _reader_class():
    """``gguf.GGUFReader`` parsing from a plain ndarray view of its memory map.

    The reader slices its buffer once per value it parses (two slices per token of a
    tokenizer's vocabulary); slicing a ``numpy.memmap`` runs Python bookkeeping each time
    (``__array_finalize__``), which made parsing SmolLM2's 49K-token file take 4.8 s here. A
    plain view of the same mapping parses it in 1.9 s; the file stays memory-mapped and the
    fields and tensors are the same (tests/test_gguf.py compares them).

    A file cut short in its tensor data (an interrupted download) raises ``_Truncated``,
    checked against the extent the tensor table gives before any tensor is viewed; one cut
    short in its header fails as numpy fails on a short slice, and ``_checked_reader_class``
    then tells why.
    """
    import gguf
    import numpy as np

    class PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _build_tensors(self, start_offs, fields):
            end = start_offs
            for field in fields:
                _, _, _, dims, raw_dtype, offset_tensor = field.parts
                kind = gguf.GGMLQuantizationType(raw_dtype[0])
                block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
                n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block_size
                end = max(end, start_offs + int(offset_tensor[0]) + n_bytes)
            if end > len(self._data):
                raise _Truncated(f"truncated at byte {len(self._data) - start_offs:,} of the "
                                 f"tensor data's {end - start_offs:,}")
            super()._build_tensors(start_offs, fields)

    return PlainViewReader


@functools.cache
def _checked_reader_class():
    """``_reader_class``' reader that raises ``_Truncated`` for a read past the end of the
    file (where ``gguf`` gets a short slice, and fails in numpy's words: "When changing to a
    larger dtype..."). Bounds-checking every read costs about 12% of a parse, so only a parse
    that failed is repeated with it (``_gguf_reader``)."""
    import numpy as np

    class CheckedReader(_reader_class()):
        def _get(self, offset, dtype, count=1, override_order=None):
            if offset + np.dtype(dtype).itemsize * int(count) > len(self._data):
                raise _Truncated(f"its header runs past the end of the file at byte "
                                 f"{len(self._data):,}")
            return super()._get(offset, dtype, count, override_order)

    return CheckedReader


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped; tensors are read when used; parsed
    from a plain view of the mapping, ``_reader_class``).

    Parsing the metadata of a 49K-token vocabulary still takes about 2 s, so the last two
    readers are kept (keyed by path, size and modification time) for the model and the
    tokenizer to share, until ``forget_readers`` (``checkpoint.load_model`` calls it once the
    weights are built).

    Raises:
        ConfigError: the ``gguf`` package is missing, or the file is unreadable, not GGUF,
            truncated (``PATH: not a complete GGUF file (...; re-download it)``, naming the
            byte where it ends) or corrupt.
    """
    try:
        reader_cls = _reader_class()
    except ImportError:
        raise ConfigError("loading a GGUF checkpoint needs the gguf package "
                          "(pip install -r requirements.txt)") from None
    path = Path(path).resolve()
    if not is_gguf(path):
        raise ConfigError(f"{path} is not a GGUF file (no GGUF magic)")
    stat = path.stat()
    return _gguf_reader(reader_cls, path, stat.st_size, stat.st_mtime_ns)


def _incomplete(path: Path, where: str) -> str:
    """The one line for a file shorter than its header says: ``PATH: not a complete GGUF file
    (truncated or corrupt: WHERE; re-download it)`` (corrupt too: a damaged size or offset
    reads as a file cut short)."""
    return f"{path}: not a complete GGUF file (truncated or corrupt: {where}; re-download it)"


@functools.lru_cache(maxsize=2)
def _gguf_reader(reader_cls, path: Path, size: int, mtime_ns: int):
    try:
        return reader_cls(path)
    except _Truncated as e:
        raise ConfigError(_incomplete(path, e.where)) from None
    except (ValueError, IndexError, KeyError, OSError) as e:
        failure = e
    try:  # what failed: a read past the end of the file, or (still) something else
        _checked_reader_class()(path)
    except _Truncated as e:
        raise ConfigError(_incomplete(path, e.where)) from None
    except (ValueError, IndexError, KeyError, OSError):
        pass
    raise ConfigError(f"cannot read GGUF file {path}: truncated or corrupt ({failure})"
                      ) from None


def forget_readers() -> None:
    """Drop the readers ``open_gguf`` keeps: a parsed reader holds every metadata field as
    numpy arrays, about 220 MiB of this process's memory for Qwen2.5-0.5B's 151,936-token
    vocabulary and merges (measured: RSS 446 against 219 MiB after ``import torch``), for as
    long as the run. Once the weights and the tokenizer are built nothing needs them; a later
    ``open_gguf`` parses the file again (seconds)."""
    _gguf_reader.cache_clear()


def release_pages(reader) -> bool:
    """Drop the pages of ``reader``'s file mapping from this process's resident set
    (``madvise(MADV_DONTNEED)`` on the read-only shared mapping), once the weights are built
    from it: the mapping stays valid, the pages stay in the kernel's page cache, and a later
    read (the tokenizer's fields, a tensor still viewing the file) faults them back in from
    there. Without it every page the load touched counts in the process's peak resident set
    until exit (the whole file: 469 MiB for Qwen2.5-Coder-0.5B Q4_K_M). Returns whether it
    could (False where numpy or the platform offers no such call)."""
    base = getattr(reader, "data", None)
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is None or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    try:
        base.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):
        return False
    return True


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
