"""The decode loop (``_run``) and the library call (``generate``): token ids in, a
``report.GenerateResult`` out.

The rest lives beside it: the decode step and its modes in ``step.py`` (``StepMode``: eager,
compiled static or dynamic, a CUDA graph of the eager step), the caches kept between calls in
``session.py`` (``Session``, ``release_caches``, ``rewind_conversation``), the result
(``GenerateResult``, a dataclass) and the text report in ``report.py``; the command line
(``python generate.py``) is ``rocketkv/cli/generate.py``.
The prompt is prefilled once; the first decode steps (``WARMUP_STEPS``) compile the step and
capture its graphs, timed apart (``compile_s``) and left out of the latency figures.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rocketkv import kernels
from rocketkv.engine import kernel_check
from rocketkv.engine.measure import MemoryMeter, StepTimer, sync
from rocketkv.engine.prefill import PrefilledPrompt, as_prompt, store_prefilled
from rocketkv.engine.report import (  # noqa: F401 (SPREAD_WARN, format_report: re-exported)
    SPREAD_WARN,
    GenerateResult,
    format_report,
    result_record,
)
from rocketkv.engine.request import CachePlan, CacheRequest
from rocketkv.engine.session import (  # noqa: F401 (release_caches, rewind_conversation: re-exported)
    CacheSpec,
    Conversation,
    Session,
    prepare_caches,
    release_caches,
    rewind_conversation,
    session,
)
from rocketkv.engine.step import (  # noqa: F401 (re-exported: tests and scripts import them from here)
    DYNAMO_CONFIG,
    WARMUP_STEPS,
    GraphStep,
    Sampling,
    StepConfig,
    StepMode,
    compiled_decode,
    decode_one_token,
    retune_caches,
    sample,
)
from rocketkv.kernels.fuse import fused_layers
from rocketkv.model import ConfigError, Transformer


@torch.no_grad()
def _run(model: Transformer, prefill_fn, B: int, first_pos: int, new_tokens: int, step_fn,
         sampling: Sampling, stop_ids: Tensor, meter: MemoryMeter,
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
    device = model.device
    timer = StepTimer(device)
    meter.reset()
    sync(device)
    draw = sampling.kwargs()  # once: the step's keyword arguments
    t0 = time.perf_counter()
    logits = prefill_fn()
    next_tok = sample(logits, **draw) if new_tokens else None  # (B, 1)
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
    caches = model.caches
    retune_at = first_pos  # the first step checks every cache (it may have been rewound)
    t_warm = time.perf_counter()
    interrupted = False
    try:
        for step in range(new_tokens - 1):
            if check and step % stop_check_every == 0 and bool(done.all()):
                break
            if first_pos + step >= retune_at:  # parameters that follow the cache's length
                changed, retune_at = retune_caches(caches, first_pos + step, force=step == 0)
                if changed and hasattr(step_fn, "recapture"):
                    step_fn.recapture()
            if step == warmup_steps and warmup_steps:
                sync(device)
                compile_s = time.perf_counter() - t_warm
                meter.reset()
            start = timer.start() if step >= warmup_steps else None
            next_tok = step_fn(model, next_tok, input_pos, **draw).clone()
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


def generate(model: Transformer, prompt: Tensor | Sequence[int] | Sequence[Sequence[int]],
             cache: CacheRequest | CachePlan | None = None, *, max_new_tokens: int = 256,
             stop_ids: Sequence[int] = (), sampling: Sampling | None = None,
             step: StepConfig | None = None, continue_conversation: bool = False,
             prefilled: PrefilledPrompt | None = None, on_token=None,
             on_prefill_layer=None) -> GenerateResult:
    """Prefill ``prompt``, then decode until a stop token, ``max_new_tokens`` or the context end.

        generate(model, ids, CacheRequest("rocketkv", 256), max_new_tokens=64)
        generate(model, ids, max_new_tokens=64, sampling=Sampling(0.7, top_p=0.9, seed=0),
                 step=StepConfig(compile=None))

    Args:
        model: a loaded ``Transformer``.
        prompt: token ids, (T,) or (B, T) (B sequences of equal length).
        cache: the KV cache (``request.CacheRequest``: method, budget, options, room reserved
            for later turns; default the full cache), or a request already planned for this
            prompt and ``max_new_tokens`` (``CacheRequest.plan``: the method is not planned
            again). Not given with ``continue_conversation``.
        max_new_tokens: generated tokens at most (the prefill's token included); 0 prefills
            only (the prompt is cached for a later ``continue_conversation`` call).
        stop_ids: a sequence stops after emitting one of these; the run stops when all have.
        sampling: ``step.Sampling`` (temperature, top_k, top_p, seed; default greedy).
        step: how the decode step runs (``step.StepConfig``: eager by default, compiled, a
            CUDA graph; warm-up steps; how often stops are read back). The warm-up steps
            compile the step (or find it compiled) and capture graphs: their time is
            ``compile_s`` and they are left out of every latency and decode-memory figure.
            Prefill runs once.
        continue_conversation: ``prompt`` is the next turn of the conversation the previous
            call left in the model's caches. The last token the previous call generated (not
            yet fed) goes first, then the prompt; the chunk attends to the cache as the method
            left it (``KVCache.append``: an evicting method's earlier prompt stays
            compressed), then decoding goes on. With the full cache this equals one prefill of
            the whole conversation.
        prefilled: the prompt's ``prefill_once`` result: the caches are built from its K/V
            instead of running the prefill again (``prompt`` must be its tokens).
        on_token: called after every generated token with the tokens so far, (B, n) int64 on
            the model's device (a host sync per step: for streaming output, not for timing).
            Ctrl-C (KeyboardInterrupt) during decoding ends the run early: the result holds
            what was generated, ``stop_reason`` ``"interrupted"``.
        on_prefill_layer: called with i after prefill layer i (progress; not called when
            the caches are built from ``prefilled``).
    Returns:
        a ``report.GenerateResult`` dataclass, read as attributes (``result.tokens_per_s``;
        ``result.to_dict()`` is the ``--json`` record; ``result["key"]`` still reads it, for
        compatibility, but it cannot be changed), with ``token_ids`` (per sequence, stop token
        included), ``prefill_s``, ``decode_ms`` (one entry per decode step), summary
        latencies, ``tokens_per_s``, ``peak_memory_bytes`` {prefill, decode, total}, the bytes
        the caches and weights hold and read per step, the method's parameters,
        ``conversation`` {start, position, room} and ``kernels`` (per kernel family what ran:
        ``kernels.report``, after the first-use self-check ``kernel_check.ensure``).
    Raises:
        ConfigError: empty prompt, prompt that leaves no room in the model's context, bad
            ``max_new_tokens``, a budget too small for the prompt, a plan made for another
            prompt or length, nothing to continue or a turn that does not fit the reserved
            room, a cache given to a continuation, a ``prefilled`` result of another prompt, a
            compiled step for caches that cannot be compiled. (A bad method, budget, option or
            sampling setting is refused when its ``CacheRequest`` or ``Sampling`` is made.)
        kernels.KernelCheckError: a kernel family failed its self-check with
            ``kernels.set_strict(True)`` (``--kernels on``), or left a sticky CUDA error.
    """
    device = model.device
    prompt = as_prompt(model, prompt)
    sampling = Sampling() if sampling is None else sampling
    step = StepConfig() if step is None else step
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must not be negative, got {max_new_tokens}")
    meter = MemoryMeter(device)
    meter.reset()
    if continue_conversation:
        if prefilled is not None:
            raise ConfigError("prefilled applies to the first turn, not to a continuation")
        if cache is not None:
            raise ConfigError("a continuation runs on the conversation's caches: pass no "
                              "cache")
        turn = _next_turn(model, prompt, max_new_tokens, on_prefill_layer)
    else:
        turn = _first_turn(model, prompt, cache, max_new_tokens, prefilled, meter,
                           on_prefill_layer)
    peak_setup = meter.peak()
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    compilable = all(c.compilable for c in model.caches)
    mode = step.mode(compilable)
    if mode is not StepMode.EAGER and not compilable:
        raise ConfigError("this method's decode step synchronizes with the host and runs "
                          "eagerly: use --no-compile")
    ran = kernel_check.ensure(model)  # first use: a failing family falls back to PyTorch
    fused = kernels.in_use(device)  # imports the kernels now, outside the graph being traced
    dense = kernels.dense_in_use(device)
    step_fn, warmup_steps = mode.step(device, step.backend, step.warmup_steps)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    first_pos = turn.start + turn.chunk.shape[1]
    run = _run(model, turn.prefill_fn, prompt.shape[0], first_pos, turn.new_tokens, step_fn,
               sampling, stop, meter, warmup_steps=warmup_steps, on_token=on_token,
               stop_check_every=step.stop_check_every)
    spec = turn.state.spec
    end = spec.positions  # positions the caches hold
    turn.state.conversation = Conversation(batch_size=prompt.shape[0], pending=run["pending"],
                                           position=run["position"], end=end)
    if getattr(step_fn, "fault", None):  # a kernel failed to compile: the PyTorch path ran
        fused = dense = False
        ran = {f: v if v == "unused" else f"pytorch (compile: {step_fn.fault})"
               for f, v in ran.items()}
    dense = dense and fused_layers(model) > 0
    if ran["dense"] == "fused" and not dense:
        ran["dense"] = "pytorch (no layer the dense kernels take)"
    conversation = {"start": turn.start, "position": run["position"],
                    "room": end - run["position"] - (run["pending"] is not None)}
    return result_record(model, spec, prompt, run, stop_ids=stop_ids,
                         max_new_tokens=max_new_tokens, limit_reason=turn.limit_reason,
                         conversation=conversation, shared=turn.shared, peak_setup=peak_setup,
                         memory_kind=meter.kind, mode=mode, fused=fused, dense=dense,
                         kernels=ran)


@dataclass
class _Turn:
    """What ``generate`` feeds and decodes: ``chunk`` (B, Tc) at positions ``start ..``,
    filled into the caches by ``prefill_fn() -> logits``, then up to ``new_tokens`` tokens;
    ``limit_reason`` is the stop reason when the room ends first."""

    state: Session
    chunk: Tensor
    start: int
    new_tokens: int
    prefill_fn: Any
    limit_reason: str
    shared: bool = False  # the caches are built from a shared prefill (``prefilled``)


def cache_spec(model: Transformer, cache: CacheRequest | CachePlan | None, batch_size: int,
               prompt_len: int, max_new_tokens: int) -> tuple[CacheSpec, int]:
    """The caches' spec for ``batch_size`` prompts of ``prompt_len`` tokens and up to
    ``max_new_tokens`` new ones (as many as the context leaves room for) plus the request's
    reserve, and those new tokens: ``cache`` planned here unless it is a plan already (then
    checked against this prompt and model). Shared by ``generate`` and the batch decoder.

    Raises:
        ConfigError: what planning refuses; a plan made for another prompt length or model.
    """
    T = prompt_len
    shard = getattr(model, "tp", None)  # the method's parameters are the whole model's
    args = shard["args"] if shard else model.args
    if isinstance(cache, CachePlan):
        plan = cache
        request = plan.request
        new_tokens = min(max_new_tokens, request.room(args, T))
        plan.check_run(args, T, new_tokens + request.reserve_tokens)
    else:
        request = CacheRequest() if cache is None else cache
        plan = request.plan(args, prompt_len=T, max_new_tokens=max_new_tokens)
        new_tokens = plan.new_tokens - request.reserve_tokens
    spec = CacheSpec(method=request.method, budget=request.budget, batch_size=batch_size,
                     prompt_len=T, new_tokens=plan.new_tokens, dtype=model.dtype,
                     device=model.device, options=dict(request.options), params=plan.params)
    return spec, new_tokens


def _first_turn(model: Transformer, prompt: Tensor, cache: CacheRequest | CachePlan | None,
                max_new_tokens: int, prefilled: PrefilledPrompt | None, meter: MemoryMeter,
                on_layer=None) -> _Turn:
    """The caches ``cache`` asks for, for ``prompt`` and up to ``max_new_tokens`` (as many as
    the context leaves room for) plus the request's reserve, planned here unless ``cache`` is
    a plan for them; prefilled by the model or from ``prefilled``."""
    B, T = prompt.shape
    if prefilled is not None and not torch.equal(prefilled.tokens, prompt):
        raise ConfigError("prefilled holds another prompt than the one given")
    spec, new_tokens = cache_spec(model, cache, B, T, max_new_tokens)
    state = prepare_caches(model, spec, meter)
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
    state = session(model)
    conv = None if state is None else state.conversation
    if conv is None:
        raise ConfigError("no conversation to continue: the previous generate() call must "
                          "leave its caches (a prefill_once or another model run since "
                          "drops them)")
    if prompt.shape[0] != conv.batch_size:
        raise ConfigError(f"the conversation has {conv['batch_size']} sequences, the "
                          f"prompt {prompt.shape[0]}")
    chunk = prompt if conv.pending is None else torch.cat([conv.pending, prompt], 1)
    start = conv.position
    room = conv.end - start
    if chunk.shape[1] > room:
        raise ConfigError(f"the turn ({chunk.shape[1]} tokens with the pending generated "
                          f"token) exceeds the conversation's room ({room} tokens); pass "
                          "a larger reserve_tokens to the first call")
    new_tokens = min(max_new_tokens, room - chunk.shape[1] + 1)
    return _Turn(state, chunk, start, new_tokens,
                 lambda: model.prefill(chunk, start=start, on_layer=on_layer), "reserve")
