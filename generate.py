"""Generate text with a (compressed) static KV cache and measure latency and memory.

    python generate.py --checkpoint DIR --prompt FILE [--method full] [--budget N] [--json OUT]
    python generate.py --checkpoint model.gguf --chat --method rocketkv --budget 256 --prompt FILE
    python generate.py --checkpoint random:llama-3.1-8b --prompt-tokens 32768 --max-new-tokens 64

The decode step (``decode_one_token``) is compiled with ``torch.compile(fullgraph=True)``
(``mode="reduce-overhead"``, i.e. CUDA graphs, on GPU); its shapes never depend on data and
``input_pos`` is a device tensor, so it compiles once per run. Compilation and graph capture
happen in the first decode steps (``WARMUP_STEPS``), which are timed apart (``compile_s``) and
left out of the latency figures; the prompt is prefilled once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from checkpoint import (
    KNOWN_CHECKPOINTS,
    RANDOM_PREFIX,
    checkpoint_args,
    is_quantized,
    load_model,
    resolve_checkpoint,
)
from compression import METHODS, UNBUDGETED, build_caches
from compression.snapkv import shared_window_votes
from kv_cache import PromptRecorder
from model import ConfigError, ModelArgs, Transformer
from tokenizer import TOKENIZER_FILES, Tokenizer, has_tokenizer, load_tokenizer

METHOD_OPTIONS = ("kernel_size", "pooling", "window", "page_size", "rocket_split",
                  "sparq_reallocate", "sparq_strided_keys", "sink_size", "heavy_ratio",
                  "duo_patterns", "duo_threshold", "block_size", "filter_layers",
                  "omnikv_selector", "offload", "skip_layers")
SPREAD_WARN = 4.0  # p90/p10 of decode steps above which the report warns of contention
WARMUP_STEPS = 3  # decode steps that compile and capture graphs, excluded from the figures
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------
# Sampling and the decode step


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None) -> Tensor:
    """Next tokens (B, 1) int64 from logits (B, vocab); greedy when ``temperature == 0``.

    Sampling draws with the exponential trick (argmax of p / Exp(1)), so no host sync.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p  # keeps the top token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(1)
    return (probs / noise).argmax(dim=-1, keepdim=True)


def decode_one_token(model: Transformer, tokens: Tensor, input_pos: Tensor, temperature: float,
                     top_k: int | None, top_p: float | None) -> Tensor:
    """One decode step: tokens (B, 1) at ``input_pos`` (1,) -> next tokens (B, 1)."""
    return sample(model(tokens, input_pos), temperature, top_k, top_p)


_compiled: dict[Any, Any] = {}

# How the compiled decode step is reused across runs of other shapes (a sweep over contexts and
# budgets): the first run of a method compiles with static shapes (the fastest kernels for a
# single run). When a later run changes a cache length, a page count or an integer parameter of
# the method (k, r, page size), Dynamo's automatic dynamic shapes recompile once with those
# sizes symbolic, and that graph then serves every other context and budget. Cache buffers and
# selector integers live on modules, which Dynamo would otherwise keep static, recompiling for
# every configuration (and failing at its recompile limit under fullgraph=True).
DYNAMO_CONFIG = {
    "force_parameter_static_shapes": False,  # buffers (cache lengths) may become dynamic
    "force_nn_module_property_static_shapes": False,
    "allow_unspec_int_on_nn_module": True,  # k, r, page_size may become symbolic
    "recompile_limit": 64,  # one graph per method structure, not per configuration
}


def _configure_dynamo() -> None:
    import torch._dynamo.config as config

    for name, value in DYNAMO_CONFIG.items():
        if hasattr(config, name):  # names present in torch 2.11 and 2.13
            setattr(config, name, value)


def compiled_decode(device: torch.device, backend: Any = None, dynamic: bool | None = None):
    """``decode_one_token`` compiled once per (device type, backend, dynamic) and reused
    across calls (see ``DYNAMO_CONFIG`` for reuse across shapes); ``dynamic=True`` compiles
    symbolic shapes from the first call (``torch.compile(dynamic=True)``)."""
    key = (device.type, backend, dynamic)
    if key not in _compiled:
        _configure_dynamo()
        kw: dict[str, Any] = {"fullgraph": True, "dynamic": dynamic}
        if backend is not None:
            kw["backend"] = backend
        elif device.type == "cuda":
            kw["mode"] = "reduce-overhead"
        _compiled[key] = torch.compile(decode_one_token, **kw)
    return _compiled[key]


# --------------------------------------------------------------------------------------------
# Measurement


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# Generation


