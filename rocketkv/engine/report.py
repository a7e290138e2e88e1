"""What a ``generate`` run reports: its result (``GenerateResult``, a dataclass built by
``result_record``: the figures of ``--json``, read as attributes; ``to_dict()`` is the JSON
record), the text report of it (``format_report``: what ``generate.py`` prints on stderr),
and the command line's live output: the prefill's progress (``prefill_bar``, ``PlainProgress``)
and the streamed text (``TextStreamer``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from rocketkv.engine.measure import (  # noqa: F401  (SPREAD_WARN: re-exported)
    SPREAD_WARN,
    device_name,
    percentile,
    spread_warning,
    weight_bytes,
    weight_bytes_per_step,
    weights_label,
)
from rocketkv.engine.session import CacheSpec
from rocketkv.engine.step import StepMode
from rocketkv.flags import PROGRESS_TOKENS
from rocketkv.formats.tokenizer import Tokenizer
from rocketkv.model import Transformer


def write_stdout(text: str) -> bool:
    """Write ``text`` to stdout and flush; False once the reader has gone (``generate.py ... |
    head``): stdout is then pointed at the null device, so later writes and the interpreter's
    final flush neither raise nor print a ``BrokenPipeError`` traceback, and the run goes on to
    its report and ``--json`` file."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        return False


@dataclass(frozen=True)
class GenerateResult(Mapping):
    """``generate``'s result: one field per figure of ``--json``, in the JSON's order (read
    them as attributes: ``result.tokens_per_s``). Times in seconds (``*_s``) or milliseconds
    (``*_ms*``), sizes in bytes (this rank's under tensor parallelism).

    ``to_dict()`` is the JSON record (a new dict: callers that add keys, as the CLI adds
    ``text``, ``checkpoint``, ``load_s``..., add them to it). For compatibility with the dict
    this was, the result also reads as a read-only mapping of that record: ``result["key"]``,
    ``"key" in result``, ``result.get(...)``, iteration over the keys; ``result["key"] = x``
    raises TypeError and the fields cannot be reassigned (frozen)."""

    method: str
    budget: int | None
    method_params: dict[str, Any]  # the method's derived parameters and the options given
    batch_size: int
    prompt_tokens: int
    prompt_token_ids: list[list[int]]
    token_ids: list[list[int]]  # per sequence, cut after its first stop token (kept)
    new_tokens: int  # tokens generated (the longest sequence)
    stop_reason: str  # eos, max_new_tokens, context_length, reserve, prefill_only, interrupted
    conversation: dict[str, int]  # {start, position, room}: positions; room: tokens to feed
    prefill_s: float
    prefill_shared: bool  # the caches were built from a shared prefill (``prefilled``)
    decode_steps: int  # timed decode steps (the warm-up left out)
    decode_ms: list[float]  # one entry per timed decode step
    decode_ms_median: float | None
    decode_ms_p10: float | None
    decode_ms_p90: float | None
    tokens_per_s: float | None  # tokens of the timed steps (all sequences) over their time
    tokens_per_s_per_sequence: float | None
    peak_memory_bytes: dict[str, int]  # {prefill, decode, total (the caches' setup counted)}
    peak_memory_kind: str  # what the meter measures (``measure.MemoryMeter.kind``)
    kv_cache_bytes: int  # the caches' allocation
    kv_bytes_per_step: int  # KV read per decode step
    kv_ideal_bytes_per_step: int
    kv_host_bytes: int  # KV held in host memory (offload)
    offload_bytes_per_step: int
    prompt_tokens_kept: dict[str, float]  # per layer: {min, max, mean}
    full_kv_bytes: int  # what the full cache would hold (and read per step) for this run
    weight_bytes: int
    weight_bytes_per_step: int
    weights: str  # ``measure.weights_label``
    bandwidth_gbps: float | None  # (weights + KV read per step) / median step time
    compile_s: float | None  # the warm-up steps (compile, graph capture)
    warmup_steps: int
    compiled: bool  # StepMode static or dynamic
    device: str
    dtype: str
    torch_version: str
    cuda_graphs: bool  # StepMode graphs
    fused_kernels: bool  # the sparse kernels ran
    dense_kernels: bool  # the dense kernels ran in at least one layer
    kernels: dict[str, str]  # family -> "fused" or "pytorch (why)" (``kernels.report``)
    batch_sizes: list[int] | None = None  # continuous batching (``batch.BatchDecoder``): the
    # requests each of its decode steps carried; None: a run of its own

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (``--json``): a new dict, the fields in order (the values are the
        result's own, not copies)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __getitem__(self, key: str) -> Any:
        if key not in _RESULT_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_RESULT_KEYS)

    def __len__(self) -> int:
        return len(_RESULT_KEYS)


