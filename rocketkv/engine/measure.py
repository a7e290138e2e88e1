"""Measurement: per-step latency, peak memory per phase, weight bytes and the memory estimate.

``generate.generate`` fills its result with these figures; ``scripts/bench.py`` and the other
benchmarks reuse them, so every figure is measured one way.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rocketkv.compression import build_caches
from rocketkv.model import ConfigError, ModelArgs, Transformer


class MemoryMeter:
    """Peak memory per phase.

    CUDA: ``torch.cuda.max_memory_allocated`` with ``reset_peak_memory_stats`` at phase
    boundaries (``kind = "cuda_max_memory_allocated"``). CPU: the process peak resident set
    (VmHWM), reset through ``/proc/self/clear_refs`` where Linux allows
    (``kind = "cpu_process_peak_rss"``); where it cannot be reset, each phase reports the peak
    since process start (``kind = "cpu_process_peak_rss_since_start"``).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self.kind = "cuda_max_memory_allocated"
        else:
            self.kind = "cpu_process_peak_rss" if self._clear_rss() else \
                "cpu_process_peak_rss_since_start"

    @staticmethod
    def _clear_rss() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "cpu_process_peak_rss":
            self._clear_rss()

    def peak(self) -> int:
        """Peak bytes since the last ``reset``."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepTimer:
    """Per-step latency: CUDA events on GPU, synchronized wall clock on CPU (ms)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((start, end))
        else:
            self.marks.append((start, time.perf_counter()))

    def ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.marks]
        return [(e - s) * 1e3 for s, e in self.marks]


SPREAD_WARN = 4.0  # p90/p10 of decode steps above which a report warns of contention


def spread_warning(p10_ms: float | None, p90_ms: float | None) -> str | None:
    """The ``warning: ...`` line of a run whose decode steps vary more than ``SPREAD_WARN``
    times (p90 over p10 of the step times, ms): other work competed for the device or the CPU
    threads, so its timings are unreliable. None for a steady run or without timings.
    ``generate.py``'s report and ``bench.py``'s rows say it in these words."""
    if not p10_ms or not p90_ms:
        return None
    spread = p90_ms / max(p10_ms, 1e-9)
    if spread <= SPREAD_WARN:
        return None
    return (f"warning: step times vary {spread:.1f}x (p90/p10): other work is probably "
            "competing for the device or CPU threads; these timings are unreliable")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0..100) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def device_name(device: torch.device) -> str:
    """The accelerator's name (``torch.cuda.get_device_name``), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def weights_label(model: Transformer) -> str:
    """``float``, ``int8`` or ``int4-g<G>`` (``quantize.py``), with ``, classifier C`` when the
    classifier is stored otherwise (``int8``, ``float``), and ``, int8 activations`` when its
    int8 layers run W8A8 (``quantized.use_int8_activations``)."""
    q = model.quantization
    if q is None:
        return "float"
    label = q["mode"] + (f"-g{q['groupsize']}" if q.get("groupsize") else "")
    label += f", classifier {q['classifier']}" if q["classifier"] != q["mode"] else ""
    return label + (", int8 activations" if q.get("activations") == "int8" else "")


def weight_bytes(model: Transformer) -> int:
    """Bytes of all of ``model``'s parameters (tied matrices counted once; int8/int4 layers
    of ``quantize.py`` at their stored size), and of the int8 layers' packed weights where they
    run W8A8 (``quantized.Int8Linear.packed_bytes``: int8 values and 12 bytes a row)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(getattr(m, "packed_bytes", 0) for m in model.modules())


def weight_bytes_per_step(model: Transformer) -> int:
    """Parameter bytes one decode step reads: all but the embedding table (a float matrix or
    a GGUF's blocks, ``quantized.GGUFEmbedding``), which is only gathered (B rows),
    unless the classifier shares it (a quantized checkpoint's classifier is its own copy,
    ``quantize.py``)."""
    emb = getattr(model.tok_embeddings, "weight", None)
    if emb is not None and getattr(model.output, "weight", None) is emb:
        return weight_bytes(model)
    return weight_bytes(model) - sum(p.numel() * p.element_size()
                                     for p in model.tok_embeddings.parameters())


