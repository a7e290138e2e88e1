"""Prompts kept uncompressed between runs, so a run whose prompt starts with a kept one prefills
only the rest (``PrefixCache``): a conversation's next turn, or another question after the same
document, by token prefix match.

What is kept is a prompt's whole K/V as one shared prefill records it (``prefill.PrefilledPrompt``:
every layer's keys and values, the last queries, and the attention sums when a method needs
them). A run extends the longest kept prefix of its prompt by the rest
(``prefill.extend_prefilled``: the new tokens attend exactly to the kept K/V) and builds its
method's caches from the whole (``generate(prefilled=...)``): the computation of a run
prefilled from scratch, whatever the method compresses (the compression is applied per run,
with the run's own question in the observation window), except that the rest is prefilled as
its own chunk. With float weights the answer is the same token for token (tested); quantized
matmuls (torch's int4 CPU kernel) round a chunk of a few rows differently from the same rows
inside a long prompt, so an answer can part where the next token is a near tie
(``results/serve/``). Methods whose caches prefill their
own way (KeyDiff's blocks, ``Method.shared_prefill`` False) cannot use it.

Least recently used prompts are dropped once the kept bytes pass ``max_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from rocketkv.engine.prefill import OBSERVATION_WINDOW, PrefilledPrompt
from rocketkv.model import ConfigError


@dataclass
class PrefixStats:
    """What a ``PrefixCache`` did: lookups that found a kept prefix (``hits``) or none
    (``misses``), prompt tokens not prefilled again (``tokens_reused``), prompts dropped to keep
    within the limit (``evicted``)."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    evicted: int = 0


class PrefixCache:
    """Recorded prompts by their token ids, at most ``max_bytes`` in all (least recently used
    dropped first; a prompt larger than the limit is not kept).

    Raises:
        ConfigError: ``max_bytes`` negative.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ConfigError(f"the prefix cache's size must not be negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self._kept: OrderedDict[tuple[int, ...], PrefilledPrompt] = OrderedDict()
        self._bytes: dict[tuple[int, ...], int] = {}
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._kept)

    def __repr__(self) -> str:
        return (f"PrefixCache(prompts={len(self)}, bytes={self.nbytes()}, "
                f"max_bytes={self.max_bytes})")

    def nbytes(self) -> int:
        """Bytes the kept prompts hold."""
        return sum(self._bytes.values())

    def longest(self, ids: Sequence[int], *, obs_window: int = OBSERVATION_WINDOW,
                attention_sums: bool = False) -> PrefilledPrompt | None:
        """The longest kept prompt that is a proper prefix of ``ids`` (at least one token
        left to prefill) and recorded what the run needs (at least ``obs_window`` queries,
        the attention sums when asked), or None; counted in ``stats``."""
        ids = tuple(ids)
        best = None
        for key, pre in self._kept.items():
            if (len(key) < len(ids) and (best is None or len(key) > len(best[0]))
                    and pre.obs_window >= obs_window
                    and (pre.attention_sums is not None or not attention_sums)
                    and ids[:len(key)] == key):
                best = (key, pre)
        if best is None:
            self.stats.misses += 1
            return None
        self._kept.move_to_end(best[0])
        self.stats.hits += 1
        self.stats.tokens_reused += len(best[0])
        return best[1]

    def add(self, pre: PrefilledPrompt) -> bool:
        """Keep ``pre`` (one sequence) by its tokens, dropping the least recently used prompts
        past ``max_bytes``; whether it was kept.

        Raises:
            ConfigError: a recording of more than one sequence.
        """
        if pre.tokens.shape[0] != 1:
            raise ConfigError("the prefix cache keeps one sequence per prompt")
        key = tuple(pre.tokens[0].tolist())
        size = pre.nbytes()
        if size > self.max_bytes:
            return False
        self._kept.pop(key, None)
        self._bytes.pop(key, None)
        while self._kept and self.nbytes() + size > self.max_bytes:
            old, _ = self._kept.popitem(last=False)
            del self._bytes[old]
            self.stats.evicted += 1
        self._kept[key] = pre
        self._bytes[key] = size
        return True

    def clear(self) -> None:
        """Drop every kept prompt (the counts stay)."""
        self._kept.clear()
        self._bytes.clear()
