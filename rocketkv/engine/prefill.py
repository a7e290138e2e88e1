"""One prefill shared by many methods' caches (the evaluations' shared prefill).

Prefill attends to the whole uncompressed prompt in every method whose caches say
``shared_prefill`` (RocketKV App. A.3), so its result does not depend on the method: an
evaluation records one prefill of a prompt (``prefill_once``), extends it by a question
(``extend_prefilled``), and builds any number of methods' and budgets' caches from it
(``generate.generate(prefilled=...)``, which calls ``store_prefilled``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rocketkv.cache import KVCache, attention_and_column_sums, causal_attention
from rocketkv.engine.measure import sync
from rocketkv.model import ConfigError, ModelArgs, Transformer

OBSERVATION_WINDOW = 64  # queries a shared prefill records by default (the methods' windows)


class PromptRecorder(KVCache):
    """Prefill-only cache that keeps one layer's whole-prompt K/V and its last ``obs_window``
    queries, so that any number of methods' caches can be built from one prefill
    (``prefill_once``). It cannot decode.

    Attributes after prefill: ``k``, ``v`` (B, H_kv, T, D) and ``q_obs`` (B, H, w, D),
    w = min(obs_window, T), in the model's dtype; with ``attention_sums``, ``sums``
    (B, H_kv, T) float32, the column sums of every prompt query's attention
    (``attention_column_sums``, what H2O's eviction needs), else None.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, obs_window: int, attention_sums: bool = False):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        self.obs_window = obs_window
        self.record_sums = attention_sums
        self.k = self.v = self.q_obs = self.sums = None

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        self.k, self.v, self.q_obs = k, v, q_obs
        if self.record_sums:
            self.sums = torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)

    def prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        if self.record_sums:
            out, sums = attention_and_column_sums(q, k, v, start)
            self.sums[..., :start + q.shape[2]] += sums
            return out
        return causal_attention(q, k, v, start)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Record a chunk after the recorded prompt (exact causal attention over both), as if
        the whole had been prefilled at once."""
        if start != self.k.shape[2]:
            raise ValueError(f"the recorded prompt has {self.k.shape[2]} tokens, not {start}")
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.q_obs = torch.cat([self.q_obs, q], dim=2)[:, :, -self.obs_window:]
        if self.record_sums:
            out, sums = attention_and_column_sums(q, self.k, self.v, start)
            self.sums = torch.cat([self.sums, self.sums.new_zeros(k.shape[:3])], dim=2) + sums
            return out
        return causal_attention(q, self.k, self.v, start)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        raise RuntimeError("PromptRecorder only records a prefill; build a method's caches")


def as_prompt(model: Transformer, prompt) -> Tensor:
    """``prompt`` as a (B, T) int64 tensor on the model's device, its ids checked.

    Raises:
        ConfigError: text instead of token ids, an empty prompt, ids outside the vocabulary,
            a prompt that fills the model's context.
    """
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                   and isinstance(prompt[0], str)):
        raise ConfigError("generate() takes token ids, not text: encode it first "
                          "(tokenizer.encode), or use rocketkv.load(...).generate(text)")
    device = model.device
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
            attention (``cache.attention_column_sums``), recorded when asked for (H2O
            needs them); None otherwise.
        memos: per layer, a dict that lives as long as the prefill, where the caches built
            from it keep work they share (``cache.prefill_memo``; e.g. the SnapKV family's
            observation-window votes, (B, H, T) float32 per layer and window length, so many
            methods' and budgets' caches score the window once per layer).
    """

    tokens: Tensor
    logits: Tensor
    k: list[Tensor]
    v: list[Tensor]
    q_obs: list[Tensor]
    prefill_s: float
    obs_window: int = OBSERVATION_WINDOW
    attention_sums: list[Tensor] | None = None
    memos: list[dict] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.memos = [{} for _ in self.k]

    def nbytes(self) -> int:
        """Bytes the recording holds: every layer's K/V, recorded queries and attention
        sums (the memos left out)."""
        parts = [*self.k, *self.v, *self.q_obs, *(self.attention_sums or [])]
        return sum(t.numel() * t.element_size() for t in parts)


def prefill_once(model: Transformer, prompt: Tensor | Sequence[int] | Sequence[Sequence[int]],
                 obs_window: int = OBSERVATION_WINDOW, attention_sums: bool = False,
                 on_layer=None) -> PrefilledPrompt:
    """Prefill ``prompt`` ((T,) or (B, T) ids) recording every layer's K/V and last
    ``obs_window`` queries (at least the largest observation window of the methods to build),
    and with ``attention_sums`` the column sums of the prompt's attention (for methods whose
    caches say ``needs_attention_sums``, e.g. H2O; on the CPU one more flash-attention pass
    over the prompt). ``on_layer`` is called with i after layer i (progress).

    Raises:
        ConfigError: an empty prompt or one that fills the model's context.
    """
    device = model.device
    prompt = as_prompt(model, prompt)
    B, T = prompt.shape
    recorders = [PromptRecorder(i, model.args, B, model.dtype, device,
                                obs_window, attention_sums) for i in range(model.args.n_layers)]
    for layer in model.layers:
        layer.attention.kv_cache = None
    model.setup_caches(recorders, T)
    sync(device)
    t0 = time.perf_counter()
    logits = model.prefill(prompt, on_layer=on_layer)
    sync(device)
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
    chunk = as_prompt(model, chunk)
    B, T = pre.tokens.shape
    if chunk.shape[0] != B:
        raise ConfigError(f"the chunk has {chunk.shape[0]} sequences, the prompt {B}")
    if T + chunk.shape[1] >= model.args.max_seq_len:
        raise ConfigError(f"{T + chunk.shape[1]} tokens leave no room in the model's context")
    device = model.device
    recorders = []
    for i in range(model.args.n_layers):
        r = PromptRecorder(i, model.args, B, model.dtype, device,
                           pre.obs_window, pre.attention_sums is not None)
        r.k, r.v, r.q_obs = pre.k[i], pre.v[i], pre.q_obs[i]
        r.sums = None if pre.attention_sums is None else pre.attention_sums[i]
        recorders.append(r)
    for layer in model.layers:
        layer.attention.kv_cache = None
    model.setup_caches(recorders, T + chunk.shape[1])
    sync(device)
    t0 = time.perf_counter()
    logits = model.prefill(chunk, start=T)
    sync(device)
    for layer in model.layers:
        layer.attention.kv_cache = None
    return PrefilledPrompt(torch.cat([pre.tokens, chunk], dim=1), logits,
                           [r.k for r in recorders], [r.v for r in recorders],
                           [r.q_obs for r in recorders],
                           pre.prefill_s + time.perf_counter() - t0, pre.obs_window,
                           None if pre.attention_sums is None else [r.sums for r in recorders])


def store_prefilled(model: Transformer, pre: PrefilledPrompt) -> Tensor:
    """Every cache of ``model`` stores its layer's recorded prompt (and compresses it, as its
    ``store_recorded_prompt`` decides); returns ``pre.logits``.

    Raises:
        ConfigError: a cache that prefills its own way, or a recording that lacks what a cache
            needs (attention sums, a long enough observation window).
    """
    for i, cache in enumerate(model.caches):
        if not cache.shared_prefill:
            raise ConfigError(f"{type(cache).__name__} prefills in its own way; it cannot be "
                              "built from a shared prefill")
        cache.store_recorded_prompt(
            pre.k[i], pre.v[i], pre.q_obs[i],
            None if pre.attention_sums is None else pre.attention_sums[i], pre.memos[i])
    return pre.logits

