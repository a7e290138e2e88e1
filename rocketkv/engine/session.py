"""What ``generate.generate`` leaves in a model between calls: a ``Session`` held on the model
(``model.generate_session``, no module state) with the spec its caches were built for and the
conversation they hold, so a repeated call reuses the caches (and the compiled graph's static
buffers) and ``continue_conversation`` goes on where the last call stopped.
``release_caches`` frees them; ``rewind_conversation`` returns to an earlier position
(``documents.CacheSnapshot``: one document, many questions).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from rocketkv.compression import build_caches
from rocketkv.compression.registry import UNPLANNED
from rocketkv.engine.documents import CacheSnapshot
from rocketkv.engine.measure import MemoryMeter
from rocketkv.kernels.fuse import fuse
from rocketkv.model import ConfigError, Transformer

ATTRIBUTE = "generate_session"  # the model's attribute that holds its Session


@dataclass(frozen=True)
class CacheSpec:
    """What a run's caches are built for (``compression.build_caches``): two runs of equal
    specs reuse the same caches and compiled step.

    Attributes:
        method, budget: the method and its token budget (None: unbudgeted).
        batch_size: sequences.
        prompt_len, new_tokens: tokens the caches hold room for: the prompt, and what follows
            it (generated tokens and the reserve for later turns).
        dtype, device: of the caches.
        options: the method's options (``Option.name`` -> value).
        params: the method's parameters planned for this spec before the weights loaded
            (``request.CachePlan.params``: the caches are built from them, the method is not
            planned again), or ``UNPLANNED`` (planned when the caches are built). Not
            compared: equal specs plan to equal parameters.
    """

    method: str
    budget: int | None
    batch_size: int
    prompt_len: int
    new_tokens: int
    dtype: torch.dtype
    device: torch.device
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    params: Any = field(default=UNPLANNED, compare=False, hash=False, repr=False)

    @property
    def positions(self) -> int:
        """Positions the caches hold: ``prompt_len + new_tokens``."""
        return self.prompt_len + self.new_tokens

    def replace(self, **changes: Any) -> CacheSpec:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Conversation:
    """The conversation a session's caches hold (``continue_conversation``).

    Attributes:
        batch_size: sequences.
        pending: the last generated token, (B, 1) int64, not yet fed; or None.
        position: tokens fed so far.
        end: positions the caches hold.
    """

    batch_size: int
    pending: torch.Tensor | None
    position: int
    end: int


@dataclass
class Session:
    """What ``generate`` left in a model's caches: the spec they were built for, weak
    references to them (whether they are still the model's shows whether the session holds),
    and the conversation they hold (None until a run has decoded)."""

    spec: CacheSpec
    caches: list[weakref.ref]
    conversation: Conversation | None = None

    def holds(self, model: Transformer) -> bool:
        """Whether ``model``'s caches are still the ones this session built."""
        current = model.caches
        return len(self.caches) == len(current) and \
            all(c is not None and ref() is c for ref, c in zip(self.caches, current))


def session(model: Transformer) -> Session | None:
    """The session of ``model``'s caches if ``generate`` built them and they are still attached
    (another run, ``prefill_once`` or ``setup_caches`` since replaces them: None)."""
    state = getattr(model, ATTRIBUTE, None)
    return state if state is not None and state.holds(model) else None


def release_caches(model: Transformer) -> None:
    """Detach and drop the caches of ``model`` (the next ``generate`` builds new ones), so
    their memory is free for something else (``scripts/bench.py``'s rows of other engines)."""
    model.__dict__.pop(ATTRIBUTE, None)
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
    state = session(model)
    conv = None if state is None else state.conversation
    if conv is None or (snapshot is not None and not snapshot.holds(model.caches)):
        raise ConfigError("no conversation to rewind: the caches were replaced since (by "
                          "another run); prefill the document again")
    if not 0 < position <= conv.end:
        raise ConfigError(f"cannot rewind to position {position} (the conversation holds "
                          f"{conv.end} positions)")
    if snapshot is not None:
        snapshot.restore()
    state.conversation = dataclasses.replace(conv, pending=None, position=position)


def prepare_caches(model: Transformer, spec: CacheSpec,
                   meter: MemoryMeter | None = None) -> Session:
    """Attach caches for ``spec``; reuse the model's current ones when ``generate`` built them
    for the same spec, so repeated calls keep the compiled graph and its static buffers (a new
    prompt overwrites every slot a step can read: prompt slots at prefill, later slots before
    they are valid). New caches: the old ones are released first, then ``meter`` is reset, so
    this run's peak never counts the caches a previous run left (a benchmark runs its rows in
    one process). The model's decode step is fused first (``kernels.fuse.fuse``: the dense
    kernels where they run, for the parts of the model that are stock). Returns the model's
    session, its conversation cleared."""
    fuse(model)
    state = session(model)
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
    caches = build_caches(spec.method, shard["args"] if shard else model.args,
                          batch_size=spec.batch_size, prompt_len=spec.prompt_len,
                          max_new_tokens=spec.new_tokens, budget=spec.budget,
                          dtype=spec.dtype, device=spec.device,
                          shard=(shard["rank"], shard["world_size"]) if shard else (0, 1),
                          planned=spec.params, **spec.options)
    model.setup_caches(caches, spec.positions)
    state = Session(spec, [weakref.ref(c) for c in caches])
    setattr(model, ATTRIBUTE, state)
    return state