def _prepare_caches(model: Transformer, spec: dict[str, Any],
                    meter: MemoryMeter | None = None) -> None:
    """Attach caches for ``spec``; reuse the model's current ones when the spec matches, so
    repeated calls keep the compiled graph and its static buffers (a new prompt overwrites
    every slot a step can read: prompt slots at prefill, later slots before they are valid).
    New caches: the old ones are released first, then ``meter`` is reset, so this run's peak
    never counts the caches a previous run left (a benchmark runs its rows in one process)."""
    model._conversation = None
    if getattr(model, "_cache_spec", None) == spec and all(c is not None for c in model.caches):
        return
    for layer in model.layers:  # free the old buffers before allocating new ones
        layer.attention.kv_cache = None
    model._cache_spec = None
    if meter is not None:
        if meter.cuda:
            torch.cuda.empty_cache()
        meter.reset()
    caches = build_caches(spec["method"], model.args, batch_size=spec["batch_size"],
                          prompt_len=spec["prompt_len"], max_new_tokens=spec["new_tokens"],
                          budget=spec["budget"], dtype=spec["dtype"], device=spec["device"],
                          **spec["options"])
    model.setup_caches(caches, spec["prompt_len"] + spec["new_tokens"])
    model._cache_spec = spec


@dataclass
class PrefilledPrompt:
    """One prefill's per-layer K/V, from which any method's caches can be built.

    Prefill attends to the whole uncompressed prompt in every method whose caches say
    ``shared_prefill`` (RocketKV App. A.3), so its output does not depend on the method: an
    evaluation prefills a prompt once and gives the result to ``generate(prefilled=...)`` for
    each method and budget. Holds every layer's K/V: 2 L B H_kv T D elements of the model dtype
    (377 MiB for SmolLM2-135M at 8K tokens in float32).

    Attributes:
        tokens: (B, T) int64 prompt.
        logits: (B, vocab) logits of the last prompt position.
        k, v: per layer (B, H_kv, T, D), keys rotated at positions 0..T-1.
        q_obs: per layer (B, H, w, D), the last w = min(obs_window, T) queries (rotated).
        prefill_s: wall time of the prefill (seconds).
        attention_sums: per layer (B, H_kv, T) float32 column sums of every prompt query's
            attention (``kv_cache.attention_column_sums``), recorded when asked for (H2O
            needs them); None otherwise.
        votes_memo: per layer, the SnapKV-family observation-window votes already computed
            from this prefill (``compression.snapkv.shared_window_votes``), so building many
            methods' and budgets' caches from it scores the window once per layer: (B, H, T)
            float32 per layer and window length, kept as long as the prefill.
    """

    tokens: Tensor
    logits: Tensor
    k: list[Tensor]
    v: list[Tensor]
    q_obs: list[Tensor]
    prefill_s: float
    obs_window: int = 64
    attention_sums: list[Tensor] | None = None
    votes_memo: list[dict] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.votes_memo = [{} for _ in self.k]


def prefill_once(model: Transformer, prompt: Tensor | Sequence[int] | Sequence[Sequence[int]],
                 obs_window: int = 64, attention_sums: bool = False) -> PrefilledPrompt:
    """Prefill ``prompt`` ((T,) or (B, T) ids) recording every layer's K/V and last
    ``obs_window`` queries (at least the largest observation window of the methods to build),
    and with ``attention_sums`` the column sums of the prompt's attention (for methods whose
    caches say ``needs_attention_sums``, e.g. H2O; about doubles the prefill's attention work).

    Raises:
        ConfigError: an empty prompt or one that fills the model's context.
    """
    device = model.tok_embeddings.weight.device
    prompt = _as_prompt(model, prompt)
    B, T = prompt.shape
    recorders = [PromptRecorder(i, model.args, B, model.tok_embeddings.weight.dtype, device,
                                obs_window, attention_sums) for i in range(model.args.n_layers)]
    for layer in model.layers:
        layer.attention.kv_cache = None
    model._cache_spec = model._conversation = None
    model.setup_caches(recorders, T)
    _sync(device)
    t0 = time.perf_counter()
    logits = model.prefill(prompt)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    for layer in model.layers:
        layer.attention.kv_cache = None
    return PrefilledPrompt(prompt, logits, [r.k for r in recorders], [r.v for r in recorders],
                           [r.q_obs for r in recorders], prefill_s, obs_window,
                           [r.sums for r in recorders] if attention_sums else None)


def extend_prefilled(model: Transformer, pre: PrefilledPrompt,
                     chunk: Tensor | Sequence[int] | Sequence[Sequence[int]]) -> PrefilledPrompt:
    """``pre``'s prompt followed by ``chunk`` ((Tc,) or (B, Tc) ids), recorded as if prefilled
    whole: the chunk's queries attend exactly to ``pre``'s K/V and to the chunk causally. One
    prefill of a document then serves both the question-agnostic run (the document alone) and
    the standard one (document + question). ``pre`` is left unchanged.

    Raises:
        ConfigError: bad ids, a batch size other than ``pre``'s, or the model's context.
    """
    chunk = _as_prompt(model, chunk)
    B, T = pre.tokens.shape
    if chunk.shape[0] != B:
        raise ConfigError(f"the chunk has {chunk.shape[0]} sequences, the prompt {B}")
    if T + chunk.shape[1] >= model.args.max_seq_len:
        raise ConfigError(f"{T + chunk.shape[1]} tokens leave no room in the model's context")
    device = model.tok_embeddings.weight.device
    recorders = []
    for i in range(model.args.n_layers):
        r = PromptRecorder(i, model.args, B, model.tok_embeddings.weight.dtype, device,
                           pre.obs_window, pre.attention_sums is not None)
        r.k, r.v, r.q_obs = pre.k[i], pre.v[i], pre.q_obs[i]
        r.sums = None if pre.attention_sums is None else pre.attention_sums[i]
        recorders.append(r)
    for layer in model.layers:
        layer.attention.kv_cache = None
    model._cache_spec = model._conversation = None
    model.setup_caches(recorders, T + chunk.shape[1])
    _sync(device)
    t0 = time.perf_counter()
    logits = model.prefill(chunk, start=T)
    _sync(device)
    for layer in model.layers:
        layer.attention.kv_cache = None
    return PrefilledPrompt(torch.cat([pre.tokens, chunk], dim=1), logits,
                           [r.k for r in recorders], [r.v for r in recorders],
                           [r.q_obs for r in recorders],
                           pre.prefill_s + time.perf_counter() - t0, pre.obs_window,
                           None if pre.attention_sums is None else [r.sums for r in recorders])


