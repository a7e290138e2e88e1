"""DuoAttention (Xiao et al. 2025): retrieval heads keep every token, streaming heads a ring.

Per KV head, retrieval heads keep every token and streaming heads keep ``sink`` + ``recent``
tokens in a ring (``streamingllm.SinkRecentCache``); heads are split by learned gates (a TSV
with one row per layer and one column per KV head, ``load_duo_pattern``;
``scripts/duo_identify.py`` makes one for any model). A layer's retrieval and streaming heads
live in two buffers of their own sizes, so nothing is padded to the largest capacity and one
compiled step serves every layer's split. Prefill attends to the whole uncompressed prompt
(RocketKV App. A.3: "we do not perform any KV cache compression or sparse attention mechanism
in the prefill phase ... including DuoAttention").

Token budget ``t`` (the RocketKV paper's baseline, App. A.3, ``duo_split``): above 640 tokens the
streaming heads keep 128 sinks + 512 recent and the share of retrieval heads is set so the
average read per KV head meets t: the int(N (t - 640) / (C - 640)) KV heads (N over the model,
C = the cache's length when decoding starts, prompt + 1 rounded up to a multiple of 64 by
``decode_horizon``, never the number of tokens asked for) with the largest gates retrieve
(``--duo-threshold``: gates above it instead); at or below 640 every head streams, with 128
sinks above 256 and ``int(0.2 t)`` below, the rest recent. Which heads retrieve is the cache's
layout and holds for the whole answer: past C the retrieval heads read one more token per step,
so a long answer's traffic grows past t by the retrieval share per token (``traffic_tokens`` is
the first steps').
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rocketkv.compression.registry import (
    INTERNAL,
    OPTIONAL,
    Method,
    Option,
    Params,
    decode_horizon,
    register,
)
from rocketkv.compression.streamingllm import SinkRecentCache
from rocketkv.model import ConfigError, ModelArgs

DUO_SINK, DUO_RECENT = 128, 512  # streaming heads above the 640-token budget (RocketKV App. A.3)
DUO_PATTERN_FILE = "full_attention_heads.tsv"
PATTERNS_DIR = Path(__file__).resolve().parents[1] / "patterns"  # patterns shipped with the engine

PATTERNS = Option("duo_patterns", "duoattention: head gates, a TSV (layers x KV heads) or a "
                  "directory with full_attention_heads.tsv; needed above a 640-token budget "
                  "(default: the one in patterns/ made for the model, if any)",
                  type=str, metavar="PATH")
THRESHOLD = Option("duo_threshold", "duoattention: gates above this retrieve (the pattern's own "
                   "split, DuoAttention deploys 0.5); default: the budget sets the share",
                   type=float)


def duo_split(t: int, capacity: int, n_heads_total: int,
              threshold: float | None = None) -> dict[str, Any]:
    """DuoAttention's parameters at budget t (RocketKV App. A.3).

    Args:
        t: token budget; capacity: the cache's length when decoding starts (what a retrieval
            head reads per step); n_heads_total: layers x KV heads.
        threshold: gates above it make retrieval heads (the pattern's own split); None: the
            budget sets how many.
    Returns:
        sink and recent (streaming heads), ``retrieval_heads`` (how many, over the model; None
        when the threshold decides) and ``needs_pattern``.
    """
    if t > DUO_SINK + DUO_RECENT:
        sink, recent = DUO_SINK, DUO_RECENT
    else:
        sink = DUO_SINK if t > 256 else int(0.2 * t)
        recent = t - sink
    n_ret = None
    if threshold is None:
        stream = sink + recent
        share = max(0.0, (t - stream) / (capacity - stream)) if capacity > stream else 1.0
        n_ret = min(n_heads_total, math.floor(share * n_heads_total))
    return {"sink": sink, "recent": recent, "retrieval_heads": n_ret,
            "needs_pattern": threshold is not None or n_ret > 0}


def first_capacity(prompt_len: int) -> int:
    """C of the split: the cache's length when decoding starts (prompt + 1), rounded up by
    ``decode_horizon``; the retrieval heads chosen for it hold for the whole answer."""
    return decode_horizon(prompt_len + 1)


def duo_traffic(n_ret: int, n_total: int, capacity: int, sink: int, recent: int) -> float:
    """Mean KV pairs read per step per KV head: retrieval heads read ``capacity``, streaming
    heads ``sink + recent``."""
    return (n_ret * capacity + (n_total - n_ret) * (sink + recent)) / n_total


def load_duo_pattern(path: str | Path, args: ModelArgs) -> Tensor:
    """DuoAttention head gates: (n_layers, n_kv_heads) float64.

    Args:
        path: a TSV file (one row per layer, one tab-separated gate per KV head; near 1 marks a
            retrieval head) or a directory holding ``full_attention_heads.tsv`` (the layout of
            DuoAttention's released patterns and of ``scripts/duo_identify.py``'s output).
    Raises:
        ConfigError: missing or unreadable file, a non-numeric value, or a shape other than the
            model's (layers x KV heads).
    """
    p = Path(path)
    if p.is_dir():
        p = p / DUO_PATTERN_FILE
    try:
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--duo-patterns: cannot read {p}: {e}") from None
    try:
        rows = [[float(x) for x in ln.split()] for ln in lines]
    except ValueError as e:
        raise ConfigError(f"--duo-patterns: {p} holds a non-numeric value ({e})") from None
    shape = (len(rows), len({len(r) for r in rows}) == 1 and len(rows[0]) if rows else 0)
    want = (args.n_layers, args.n_kv_heads)
    if shape != want:
        raise ConfigError(f"--duo-patterns: {p} has {len(rows)} rows of "
                          f"{sorted({len(r) for r in rows})} gates; the model needs {want[0]} "
                          f"rows (layers) of {want[1]} gates (KV heads)")
    gates = torch.tensor(rows, dtype=torch.float64)
    if not torch.isfinite(gates).all():
        raise ConfigError(f"--duo-patterns: {p} holds a value that is not finite")
    return gates


def duo_retrieval_heads(gates: Tensor, n_ret: int | None = None,
                        threshold: float | None = None) -> list[list[int]]:
    """Retrieval KV heads per layer: the ``n_ret`` largest gates over the whole model (ties by
    layer, then head), or every gate above ``threshold``."""
    L, Hkv = gates.shape
    flat = gates.flatten()
    if threshold is not None:
        chosen = set((flat > threshold).nonzero().flatten().tolist())
    else:
        order = sorted(range(L * Hkv), key=lambda i: (-float(flat[i]), i))
        chosen = set(order[:n_ret])
    return [[h for h in range(Hkv) if i * Hkv + h in chosen] for i in range(L)]


def shipped_pattern(args: ModelArgs, root: Path = PATTERNS_DIR) -> Path | None:
    """The pattern directory under ``root`` (``patterns/``) made for this model: its
    ``config.json`` names the model (``ModelArgs.name``, e.g. a GGUF's ``general.name``) and
    its TSV has the model's layers x KV heads; None when there is none."""
    for cfg in sorted(root.glob(f"*/{'config.json'}")):
        try:
            made_for = json.loads(cfg.read_text()).get("model")
        except (OSError, ValueError):
            continue
        tsv = cfg.parent / DUO_PATTERN_FILE
        if made_for == args.name and tsv.is_file():
            rows = [ln.split() for ln in tsv.read_text().splitlines() if ln.strip()]
            if len(rows) == args.n_layers and all(len(r) == args.n_kv_heads for r in rows):
                return cfg.parent
    return None


@dataclass(frozen=True, kw_only=True)
class DuoAttentionParams(Params):
    """DuoAttention at budget t (``duo_split``): streaming heads keep ``sink`` + ``recent``;
    ``retrieval_heads`` of the model's KV heads keep everything (None: the gates above
    ``--duo-threshold`` decide). Once the pattern is read (``validate``): the count,
    ``retrieval_share`` of every KV head, ``duo_patterns`` (the file) and ``heads``, the
    retrieval KV heads of each layer (internal)."""

    sink: int
    recent: int
    retrieval_heads: int | None
    needs_pattern: bool = field(metadata=INTERNAL)
    retrieval_share: float | None = field(default=None, metadata=OPTIONAL)
    duo_patterns: str | None = field(default=None, metadata=OPTIONAL)
    heads: list[list[int]] | None = field(default=None, metadata=INTERNAL)


@register
class DuoAttentionMethod(Method):
    name = "duoattention"
    description = ("DuoAttention: retrieval heads keep everything, streaming heads sinks + "
                   "recent (--duo-patterns)")
    budget_rule = ("t > 640: streaming heads 128 + 512, the top int(N (t - 640) / (C - 640)) "
                   "of the N KV heads retrieve (C: T + 1 rounded up to 64 tokens) "
                   "(`--duo-threshold`: gates above it instead); t <= "
                   "640: every head streams, 128 sinks above 256 else int(0.2 t), the rest recent")
    options = (PATTERNS, THRESHOLD)
    cache_classes = (SinkRecentCache,)
    source = "DuoAttention (Xiao et al. 2025); RocketKV App. A.3"

    def derive(self, budget, prompt_len, args, options):
        N = args.n_layers * args.n_kv_heads
        cap = first_capacity(prompt_len)
        split = duo_split(budget, cap, N, options.get("duo_threshold"))
        n_ret = split["retrieval_heads"]
        traffic = None if n_ret is None else duo_traffic(n_ret, N, cap, split["sink"],
                                                         split["recent"])
        degenerate = None
        if n_ret == 0 and cap > budget:
            degenerate = ("no retrieval head at this budget: every head streams "
                          f"({split['sink']} sinks + {split['recent']} recent), StreamingLLM")
        return DuoAttentionParams(budget=budget, compression_ratio=prompt_len / budget,
                                  traffic_tokens=traffic, degenerate=degenerate, **split)

    def validate(self, params, args, prompt_len, options):
        return self.with_retrieval_heads(params, args, first_capacity(prompt_len), options)

    def shard_params(self, params, rank, world, args):
        """The retrieval heads were chosen over every KV head (the gates rank them all);
        rank ``rank`` keeps its own H_kv / world heads, numbered from 0."""
        n = args.n_kv_heads // world
        lo = rank * n
        heads = [[h - lo for h in layer if lo <= h < lo + n] for layer in params.heads]
        return params.replace(heads=heads)

    def build_layer(self, layer, args, params, *, batch_size, prompt_len, max_new_tokens,
                    dtype, device):
        heads = params.heads[layer]
        return SinkRecentCache(layer, args, batch_size, dtype, device, prompt_len=prompt_len,
                               max_new_tokens=max_new_tokens, sink=params.sink,
                               recent=params.recent, retrieval_heads=heads,
                               params={**params.to_dict(), "layer_retrieval_heads": heads})

    @staticmethod
    def with_retrieval_heads(p: DuoAttentionParams, args: ModelArgs, capacity: int,
                             options: dict[str, Any]) -> DuoAttentionParams:
        """``p`` with the retrieval KV heads of each layer (``heads``) from
        ``--duo-patterns``, and the ``retrieval_heads``, ``retrieval_share``,
        ``duo_patterns`` and ``traffic_tokens`` they make (or a ``note`` that the pattern
        goes unused).

        Raises:
            ConfigError: the budget needs retrieval heads and no pattern was given, or a bad
                pattern file (``load_duo_pattern``).
        """
        path = options.get("duo_patterns")
        t = p.budget
        if not p.needs_pattern:
            note = None if path is None else \
                f"--duo-patterns unused: at budget {t} every head streams"
            return p.replace(heads=[[] for _ in range(args.n_layers)], note=note)
        if path is None:
            path = shipped_pattern(args)
        if path is None:
            need = (f"keeps {p.retrieval_heads} retrieval heads" if p.retrieval_heads
                    is not None else f"retrieves on the gates above --duo-threshold "
                    f"{options.get('duo_threshold')}")
            raise ConfigError(f"duoattention at budget {t} (above {p.sink + p.recent} "
                              f"tokens) {need} and needs the heads' gates: --duo-patterns PATH "
                              "(a TSV of layers x KV heads; scripts/duo_identify.py makes one "
                              f"for any model; none in {PATTERNS_DIR} for {args.name!r})")
        gates = load_duo_pattern(path, args)
        heads = duo_retrieval_heads(gates, p.retrieval_heads, options.get("duo_threshold"))
        n_ret = sum(len(h) for h in heads)
        N = args.n_layers * args.n_kv_heads
        return p.replace(heads=heads, retrieval_heads=n_ret, retrieval_share=n_ret / N,
                         duo_patterns=str(path),
                         traffic_tokens=duo_traffic(n_ret, N, capacity, p.sink, p.recent))
