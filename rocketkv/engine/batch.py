"""Continuous batching: requests with different prompts, methods and budgets decode together,
joining and leaving between steps (``BatchDecoder``).

Each request keeps caches of its own (its method, its budget, batch size 1), built and filled
by the same prefill as a single run. A batched decode step runs what the requests share in
one call over all of them: the embedding, the norms, the q/k/v, output and MLP projections,
the LM head; RoPE rotates each request's token at its own position; then each request's
caches attend for it (``KVCache.decode``, the single run's call). So a method needs nothing to
join a batch, and any mix of methods and budgets decodes together; the weights are read once
per step for the whole batch, which is where decoding spends its time at short and medium
contexts (the attention is per request, as its cache is).

A request's prefill runs between decode steps, layer by layer: after every
``prefill_layers`` layers of a new prompt one decode step of the running requests runs, so a
long prompt delays each running request's next token by those layers, not by its whole
prefill.

Greedy answers equal the single run's when the matrix products give each row the same bits
whatever the batch (``tests/test_batch.py`` checks this; a product whose kernel depends on the
row count, as the float LM head on a CPU may, can differ in the last bits and so change an
answer at a near tie: the load test counts them, ``results/serve/``). Sampled requests draw
from a generator of their own (seeded by ``Sampling.seed``), so their draws do not depend on
the batch, but they do not repeat a single run's draws.

The decode step is eager (not compiled: its shapes change as requests join and leave).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rocketkv.compression import build_caches
from rocketkv.engine.checks import Run
from rocketkv.engine.generate import cache_spec
from rocketkv.engine.measure import MemoryMeter
from rocketkv.engine.prefill import PrefilledPrompt, store_prefilled
from rocketkv.engine.report import GenerateResult, result_record
from rocketkv.engine.session import CacheSpec, prepare_caches, release_caches
from rocketkv.engine.step import StepMode, retune_caches, sample
from rocketkv.model import ConfigError, Transformer

PREFILL_LAYERS = 4  # prefill layers of a new prompt between two decode steps of the batch


class KVCapacityError(ConfigError):
    """A request whose KV cache alone exceeds the batch's ``max_kv_bytes``: it could never be
    admitted (the server answers 503)."""


def kv_bytes(model: Transformer, run: Run) -> int:
    """Bytes the KV caches of ``run`` will hold (device and host: ``allocated_bytes`` plus
    ``host_bytes`` over its layers), from caches built on the meta device with its plan
    (nothing allocated). The prefill's transient K/V is not counted."""
    plan = run.plan
    request = plan.request
    caches = build_caches(request.method, model.args, batch_size=run.batch_size,
                          prompt_len=len(run.ids), max_new_tokens=plan.new_tokens,
                          budget=request.budget, dtype=model.dtype, device="meta",
                          planned=plan.params, **dict(request.options))
    return sum(c.allocated_bytes() + c.host_bytes() for c in caches)


@dataclass(eq=False)
class BatchSlot:
    """One request in a ``BatchDecoder``: its run, its caches and where its answer stands.

    Attributes:
        run: the request (``checks.Run``: prompt ids, cache plan, sampling, stop ids).
        tokens: generated token ids so far (the stop token included when one ended it).
        done: the request has finished (``stop_reason`` set) or failed (``error`` set).
        result: its ``report.GenerateResult`` once finished.
        error: the exception that ended it (``on_token`` raised, or the step failed).
    """

    run: Run
    spec: CacheSpec
    caches: list
    new_tokens: int  # tokens it may generate (the run's, within the context)
    kv_bytes: int  # what its caches hold (``kv_bytes``), device and host
    limit_reason: str
    on_token: Callable[[Tensor], Any] | None
    on_done: Callable[[BatchSlot], Any] | None
    generator: torch.Generator | None
    shared: bool
    position: int = 0  # the position its next fed token is written at
    pos_t: Tensor | None = None  # (1,) int64: ``position`` on the model's device
    next_tok: Tensor | None = None  # (1, 1) int64: the token fed at the next step
    tokens: list[int] = field(default_factory=list)
    retune_at: int = 0
    first: bool = True  # its first decode step (caches asked to retune with force)
    prefill_s: float = 0.0
    decode_ms: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    peak_prefill: int = 0
    done: bool = False
    result: GenerateResult | None = None
    error: BaseException | None = None


