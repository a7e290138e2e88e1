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
import signal
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import kernels
import tp
from checkpoint import (
    KNOWN_CHECKPOINTS,
    checkpoint_args,
    is_quantized,
    load_model,
    resolve_checkpoint,
)
from checks import (
    NO_TOKENIZER,
    check_document,
    check_fit,
    check_request,
    checkpoint_tokenizer,
    result_text,
)
from cli import (
    DTYPES,
    OneLineParser,
    add_kernels_option,
    apply_kernels_option,
    check_json_path,
    check_positive,
    read_prompt,
    resolve_device,
    write_json,
    write_stdout,
)
from compression import (
    METHODS,
    add_method_options,
    build_caches,
    given_options,
    help_epilog,
)
from documents import (
    CacheSnapshot,
    document_ids,
    prefill_summary,
    question_ids,
    read_questions,
    summary_line,
)
from gguf_quantized import GGUF_WEIGHTS
from kernels import check as kernel_check
from measure import (
    MemoryMeter,
    StepTimer,
    check_memory,
    device_name,
    percentile,
    sync,
    weight_bytes,
    weight_bytes_per_step,
    weights_label,
)
from model import ConfigError, Transformer
from prefill import PrefilledPrompt, as_prompt, store_prefilled
from tokenizer import Tokenizer

SPREAD_WARN = 4.0  # p90/p10 of decode steps above which the report warns of contention
WARMUP_STEPS = 3  # decode steps that compile and capture graphs, excluded from the figures


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


class GraphStep:
    """The eager decode step (``decode_one_token``) captured in one CUDA graph: no
    ``torch.compile``, so the capture takes about a second where a compile takes a minute,
    at the price of the step's unfused kernels (each replayed from the graph, without its
    launch overhead). Called as ``decode_one_token``: the first call runs eagerly on a side
    stream (lazy initializations, Triton's JIT), the second captures the step and replays it,
    later calls copy the token in and replay. The graph holds the run's caches and its
    position tensor (the loop's own, advanced in place), so every run builds its own.

    Raises:
        ConfigError: the device is not CUDA.
    """

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ConfigError("CUDA graphs (--cuda-graphs, --compile-regime graphs) need a "
                              f"CUDA device, not {device.type}")
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False

    def __call__(self, model: Transformer, tokens: Tensor, input_pos: Tensor,
                 **sampling) -> Tensor:
        if not self.warm:
            self.warm = True
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = decode_one_token(model, tokens, input_pos, **sampling)
            torch.cuda.current_stream().wait_stream(side)
            return out
        if self.graph is None:
            self.tokens, self.pos = tokens.clone(), input_pos
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = decode_one_token(model, self.tokens, self.pos, **sampling)
        elif input_pos is not self.pos:
            raise ValueError("a captured decode step replays with its own position tensor")
        else:
            self.tokens.copy_(tokens)
        self.graph.replay()
        return self.out


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
# Generation


@dataclass
class _CacheState:
    """What ``generate`` left in a model's caches: the spec they were built for, weak
    references to them (whether they are still the model's shows whether the state holds), and
    the conversation they hold (``continue_conversation``)."""

    spec: dict[str, Any]
    caches: list[weakref.ref]
    conversation: dict[str, Any] | None = None


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Transformer -> _CacheState


def _cache_state(model: Transformer) -> _CacheState | None:
    """The state of ``model``'s caches if ``generate`` built them and they are still attached
    (another run, ``prefill_once`` or ``setup_caches`` since replaces them: None)."""
    state = _STATES.get(model)
    current = model.caches
    if state is None or len(state.caches) != len(current) or \
            any(c is None or ref() is not c for ref, c in zip(state.caches, current)):
        return None
    return state


def release_caches(model: Transformer) -> None:
    """Detach and drop the caches of ``model`` (the next ``generate`` builds new ones), so
    their memory is free for something else (``scripts/bench.py``'s rows of other engines)."""
    _STATES.pop(model, None)
    for layer in model.layers:
        layer.attention.kv_cache = None