_RESULT_KEYS = {f.name: None for f in fields(GenerateResult)}  # the JSON keys, in order


def result_record(model: Transformer, spec: CacheSpec, prompt: Tensor,
                  run: dict[str, Any], *, stop_ids: Sequence[int], max_new_tokens: int,
                  limit_reason: str, conversation: dict[str, int], shared: bool,
                  peak_setup: int, memory_kind: str, mode: StepMode, fused: bool, dense: bool,
                  kernels: dict[str, str], caches: list | None = None,
                  batch_sizes: list[int] | None = None) -> GenerateResult:
    """``generate``'s result (see its Returns) from ``_run``'s: tokens cut at each sequence's
    stop token, the stop reason, latency, memory (``peak_setup``: the caches' allocation,
    counted in the total) and the bytes the caches and weights hold and move; then how the
    run went: its ``conversation`` {start, position, room}, whether the caches came from a
    ``shared`` prefill, the step ``mode`` and the kernels that ran (``kernels.report``).
    ``caches``: the run's caches when the model holds none (a batched request's; default
    ``model.caches``); ``batch_sizes``: a batched request's step sizes."""
    B, T = prompt.shape
    device, dtype = model.device, model.dtype
    end = spec.positions
    # each sequence ends at its first stop token (kept); the rest of the batch may run on
    tokens = []
    stop_set = set(stop_ids)
    for row in run["tokens"]:
        end_i = next((i + 1 for i, t in enumerate(row) if t in stop_set), len(row))
        tokens.append(row[:end_i])
    n_generated = len(run["tokens"][0])
    if run["interrupted"]:
        stop_reason = "interrupted"
    elif max_new_tokens == 0:
        stop_reason = "prefill_only"
    elif all(t and t[-1] in stop_set for t in tokens):
        stop_reason = "eos"
    elif n_generated >= max_new_tokens:
        stop_reason = "max_new_tokens"
    else:
        stop_reason = limit_reason

    decode_ms = run["decode_ms"]
    median = percentile(decode_ms, 50)
    caches = model.caches if caches is None else caches
    kv_cache_bytes = sum(c.allocated_bytes() for c in caches)
    kv_per_step = sum(c.bytes_read_per_step() for c in caches)
    kv_ideal = sum(c.ideal_bytes_per_step() for c in caches)
    kv_host = sum(c.host_bytes() for c in caches)
    # what the full cache would store, and read whole at every step, for this run (this
    # rank's KV heads under tensor parallelism)
    a = model.args
    full_kv_bytes = 2 * a.n_layers * B * a.n_kv_heads * a.head_dim * end * dtype.itemsize
    kept = [getattr(c, "kept", spec.prompt_len) for c in caches]  # prompt tokens kept
    w_per_step = weight_bytes_per_step(model)
    return GenerateResult(
        method=spec.method,
        budget=spec.budget,
        method_params={**caches[-1].method_params(), **spec.options},
        batch_size=B,
        prompt_tokens=T,
        prompt_token_ids=prompt.tolist(),
        token_ids=tokens,
        new_tokens=n_generated,
        stop_reason=stop_reason,
        conversation=conversation,
        prefill_s=run["prefill_s"],
        prefill_shared=shared,
        decode_steps=len(decode_ms),
        decode_ms=decode_ms,
        decode_ms_median=median,
        decode_ms_p10=percentile(decode_ms, 10),
        decode_ms_p90=percentile(decode_ms, 90),
        tokens_per_s=(B * len(decode_ms) / (sum(decode_ms) / 1e3)) if decode_ms else None,
        tokens_per_s_per_sequence=(len(decode_ms) / (sum(decode_ms) / 1e3))
        if decode_ms else None,
        peak_memory_bytes={"prefill": run["peak_prefill"], "decode": run["peak_decode"],
                           "total": max(peak_setup, run["peak_prefill"], run["peak_decode"])},
        peak_memory_kind=memory_kind,
        kv_cache_bytes=kv_cache_bytes,
        kv_bytes_per_step=kv_per_step,
        kv_ideal_bytes_per_step=kv_ideal,
        kv_host_bytes=kv_host,
        offload_bytes_per_step=sum(c.offload_bytes_per_step() for c in caches),
        prompt_tokens_kept={"min": min(kept), "max": max(kept), "mean": sum(kept) / len(kept)},
        full_kv_bytes=full_kv_bytes,
        weight_bytes=weight_bytes(model),
        weight_bytes_per_step=w_per_step,
        weights=weights_label(model),
        bandwidth_gbps=((w_per_step + kv_per_step) / (median / 1e3) / 1e9) if median else None,
        compile_s=run["compile_s"],
        warmup_steps=run["warmup_steps"],
        compiled=mode in (StepMode.STATIC, StepMode.DYNAMIC),
        device=device_name(device),
        dtype=str(dtype).removeprefix("torch."),
        torch_version=torch.__version__,
        cuda_graphs=mode is StepMode.GRAPHS,
        fused_kernels=fused,
        dense_kernels=dense,
        kernels=kernels,  # family -> "fused" or "pytorch (why)" (kernels.report)
        batch_sizes=batch_sizes,
    )




