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


def generate(model: Transformer, prompt: Tensor | Sequence[int] | Sequence[Sequence[int]], *,
             method: str = "full", budget: int | None = None, max_new_tokens: int = 256,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, stop_ids: Sequence[int] = (), compile: bool | None = False,
             compile_backend: Any = None, method_options: dict[str, Any] | None = None,
             warmup_steps: int = WARMUP_STEPS, reserve_tokens: int = 0,
             continue_conversation: bool = False,
             prefilled: PrefilledPrompt | None = None, on_token=None,
             stop_check_every: int = 1, compile_dynamic: bool | None = None,
             on_prefill_layer=None, cuda_graphs: bool = False) -> GenerateResult:
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
        compile_dynamic: None or False (default): the first compile has static shapes and a
            later call with other sizes recompiles once with them symbolic (``DYNAMO_CONFIG``);
            True: symbolic from the first call; the compiled step is shared per setting.
            ``compile``, ``cuda_graphs`` and ``compile_dynamic`` name one ``step.StepMode``
            (``StepMode.options`` gives them for a mode).
        warmup_steps: decode steps left out of the figures when compiling (default 3: CUDA
            graph trees run a step, record the next, and replay from the third).
        reserve_tokens: extra cache room (tokens) for later turns of the conversation. The
            caches hold prompt + max_new_tokens + reserve_tokens positions; the room changes
            buffer sizes only, never a method's parameters (they follow the tokens in the
            cache: ``compression.decode_horizon``).
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
            ``max_new_tokens`` or ``reserve_tokens``, unknown method or invalid budget, nothing
            to continue or a turn that does not fit the reserved room, a ``prefilled`` result
            of another prompt.
        kernels.KernelCheckError: a kernel family failed its self-check with
            ``kernels.set_strict(True)`` (``--kernels on``), or left a sticky CUDA error.
    """
    device = model.device
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
        spec = CacheSpec(method=method, budget=budget, batch_size=prompt.shape[0],
                         prompt_len=prompt.shape[1], new_tokens=reserve_tokens,
                         dtype=model.dtype, device=device, options=dict(method_options or {}))
        turn = _first_turn(model, prompt, spec, max_new_tokens, prefilled, meter,
                           on_prefill_layer)
    peak_setup = meter.peak()
    sampling = Sampling(temperature, top_k, top_p)
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    compilable = all(c.compilable for c in model.caches)
    mode = StepMode.of(compilable if compile is None else compile, cuda_graphs, compile_dynamic)
    if mode is not StepMode.EAGER and not compilable:
        raise ConfigError("this method's decode step synchronizes with the host and runs "
                          "eagerly: use --no-compile")
    ran = kernel_check.ensure(model)  # first use: a failing family falls back to PyTorch
    fused = kernels.in_use(device)  # imports the kernels now, outside the graph being traced
    dense = kernels.dense_in_use(device)
    step_fn, warmup_steps = mode.step(device, compile_backend, warmup_steps)
    if seed is not None:
        torch.manual_seed(seed)
    first_pos = turn.start + turn.chunk.shape[1]
    run = _run(model, turn.prefill_fn, prompt.shape[0], first_pos, turn.new_tokens, step_fn,
               sampling, stop, meter, warmup_steps=warmup_steps, on_token=on_token,
               stop_check_every=stop_check_every)
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


def _first_turn(model: Transformer, prompt: Tensor, spec: CacheSpec, max_new_tokens: int,
                prefilled: PrefilledPrompt | None, meter: MemoryMeter, on_layer=None) -> _Turn:
    """The caches of ``spec`` for ``prompt`` (``spec.new_tokens`` holds the reserve, to
    which the new tokens are added), prefilled by the model or from ``prefilled``."""
    T, context = prompt.shape[1], model.args.max_seq_len
    reserve = spec.new_tokens
    if prefilled is not None and not torch.equal(prefilled.tokens, prompt):
        raise ConfigError("prefilled holds another prompt than the one given")
    new_tokens = min(max_new_tokens, context - T)  # prompt + generated fit the context
    if T + new_tokens + reserve > context:
        raise ConfigError(f"prompt {T} + new tokens {new_tokens} + reserve_tokens "
                          f"{reserve} exceed the model's context ({context} tokens)")
    state = prepare_caches(model, spec.replace(new_tokens=new_tokens + reserve), meter)
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
