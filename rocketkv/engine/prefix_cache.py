"""Prompts kept uncompressed between runs, so a run whose prompt starts like a kept one prefills
only the rest (``PrefixCache``): a conversation's next turn (the kept prompt whole), or another
question after the same document (the shared start, less the last ``obs_window`` tokens before
the prompts part, which are prefilled again with the rest: ``PrefixCache.longest``).

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


MIN_REUSE = 32  # tokens: a shorter shared start is prefilled again rather than copied


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` agree (tokens two prompts share;
    ``evals.metrics`` counts agreeing answers with it)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
        """The longest reusable start of ``ids`` among the kept prompts, as a recording to
        extend by the rest (``prefill.extend_prefilled``), or None; counted in ``stats``.

        A kept prompt that is a proper prefix of ``ids`` is reused whole. A kept prompt that
        shares only a start with ``ids`` (another question after the same document) is
        reused up to the recording's observation window (at least ``obs_window`` tokens)
        before they part: the keys and values of a prefix are the same whatever follows
        (causal attention), but its last queries and any attention sums are not, so those
        tokens are prefilled again with the rest (the recorded queries then all come from the
        new chunk), and a run that needs
        attention sums (H2O) reuses whole prompts only. At least ``MIN_REUSE`` tokens, and
        one token left to prefill."""
        ids = tuple(ids)
        best: tuple[int, tuple[int, ...], PrefilledPrompt] | None = None
        for key, pre in self._kept.items():
            if pre.obs_window < obs_window or (attention_sums and pre.attention_sums is None):
                continue
            common = matching_prefix(key, ids)
            if common == len(key) < len(ids):
                usable = common  # the whole kept prompt
            elif attention_sums:
                continue  # sums cover later queries too: a part of them is no prefix's
            else:
                usable = min(common, len(ids) - 1) - pre.obs_window  # every query fresh
            if usable >= MIN_REUSE and (best is None or usable > best[0]):
                best = (usable, key, pre)
        if best is None:
            self.stats.misses += 1
            return None
        usable, key, pre = best
        self._kept.move_to_end(key)
        self.stats.hits += 1
        self.stats.tokens_reused += usable
        if usable == len(key):
            return pre
        return PrefilledPrompt(  # a view of the kept K/V: extending it copies, never writes
            pre.tokens[:, :usable], pre.logits, [k[:, :, :usable] for k in pre.k],
            [v[:, :, :usable] for v in pre.v], pre.q_obs, 0.0, pre.obs_window, None)

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