def rewind_conversation(model: Transformer, position: int,
                        snapshot: CacheSnapshot | None = None) -> None:
    """Make the next ``continue_conversation`` call write from ``position`` (tokens fed so
    far) with no pending generated token, the caches' state restored from ``snapshot``
    (taken at ``position``: what the method changed since, an evicting cache's slots, running
    scores; ``documents.CacheSnapshot``).

    Raises:
        ConfigError: no conversation in ``model``'s caches, caches other than the
            snapshot's, or ``position`` outside the conversation.
    """
    state = _cache_state(model)
    conv = None if state is None else state.conversation
    if conv is None or (snapshot is not None and not snapshot.holds(model.caches)):
        raise ConfigError("no conversation to rewind: the caches were replaced since (by "
                          "another run); prefill the document again")
    if not 0 < position <= conv["end"]:
        raise ConfigError(f"cannot rewind to position {position} (the conversation holds "
                          f"{conv['end']} positions)")
    if snapshot is not None:
        snapshot.restore()
    state.conversation = {**conv, "pending": None, "position": position}


def _prepare_caches(model: Transformer, spec: dict[str, Any],
                    meter: MemoryMeter | None = None) -> _CacheState:
    """Attach caches for ``spec``; reuse the model's current ones when ``generate`` built them
    for the same spec, so repeated calls keep the compiled graph and its static buffers (a new
    prompt overwrites every slot a step can read: prompt slots at prefill, later slots before
    they are valid). New caches: the old ones are released first, then ``meter`` is reset, so
    this run's peak never counts the caches a previous run left (a benchmark runs its rows in
    one process). Returns the caches' state, its conversation cleared."""
    state = _cache_state(model)
    if state is not None and state.spec == spec:
        state.conversation = None
        return state
    release_caches(model)  # free the old buffers before allocating new ones
    if meter is not None:
        if meter.cuda:
            torch.cuda.empty_cache()
        meter.reset()
    shard = getattr(model, "tp", None)  # tensor parallelism (tp.py): this rank's KV heads,
    # the method's parameters of the whole model
    caches = build_caches(spec["method"], shard["args"] if shard else model.args,
                          batch_size=spec["batch_size"], prompt_len=spec["prompt_len"],
                          max_new_tokens=spec["new_tokens"], budget=spec["budget"],
                          dtype=spec["dtype"], device=spec["device"],
                          shard=(shard["rank"], shard["world_size"]) if shard else (0, 1),
                          **spec["options"])
    model.setup_caches(caches, spec["prompt_len"] + spec["new_tokens"])
    state = _STATES[model] = _CacheState(spec, [weakref.ref(c) for c in caches])
    return state


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
    sync(device)
    t0 = time.perf_counter()
    logits = prefill_fn()
    next_tok = sample(logits, **sampling) if new_tokens else None  # (B, 1)
    sync(device)
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
                sync(device)
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
        sync(device)
        compile_s = time.perf_counter() - t_warm
    return {"tokens": out[:, :n].tolist(), "prefill_s": prefill_s, "decode_ms": timer.ms(),
            "peak_prefill": peak_prefill, "peak_decode": meter.peak(), "compile_s": compile_s,
            "warmup_steps": min(warmup_steps, max(n - 1, 0)), "interrupted": interrupted,
            "pending": out[:, n - 1:n] if n else None, "position": first_pos + max(n - 1, 0)}


