"""The decode step and how it runs: sampling (``sample``), the step (``decode_one_token``),
and the step modes (``StepMode``: eager, compiled with static or dynamic shapes, or the eager
step captured in a CUDA graph, ``GraphStep``), shared by ``generate.generate`` and
``scripts/bench.py``'s ``--compile-regime`` (whose values are the modes' names, ``REGIMES``).

The compiled step is ``torch.compile(fullgraph=True)`` (``mode="reduce-overhead"``, i.e. CUDA
graphs, on GPU); its shapes never depend on data and ``input_pos`` is a device tensor, so it
compiles once per run. Compilation and graph capture happen in the first decode steps
(``WARMUP_STEPS``), which ``generate`` times apart (``compile_s``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rocketkv import kernels
from rocketkv.cache.base import NEVER
from rocketkv.engine.step_ledger import persistent_inductor_cache
from rocketkv.model import ConfigError, Transformer

WARMUP_STEPS = 3  # decode steps that compile and capture graphs, excluded from the figures


@dataclass(frozen=True)
class Sampling:
    """How a run draws its next tokens (``sample``): ``temperature`` (0: greedy), ``top_k``
    and ``top_p`` (None: off), ``seed`` (None: torch's generator as it stands). ``kwargs()``
    passes the first three to ``sample`` and the decode step.

    Raises:
        ConfigError: when made: a negative or infinite temperature, ``top_k`` not positive,
            ``top_p`` outside (0, 1] (in the command line's words: ``--top-k must be ...``).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k <= 0:
            raise ConfigError(f"--top-k must be positive, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must lie in (0, 1], got {self.top_p}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"--temperature must be a finite number >= 0, got "
                              f"{self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def kwargs(self) -> dict[str, float | int | None]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass(frozen=True)
class StepConfig:
    """How ``generate``'s decode loop runs its steps.

    Attributes:
        compile: compile the decode step (CUDA graphs on GPU); None: compiled when every cache
            of the method can be (``KVCache.compilable``), else eager. Default False (eager).
        cuda_graphs: instead of compiling, capture the eager step in a CUDA graph
            (``GraphStep``; CUDA only; ``compile`` is then ignored); its first 2 steps are the
            warm-up.
        compile_dynamic: None or False: the first compile has static shapes and a later call
            with other sizes recompiles once with them symbolic (``DYNAMO_CONFIG``); True:
            symbolic from the first call.
        backend: a ``torch.compile`` backend (tests use a counting backend); None: inductor.
        warmup_steps: decode steps that compile the step and capture graphs, timed apart as
            ``compile_s`` and left out of every latency and decode-memory figure.
        stop_check_every: with stop tokens, read whether every sequence has stopped every N
            decode steps (a host sync each time); the result is the same, the steps run past
            the stop are dropped.
    Raises:
        ConfigError: when made: ``warmup_steps`` negative, ``stop_check_every`` below 1.
    """

    compile: bool | None = False
    cuda_graphs: bool = False
    compile_dynamic: bool | None = None
    backend: Any = None
    warmup_steps: int = WARMUP_STEPS
    stop_check_every: int = 1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must not be negative, got {self.warmup_steps}")
        if self.stop_check_every < 1:
            raise ConfigError(f"stop_check_every must be at least 1, got "
                              f"{self.stop_check_every}")

    @classmethod
    def of(cls, mode: StepMode, **changes: Any) -> StepConfig:
        """The config that runs ``mode`` (``StepMode.options``), with ``changes``."""
        return cls(**{**mode.options, **changes})

    def replace(self, **changes: Any) -> StepConfig:
        return dataclasses.replace(self, **changes)

    def mode(self, compilable: bool) -> StepMode:
        """The step mode for caches that can (``compilable``) or cannot be compiled."""
        return StepMode.of(compilable if self.compile is None else self.compile,
                           self.cuda_graphs, self.compile_dynamic)


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Next tokens (B, 1) int64 from logits (B, vocab); greedy when ``temperature == 0``.

    Sampling draws with the exponential trick (argmax of p / Exp(1)), so no host sync;
    ``generator``: the draws' source (None: torch's default generator).
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
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1, keepdim=True)


def decode_one_token(model: Transformer, tokens: Tensor, input_pos: Tensor, temperature: float,
                     top_k: int | None, top_p: float | None) -> Tensor:
    """One decode step: tokens (B, 1) at ``input_pos`` (1,) -> next tokens (B, 1)."""
    return sample(model(tokens, input_pos), temperature, top_k, top_p)


class FallbackStep:
    """A compiled decode step (called as ``decode_one_token``) that outlives a fused kernel
    which fails to compile: when a call raises a Triton error (``kernels.compile_fault``:
    torch.compile's Inductor raises its own error from the kernel's, before the step runs, so
    nothing of the step has happened), one ``warning:`` line goes to stderr, every kernel
    family is switched off on the device for the process (``kernels.switch_off``, by
    "compile"; a result's ``kernels`` entry says so), Dynamo's caches are reset and the same
    call compiles the PyTorch path. A CUDA error (the context may be lost), a second fault,
    any other error, or ``--kernels on`` (``kernels.strict``) is raised. Made by
    ``StepMode.step`` for the compiled modes. On the H200 (2026-11-27) the prefix
    attention failed to compile this way in float32 (an fp64 scale), ending the run."""

    def __init__(self, step, device: torch.device):
        self.step, self.device = step, device
        self.fault: str | None = None  # the reason it fell back, once it has

    def __call__(self, model: Transformer, tokens: Tensor, input_pos: Tensor, *args, **kw):
        try:
            return self.step(model, tokens, input_pos, *args, **kw)
        except Exception as e:
            reason = kernels.compile_fault(e)
            if reason is None or self.fault is not None or kernels.strict():
                raise
        self.fault = reason
        print(f"warning: a fused kernel failed to compile in the decode step ({reason}); the "
              f"kernels are off on {self.device} for this process and the step compiles the "
              "PyTorch path", file=sys.stderr)
        for family in kernels.FAMILIES:
            kernels.switch_off(family, self.device, reason, by="compile")
        torch._dynamo.reset()
        return self.step(model, tokens, input_pos, *args, **kw)


def retune_caches(caches: Sequence[nn.Module], input_pos: int, force: bool = False
                  ) -> tuple[bool, int]:
    """Ask each cache for the decode parameters of the step that writes ``input_pos``
    (``KVCache.retune_for``: parameters that follow the cache's length; ``force`` at a call's
    first step). Returns whether a cache changed its tensors (a captured step must be
    recaptured) and the next position at which to ask (the least ``retune_at``)."""
    changed = False
    for c in caches:
        changed |= c.retune_for(input_pos, force=force)
    return changed, min((c.retune_at for c in caches), default=NEVER)


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
        StepMode.GRAPHS.check_device(device, "a CUDA graph (--cuda-graphs, --compile-regime "
                                     "graphs)")
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False

    def recapture(self) -> None:
        """Capture the step again at the next call (a cache changed its tensors:
        ``KVCache.retune_for``)."""
        self.graph, self.warm = None, False

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


def _block(layer: nn.Module, x: Tensor, rope: Tensor, input_pos: Tensor) -> Tensor:
    """One decoder layer's decode step (``Transformer.forward``'s ``block``)."""
    return layer(x, rope, input_pos)


class LayerCompiledStep:
    """``decode_one_token`` with each decoder layer run through one compiled graph (regional
    compilation): the CPU's compiled step. Called as ``decode_one_token``.

    Dynamo lifts a layer's weights and cache buffers into the graph's inputs, so the layers
    of one structure share one graph: Inductor lowers and g++ builds one layer instead of
    all of them. SmolLM2-135M (30 layers, float32, 1 thread, load average 5 on 2 cores) at 4K:
    the whole-step graph compiled in 98 s (``full``) and 334 s (``rocketkv`` @256), the
    per-layer graph in 8.5-10 s (21-25 s with int4 weights), for most of the gain at 4K; at
    16 tokens the call per layer costs part of it (``docs/generate.md``). The embedding,
    final norm, LM head and sampling (a few large ops) run eagerly."""

    def __init__(self, **compile_kw):
        self.block = torch.compile(_block, **compile_kw)

    def __call__(self, model: Transformer, tokens: Tensor, input_pos: Tensor,
                 temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
        return sample(model(tokens, input_pos, block=self.block), temperature, top_k, top_p)


def compiled_decode(device: torch.device, backend: Any = None, dynamic: bool | None = None):
    """``decode_one_token`` compiled once per (device type, backend, dynamic) and reused
    across calls (see ``DYNAMO_CONFIG`` for reuse across shapes); ``dynamic=True`` compiles
    symbolic shapes from the first call (``torch.compile(dynamic=True)``). On CPU with
    Inductor (``backend`` None) each layer is compiled (``LayerCompiledStep``); elsewhere,
    and with a given backend (tests' counting backends: the whole step traced as one
    graph), the whole step is one graph."""
    key = (device.type, backend, dynamic)
    if key not in _compiled:
        persistent_inductor_cache()
        _configure_dynamo()
        kw: dict[str, Any] = {"fullgraph": True, "dynamic": dynamic}
        if backend is not None:
            kw["backend"] = backend
        elif device.type == "cuda":
            kw["mode"] = "reduce-overhead"
        _compiled[key] = LayerCompiledStep(**kw) if device.type == "cpu" and backend is None \
            else torch.compile(decode_one_token, **kw)
    return _compiled[key]


# A CPU run compiles its step by default from this many decode steps (--max-new-tokens): the
# per-layer compile (LayerCompiledStep) took 8.5-10 s and saved 15-20 ms a step on SmolLM2-135M
# at 4K (float32, 1 thread, load average 4-5 on 2 cores; docs/generate.md has the table), so it
# pays back after 500-700 steps; shorter runs stay eager.
CPU_COMPILE_MIN_STEPS = 1024


def cpp_compiler_found() -> bool:
    """Whether Inductor's CPU backend finds a C++ compiler (``$CXX``, else ``g++``, on PATH)."""
    return shutil.which(os.environ.get("CXX") or "g++") is not None


def default_compile(compile: bool | None, device: torch.device,
                    decode_steps: int | None = None) -> bool | None:
    """``generate``'s ``compile`` for a run that did not choose (``compile`` None): None (compiled
    where the method's caches can be: OmniKV's offload cannot) on CUDA; on CPU None when the run
    asks for at least ``CPU_COMPILE_MIN_STEPS`` decode steps (``decode_steps``, the run's
    ``max_new_tokens``; None: unknown) and a C++ compiler is found, else False (eager: a
    shorter run would not pay the compile back); False elsewhere. A choice made
    (``compile`` True or False) is kept. The CLI's and the API's default."""
    if compile is not None:
        return compile
    if device.type == "cuda":
        return None
    if device.type == "cpu" and decode_steps is not None and \
            decode_steps >= CPU_COMPILE_MIN_STEPS and cpp_compiler_found():
        return None
    return False


class StepMode(str, enum.Enum):
    """How the decode step runs: ``eager`` (``decode_one_token`` as is), ``static`` (compiled,
    static shapes first; a later run of other sizes recompiles once with them symbolic:
    ``DYNAMO_CONFIG``), ``dynamic`` (compiled with symbolic shapes from the first call) or
    ``graphs`` (the eager step captured in a CUDA graph, ``GraphStep``; no ``torch.compile``).
    The values are ``scripts/bench.py``'s ``--compile-regime`` and its rows'
    ``compile_regime``."""

    EAGER = "eager"
    STATIC = "static"
    DYNAMIC = "dynamic"
    GRAPHS = "graphs"

    @property
    def description(self) -> str:
        """The mode in words (``REGIMES``: check_targets' tables, profile_step's report)."""
        return REGIMES[self.value]

    @classmethod
    def of(cls, compile: bool, cuda_graphs: bool = False,
           compile_dynamic: bool | None = None) -> StepMode:
        """The mode ``generate``'s flags name (``cuda_graphs`` wins over ``compile``)."""
        if cuda_graphs:
            return cls.GRAPHS
        if not compile:
            return cls.EAGER
        return cls.DYNAMIC if compile_dynamic else cls.STATIC

    @property
    def options(self) -> dict[str, Any]:
        """``StepConfig``'s settings for this mode (``compile=None``: compiled where the
        method's caches can be; ``StepConfig.of``)."""
        return {"compile": None if self in (StepMode.STATIC, StepMode.DYNAMIC) else False,
                "cuda_graphs": self is StepMode.GRAPHS,
                "compile_dynamic": True if self is StepMode.DYNAMIC else None}

    def check_device(self, device: torch.device, flag: str = "--cuda-graphs") -> None:
        """Raises ConfigError: ``graphs`` on a device other than CUDA (``flag`` names it)."""
        if self is StepMode.GRAPHS and device.type != "cuda":
            raise ConfigError(f"{flag} needs a CUDA device, not {device.type}")

    def step(self, device: torch.device, backend: Any = None,
             warmup_steps: int = WARMUP_STEPS) -> tuple[Any, int]:
        """The step function (called as ``decode_one_token``) and its warm-up steps (0 eager,
        2 for a CUDA graph: an eager step, then the capture)."""
        if self is StepMode.GRAPHS:
            return GraphStep(device), 2
        if self is StepMode.EAGER:
            return decode_one_token, 0
        step = compiled_decode(device, backend, True if self is StepMode.DYNAMIC else None)
        return FallbackStep(step, device), warmup_steps


REGIMES = {  # a row's compile_regime (a StepMode's value), in words
    "static": "compiled, one static graph per row", "dynamic": "compiled with dynamic shapes",
    "graphs": "a CUDA graph of the eager step (no torch.compile)", "eager": "eager, no graph",
}