def float_weight_bytes(args: ModelArgs, dtype: torch.dtype) -> int:
    """Bytes of a float model of shape ``args`` in ``dtype`` (a tied classifier counted once;
    q/k/v biases where ``args.qkv_bias``)."""
    D = args.head_dim
    qkv = (args.n_heads + 2 * args.n_kv_heads) * D
    per_layer = (args.dim * qkv + args.n_heads * D * args.dim
                 + 3 * args.dim * args.intermediate_size + 2 * args.dim
                 + (qkv if args.qkv_bias else 0))
    tables = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
    return (args.n_layers * per_layer + tables + args.dim) * dtype.itemsize


def available_bytes(device: torch.device) -> int | None:
    """Memory free for this run: CUDA's free device memory, or the CPU's MemAvailable
    (``/proc/meminfo``); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(args: ModelArgs, dtype: torch.dtype, device: torch.device, batch: int,
                 tokens: int) -> None:
    """Refuse a run whose float weights plus full-size KV cache (``tokens`` per sequence) do
    not fit in the memory ``device`` has free, before anything is allocated.

    Raises:
        ConfigError: with the estimate, what is free and what to change.
    """
    free = available_bytes(device)
    weights = float_weight_bytes(args, dtype)
    kv = 2 * args.n_layers * batch * args.n_kv_heads * args.head_dim * tokens * dtype.itemsize
    if free is not None and weights + kv > free:
        gib = 2 ** 30
        name = str(dtype).removeprefix("torch.")
        raise ConfigError(f"this run needs at least {(weights + kv) / gib:.1f} GiB ({name} "
                          f"weights {weights / gib:.1f} GiB + KV cache {kv / gib:.1f} GiB) but "
                          f"{device.type} has {free / gib:.1f} GiB free; use a GPU, --dtype "
                          "bfloat16, quantized weights (quantize.py) or a shorter run")



def run_kv_bytes(method: str, args: ModelArgs, *, batch: int, prompt_len: int, new_tokens: int,
                 budget: int | None, dtype: torch.dtype, options: dict[str, Any]) -> int:
    """Bytes a run of ``method`` holds beside the weights: its caches (built on the meta
    device, so nothing is allocated) plus one layer's uncompressed prompt K/V, which prefill
    holds while a layer's cache compresses it.

    Raises:
        ConfigError: what ``compression.build_caches`` refuses.
    """
    caches = build_caches(method, args, batch_size=batch, prompt_len=prompt_len,
                          max_new_tokens=new_tokens, budget=budget, dtype=dtype,
                          device="meta", **options)
    layer = 2 * batch * args.n_kv_heads * args.head_dim * prompt_len * dtype.itemsize
    return sum(c.allocated_bytes() for c in caches) + layer


def check_run_memory(model: Transformer, method: str, *, batch: int, prompt_len: int,
                     new_tokens: int, budget: int | None, options: dict[str, Any]) -> None:
    """Refuse a run of ``method`` on the loaded ``model`` whose caches (``run_kv_bytes``) do
    not fit in the memory its device has free, counting the model's current caches as free
    (a new run releases them first), before anything is allocated.

    Raises:
        ConfigError: with the estimate and what is free.
    """
    device, dtype = model.device, model.dtype
    free = available_bytes(device)
    if free is None:
        return
    free += sum(c.allocated_bytes() for c in model.caches if c is not None)
    need = run_kv_bytes(method, model.args, batch=batch, prompt_len=prompt_len,
                        new_tokens=new_tokens, budget=budget, dtype=dtype, options=options)
    if need > free:
        gib = 2 ** 30
        raise ConfigError(f"{method} at {prompt_len} tokens, batch {batch} needs about "
                          f"{need / gib:.1f} GiB of KV cache and prefill buffers beside the "
                          f"weights, but {device.type} has {free / gib:.1f} GiB free")