def generate(model: Transformer, prompt: Tensor | Sequence[int] | Sequence[Sequence[int]], *,
             method: str = "full", budget: int | None = None, max_new_tokens: int = 256,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, stop_ids: Sequence[int] = (), compile: bool | None = False,
             compile_backend: Any = None, method_options: dict[str, Any] | None = None,
             warmup_steps: int = WARMUP_STEPS, reserve_tokens: int = 0,
             continue_conversation: bool = False,
             prefilled: PrefilledPrompt | None = None, on_token=None,
             stop_check_every: int = 1, compile_dynamic: bool | None = None,
             on_prefill_layer=None, cuda_graphs: bool = False) -> dict[str, Any]:
    """Prefill ``prompt``, then decode until a stop token, ``max_new_tokens`` or the context end.

    Args:
        model: a loaded ``Transformer``.
        prompt: token ids, (T,) or (B, T) (B sequences of equal length).
        method, budget, method_options: the KV cache (``compression.METHODS``); budget in tokens.
        max_new_tokens: generated tokens at most (the prefill's token included); 0 prefills
            only (the prompt is cached for a later ``continue_conversation`` call).
        temperature, top_k, top_p: sampling (temperature 0 is greedy); ``seed`` seeds it.
        stop_ids: a sequence stops after emitting one of these; the run stops when all have.
        compile: compile the decode step (CUDA graphs on GPU); None: compile when every
            cache of the method can (``KVCache.compilable``). The first ``warmup_steps``
            decode steps compile it (or find it compiled) and capture the graphs: their time is
            ``compile_s`` and they are left out of every latency and decode-memory figure.
            Prefill runs once.
        compile_backend: a ``torch.compile`` backend (tests use a counting backend).
        cuda_graphs: instead of compiling, capture the eager step in a CUDA graph
            (``GraphStep``; CUDA only, ``compile`` is then ignored); its first 2 steps are
            the warm-up.
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
        on_prefill_layer: called with i after prefill layer i (progress; not called when
            the caches are built from ``prefilled``).
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
        method's parameters, ``conversation`` {start, position, room} (positions; room:
        tokens a continuation may still feed) and ``kernels`` (per kernel family what ran:
        ``kernels.report``, after the first-use self-check ``kernels.check.ensure``).
    Raises:
        ConfigError: empty prompt, prompt that leaves no room in the model's context, bad
            ``max_new_tokens`` or ``reserve_tokens``, unknown method or invalid budget, nothing
            to continue or a turn that does not fit the reserved room, a ``prefilled`` result
            of another prompt.
        kernels.KernelCheckError: a kernel family failed its self-check with
            ``kernels.set_strict(True)`` (``--kernels on``), or left a sticky CUDA error.
    """
    device = model.tok_embeddings.weight.device
    prompt = as_prompt(model, prompt)
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must not be negative, got {max_new_tokens}")
    if reserve_tokens < 0:
        raise ConfigError(f"reserve_tokens must not be negative, got {reserve_tokens}")
    if stop_check_every < 1:
        raise ConfigError(f"stop_check_every must be at least 1, got {stop_check_every}")
    meter = MemoryMeter(device)
    meter.reset()
    if continue_conversation:
        if prefilled is not None:
            raise ConfigError("prefilled applies to the first turn, not to a continuation")
        turn = _next_turn(model, prompt, max_new_tokens, on_prefill_layer)
    else:
        spec = {"method": method, "budget": budget, "batch_size": prompt.shape[0],
                "prompt_len": prompt.shape[1], "new_tokens": reserve_tokens,
                "dtype": model.tok_embeddings.weight.dtype, "device": device,
                "options": dict(method_options or {})}
        turn = _first_turn(model, prompt, spec, max_new_tokens, prefilled, meter,
                           on_prefill_layer)
    peak_setup = meter.peak()
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    if cuda_graphs:
        compile = False
    elif compile is None:
        compile = all(c.compilable for c in model.caches)
    if (compile or cuda_graphs) and not all(c.compilable for c in model.caches):
        raise ConfigError("this method's decode step synchronizes with the host and runs "
                          "eagerly: use --no-compile")
    ran = kernel_check.ensure(model)  # first use: a failing family falls back to PyTorch
    fused = kernels.in_use(device)  # imports the kernels now, outside the graph being traced
    dense = kernels.dense_in_use(device)
    if cuda_graphs:
        step_fn, warmup_steps = GraphStep(device), 2  # an eager step, then the capture
    else:
        step_fn = compiled_decode(device, compile_backend, compile_dynamic) if compile \
            else decode_one_token
    if seed is not None:
        torch.manual_seed(seed)
    first_pos = turn.start + turn.chunk.shape[1]
    run = _run(model, turn.prefill_fn, prompt.shape[0], first_pos, turn.new_tokens, step_fn,
               sampling, stop, meter,
               warmup_steps=warmup_steps if compile or cuda_graphs else 0,
               on_token=on_token, stop_check_every=stop_check_every)
    spec = turn.state.spec
    end = spec["prompt_len"] + spec["new_tokens"]  # positions the caches hold
    turn.state.conversation = {"batch_size": prompt.shape[0], "pending": run["pending"],
                               "position": run["position"], "end": end}
    result = _report(model, spec, prompt, run, stop_ids, max_new_tokens, turn.limit_reason)
    result["conversation"] = {"start": turn.start, "position": run["position"],
                              "room": end - run["position"] - (run["pending"] is not None)}
    result["prefill_shared"] = turn.shared
    result["peak_memory_bytes"]["total"] = max(peak_setup, result["peak_memory_bytes"]["total"])
    result["peak_memory_kind"] = meter.kind
    result["compiled"] = bool(compile)
    result["cuda_graphs"] = cuda_graphs
    result["fused_kernels"] = fused
    result["dense_kernels"] = dense and any(layer.fusable() for layer in model.layers)
    if ran["dense"] == "fused" and not result["dense_kernels"]:
        ran["dense"] = "pytorch (no layer the dense kernels take)"
    result["kernels"] = ran  # family -> "fused" or "pytorch (why)" (kernels.report)
    return result