def _store_prefilled(model: Transformer, pre: PrefilledPrompt) -> Tensor:
    """Every cache stores its layer's recorded prompt (and compresses it); returns the logits."""
    for i, cache in enumerate(model.caches):
        if not cache.shared_prefill:
            raise ConfigError(f"{type(cache).__name__} prefills in its own way; it cannot be "
                              "built from a shared prefill")
        if cache.needs_attention_sums:
            if pre.attention_sums is None:
                raise ConfigError(f"{type(cache).__name__} evicts on the prompt's accumulated "
                                  "attention: prefill_once(..., attention_sums=True) must "
                                  "record it")
            cache.store_scored_prompt(pre.k[i], pre.v[i], pre.attention_sums[i])
            continue
        q_obs = pre.q_obs[i]
        if cache.obs_window > q_obs.shape[2] and q_obs.shape[2] < pre.tokens.shape[1]:
            raise ConfigError(f"the method's observation window ({cache.obs_window} tokens) "
                              f"exceeds the {q_obs.shape[2]} queries recorded by prefill_once")
        w = min(cache.obs_window, q_obs.shape[2])  # the method's window; 0: no eviction
        with shared_window_votes(pre.votes_memo[i]):  # one vote per layer and window
            cache.store_prompt(pre.k[i], pre.v[i], q_obs[:, :, q_obs.shape[2] - w:])
    return pre.logits


@torch.no_grad()
def _run(model: Transformer, prefill_fn, B: int, first_pos: int, new_tokens: int, step_fn,
         sampling: dict, stop_ids: Tensor, meter: MemoryMeter,
         warmup_steps: int = 0, on_token=None, stop_check_every: int = 1) -> dict[str, Any]:
    """Prefill (``prefill_fn() -> logits``), then decode from position ``first_pos``; the first
    ``warmup_steps`` decode steps (compilation, CUDA-graph capture) are timed together as
    ``compile_s`` and left out of ``decode_ms`` and of the decode-phase memory peak. Their
    tokens are real output. ``new_tokens == 0``: prefill only.

    The loop reads nothing back from the device unless it must: without ``stop_ids`` (a
    benchmark) never, so the host queues steps (graph replays) back to back; with them, whether
    every sequence has stopped is read every ``stop_check_every`` steps, and the steps run
    past the stop are dropped from the result (tokens, position and pending token as if
    checked every step; an evicting cache has seen those extra tokens)."""
    device = model.tok_embeddings.weight.device
    timer = StepTimer(device)
    meter.reset()
    _sync(device)
    t0 = time.perf_counter()
    logits = prefill_fn()
    next_tok = sample(logits, **sampling) if new_tokens else None  # (B, 1)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    peak_prefill = meter.peak()
    meter.reset()

    out = torch.empty(B, new_tokens, dtype=torch.long, device=device)
    n = 0
    compile_s = None
    check = stop_ids.numel() > 0  # no stop tokens: nothing to read back in the loop
    if new_tokens:
        out[:, :1] = next_tok
        done = torch.isin(next_tok[:, 0], stop_ids)
        n = 1
        if on_token is not None:
            on_token(out[:, :n])
    input_pos = torch.tensor([first_pos], dtype=torch.long, device=device)
    t_warm = time.perf_counter()
    interrupted = False
    try:
        for step in range(new_tokens - 1):
            if check and step % stop_check_every == 0 and bool(done.all()):
                break
            if step == warmup_steps and warmup_steps:
                _sync(device)
                compile_s = time.perf_counter() - t_warm
                meter.reset()
            start = timer.start() if step >= warmup_steps else None
            next_tok = step_fn(model, next_tok, input_pos, **sampling).clone()
            if start is not None:
                timer.stop(start)
            out[:, n:n + 1] = next_tok
            n += 1
            input_pos += 1
            if check:
                done |= torch.isin(next_tok[:, 0], stop_ids)
            if on_token is not None:
                on_token(out[:, :n])
    except KeyboardInterrupt:  # Ctrl-C: keep what was generated (the caller reports it)
        interrupted = True
    if check and n > 1 and stop_check_every > 1:  # drop the steps run past the last stop
        hit = torch.isin(out[:, :n], stop_ids)  # (B, n)
        if bool(hit.any(dim=1).all()):
            n = int(hit.int().argmax(dim=1).max()) + 1
    if warmup_steps and compile_s is None and n > 1:  # the run ended within the warm-up
        _sync(device)
        compile_s = time.perf_counter() - t_warm
    return {"tokens": out[:, :n].tolist(), "prefill_s": prefill_s, "decode_ms": timer.ms(),
            "peak_prefill": peak_prefill, "peak_decode": meter.peak(), "compile_s": compile_s,
            "warmup_steps": min(warmup_steps, max(n - 1, 0)), "interrupted": interrupted,
            "pending": out[:, n - 1:n] if n else None, "position": first_pos + max(n - 1, 0)}