def prefill_bar(n_layers: int, tokens: int, disabled: bool):
    """Prefill progress on stderr, called once per layer (``bar.update()``, ``bar.close()``),
    or None with ``disabled`` (``--no-progress``) or a prompt under ``PROGRESS_TOKENS``
    tokens: a tqdm bar over the layers when stderr is a terminal, else ``PlainProgress`` (a
    log file or a pipe: one plain line every few seconds, not a bar's carriage returns)."""
    if disabled or tokens < PROGRESS_TOKENS:
        return None
    if not sys.stderr.isatty():
        return PlainProgress(n_layers, f"prefill {tokens} tokens")
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(n_layers, f"prefill {tokens} tokens")
    return tqdm(total=n_layers, desc=f"prefill {tokens} tokens", unit="layer", leave=False,
                file=sys.stderr)


class PlainProgress:
    """Progress for a stderr that is not a terminal: ``<what>: layer i/N, s elapsed`` at most
    every ``every`` seconds (a Qwen 8K prefill on a log file was silent for 6-8 minutes)."""

    def __init__(self, total: int, what: str, every: float = 5.0):
        self.total, self.what, self.every = total, what, every
        self.done, self.start = 0, time.perf_counter()
        self.last = self.start

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every and self.done < self.total:
            self.last = now
            print(f"{self.what}: layer {self.done}/{self.total}, {now - self.start:.0f} s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def bar_step(bar):
    """``generate``'s ``on_prefill_layer`` for a ``prefill_bar``."""
    return lambda i: bar.update()


class TextStreamer:
    """``generate``'s ``on_token`` that streams the text of sequence 0 as it grows: the whole
    continuation is decoded again each step and only the new suffix is passed to ``emit``, so
    multi-token characters come out whole (text ending in an incomplete character waits for the
    next token). ``emit`` defaults to the CLI's stdout (``write_stdout``); the API passes its
    caller's ``on_text``."""

    def __init__(self, tok: Tokenizer, stop_ids: Sequence[int],
                 emit: Callable[[str], Any] | None = None):
        self.tok, self.stop = tok, set(stop_ids)
        self.emit = write_stdout if emit is None else emit
        self.shown = ""

    def __call__(self, tokens: Tensor) -> None:
        text = self.tok.decode([t for t in tokens[0].tolist() if t not in self.stop])
        if text.startswith(self.shown) and not text.endswith("\ufffd") and \
                len(text) > len(self.shown):
            self.emit(text[len(self.shown):])
            self.shown = text

    def flush(self, text: str) -> None:
        """Emit what is still missing of the final ``text`` (a character the last token left
        incomplete); nothing when what was shown is not its start."""
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.emit(text[len(self.shown):])
            self.shown = text

    def finish(self, text: str) -> None:
        """End the streamed text with what is still missing of ``text`` and a newline."""
        rest = text[len(self.shown):] if text.startswith(self.shown) else "\n" + text
        self.emit(rest + "\n")


# parameters the method line leaves out: the budget and method (on the line already), the
# flags ``plan`` sets, the sizes the other lines give
_HIDDEN_PARAMS = {"budget", "method", "compressed", "note", "max_seq_len", "prompt_tokens_kept"}


def _param_value(value: Any) -> str:
    """A parameter's value for people: floats to 3 significant digits (whole above 1000),
    lists joined by commas."""
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_param_value(v) for v in value)
    return str(value)


def method_line(r: Mapping[str, Any]) -> str:
    """The report's first line: the method, its budget and its parameters named and rounded
    (``method rocketkv  budget 256  (compression ratio 7.81, c2 2.92, page size 2, ...)``);
    booleans, ``skip_layers`` 0 and the fields ``_HIDDEN_PARAMS`` names are left out (the JSON's
    ``method_params`` keeps them all)."""
    line = f"method {r['method']}" + ("" if r["budget"] is None else f"  budget {r['budget']}")
    params = r.get("method_params") or {}
    if params.get("compressed") is False:
        return line + "  (no compression: the budget covers the whole sequence)"
    shown = [f"{k.replace('_', ' ')} {_param_value(v)}" for k, v in params.items()
             if k not in _HIDDEN_PARAMS and not isinstance(v, bool) and v is not None
             and not (k == "skip_layers" and not v)]
    return line + (f"  ({', '.join(shown)})" if shown else "")