@dataclass
class _Turn:
    """What ``generate`` feeds and decodes: ``chunk`` (B, Tc) at positions ``start ..``,
    filled into the caches by ``prefill_fn() -> logits``, then up to ``new_tokens`` tokens;
    ``limit_reason`` is the stop reason when the room ends first."""

    state: _CacheState
    chunk: Tensor
    start: int
    new_tokens: int
    prefill_fn: Any
    limit_reason: str
    shared: bool = False  # the caches are built from a shared prefill (``prefilled``)


def _first_turn(model: Transformer, prompt: Tensor, spec: dict[str, Any], max_new_tokens: int,
                prefilled: PrefilledPrompt | None, meter: MemoryMeter, on_layer=None) -> _Turn:
    """The caches of ``spec`` for ``prompt`` (``spec["new_tokens"]`` holds the reserve, to
    which the new tokens are added), prefilled by the model or from ``prefilled``."""
    T, context = prompt.shape[1], model.args.max_seq_len
    reserve = spec["new_tokens"]
    if prefilled is not None and not torch.equal(prefilled.tokens, prompt):
        raise ConfigError("prefilled holds another prompt than the one given")
    new_tokens = min(max_new_tokens, context - T)  # prompt + generated fit the context
    if T + new_tokens + reserve > context:
        raise ConfigError(f"prompt {T} + new tokens {new_tokens} + reserve_tokens "
                          f"{reserve} exceed the model's context ({context} tokens)")
    state = _prepare_caches(model, {**spec, "new_tokens": new_tokens + reserve}, meter)
    if prefilled is not None and not all(c.shared_prefill for c in model.caches):
        prefilled = None  # the method prefills its own way (KeyDiff's blocks)
    if prefilled is not None:
        return _Turn(state, prompt, 0, new_tokens, lambda: store_prefilled(model, prefilled),
                     "context_length", shared=True)
    return _Turn(state, prompt, 0, new_tokens, lambda: model.prefill(prompt, on_layer=on_layer),
                 "context_length")


def _next_turn(model: Transformer, prompt: Tensor, max_new_tokens: int,
               on_layer=None) -> _Turn:
    """The next turn of the conversation the previous ``generate`` call left in the caches:
    its pending token, then ``prompt``, fed at the conversation's position."""
    state = _cache_state(model)
    conv = None if state is None else state.conversation
    if conv is None:
        raise ConfigError("no conversation to continue: the previous generate() call must "
                          "leave its caches (a prefill_once or another model run since "
                          "drops them)")
    if prompt.shape[0] != conv["batch_size"]:
        raise ConfigError(f"the conversation has {conv['batch_size']} sequences, the "
                          f"prompt {prompt.shape[0]}")
    chunk = prompt if conv["pending"] is None else torch.cat([conv["pending"], prompt], 1)
    start = conv["position"]
    room = conv["end"] - start
    if chunk.shape[1] > room:
        raise ConfigError(f"the turn ({chunk.shape[1]} tokens with the pending generated "
                          f"token) exceeds the conversation's room ({room} tokens); pass "
                          "a larger reserve_tokens to the first call")
    new_tokens = min(max_new_tokens, room - chunk.shape[1] + 1)
    return _Turn(state, chunk, start, new_tokens,
                 lambda: model.prefill(chunk, start=start, on_layer=on_layer), "reserve")