class BatchDecoder:
    """Decodes any number of requests together, one step for all (see the module's
    docstring). Not thread-safe: one thread calls ``admit`` and ``step`` (the server's engine
    thread, ``serve.app``).

        decoder = BatchDecoder(model)
        a = decoder.admit(run_a)          # prefilled, first token drawn
        b = decoder.admit(run_b)
        while decoder.running:
            decoder.step()                # both decode; finished ones leave
        a.result.token_ids, b.result.token_ids

    Args:
        model: a loaded ``Transformer``; its own caches (``generate``'s session) are released
            when a request is admitted.
        max_batch: requests decoded together at most (``admit`` refuses more).
        prefill_layers: a new prompt's prefill layers between two decode steps of the
            running requests (``PREFILL_LAYERS``); 0: the prefill runs whole.
    """

    def __init__(self, model: Transformer, *, max_batch: int = 8,
                 prefill_layers: int = PREFILL_LAYERS):
        if max_batch < 1:
            raise ConfigError(f"--max-batch must be positive, got {max_batch}")
        if getattr(model, "tp", None):
            raise ConfigError("continuous batching runs on one process, not under tensor "
                              "parallelism")
        self.model = model
        self.max_batch = max_batch
        self.prefill_layers = prefill_layers
        self.running: list[BatchSlot] = []
        self.meter = MemoryMeter(model.device)
        self.steps = 0  # decode steps run
        self.step_tokens = 0  # tokens they produced
        self.step_s = 0.0  # seconds they took

    def room(self) -> int:
        """Requests that may still be admitted."""
        return self.max_batch - len(self.running)

    def kv_bytes_held(self) -> int:
        """Bytes the running requests' caches hold."""
        return sum(s.kv_bytes for s in self.running)

    @torch.no_grad()
    def admit(self, run: Run, *, on_token: Callable[[Tensor], Any] | None = None,
              on_done: Callable[[BatchSlot], Any] | None = None,
              prefilled: PrefilledPrompt | None = None) -> BatchSlot:
        """Build ``run``'s caches, prefill its prompt (one decode step of the running requests
        after every ``prefill_layers`` of its layers) and draw its first token; it decodes with
        the others from the next ``step`` on.

        Args:
            run: one sequence (``batch_size`` 1), planned for this model (``checks.plan_run``).
            on_token: called with the request's tokens so far, (1, n) int64, after each one;
                an exception it raises ends the request (``BatchSlot.error``), not the batch.
            on_done: called with the slot when it finishes or fails.
            prefilled: the prompt's ``prefill_once`` result (a prefix cache's): the caches are
                built from its K/V, no prefill runs.
        Returns:
            the request's ``BatchSlot`` (already done when its first token ended it).
        Raises:
            ConfigError: a batch of copies, the batch full, a plan made for another model or
                prompt, a cache that cannot be built.
        """
        if run.batch_size != 1:
            raise ConfigError("a batched request is one sequence (batch_size 1)")
        if not self.room():
            raise ConfigError(f"the batch is full ({self.max_batch} requests)")
        model, device = self.model, self.model.device
        prompt = torch.tensor([run.ids], dtype=torch.long, device=device)
        T = prompt.shape[1]
        spec, new_tokens = cache_spec(model, run.plan, 1, T, run.max_new_tokens)
        release_caches(model)  # another request's caches may not be reused for this one
        prepare_caches(model, spec)
        caches = model.caches
        if prefilled is not None and not all(c.shared_prefill for c in caches):
            prefilled = None
        generator = None
        if not run.sampling.greedy:
            generator = torch.Generator(device=device)
            if run.sampling.seed is not None:
                generator.manual_seed(run.sampling.seed)
            else:
                generator.seed()
        slot = BatchSlot(run=run, spec=spec, caches=caches, new_tokens=new_tokens,
                         kv_bytes=sum(c.allocated_bytes() + c.host_bytes() for c in caches),
                         limit_reason="context_length", on_token=on_token, on_done=on_done,
                         generator=generator, shared=prefilled is not None)
        t0 = time.perf_counter()
        try:
            if prefilled is not None:
                if not torch.equal(prefilled.tokens, prompt):
                    raise ConfigError("prefilled holds another prompt than the one given")
                logits = store_prefilled(model, prefilled)
            else:
                logits = model.prefill(prompt, on_layer=self._between_layers)
        finally:
            release_caches(model)  # the slot holds them; the model's layers hold none
        slot.prefill_s = time.perf_counter() - t0
        slot.peak_prefill = self.meter.peak()
        slot.position, slot.retune_at = T, T
        slot.pos_t = torch.tensor([T], dtype=torch.long, device=device)
        if new_tokens == 0:
            self._finish(slot)
            return slot
        self._take(slot, self._draw(slot, logits))
        if not slot.done:
            self.running.append(slot)
        return slot

    def _between_layers(self, i: int) -> None:
        """A prefill's ``on_layer``: a decode step of the running requests every
        ``prefill_layers`` layers (not after the last: the new request joins then)."""
        if (self.prefill_layers and self.running and (i + 1) % self.prefill_layers == 0
                and i + 1 < self.model.args.n_layers):
            try:
                self.step()
            except Exception:  # the running requests have the error, not the new one
                pass

    def _draw(self, slot: BatchSlot, logits: Tensor) -> int:
        """The request's next token from its logits (1, vocab)."""
        s = slot.run.sampling
        tok = sample(logits, **s.kwargs(), generator=slot.generator)
        return int(tok)

    def _take(self, slot: BatchSlot, tok: int) -> None:
        """Record the request's new token ``tok``; finish it at a stop token or its limit."""
        slot.tokens.append(tok)
        slot.next_tok = torch.tensor([[tok]], dtype=torch.long, device=self.model.device)
        if slot.on_token is not None:
            try:
                slot.on_token(torch.tensor([slot.tokens], dtype=torch.long))
            except BaseException as e:  # the caller ends it (a client gone): not the batch
                self._fail(slot, e)
                return
        if tok in slot.run.stop_ids or len(slot.tokens) >= slot.new_tokens:
            self._finish(slot)

    @torch.no_grad()
    def step(self) -> list[BatchSlot]:
        """One decode step of every running request; returns those that finished at it.

        Raises whatever the step raised after failing every running request with it (a
        fault in a shared projection cannot be pinned on one request)."""
        slots = list(self.running)
        if not slots:
            return []
        t0 = time.perf_counter()
        try:
            for s in slots:
                if s.position >= s.retune_at:  # parameters that follow the cache's length
                    _, s.retune_at = retune_caches(s.caches, s.position, force=s.first)
                s.first = False
            logits = self._forward(slots)
            toks = [self._draw(s, logits[j:j + 1]) for j, s in enumerate(slots)] \
                if any(s.generator is not None for s in slots) \
                else logits.argmax(dim=-1).tolist()
        except BaseException as e:
            for s in slots:
                self._fail(s, e)
            raise
        ms = (time.perf_counter() - t0) * 1e3
        self.steps += 1
        self.step_tokens += len(slots)
        self.step_s += ms / 1e3
        finished = []
        for s, tok in zip(slots, toks):
            s.decode_ms.append(ms)
            s.batch_sizes.append(len(slots))
            s.position += 1
            s.pos_t += 1
            self._take(s, tok)
            if s.done:
                finished.append(s)
        return finished

    def _forward(self, slots: list[BatchSlot]) -> Tensor:
        """The batched decode step: logits (N, vocab) for the N requests' next tokens, each at
        its own position (``Transformer.forward``'s computation, row by row for RoPE and the
        caches)."""
        model = self.model
        tokens = torch.cat([s.next_tok for s in slots])  # (N, 1)
        pos = torch.tensor([s.position for s in slots], dtype=torch.long, device=model.device)
        rope = model.rope[pos]  # (N, D/2, 2): one position per request
        x = model.tok_embeddings(tokens)  # (N, 1, dim)
        for i, layer in enumerate(model.layers):
            attn = layer.attention
            # the N tokens as one sequence of N positions: one projection, RoPE row by row
            q, k, v = attn.qkv(layer.attention_norm(x).transpose(0, 1), rope)
            q, k, v = q.transpose(0, 2), k.transpose(0, 2), v.transpose(0, 2)  # (N, H, 1, D)
            y = torch.cat([s.caches[i].decode(q[j:j + 1], k[j:j + 1], v[j:j + 1], s.pos_t)
                           for j, s in enumerate(slots)])  # (N, H, 1, D)
            h = x + attn.out(y)
            x = h + layer.feed_forward(layer.ffn_norm(h))
        return model.output(model.norm(x))[:, -1]

    def _fail(self, slot: BatchSlot, error: BaseException) -> None:
        slot.error = error
        self._leave(slot)

    def _finish(self, slot: BatchSlot) -> None:
        slot.result = self._record(slot)
        self._leave(slot)

    def _leave(self, slot: BatchSlot) -> None:
        slot.done = True
        if slot in self.running:
            self.running.remove(slot)
        slot.caches = []  # its memory is free once the caller lets go of the result
        if slot.on_done is not None:
            slot.on_done(slot)

    def _record(self, slot: BatchSlot) -> GenerateResult:
        """The request's ``GenerateResult``, as a single run reports it; its decode latencies
        are the batched steps it took part in (``batch_sizes``: how many requests each
        carried), its memory peaks the process's while it ran (shared with the batch)."""
        n = len(slot.tokens)
        run = {"tokens": [list(slot.tokens)], "prefill_s": slot.prefill_s,
               "decode_ms": slot.decode_ms, "peak_prefill": slot.peak_prefill,
               "peak_decode": self.meter.peak(), "compile_s": None, "warmup_steps": 0,
               "interrupted": False, "pending": None,
               "position": slot.spec.prompt_len + max(n - 1, 0)}
        prompt = torch.tensor([slot.run.ids], dtype=torch.long)
        conversation = {"start": 0, "position": run["position"],
                        "room": slot.spec.positions - run["position"]}
        return result_record(self.model, slot.spec, prompt, run, stop_ids=slot.run.stop_ids,
                          max_new_tokens=slot.run.max_new_tokens,
                          limit_reason=slot.limit_reason, conversation=conversation,
                          shared=slot.shared, peak_setup=0,
                          memory_kind=self.meter.kind + " (shared by the batch)",
                          mode=StepMode.EAGER, fused=False, dense=False,
                          kernels={}, caches=slot.caches,
                          batch_sizes=list(slot.batch_sizes))


