"""Write a weight-only int8 or int4 checkpoint (the format: ``quantized.py``).

    python quantize.py --checkpoint CKPT --mode int8 [--out DIR]
    python quantize.py --checkpoint CKPT --mode int4 --groupsize 32|64|128|256 [--out DIR]

``CKPT`` is anything ``generate.py --checkpoint`` takes: a Hugging Face directory, a GGUF file, a
converted directory, a short name, or ``random:NAME`` (random weights at a named config's shapes,
for benchmarks). The output directory (default: in the current directory, ``<name>-int8`` or
``<name>-int4-g<G>``, never beside the source; ``checkpoints/random-<NAME>-...`` for random
weights) is a converted
checkpoint (``model_args.json`` + ``model.safetensors``) plus ``quantization.json``, which
records the mode, the group size and the quantized layers, and the source's tokenizer.
Everything is written under a temporary name and renamed at the end: a failed run leaves
nothing behind. Ctrl-C before the rename ends the run with exit status 130, one ``error:``
line and nothing written; once every file is written the run completes and Ctrl-C is
ignored. What is quantized and how it runs: ``quantized.py``.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from rocketkv.cli.common import DTYPES
from rocketkv.cli.quantize_flags import build_parser
from rocketkv.formats.checkpoint import (
    NATIVE_CONFIG,
    NATIVE_WEIGHTS,
    RANDOM_PREFIX,
    check_new_directory,
    checkpoint_args,
    read_checkpoint,
    resolve_checkpoint,
    write_directory,
)
from rocketkv.formats.gguf_reader import is_gguf
from rocketkv.formats.tokenizer import TOKENIZER_FILES, HFTokenizer, has_tokenizer, load_tokenizer
from rocketkv.model import ConfigError
from rocketkv.quantized import (
    FORMAT_VERSION,
    QUANT_CONFIG,
    check_quantizable,
    quantize_tensor,
    quantized_linears,
)


def default_out(checkpoint: str, mode: str, groupsize: int | None) -> Path:
    """``<source>-int8`` / ``<source>-int4-g<G>`` in the current directory (the source's stem
    for a file): never beside the source, whose folder may be read-only or shared;
    ``checkpoints/random-<NAME>-...`` for ``random:NAME``."""
    tag = mode if mode == "int8" else f"{mode}-g{groupsize}"
    if checkpoint.startswith(RANDOM_PREFIX):
        return Path("checkpoints") / f"random-{checkpoint[len(RANDOM_PREFIX):]}-{tag}"
    src = Path(checkpoint)
    return Path(f"{src.stem if src.is_file() else src.name}-{tag}")


def _save_tokenizer(source: str, out: Path) -> list[str]:
    """Copy the source's tokenizer into ``out`` (files named as ``load_tokenizer`` reads them);
    returns the names written (none for a source without a tokenizer)."""
    if source.startswith(RANDOM_PREFIX) or not has_tokenizer(source):
        return []
    tok = load_tokenizer(source)
    if isinstance(tok, HFTokenizer):  # tokenizer.json, a GGUF's metadata
        written = [p.name for p in tok.save(out)]
        generation = {"bos_token_id": tok.bos_id, "eos_token_id": list(tok.stop_ids)}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
        return written + ["generation_config.json"]
    src = Path(source)  # a SentencePiece or tiktoken tokenizer.model in a directory
    model_file = next(src / n for n in TOKENIZER_FILES if (src / n).is_file())
    shutil.copyfile(model_file, out / "tokenizer.model")
    written = ["tokenizer.model"]
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            written.append(name)
    return written


def quantize_checkpoint(checkpoint: str, mode: str, groupsize: int | None, out: str | Path,
                        classifier: str = "int8", dtype: torch.dtype | None = None,
                        device: str = "cpu", progress: bool = True,
                        before_commit: Callable[[], None] | None = None) -> Path:
    """Write the quantized checkpoint directory ``out`` for ``checkpoint`` (module docstring).

    ``dtype``: the dtype of the tensors kept in float (embedding, norms, a float classifier):
    default as stored, except bfloat16 for a GGUF's dequantized tensors and random weights.
    ``device``: where the quantization arithmetic runs. ``before_commit``: called once every
    file is written, just before the directory is renamed into place (the command line stops
    taking Ctrl-C there); an exception it raises removes the files, as any failure does.

    Raises:
        ConfigError: see ``check_quantizable``; an already quantized source; ``out`` that
            exists and is not an empty directory; ``device`` cuda without CUDA; unreadable
            sources (``checkpoint.read_checkpoint``).
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine")
    out = check_new_directory(out)
    source = resolve_checkpoint(checkpoint)
    if Path(source).is_dir() and (Path(source) / QUANT_CONFIG).is_file():
        raise ConfigError(f"{checkpoint} is already quantized ({QUANT_CONFIG}); quantize its "
                          "float source instead")
    check_quantizable(checkpoint_args(source), mode, groupsize, classifier)  # before reading
    if dtype is None and not source.startswith(RANDOM_PREFIX) and is_gguf(source):
        # a GGUF's float tensors are dequantized blocks: float32 would store the embedding at
        # 2-8x its file's size (an int4 SmolLM2 was 2.2x its Q4_1 source); bfloat16's rounding
        # (2^-9 relative) is far below a 4-bit block's step and about an 8-bit block's
        dtype = torch.bfloat16
    args, sd, _ = read_checkpoint(source, dtype=dtype, random_dtype=dtype or torch.bfloat16)

    names = quantized_linears(args, mode, classifier)
    if args.tie_word_embeddings and "output" in names:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    stored: dict[str, Tensor] = {}
    with tqdm(names.items(), desc=f"quantize {mode}", unit="layer", file=PROGRESS_STREAM,
              disable=not progress) as layers:
        for name, m in layers:
            w = sd.pop(f"{name}.weight").to(device)
            for suffix, t in quantize_tensor(w, m, groupsize).items():
                stored[f"{name}.{suffix}"] = t.cpu()
    if args.tie_word_embeddings:
        sd.pop("output.weight", None)
    stored.update({n: t.contiguous() for n, t in sd.items()})
    config = {"format_version": FORMAT_VERSION, "mode": mode, "groupsize": groupsize,
              "classifier": names.get("output", "float"),
              "embedding": "float", "linears": names, "source": checkpoint,
              "float_dtype": str(sd["tok_embeddings.weight"].dtype).removeprefix("torch."),
              "torch_version": torch.__version__}

    def fill(tmp: Path) -> None:
        save_file(stored, tmp / NATIVE_WEIGHTS, metadata={"format": "pt"})
        (tmp / NATIVE_CONFIG).write_text(json.dumps(args.to_dict(), indent=2))
        (tmp / QUANT_CONFIG).write_text(json.dumps(config, indent=2))
        _save_tokenizer(source, tmp)
        if before_commit is not None:
            before_commit()

    return write_directory(out, fill)