def _report(model: Transformer, spec: dict[str, Any], prompt: Tensor, run: dict[str, Any],
            stop_ids: Sequence[int], max_new_tokens: int, limit_reason: str) -> dict[str, Any]:
    """``generate``'s result from ``_run``'s: tokens cut at each sequence's stop token, the
    stop reason, latency, memory and the bytes the caches and weights hold and move."""
    B, T = prompt.shape
    device, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    end = spec["prompt_len"] + spec["new_tokens"]
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
    # what the full cache would store, and read whole at every step, for this run (this
    # rank's KV heads under tensor parallelism)
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
        "conversation": None,  # generate fills these four
        "prefill_s": run["prefill_s"],
        "prefill_shared": None,
        "decode_steps": len(decode_ms),
        "decode_ms": decode_ms,
        "decode_ms_median": median,
        "decode_ms_p10": percentile(decode_ms, 10),
        "decode_ms_p90": percentile(decode_ms, 90),
        "tokens_per_s": (B * len(decode_ms) / (sum(decode_ms) / 1e3)) if decode_ms else None,
        "tokens_per_s_per_sequence": (len(decode_ms) / (sum(decode_ms) / 1e3))
        if decode_ms else None,
        "peak_memory_bytes": {"prefill": run["peak_prefill"], "decode": run["peak_decode"],
                              "total": max(run["peak_prefill"], run["peak_decode"])},
        "peak_memory_kind": None,
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
        "compiled": None,
        "device": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
    }


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0], epilog=help_epilog(),
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
    src.add_argument("--prompt", metavar="FILE", help="prompt text file, - for stdin")
    src.add_argument("-p", "--prompt-text", metavar="TEXT", help="the prompt text itself")
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
    p.add_argument("--gguf-weights", choices=GGUF_WEIGHTS, default="float",
                   help="a GGUF's weights dequantized to float (default), or kept quantized "
                        "(4-bit blocks as int4, others int8; docs/quantization.md)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on for cuda)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="instead of compiling, capture the eager decode step in a CUDA graph "
                        "(about a second instead of a minute's compile; unfused kernels)")
    add_kernels_option(p)
    p.add_argument("--chat", action="store_true",
                   help="the prompt is the user message of the checkpoint's chat template; "
                        "generation stops at the template's end-of-turn token")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print the text as it is decoded (default; batch 1 with a tokenizer). "
                        "A host sync per token: --no-stream for timing runs")
    p.add_argument("--questions", metavar="FILE",
                   help="questions about the --prompt document, one a line (or JSON lines "
                        "with a \"question\" key): the document is prefilled once and each "
                        "question answered from its cache, rewound after each answer")
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    p.add_argument("--no-progress", action="store_true",
                   help="no prefill progress bar (shown on stderr when it is a terminal and "
                        f"the prompt has at least {PROGRESS_TOKENS} tokens)")
    return p


PROGRESS_TOKENS = 512  # prompts from this many tokens show a prefill progress bar


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


def _bar_step(bar):
    return lambda i: bar.update()


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
            write_stdout(text[len(self.shown):])
            self.shown = text

    def finish(self, text: str) -> None:
        """End the streamed text with what is still missing of ``text`` and a newline."""
        rest = text[len(self.shown):] if text.startswith(self.shown) else "\n" + text
        write_stdout(rest + "\n")


