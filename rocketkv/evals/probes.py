"""Probes of what a compressed cache reads and keeps, computed beside the engine without
changing it.

* ``RecallProbe``: during decode steps, the positions each layer's attention reads (the
  selector's picks, recomputed with the selector's own functions; an evicting cache's kept
  prompt positions, recomputed with its own ``evict``), against the exact attention over every
  position so far: ``evals.fidelity``'s attention recall (``evals.metrics.selection_masses``).
* ``kept_positions``: the prompt positions a cache holds at the end of prefill
  (``scripts/kept_tokens.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import CompressedKVCache, KVCache, Selector, gather_tokens
from rocketkv.compression.omnikv import OmniKVSparseCache
from rocketkv.engine.prefill import PrefilledPrompt
from rocketkv.evals.metrics import selection_masses
from rocketkv.model import ConfigError, Transformer


def selected_slots(selector: Selector, cache: CompressedKVCache, q: Tensor,
                   valid: Tensor) -> Tensor:
    """Slots (B, H_kv, 1 or G, S) bool the selector's ``attend`` reads for q (B, H, 1, D) given
    ``valid`` (S,): its ``select`` (every selector offers it), less unwritten picks (the
    attention masks them), and per query head where the cache keeps a ``head_mask``
    (original SnapKV); a selector that evicts as the answer grows says itself
    (``attended``, SnapKV and SnapKV++)."""
    attended = getattr(selector, "attended", None)
    if attended is not None:  # decode-time eviction (SnapKV family): what each head reads
        return attended(cache, valid.sum().reshape(1) - 1 + cache.slot_offset)
    B, Hkv, S = cache.batch_size, cache.n_kv_heads, cache.length
    idx = selector.select(cache, q, valid)
    sel = torch.zeros(B, Hkv, S, dtype=torch.bool, device=valid.device)
    sel.scatter_(-1, idx, True)
    sel = (sel & valid)[:, :, None]  # attend_selected masks unwritten picks
    return sel if cache.head_mask is None else sel & cache.head_mask


class RecallProbe:
    """Measures ``attention_recall`` (``evals.fidelity``'s docstring) during decode steps,
    leaving the engine untouched: ``attach`` wraps each compressed cache's
    ``selector.attend`` (and each uncompressed layer's ``decode``) as instance attributes;
    ``detach`` removes them.

    Args:
        pre: the shared prefill the caches were built from (prompt keys, observation queries).
        keep_raw: also keep, per (layer, step), the query, the full keys and values, the
            selected positions and the attention output (tests).
    Attributes:
        records: (layer, covered, oracle, k), each (B, H_kv) float32, one per layer and step.
        raw: dicts of the kept tensors when ``keep_raw``.
    """

    def __init__(self, pre: PrefilledPrompt, keep_raw: bool = False):
        self.pre = pre
        self.keep_raw = keep_raw
        self.records: list[tuple[int, Tensor, Tensor, Tensor]] = []
        self.raw: list[dict[str, Any]] = []
        self._undo: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def attached(self, model: Transformer) -> Iterator[RecallProbe]:
        self.attach(model)
        try:
            yield self
        finally:
            self.detach()

    def attach(self, model: Transformer) -> None:
        for layer, cache in enumerate(model.caches):
            if isinstance(cache, CompressedKVCache):
                self._wrap_selector(layer, cache)
            elif hasattr(cache, "read_positions"):
                self._wrap_positions(layer, cache)
            else:
                self._wrap_dense(layer, cache)

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _prompt_positions(self, layer: int, cache: CompressedKVCache) -> Tensor | None:
        """(B, H_kv, kept) prompt positions of the cache's prompt slots; None: all T kept."""
        if cache.evict is None:
            return None
        q_obs = self.pre.q_obs[layer]
        w = min(cache.obs_window, q_obs.shape[2])
        idx, _ = cache.evict(q_obs[:, :, q_obs.shape[2] - w:], self.pre.k[layer])
        if not torch.equal(gather_tokens(self.pre.k[layer], idx),
                           cache.k_cache[:, :, :cache.kept]):
            raise RuntimeError(f"layer {layer}: recomputed eviction does not reproduce the "
                               "cached prompt keys")
        return idx

    def _wrap_selector(self, layer: int, cache: CompressedKVCache) -> None:
        selector = cache.selector
        original = selector.attend
        prompt_pos = self._prompt_positions(layer, cache)
        k_prompt, v_prompt = self.pre.k[layer], self.pre.v[layer]
        T = k_prompt.shape[2]

        def attend(cache_: CompressedKVCache, q: Tensor, pos: Tensor) -> Tensor:
            valid = cache_.valid_slots(pos)
            sel = selected_slots(selector, cache_, q, valid)
            out = original(cache_, q, pos)
            slot = int(valid.sum()) - 1
            kept = cache_.kept
            B, Hkv, Gx, _ = sel.shape
            if prompt_pos is None:
                prompt_sel = sel[..., :T]
            else:
                prompt_sel = torch.zeros(B, Hkv, Gx, T, dtype=torch.bool, device=sel.device)
                prompt_sel.scatter_(-1, prompt_pos[:, :, None].expand(-1, -1, Gx, -1),
                                    sel[..., :kept])
            pos_sel = torch.cat([prompt_sel, sel[..., kept:slot + 1]], dim=-1)
            k_gen = cache_.k_cache[:, :, kept:slot + 1]
            p = _exact_probs(q, k_prompt, k_gen)
            self.records.append((layer, *selection_masses(p, pos_sel)))
            if self.keep_raw:
                self.raw.append({
                    "layer": layer, "q": q.clone(), "selected": pos_sel.clone(), "out": out,
                    "k": torch.cat([k_prompt, k_gen], dim=2).clone(),
                    "v": torch.cat([v_prompt, cache_.v_cache[:, :, kept:slot + 1]], 2).clone(),
                    "record": self.records[-1]})
            return out

        selector.attend = attend
        self._undo.append(lambda: delattr(selector, "attend"))

    def _wrap_positions(self, layer: int, cache: KVCache) -> None:
        """A cache evicting within a fixed capacity: the positions it read, from
        ``read_positions``, against the exact attention over every position so far."""
        original = cache.decode
        k_prompt, v_prompt = self.pre.k[layer], self.pre.v[layer]
        T = k_prompt.shape[2]
        generated: list[Tensor] = []
        values: list[Tensor] = []

        def decode(q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
            out = original(q, k, v, input_pos)
            generated.append(k.clone())
            if self.keep_raw:
                values.append(v.clone())
            p = int(input_pos[0])
            if p != T + len(generated) - 1:
                raise RuntimeError(f"layer {layer}: the probe expects consecutive decode steps "
                                   f"from position {T}, got {p}")
            pos = cache.read_positions(p)  # (B, H_kv, n), -1 padding
            hits = torch.zeros(*pos.shape[:2], p + 1, dtype=torch.int32, device=pos.device)
            hits.scatter_add_(-1, pos.clamp(min=0), (pos >= 0).to(torch.int32))
            sel = (hits > 0)[:, :, None]  # (B, H_kv, 1, p + 1)
            k_gen = torch.cat(generated, dim=2)
            probs = _exact_probs(q, k_prompt, k_gen)
            self.records.append((layer, *selection_masses(probs, sel)))
            if self.keep_raw:
                self.raw.append({
                    "layer": layer, "q": q.clone(), "selected": sel, "out": out,
                    "k": torch.cat([k_prompt, k_gen], dim=2),
                    "v": torch.cat([v_prompt, *values], dim=2), "record": self.records[-1]})
            return out

        cache.decode = decode
        self._undo.append(lambda: delattr(cache, "decode"))

    def _wrap_dense(self, layer: int, cache: KVCache) -> None:
        original = cache.decode

        def decode(q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
            out = original(q, k, v, input_pos)
            ones = torch.ones(cache.batch_size, cache.n_kv_heads)
            self.records.append((layer, ones, ones, ones * (int(input_pos[0]) + 1)))
            return out

        cache.decode = decode
        self._undo.append(lambda: delattr(cache, "decode"))

    def summary(self, n_layers: int) -> dict[str, Any]:
        """Means over every record: ``attention_recall`` (covered / oracle),
        ``attention_mass`` (covered), ``oracle_mass``, ``selected_tokens`` (k), and
        ``attention_recall_per_layer``; None values when nothing was recorded."""
        if not self.records:
            return {"attention_recall": None, "attention_mass": None, "oracle_mass": None,
                    "selected_tokens": None, "attention_recall_per_layer": None}
        covered = torch.stack([r[1] for r in self.records])
        oracle = torch.stack([r[2] for r in self.records])
        recall = covered / oracle
        layers = torch.tensor([r[0] for r in self.records])
        per_layer = [float(recall[layers == i].mean()) if bool((layers == i).any()) else None
                     for i in range(n_layers)]
        return {"attention_recall": float(recall.mean()),
                "attention_mass": float(covered.mean()),
                "oracle_mass": float(oracle.mean()),
                "selected_tokens": float(torch.stack([r[3] for r in self.records]).mean()),
                "attention_recall_per_layer": per_layer}


def _exact_probs(q: Tensor, k_prompt: Tensor, k_gen: Tensor) -> Tensor:
    """Exact attention (B, H_kv, G, T + n) float32 of q (B, H, 1, D) over the prompt keys
    k_prompt (B, H_kv, T, D) then the generated keys k_gen (B, H_kv, n, D)."""
    B, H, _, D = q.shape
    Hkv = k_prompt.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, D)
    s = torch.cat([torch.matmul(qg, k_prompt.transpose(-1, -2)),
                   torch.matmul(qg, k_gen.transpose(-1, -2))], dim=-1).float()
    return (s / math.sqrt(D)).softmax(dim=-1)


def kept_positions(cache, pre, layer: int, T: int) -> Tensor:
    """(B, H_kv, T) bool: the prompt positions ``cache`` holds after prefill.

    Raises:
        ConfigError: a cache that cannot say (no eviction state to read).
    """
    B, Hkv = pre.k[layer].shape[:2]
    out = torch.zeros(B, Hkv, T, dtype=torch.bool)
    if isinstance(cache, CompressedKVCache | OmniKVSparseCache):
        if not isinstance(cache, CompressedKVCache) or cache.evict is None:  # nothing dropped
            out[:] = True
            return out
        q_obs = pre.q_obs[layer]
        idx, _ = cache.evict(q_obs[:, :, q_obs.shape[2] - min(cache.obs_window,
                                                              q_obs.shape[2]):], pre.k[layer])
        return out.scatter_(-1, idx.cpu(), True)
    if not hasattr(cache, "read_positions"):
        if getattr(cache, "max_seq_len", 0) >= T:  # a full cache (a layer left uncompressed)
            out[:] = True
            return out
        raise ConfigError(f"{type(cache).__name__} does not say which positions it keeps")
    pos = cache.read_positions(T - 1).cpu()  # (B, H_kv, n), -1 empty
    valid = (pos >= 0) & (pos < T)
    return out.scatter_(-1, pos.clamp(min=0, max=T - 1), valid)