def _as_prompt(model: Transformer, prompt) -> Tensor:
    """``prompt`` as a (B, T) int64 tensor on the model's device, its ids checked."""
    device = model.tok_embeddings.weight.device
    prompt = torch.as_tensor(prompt, dtype=torch.long, device=device)
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ConfigError("the prompt is empty")
    if int(prompt.min()) < 0 or int(prompt.max()) >= model.args.vocab_size:
        raise ConfigError(f"prompt token ids must lie in [0, {model.args.vocab_size})")
    if prompt.shape[1] >= model.args.max_seq_len:
        raise ConfigError(f"the prompt ({prompt.shape[1]} tokens) leaves no room in the model's "
                          f"context ({model.args.max_seq_len} tokens)")
    return prompt


def generate(model: Transformer, prompt: Tensor | Sequence[int] | Sequence[Sequence[int]], *,
             method: str = "full", budget: int | None = None, max_new_tokens: int = 256,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, stop_ids: Sequence[int] = (), compile: bool = False,
             compile_backend: Any = None, method_options: dict[str, Any] | None = None,
             warmup_steps: int = WARMUP_STEPS, reserve_tokens: int = 0,
             continue_conversation: bool = False,
             prefilled: PrefilledPrompt | None = None, on_token=None,
             stop_check_every: int = 1, compile_dynamic: bool | None = None) -> dict[str, Any]:
    """Prefill ``prompt``, then decode until a stop token, ``max_new_tokens`` or the context end.

    Args:
        model: a loaded ``Transformer``.
        prompt: token ids, (T,) or (B, T) (B sequences of equal length).
        method, budget, method_options: the KV cache (``compression.METHODS``); budget in tokens.
        max_new_tokens: generated tokens at most (the prefill's token included); 0 prefills
            only (the prompt is cached for a later ``continue_conversation`` call).
        temperature, top_k, top_p: sampling (temperature 0 is greedy); ``seed`` seeds it.
        stop_ids: a sequence stops after emitting one of these; the run stops when all have.
        compile: compile the decode step (CUDA graphs on GPU). The first ``warmup_steps``
            decode steps compile it (or find it compiled) and capture the graphs: their time is
            ``compile_s`` and they are left out of every latency and decode-memory figure.
            Prefill runs once.
        compile_backend: a ``torch.compile`` backend (tests use a counting backend).
        compile_dynamic: None (default): the first compile has static shapes and a later call
            with other sizes recompiles once with them symbolic (``DYNAMO_CONFIG``); True:
            symbolic from the first call; the compiled step is shared per setting.
        warmup_steps: decode steps left out of the figures when compiling (default 3: CUDA
            graph trees run a step, record the next, and replay from the third).
        reserve_tokens: extra cache room (tokens) for later turns of the conversation. The
            caches hold prompt + max_new_tokens + reserve_tokens positions, and the budget's
            ``max_new_tokens`` (m) is that whole later part: for SnapKV the prompt budget is
            t - m, since every later token is read at every step.
        continue_conversation: ``prompt`` is the next turn of the conversation the previous
            call left in the model's caches (same method and budget; method arguments are
            ignored). The last token the previous call generated (not yet fed) goes first, then
            the prompt; the chunk attends to the cache as the method left it (``KVCache.append``:
            an evicting method's earlier prompt stays compressed), then decoding goes on.
            With ``method="full"`` this equals one prefill of the whole conversation.
        on_token: called after every generated token with the tokens so far, (B, n) int64 on
            the model's device (a host sync per step: for streaming output, not for timing).
            Ctrl-C (KeyboardInterrupt) during decoding ends the run early: the result holds
            what was generated, ``stop_reason`` ``"interrupted"``.
        prefilled: the prompt's ``prefill_once`` result: the caches are built from its K/V
            instead of running the prefill again (``prompt`` must be its tokens).
        stop_check_every: with ``stop_ids``, read whether every sequence has stopped every N
            decode steps (a host sync each time) instead of every step; the result is the
            same, the steps run past the stop are dropped. Without ``stop_ids`` nothing is
            read back during decoding.
    Returns:
        dict with ``token_ids`` (per sequence, stop token included), ``prefill_s``,
        ``decode_ms`` (one entry per decode step), summary latencies, ``tokens_per_s`` (tokens
        from decode steps over their time), ``peak_memory_bytes`` {prefill, decode, total},
        ``kv_cache_bytes``, ``kv_bytes_per_step``, ``weight_bytes``, ``bandwidth_gbps``, the
        method's parameters and ``conversation`` {start, position, room} (positions; room:
        tokens a continuation may still feed).
    Raises:
        ConfigError: empty prompt, prompt that leaves no room in the model's context, bad
            ``max_new_tokens`` or ``reserve_tokens``, unknown method or invalid budget, nothing
            to continue or a turn that does not fit the reserved room, a ``prefilled`` result
            of another prompt.
    """
    device = model.tok_embeddings.weight.device
    dtype = model.tok_embeddings.weight.dtype
    prompt = _as_prompt(model, prompt)
    B, T = prompt.shape
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must not be negative, got {max_new_tokens}")
    if reserve_tokens < 0:
        raise ConfigError(f"reserve_tokens must not be negative, got {reserve_tokens}")
    if stop_check_every < 1:
        raise ConfigError(f"stop_check_every must be at least 1, got {stop_check_every}")
    context = model.args.max_seq_len
    meter = MemoryMeter(device)
    meter.reset()
    if continue_conversation:
        conv = getattr(model, "_conversation", None)
        if conv is None:
            raise ConfigError("no conversation to continue: the previous generate() call must "
                              "leave its caches (a prefill_once or another model run since "
                              "drops them)")
        if prefilled is not None:
            raise ConfigError("prefilled applies to the first turn, not to a continuation")
        if B != conv["batch_size"]:
            raise ConfigError(f"the conversation has {conv['batch_size']} sequences, the "
                              f"prompt {B}")
        spec = model._cache_spec
        chunk = prompt if conv["pending"] is None else torch.cat([conv["pending"], prompt], 1)
        start = conv["position"]
        room = conv["end"] - start
        if chunk.shape[1] > room:
            raise ConfigError(f"the turn ({chunk.shape[1]} tokens with the pending generated "
                              f"token) exceeds the conversation's room ({room} tokens); pass "
                              "a larger reserve_tokens to the first call")
        new_tokens = min(max_new_tokens, room - chunk.shape[1] + 1)
        limit_reason = "reserve"

        def prefill_fn():
            return model.prefill(chunk, start=start)
    else:
        if prefilled is not None and not torch.equal(prefilled.tokens, prompt):
            raise ConfigError("prefilled holds another prompt than the one given")
        new_tokens = min(max_new_tokens, context - T)  # prompt + generated fit the context
        if T + new_tokens + reserve_tokens > context:
            raise ConfigError(f"prompt {T} + new tokens {new_tokens} + reserve_tokens "
                              f"{reserve_tokens} exceed the model's context ({context} tokens)")
        spec = {"method": method, "budget": budget, "batch_size": B, "prompt_len": T,
                "new_tokens": new_tokens + reserve_tokens, "dtype": dtype, "device": device,
                "options": dict(method_options or {})}
        _prepare_caches(model, spec, meter)
        chunk, start, limit_reason = prompt, 0, "context_length"
        if prefilled is not None and not all(c.shared_prefill for c in model.caches):
            prefilled = None  # the method prefills its own way (KeyDiff's blocks)
        if prefilled is not None:
            def prefill_fn():
                return _store_prefilled(model, prefilled)
        else:
            def prefill_fn():
                return model.prefill(prompt)
    peak_setup = meter.peak()
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)

    if compile and not all(c.compilable for c in model.caches):
        raise ConfigError("this method's decode step synchronizes with the host (--offload) "
                          "and runs eagerly: use --no-compile")
    step_fn = compiled_decode(device, compile_backend, compile_dynamic) if compile \
        else decode_one_token
    if seed is not None:
        torch.manual_seed(seed)
    first_pos = start + chunk.shape[1]
    run = _run(model, prefill_fn, B, first_pos, new_tokens, step_fn, sampling, stop, meter,
               warmup_steps=warmup_steps if compile else 0, on_token=on_token,
               stop_check_every=stop_check_every)
    end = spec["prompt_len"] + spec["new_tokens"]  # positions the caches hold
    model._conversation = {"batch_size": B, "pending": run["pending"],
                           "position": run["position"], "end": end}

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
    caches = model.caches
    kv_cache_bytes = sum(c.allocated_bytes() for c in caches)
    kv_per_step = sum(c.bytes_read_per_step() for c in caches)
    kv_ideal = sum(c.ideal_bytes_per_step() for c in caches)
    kv_host = sum(c.host_bytes() for c in caches)
    # what the full cache would store, and read whole at every step, for this run
    a = model.args
    full_kv_bytes = 2 * a.n_layers * B * a.n_kv_heads * a.head_dim * end * dtype.itemsize
    kept = [getattr(c, "kept", spec["prompt_len"]) for c in caches]  # prompt tokens kept
    w_per_step = weight_bytes_per_step(model)
    return {
        "method": spec["method"],
        "budget": spec["budget"],
        "method_params": {**caches[-1].method_params(), **spec["options"]},
        "batch_size": B,
        "prompt_tokens": T,
        "prompt_token_ids": prompt.tolist(),
        "token_ids": tokens,
        "new_tokens": n_generated,
        "stop_reason": stop_reason,
        "conversation": {"start": start, "position": run["position"],
                         "room": end - run["position"] - (run["pending"] is not None)},
        "prefill_s": run["prefill_s"],
        "prefill_shared": prefilled is not None,
        "decode_steps": len(decode_ms),
        "decode_ms": decode_ms,
        "decode_ms_median": median,
        "decode_ms_p10": percentile(decode_ms, 10),
        "decode_ms_p90": percentile(decode_ms, 90),
        "tokens_per_s": (B * len(decode_ms) / (sum(decode_ms) / 1e3)) if decode_ms else None,
        "tokens_per_s_per_sequence": (len(decode_ms) / (sum(decode_ms) / 1e3))
        if decode_ms else None,
        "peak_memory_bytes": {"prefill": run["peak_prefill"], "decode": run["peak_decode"],
                              "total": max(peak_setup, run["peak_prefill"], run["peak_decode"])},
        "peak_memory_kind": meter.kind,
        "kv_cache_bytes": kv_cache_bytes,
        "kv_bytes_per_step": kv_per_step,
        "kv_ideal_bytes_per_step": kv_ideal,
        "kv_host_bytes": kv_host,
        "offload_bytes_per_step": sum(c.offload_bytes_per_step() for c in caches),
        "prompt_tokens_kept": {"min": min(kept), "max": max(kept),
                               "mean": sum(kept) / len(kept)},
        "full_kv_bytes": full_kv_bytes,
        "weight_bytes": weight_bytes(model),
        "weight_bytes_per_step": w_per_step,
        "weights": weights_label(model),
        "bandwidth_gbps": ((w_per_step + kv_per_step) / (median / 1e3) / 1e9) if median else None,
        "compile_s": run["compile_s"],
        "warmup_steps": run["warmup_steps"],
        "compiled": bool(compile),
        "device": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
    }