def format_report(r: dict[str, Any], load_line: bool = True) -> str:
    """The text report of a ``generate`` result (what the CLI prints on stderr); without
    ``load_line`` the load time is left out (the CLI prints it when the load ends)."""
    def mb(x):
        return f"{x / 2**20:.1f} MiB"

    lines = [
        f"method {r['method']}  budget {r['budget']}  params {r['method_params']}",
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
        f"{r['compiled']}" + ("  CUDA graph of the eager step" if r.get("cuda_graphs") else "")
        + (f" (compile {r['compile_s']:.1f} s)" if r["compile_s"] else "")
        + "  fused kernels " + ("all" if r.get("dense_kernels") else "sparse" if
                                r.get("fused_kernels") else "off"),
        *([f"kernels: {', '.join(f'{k} {v}' for k, v in r['kernels'].items())}"]
          if r.get("kernels") else []),
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


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: the generated text on stdout (a ``==> sequence i <==`` header before
    each when the batch has several), the report on stderr, ``--json`` for every figure.

    Exit status: 0; 2 for bad input (one ``error:`` line, before any slow work where it can
    be checked); 1 out of memory or an unwritable JSON; 130 after Ctrl-C and 143 after SIGTERM
    (what was generated, the report and the JSON are kept). Under ``torchrun`` (``tp.py``)
    only rank 0 prints and writes; a collective that fails (another rank stopped) or times
    out ends each rank with one ``error:`` line and status 1."""
    args = build_parser().parse_args(argv)
    signals: list[int] = []

    def on_sigterm(signum, frame):  # what `timeout` and job schedulers send: as Ctrl-C
        signals.append(signum)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: leave SIGTERM alone
        previous = None
    try:
        code = _main(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 128 + signal.SIGTERM if signals and code == 130 else code


def _kernel_fault(e: Exception) -> int:
    """1, after one ``error:`` line, for a kernel's fault that escaped the self-check (a
    failed ``--kernels on`` self-check, a Triton compile error, a CUDA error:
    ``kernels.fault``); any other exception is raised again."""
    reason = kernels.fault(e)
    if reason is None:
        raise e
    print(f"error: {reason}" + ("" if isinstance(e, kernels.KernelCheckError) else
                                "; --kernels off runs the PyTorch path"), file=sys.stderr)
    return 1


def _main(args: argparse.Namespace) -> int:
    rank, world = tp.rank(), 1  # world 1 until torchrun's process group is joined
    try:
        check_positive(args, "batch_size", "prompt_tokens", "threads")
        if args.threads:
            torch.set_num_threads(args.threads)
        options = given_options(args)
        check_request(args.method, args.budget, options, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        if args.temperature == 0 and (args.top_k or args.top_p is not None) and rank == 0:
            print("note: --top-k and --top-p shape sampling; at --temperature 0 (greedy, the "
                  "default) they change nothing", file=sys.stderr)
        check_json_path(args.json)
        device = resolve_device(args.device)
        if args.cuda_graphs and device.type != "cuda":
            raise ConfigError(f"--cuda-graphs needs a CUDA device, not {device.type}")
        rank, world = tp.init(device.type)  # torchrun: this process is one rank of world
        dtype = DTYPES[args.dtype] if args.dtype else (
            torch.bfloat16 if device.type == "cuda" else torch.float32)
        apply_kernels_option(args)
        # default: compiled on CUDA where the method's caches allow (OmniKV's --offload not)
        compile = args.compile if args.compile is not None else \
            (None if device.type == "cuda" else False)
        if args.system is not None and not args.chat:
            raise ConfigError("--system needs --chat (it is a message of the chat template)")
        if args.chat and args.prompt_tokens is not None:
            raise ConfigError("--chat needs a text --prompt or --prompt-text")
        text = args.prompt_text if args.prompt_text is not None else \
            read_prompt(args.prompt) if args.prompt is not None else None
        if text is not None and not text.strip():
            raise ConfigError("--prompt-text is empty")

        t_load = time.perf_counter()
        checkpoint = resolve_checkpoint(args.checkpoint)
        margs = checkpoint_args(checkpoint)
        tok = checkpoint_tokenizer(checkpoint, margs, args.tokenizer)
        if tok is None and text is not None:
            raise ConfigError(NO_TOKENIZER)
        if args.questions is not None:  # one document, many questions: rocketkv.py
            if world > 1:
                raise ConfigError("--questions runs in one process, not under torchrun")
            return _answer_questions(args, checkpoint, margs, tok, text, device, dtype,
                                     options, compile, t_load)
        if text is not None:
            ids = tok.encode_chat(text, system=args.system) if args.chat else tok.encode(text)
        else:
            gen = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(0, margs.vocab_size, (args.prompt_tokens,),
                                generator=gen).tolist()
        tp.check_world(margs, world)
        # every method setting is checked here, before the weights load
        room = check_fit(args.method, margs, len(ids), args.max_new_tokens, args.budget,
                         options)
        if not is_quantized(checkpoint):
            check_memory(tp.local_args(margs, world), dtype, device, args.batch_size,
                         len(ids) + args.max_new_tokens)
        model = load_model(checkpoint, device, dtype, shard=(rank, world),
                           gguf_weights=args.gguf_weights)
        load_s = time.perf_counter() - t_load
        if rank == 0:  # now, not after the prefill: a long prefill would hide a finished load
            print(f"load (weights and tokenizer) {load_s:.1f} s", file=sys.stderr, flush=True)
        prompt = torch.tensor([ids] * args.batch_size)
        if room < args.max_new_tokens:
            print(f"note: --max-new-tokens {args.max_new_tokens} exceeds the {room} tokens the "
                  f"model's context ({model.args.max_seq_len}) leaves after the {len(ids)}-token "
                  "prompt; generation stops at the context end", file=sys.stderr)
        stop_ids = () if (tok is None or args.ignore_eos) else (
            tok.chat_stop_ids if args.chat else tok.stop_ids)
        streamer = TextStreamer(tok, stop_ids) if (
            tok is not None and args.batch_size == 1 and args.stream and rank == 0) else None
        bar = prefill_bar(model.args.n_layers, len(ids), args.no_progress or rank != 0)
        try:
            result = generate(model, prompt, method=args.method, budget=args.budget,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              stop_ids=stop_ids, compile=compile, method_options=options,
                              cuda_graphs=args.cuda_graphs,
                              on_token=streamer,
                              on_prefill_layer=None if bar is None else _bar_step(bar))
        finally:
            if bar is not None:
                bar.close()
    except ConfigError as e:
        if rank == 0:  # every rank runs the same checks: one line, not one per rank
            print(f"error: {e}", file=sys.stderr)
        elif tp.launched():  # let rank 0 print before torchrun ends the ranks
            tp.wait_for_rank_0()
        return 2
    except torch.OutOfMemoryError as e:  # (a RuntimeError: before that clause)
        print(f"error: out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # gloo and NCCL report a peer that stopped this way
        if world == 1:
            return _kernel_fault(e)
        print(f"error: rank {rank} of {world}: {tp.failure(e)}", file=sys.stderr)
        tp.exit_now(1)  # a broken process group aborts the interpreter's exit: skip it
    except KeyboardInterrupt:  # before decoding started: nothing generated yet
        if rank == 0:  # torchrun signals every rank, and ends the rest once one has stopped
            print("error: interrupted before any token was generated", file=sys.stderr)
        return 130
    except Exception as e:  # a Triton compile error is no RuntimeError
        return _kernel_fault(e)

    result["world_size"] = world
    if world > 1:  # every rank's share (a collective: all ranks take part); rank 0 reports
        shares = tp.gather({k: result[k] for k in ("kv_cache_bytes", "kv_bytes_per_step",
                                                   "weight_bytes", "peak_memory_bytes")})
        result["per_rank"] = shares
        for k in ("kv_cache_bytes", "kv_bytes_per_step", "weight_bytes"):
            result[f"{k}_all_ranks"] = sum(s[k] for s in shares)
        tp.shutdown()
        if rank != 0:
            return 0
    result["text"] = result_text(tok, result["token_ids"], stop_ids)
    result["checkpoint"] = args.checkpoint
    result["model"] = model.args.name
    result["load_s"] = load_s
    interrupted = result["stop_reason"] == "interrupted"
    result["interrupted"] = interrupted
    if streamer is not None:
        streamer.finish(result["text"][0])
    elif result["text"] is not None:
        for i, text in enumerate(result["text"]):
            header = f"==> sequence {i} <==\n" if len(result["text"]) > 1 else ""
            write_stdout(f"{header}{text}\n")
    write_stdout("")
    print(format_report(result, load_line=False), file=sys.stderr)
    if args.json:
        try:
            write_json(args.json, result)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 130 if interrupted else 0


def _answer_questions(args: argparse.Namespace, checkpoint: str, margs, tok: Tokenizer | None,
                      text: str | None, device: torch.device, dtype: torch.dtype,
                      options: dict[str, Any], compile: bool | None, t_load: float) -> int:
    """``--questions``: the document prefilled once, then per question its answer block on
    stdout (``==> question i: ... <==``) and a line on stderr, each answered from the
    document's cache rewound (``rewind_conversation``); the prefill paid once on stderr and
    in ``--json`` (``document``, one record per question in ``questions``). Everything is
    checked before the weights load."""
    if text is None:
        raise ConfigError("--questions needs a text document (--prompt or --prompt-text)")
    if args.batch_size != 1:
        raise ConfigError("--questions answers one sequence: --batch-size must be 1")
    questions = read_questions(args.questions)
    doc = document_ids(tok, text, args.chat, args.system)
    asks = [question_ids(tok, q, args.chat, text, args.system) for q in questions]
    reserve = min(max(map(len, asks)) + args.max_new_tokens - 1, margs.max_seq_len - len(doc))
    check_document(args.method, margs, len(doc), reserve, args.budget, options)
    if not is_quantized(checkpoint):
        check_memory(margs, dtype, device, 1, len(doc) + reserve)
    model = load_model(checkpoint, device, dtype, gguf_weights=args.gguf_weights)
    load_s = time.perf_counter() - t_load
    print(f"load (weights and tokenizer) {load_s:.1f} s", file=sys.stderr, flush=True)
    bar = prefill_bar(model.args.n_layers, len(doc), args.no_progress)
    try:
        first = generate(model, doc, method=args.method, budget=args.budget, max_new_tokens=0,
                         reserve_tokens=reserve, compile=compile, method_options=options,
                         on_prefill_layer=None if bar is None else _bar_step(bar))
    finally:
        if bar is not None:
            bar.close()
    snapshot = CacheSnapshot(model.caches)
    stop_ids = () if args.ignore_eos else (tok.chat_stop_ids if args.chat else tok.stop_ids)
    records: list[dict[str, Any]] = []
    for i, (question, ids) in enumerate(zip(questions, asks), 1):
        write_stdout(f"==> question {i}: {question} <==\n")
        streamer = TextStreamer(tok, stop_ids) if args.stream else None
        rewind_conversation(model, len(doc), snapshot)
        r = generate(model, ids, continue_conversation=True,
                     max_new_tokens=min(args.max_new_tokens, reserve - len(ids) + 1),
                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                     seed=args.seed, stop_ids=stop_ids, compile=compile, on_token=streamer)
        r.update(question=question, text=result_text(tok, r["token_ids"], stop_ids),
                 document_prefill_s=first["prefill_s"])
        if streamer is not None:
            streamer.finish(r["text"][0])
        else:
            write_stdout(r["text"][0] + "\n")
        records.append(r)
        print(f"question {i}: {r['prompt_tokens']} tokens prefilled in "
              f"{r['prefill_s'] * 1e3:.1f} ms, {r['new_tokens']} generated ({r['stop_reason']})",
              file=sys.stderr)
        if r["stop_reason"] == "interrupted":
            break
    summary = prefill_summary(len(doc), first["prefill_s"], records)
    print(summary_line(summary), file=sys.stderr)
    if args.json:
        try:
            write_json(args.json, {"checkpoint": args.checkpoint, "model": model.args.name,
                                   "load_s": load_s, "document": first, **summary,
                                   "questions": records})
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 130 if records[-1]["stop_reason"] == "interrupted" else 0


if __name__ == "__main__":
    tp.exit_now(main()) if tp.launched() else sys.exit(main())