def kernels_ran(r: Mapping[str, Any]) -> bool:
    """Whether the report names the kernels: on CUDA, or where a family ran or was tried
    elsewhere (forced onto Triton's interpreter); not on a CPU run where they cannot run."""
    states = (r.get("kernels") or {}).values()
    if not states:
        return False
    return r.get("device", "cpu") != "cpu" or any(
        v == "fused" or v.startswith("pytorch (self-check") for v in states)


def format_report(r: Mapping[str, Any], load_line: bool = True) -> str:
    """The text report of a ``generate`` result, or of the CLI's record of it (its
    ``to_dict()`` with ``load_s``, ``world_size``... added): what the CLI prints on stderr;
    without ``load_line`` the load time is left out (the CLI prints it when the load ends)."""
    def mb(x):
        return f"{x / 2**20:.1f} MiB"

    lines = [
        method_line(r),
        *([f"load (weights and tokenizer) {r['load_s']:.1f} s"]
          if load_line and r.get("load_s") else []),
        f"prompt tokens {r['prompt_tokens']}  generated {r['new_tokens']} ({r['stop_reason']})"
        f"  batch {r['batch_size']}",
        f"prefill (time to first token) {r['prefill_s'] * 1e3:.1f} ms",
    ]
    if r["decode_steps"]:
        lines += [
            f"decode {r['decode_steps']} steps: median {r['decode_ms_median']:.2f} ms  "
            f"p10 {r['decode_ms_p10']:.2f} ms  p90 {r['decode_ms_p90']:.2f} ms  "
            f"{r['tokens_per_s']:.1f} tokens/s",
            *([warn] if (warn := spread_warning(r["decode_ms_p10"], r["decode_ms_p90"]))
              else []),
            f"achieved bandwidth {r['bandwidth_gbps']:.1f} GB/s "
            f"(weights {mb(r['weight_bytes_per_step'])} + KV {mb(r['kv_bytes_per_step'])} "
            "read per step)",
        ]
    kept, T = r["prompt_tokens_kept"], r["prompt_tokens"]
    kept_text = (f"{kept['min']}" if kept["min"] == kept["max"]
                 else f"{kept['min']}-{kept['max']} (mean {kept['mean']:.0f})")
    lines += [
        f"compression: {kept_text} of {T} prompt tokens kept per layer; KV stored "
        f"{mb(r['kv_cache_bytes'])} vs {mb(r['full_kv_bytes'])} full "
        f"({r['kv_cache_bytes'] / r['full_kv_bytes']:.1%}); read per step "
        f"{mb(r['kv_bytes_per_step'])} vs {mb(r['full_kv_bytes'])} full "
        f"({r['kv_bytes_per_step'] / r['full_kv_bytes']:.1%})",
    ]
    if r.get("kv_host_bytes"):
        lines.append(f"offload: {mb(r['kv_host_bytes'])} of KV in host memory (not counted "
                     f"above); {mb(r['offload_bytes_per_step'])} copied to the device per "
                     "step")
    pk = r["peak_memory_bytes"]
    lines += [
        f"peak memory ({r['peak_memory_kind']}): prefill {mb(pk['prefill'])}  decode "
        f"{mb(pk['decode'])}  total {mb(pk['total'])}",
        f"KV cache {mb(r['kv_cache_bytes'])}  weights {mb(r['weight_bytes'])} "
        f"({r.get('weights', 'float')})",
        f"device {r['device']}  dtype {r['dtype']}  torch {r['torch_version']}  compiled "
        f"{r['compiled']}" + ("  CUDA graph of the eager step" if r.get("cuda_graphs") else "")
        + (f" (compile {r['compile_s']:.1f} s)" if r["compile_s"] else "")
        + "  fused kernels " + ("all" if r.get("dense_kernels") else "sparse" if
                                r.get("fused_kernels") else "off"),
        *([f"kernels: {', '.join(f'{k} {v}' for k, v in r['kernels'].items())}"]
          if kernels_ran(r) else []),
    ]
    if r.get("world_size", 1) > 1:
        per = r["per_rank"]
        lines.append(
            f"tensor parallel: {r['world_size']} ranks (figures above are rank 0's); KV cache "
            f"{' + '.join(mb(s['kv_cache_bytes']) for s in per)} = "
            f"{mb(r['kv_cache_bytes_all_ranks'])}; KV read per step "
            f"{mb(r['kv_bytes_per_step_all_ranks'])}; weights "
            f"{mb(r['weight_bytes_all_ranks'])}; peak per rank "
            f"{', '.join(mb(s['peak_memory_bytes']['total']) for s in per)}")
    return "\n".join(lines)