# --------------------------------------------------------------------------------------------
# CLI


def add_method_options(m: argparse._ActionsContainer) -> None:
    """Every method option (``METHOD_OPTIONS``) as a CLI flag, for generate.py, bench.py and
    the accuracy scripts; an option the chosen method does not read is refused at build time
    (``compression.check_options``)."""
    m.add_argument("--kernel-size", type=int,
                   help="SnapKV/SnapKV++/RocketKV pooling kernel (odd; default 7 for snapkv, "
                        "63/511 by prompt length for snapkv_pp and rocketkv)")
    m.add_argument("--pooling", choices=["avg", "max"], help="snapkv pooling (default avg)")
    m.add_argument("--window", type=int, help="observation window in tokens (default 32)")
    m.add_argument("--page-size", type=int,
                   help="quest page size (default max(16, tokens / (budget / 2)))")
    m.add_argument("--rocket-split", choices=["sqrt", "adaptive"],
                   help="RocketKV budget split between stages (default sqrt: paper v1)")
    m.add_argument("--sparq-reallocate", action="store_true",
                   help="sparq: mix in the mean value by the unselected probability mass")
    m.add_argument("--sparq-strided-keys", action="store_true",
                   help="sparq: no dim-major copy of K (storage 1x instead of 1.5x the full "
                        "cache); the r dims are then a strided read of every key row")
    m.add_argument("--sink-size", type=int,
                   help="streamingllm: attention sinks kept (default 4)")
    m.add_argument("--heavy-ratio", type=float,
                   help="h2o: share of the budget for heavy hitters (default 0.5)")
    m.add_argument("--duo-patterns", metavar="PATH",
                   help="duoattention: head gates, a TSV (layers x KV heads) or a directory "
                        "with full_attention_heads.tsv; needed above a 640-token budget")
    m.add_argument("--duo-threshold", type=float,
                   help="duoattention: gates above this retrieve (the pattern's own split, "
                        "DuoAttention deploys 0.5); default: the budget sets the share")
    m.add_argument("--block-size", type=int,
                   help="keydiff: prompt tokens per prefill block (default 128); cache memory "
                        "stays within budget + block")
    m.add_argument("--filter-layers", type=_layer_list, metavar="L1,L2,...",
                   help="omnikv: filter layers (default: the paper's 2,8,18 for 32 layers, "
                        "scaled to other depths)")
    m.add_argument("--omnikv-selector", choices=["last", "uniform", "exponential"],
                   help="omnikv: context selector over its observation window (default last)")
    m.add_argument("--offload", action="store_true",
                   help="omnikv: keep the sparse layers' K/V in host memory (runs eagerly)")
    m.add_argument("--skip-layers", type=int,
                   help="leave the first N layers uncompressed (the paper: 2 for LongChat)")