@dataclass(eq=False)
class _Job:
    run: Run
    future: Future
    on_token: Callable[[Tensor], Any] | None
    prepare: Callable[[Callable[[int], Any]], PrefilledPrompt | None] | None
    finish: Callable[[GenerateResult], Any] | None
    kv_bytes: int


class Batcher:
    """A ``BatchDecoder`` on a thread of its own, fed by a queue: ``submit`` returns a
    ``concurrent.futures.Future`` at once; the thread admits waiting requests while the batch
    has room (in the order they came) and steps the batch while any runs. The server's
    engine thread (``serve.app``, ``--max-batch``).

    Admission by KV bytes (``max_kv_bytes``): each request's caches are sized when it is
    submitted (``kv_bytes``: its method, budget, prompt and answer length); the request at the
    head of the queue is admitted when the running requests' caches and its own fit, else it
    and those behind it wait (first come, first served: a large request is not passed over
    forever). One that could not fit even alone is refused at once (``KVCapacityError``).

    Args:
        model, max_batch, prefill_layers: the ``BatchDecoder``'s.
        max_kv_bytes: bytes the running requests' caches may hold together; None: no limit.
    """

    def __init__(self, model: Transformer, *, max_batch: int = 8,
                 prefill_layers: int = PREFILL_LAYERS, max_kv_bytes: int | None = None):
        if max_kv_bytes is not None and max_kv_bytes <= 0:
            raise ConfigError(f"--max-kv-mib must be positive, got {max_kv_bytes / 2**20:g}")
        self.max_kv_bytes = max_kv_bytes
        self.decoder = BatchDecoder(model, max_batch=max_batch, prefill_layers=prefill_layers)
        self._queue: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rocketkv-batch", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Requests decoding now."""
        return len(self.decoder.running)

    def submit(self, run: Run, *, on_token: Callable[[Tensor], Any] | None = None,
               prepare: Callable[[Callable[[int], Any]], PrefilledPrompt | None] | None = None,
               finish: Callable[[GenerateResult], Any] | None = None) -> Future:
        """Queue ``run``; the future's result is its ``GenerateResult`` (through ``finish``
        when given, called on the batch thread), its exception what ended it. ``cancel()``
        on the future withdraws a request not yet admitted. ``prepare(on_layer)``, called on
        the batch thread when the request is admitted, may return the prompt's prefilled
        K/V (a prefix cache's) to build its caches from; its prefill should call
        ``on_layer(i)`` after layer i (the batch decodes between layers).

        Raises:
            KVCapacityError: its caches alone exceed ``max_kv_bytes``.
            ConfigError: the batcher is closed.
        """
        need = kv_bytes(self.decoder.model, run)
        if self.max_kv_bytes is not None and need > self.max_kv_bytes:
            raise KVCapacityError(
                f"this request's KV cache needs {need / 2**20:.1f} MiB, more than the "
                f"{self.max_kv_bytes / 2**20:.1f} MiB the server holds for all requests "
                "(--max-kv-mib): a smaller budget, prompt or max_tokens fits")
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise ConfigError("the engine is shutting down")
            self._queue.append(_Job(run, future, on_token, prepare, finish, need))
            self._wake.notify()
        return future

    def close(self, wait: bool = True) -> None:
        """Admit nothing more (queued requests are cancelled); with ``wait``, return once the
        running requests have finished."""
        with self._wake:
            self._closed = True
            while self._queue:
                self._queue.popleft().future.cancel()
            self._wake.notify()
        if wait:
            self._thread.join()

    def _loop(self) -> None:
        dec = self.decoder
        while True:
            with self._wake:
                while not self._queue and not dec.running and not self._closed:
                    self._wake.wait()
                if self._closed and not dec.running:
                    return
                jobs = []
                held = dec.kv_bytes_held()
                while self._queue and len(jobs) < dec.room():
                    if self._queue[0].future.cancelled():
                        self._queue.popleft()
                        continue
                    need = self._queue[0].kv_bytes
                    if self.max_kv_bytes is not None and held + need > self.max_kv_bytes \
                            and (dec.running or jobs):
                        break  # waits for running requests to leave
                    held += need
                    jobs.append(self._queue.popleft())
            for job in jobs:
                if job.future.set_running_or_notify_cancel():
                    self._admit(job)
            try:
                dec.step()
            except Exception:  # every running request has the error (their futures)
                pass

    def _admit(self, job: _Job) -> None:
        def done(slot: BatchSlot) -> None:
            if slot.error is not None:
                job.future.set_exception(slot.error)
                return
            try:
                job.future.set_result(slot.result if job.finish is None
                                      else job.finish(slot.result))
            except BaseException as e:
                job.future.set_exception(e)

        try:
            prefilled = None if job.prepare is None else \
                job.prepare(self.decoder._between_layers)
            self.decoder.admit(job.run, on_token=job.on_token, on_done=done,
                               prefilled=prefilled)
        except BaseException as e:
            if not job.future.done():
                job.future.set_exception(e)