class _ProgressStream:
    """The progress bar's stderr, remembering whether its last write left a line open (a
    frame drawn after ``\\r``, no newline yet). tqdm ends its line when it closes, but not
    always after Ctrl-C: interrupted between drawing a frame and recording that it drew one
    (``tqdm.update``, the constructor), it closes without a newline, and the error line would
    follow the frame on the same line (``run`` ends it)."""

    line_open = False

    def write(self, text: str) -> int:
        if text:
            self.line_open = not text.endswith("\n")
        return sys.stderr.write(text)

    def __getattr__(self, name: str):  # flush, encoding, isatty...: stderr's, as it is now
        return getattr(sys.stderr, name)


PROGRESS_STREAM = _ProgressStream()


def main(argv=None) -> int:
    """``quantize.py`` in this process: the exit status (argparse's own usage errors still
    exit; a ``--mode``/``--groupsize`` mismatch is returned as 2, after its one line)."""
    return run(build_parser(check_groups=False).parse_args(argv))


def _ignore_interrupts() -> None:
    """Ctrl-C ignored from here to the process's exit (main thread only: elsewhere Python
    delivers no signals). A Ctrl-C already pending raises KeyboardInterrupt here, before
    anything is committed. The ignore outlives the interpreter's shutdown, which restores
    SIGINT's default action (death by the signal, nothing said) only for signals that had a
    Python handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def run(a, *, restore_interrupts: bool = True) -> int:
    """Quantize as the parsed arguments ``a`` say; the exit status: 0 once the directory is
    in place, 2 for bad input, 130 after Ctrl-C with nothing written. From the moment the
    files are complete (just before the rename) Ctrl-C is ignored, so a Ctrl-C late in the
    run cannot end it with status 130 beside a complete folder, nor after the rename say that
    nothing was written. ``restore_interrupts``: SIGINT's handler as it was on return (for
    callers in a process that goes on); ``entry`` keeps Ctrl-C ignored until the exit."""
    previous = signal.getsignal(signal.SIGINT)
    PROGRESS_STREAM.line_open = False
    try:
        out = a.out or default_out(a.checkpoint, a.mode, a.groupsize)
        path = quantize_checkpoint(a.checkpoint, a.mode, a.groupsize, out,
                                   classifier=a.classifier,
                                   dtype=DTYPES[a.dtype] if a.dtype else None, device=a.device,
                                   progress=not a.no_progress, before_commit=_ignore_interrupts)
        print(f"wrote {path}")
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the rename: write_directory removed its temporary copy
        if not restore_interrupts:
            try:
                _ignore_interrupts()  # a second Ctrl-C on the way out changes nothing
            except KeyboardInterrupt:
                pass
        if PROGRESS_STREAM.line_open:  # the bar's frame: the error line starts its own
            print(file=sys.stderr)
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    finally:
        if restore_interrupts and previous is not None \
                and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)


def entry(args=None) -> None:
    """``python quantize.py`` and the ``rocketkv quantize`` console command."""
    if args is None:
        args = build_parser().parse_args()
    sys.exit(run(args, restore_interrupts=False))