def _layer_list(text: str) -> list[int]:
    """``--filter-layers 2,8,18`` -> [2, 8, 18] (argparse type; a bad list is a usage error)."""
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got "
                                         f"{text!r}") from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one layer index")
    return layers


def weights_label(model: Transformer) -> str:
    """``float``, ``int8`` or ``int4-g<G>`` (``quantize.py``), with ``, classifier C`` when the
    classifier is stored otherwise (``int8``, ``float``)."""
    q = model.quantization
    if q is None:
        return "float"
    label = q["mode"] + (f"-g{q['groupsize']}" if q.get("groupsize") else "")
    return label + (f", classifier {q['classifier']}" if q["classifier"] != q["mode"] else "")


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one ``error: ...`` line and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` whole: a temporary file beside it, then
    ``os.replace``; on failure the temporary file is removed.

    Raises:
        ConfigError: the file cannot be written (the OS's reason).
    """
    tmp = Path(f"{path}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None


def check_json_path(path: str | None, flag: str = "--json") -> None:
    """Fail before a run whose JSON destination cannot be written: a missing directory, a
    directory in the file's place, or no write permission (a read-only filesystem included).

    Raises:
        ConfigError: naming the problem.
    """
    if not path:
        return
    dest = Path(path)
    parent = dest.resolve().parent
    if dest.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name")
    if not parent.is_dir():
        raise ConfigError(f"{flag}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (dest.exists()
                                                    and not os.access(dest, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable (permissions or a read-only "
                          "filesystem)")


def check_positive(args: argparse.Namespace, *flags: str) -> None:
    """ConfigError naming the first of ``flags`` (argparse dests) set to a value <= 0."""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")


def build_parser() -> argparse.ArgumentParser:
    methods = "\n".join(f"  {name:<12} {desc}" for name, (desc, _) in METHODS.items())
    p = OneLineParser(description=__doc__.split("\n\n")[0], epilog=f"methods:\n{methods}",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory (HF layout or converted), a .gguf file, a short "
                        f"name ({', '.join(KNOWN_CHECKPOINTS)}: a local copy in checkpoints/ or "
                        "the Hugging Face cache), or random:NAME with NAME a named config "
                        "(random weights at the real shapes)")
    p.add_argument("--tokenizer", help="tokenizer.json, tokenizer.model or .gguf file "
                   "(default: the checkpoint's)")
    p.add_argument("--method", default="full", choices=list(METHODS), metavar="METHOD",
                   help="KV cache method (see below; default full)")
    p.add_argument("--budget", type=int, help="token budget: KV pairs read per decode step per "
                   "layer per KV-head group")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text file, - for stdin")
    src.add_argument("--prompt-tokens", type=int, metavar="N",
                     help="synthetic prompt of N random token ids (efficiency runs)")
    add_method_options(p.add_argument_group(
        "method options (every derived parameter is printed and saved)"))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1,
                   help="copies of the prompt decoded together")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on for cuda)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is the user message of the checkpoint's chat template; "
                        "generation stops at the template's end-of-turn token")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print the text as it is decoded (default; batch 1 with a tokenizer). "
                        "A host sync per token: --no-stream for timing runs")
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    return p


def _read_prompt(path: str) -> str:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read prompt file {path}: {e}") from None
    if not text.strip():
        raise ConfigError(f"prompt file {path} is empty")
    return text.removesuffix("\n").removesuffix("\r")  # the newline that ends a text file


class TextStreamer:
    """``generate``'s ``on_token`` for the CLI: prints the text of sequence 0 as it grows (the
    whole continuation is decoded again each step, so multi-token characters come out whole;
    text ending in an incomplete character waits for the next token)."""

    def __init__(self, tok: Tokenizer, stop_ids: Sequence[int]):
        self.tok, self.stop = tok, set(stop_ids)
        self.shown = ""

    def __call__(self, tokens: Tensor) -> None:
        text = self.tok.decode([t for t in tokens[0].tolist() if t not in self.stop])
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text

    def finish(self, text: str) -> None:
        """End the streamed text with what is still missing of ``text`` and a newline."""
        rest = text[len(self.shown):] if text.startswith(self.shown) else "\n" + text
        sys.stdout.write(rest + "\n")
        sys.stdout.flush()


def weight_bytes(model: Transformer) -> int:
    """Bytes of all of ``model``'s parameters (tied matrices counted once; int8/int4 layers
    of ``quantize.py`` at their stored size)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weight_bytes_per_step(model: Transformer) -> int:
    """Parameter bytes one decode step reads: all but the embedding table, which is only
    gathered (B rows), unless the classifier shares it (a quantized checkpoint's classifier
    is its own copy, ``quantize.py``)."""
    emb = model.tok_embeddings.weight
    tied = getattr(model.output, "weight", None) is emb
    return weight_bytes(model) - (0 if tied else emb.numel() * emb.element_size())


def float_weight_bytes(args: ModelArgs, dtype: torch.dtype) -> int:
    """Bytes of a float model of shape ``args`` in ``dtype`` (a tied classifier counted once)."""
    D = args.head_dim
    per_layer = (args.dim * (args.n_heads + 2 * args.n_kv_heads) * D + args.n_heads * D * args.dim
                 + 3 * args.dim * args.intermediate_size + 2 * args.dim)
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


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but CUDA is not available on this machine")
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"unsupported device {name!r} (cuda or cpu)")
    return device


def format_report(r: dict[str, Any]) -> str:
    def mb(x):
        return f"{x / 2**20:.1f} MiB"

    lines = [
        f"method {r['method']}  budget {r['budget']}  params {r['method_params']}",
        f"prompt tokens {r['prompt_tokens']}  generated {r['new_tokens']} ({r['stop_reason']})"
        f"  batch {r['batch_size']}",
        f"prefill (time to first token) {r['prefill_s'] * 1e3:.1f} ms",
    ]
    if r["decode_steps"]:
        lines += [
            f"decode {r['decode_steps']} steps: median {r['decode_ms_median']:.2f} ms  "
            f"p10 {r['decode_ms_p10']:.2f} ms  p90 {r['decode_ms_p90']:.2f} ms  "
            f"{r['tokens_per_s']:.1f} tokens/s",
            *([f"warning: step times vary {spread:.1f}x (p90/p10): other work is probably "
                "competing for the device or CPU threads; these timings are unreliable"]
              if (spread := r["decode_ms_p90"] / max(r["decode_ms_p10"], 1e-9)) > SPREAD_WARN
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
        f"{r['compiled']}" + (f" (compile {r['compile_s']:.1f} s)" if r["compile_s"] else ""),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.budget is not None and args.budget <= 0:
            raise ConfigError(f"--budget must be a positive number of tokens, got {args.budget}")
        check_positive(args, "max_new_tokens", "batch_size", "prompt_tokens", "top_k",
                       "threads")
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.top_p is not None and not 0 < args.top_p <= 1:
            raise ConfigError(f"--top-p must lie in (0, 1], got {args.top_p}")
        if not math.isfinite(args.temperature) or args.temperature < 0:
            raise ConfigError(f"--temperature must be a finite number >= 0, got "
                              f"{args.temperature}")
        if args.budget is not None and args.method in UNBUDGETED:
            raise ConfigError(f"method {args.method} reads every cached token and takes no "
                              "--budget")
        check_json_path(args.json)
        device = _resolve_device(args.device)
        dtype = DTYPES[args.dtype] if args.dtype else (
            torch.bfloat16 if device.type == "cuda" else torch.float32)
        compile = (device.type == "cuda" and not args.offload) if args.compile is None \
            else args.compile
        if args.system is not None and not args.chat:
            raise ConfigError("--system needs --chat (it is a message of the chat template)")
        if args.chat and args.prompt is None:
            raise ConfigError("--chat needs a text --prompt")
        text = _read_prompt(args.prompt) if args.prompt is not None else None

        checkpoint = resolve_checkpoint(args.checkpoint)
        if not is_quantized(checkpoint):
            check_memory(checkpoint_args(checkpoint), dtype, device, args.batch_size,
                         (args.prompt_tokens or 0) + args.max_new_tokens)
        model = load_model(checkpoint, device, dtype)
        tok: Tokenizer | None = None
        if args.tokenizer:
            tok = load_tokenizer(args.tokenizer)
        elif not checkpoint.startswith(RANDOM_PREFIX) and has_tokenizer(checkpoint):
            tok = load_tokenizer(checkpoint)
        if tok is None and text is not None:
            raise ConfigError("a text prompt needs a tokenizer: the checkpoint has none ("
                              f"{', '.join(TOKENIZER_FILES)} or GGUF tokenizer metadata); pass "
                              "--tokenizer FILE or use --prompt-tokens N")
        if tok is not None and tok.vocab_size > model.args.vocab_size:
            raise ConfigError(f"tokenizer has {tok.vocab_size} tokens, model only "
                              f"{model.args.vocab_size}")
        if text is not None:
            ids = tok.encode_chat(text, system=args.system) if args.chat else tok.encode(text)
        else:
            gen = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(0, model.args.vocab_size, (args.prompt_tokens,),
                                generator=gen).tolist()
        prompt = torch.tensor([ids] * args.batch_size)
        room = model.args.max_seq_len - len(ids)
        if 0 < room < args.max_new_tokens:
            print(f"note: --max-new-tokens {args.max_new_tokens} exceeds the {room} tokens the "
                  f"model's context ({model.args.max_seq_len}) leaves after the {len(ids)}-token "
                  "prompt; generation stops at the context end", file=sys.stderr)
        stop_ids = () if (tok is None or args.ignore_eos) else (
            tok.chat_stop_ids if args.chat else tok.stop_ids)
        options = {name: getattr(args, name) for name in METHOD_OPTIONS
                   if getattr(args, name) is not None and getattr(args, name) is not False}
        if args.method == "full" and options:
            raise ConfigError(f"method full takes no method options ({', '.join(options)})")
        streamer = TextStreamer(tok, stop_ids) if (
            tok is not None and args.batch_size == 1 and args.stream) else None
        result = generate(model, prompt, method=args.method, budget=args.budget,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop_ids=stop_ids, compile=compile, method_options=options,
                          on_token=streamer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before decoding started: nothing generated yet
        print("error: interrupted before any token was generated", file=sys.stderr)
        return 130
    except torch.OutOfMemoryError as e:
        print(f"error: out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1

    stop_set = set(stop_ids)
    result["text"] = ([tok.decode([t for t in row if t not in stop_set])
                       for row in result["token_ids"]] if tok is not None else None)
    result["checkpoint"] = args.checkpoint
    result["model"] = model.args.name
    interrupted = result["stop_reason"] == "interrupted"
    result["interrupted"] = interrupted
    if streamer is not None:
        streamer.finish(result["text"][0])
    elif result["text"] is not None:
        print(result["text"][0])
    if result["text"] is not None:
        print("-" * 80)
    print(format_report(result))
    if args.json:
        try:
            write_json(args.json, result)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
