"""Fidelity of KV-cache compression on a real checkpoint: agreement with the full cache,
perplexity of held-out text, KL divergence of next-token distributions, attention recall of the
selected tokens against Exact-TopK, and the bytes each method stores and reads.

    python scripts/eval_accuracy.py \\
        --checkpoint ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompt-tokens 2048 --budgets 128 256 512 --num-prompts 4 --out results/accuracy
    python scripts/eval_accuracy.py --checkpoint checkpoints/stories260K --prompt-tokens 400 \\
        --text ../shared/data/text/tinystories_*.txt --budgets 64 128 256 --json e.json

Quick run: ``--limit 1`` (at most one prompt per prompt length). SmolLM2 (8K context) takes
``--prompt-tokens`` up to 8160 with ``--max-new-tokens 32`` (several values: one table each,
e.g. ``2048 4096``); the recorded run (``results/accuracy``) is the command above, 2048 being
the default. stories260K (512-token context) needs ``--prompt-tokens`` <= 480 and
TinyStories ``--text``.

Prompt set (deterministic). Documents: each ``--text`` path in order, a directory standing for
its ``*.txt`` files sorted by name (default: ``../shared/data/text/PaulGrahamEssays``, 49
essays, one document each); each file is split on ``<|endoftext|>``, each piece stripped of
surrounding whitespace, empty pieces dropped. Each document is tokenized whole with
``tok.encode(text, bos=False)`` and cut into non-overlapping windows of ``W = T + m - len(P)``
tokens starting at token 0, W, 2W, ...; a trailing piece shorter than W is dropped, windows never
cross documents. ``P`` is what the tokenizer itself puts before a text (``bos_prefix``: the ids
``tok.encode(text, bos=True)`` adds in front of ``tok.encode(text, bos=False)``): ``[BOS]`` for
SentencePiece (stories260K), tiktoken and Hugging Face tokenizers whose post-processor adds BOS;
nothing for SmolLM2 (``add_bos`` false; its ``bos_id`` is ``<|im_start|>``, which a plain text
never starts with). Window i becomes ``P + window``: the prompt is its first T tokens (P included)
and the continuation its last m tokens. With K candidate windows in document order (first path
first), the prompts are the windows ``floor(i * K / N)`` for ``i = 0 .. N-1`` (evenly spread;
N = ``--num-prompts``, or ``--limit`` when smaller) under ``--seed 0`` (the default); any other
seed draws N distinct windows with Python's ``random.Random(seed).sample`` and keeps them in
document order. Fewer than N windows is an error. Each ``--prompt-tokens`` value T gets its own
prompt set and its own table; nothing else is random (greedy decoding, no dropout), so a run is
reproducible for a given seed.

One prefill per prompt. Every method prefills with exact attention over the whole prompt, so the
prompt is prefilled once (``generate.prefill_once``) and every (method, budget)'s caches are
built from that prefill's per-layer K/V (``generate(..., prefilled=pre)``; caches sized for
``prompt_len = T`` and m new tokens, float32, batch 1, afresh for every pass below). ``full``
ignores the budget and is reported once (budget ``null``). A budget that the method rejects
(``ConfigError``) gives a row with ``"error"`` (the message) and no numbers. The numbers equal
those of a separate prefill per configuration (tests/test_eval_accuracy.py checks it).

Numbers, per (T, method, budget), each over the N prompts of that T:

* ``match_prefix``: greedy decoding, ``m`` tokens (the first from the prefill logits, then m - 1
  decode steps feeding the previous token at positions T, T+1, ...; EOS does not stop it) by
  ``generate(prefilled=pre, max_new_tokens=m)`` with the method's caches and with the full cache
  (``reference_continuations``); the number of leading tokens of the method's continuation equal
  to the full cache's, averaged over prompts (0..m).
* ``teacher_forced_top1``: the full cache's greedy continuation g_0..g_{m-1} is forced through
  the method's caches (built by ``generate(max_new_tokens=0, reserve_tokens=m, prefilled=pre)``;
  decode steps feed g_0..g_{m-2} at positions T..T+m-2); the fraction of the N*m predictions
  (the prefill logits, then each decode step's) whose argmax equals the next full-cache token
  g_j. The first prediction comes from the shared prefill, so it always agrees.
* ``perplexity``: the m real continuation tokens c_0..c_{m-1} of the same text are forced the
  same way (decode steps feed c_0..c_{m-2} at positions T..T+m-2); NLL_j = -log
  softmax(logits_j)[c_j] (float32) with logits_0 from prefill and logits_j from the decode step
  that fed c_{j-1}; the number is exp(mean NLL over all N*m tokens). ``full``'s row is the same
  with the full cache.
* ``kl_divergence``: in that same teacher-forced pass, KL(p_full,j || p_method,j) = sum_v
  p_full,j(v) (log p_full,j(v) - log p_method,j(v)) in nats, from float32 log-softmax of the
  full cache's and the method's logits at position j (both fed the real tokens c_0..c_{j-1});
  the mean over the N*m positions (row 0, the shared prefill, is 0 by construction).
  ``kl_per_token`` keeps every value. ``full`` gives exactly 0.
* ``attention_recall`` (selecting methods; ``null`` for ``full``): at each decode step of that
  pass (m - 1 per prompt) and each layer, with q the method's own query (B = 1, H heads, group
  size G, H_kv KV heads) and the keys of every position 0..t the full cache would hold in this
  run (the T prompt keys of the shared prefill, then the method's own keys of the generated
  positions), p_g(i) = softmax_i(q_g . k_i / sqrt(D)) (float32) for each query head g. For each
  KV head, with S the set of positions the method's attention reads at this step (mapped from
  its cache slots: the prompt positions its eviction kept, then the generated ones):
  ``covered`` = (1/G) sum_g sum_{i in S} p_g(i) (the raw attention mass, 0..1) and ``oracle``
  = (1/G) (sum of the |S| largest values of sum_g p_g) (Exact-TopK's mass with k = |S| tokens,
  shared by the group); recall = covered / oracle (1.0: as good as the oracle). For the
  original SnapKV, whose query heads read their own prompt tokens (per-head masks), covered and
  oracle are per query head (S_g, top |S_g| of p_g) and averaged over the group. Layers left
  uncompressed (a budget covering the sequence) count with recall and mass 1. Reported: the
  mean over prompts, steps, layers and KV heads of recall (``attention_recall``), of covered
  (``attention_mass``), of oracle (``oracle_mass``) and of |S| (``selected_tokens``), and
  per-layer means of recall (``attention_recall_per_layer``).
  How S is obtained without changing the engine (``RecallProbe``): the selector's ``attend``
  of each compressed cache is wrapped for the pass; the wrapper recomputes the selection from
  the same (cache, q, valid) with the selector's own functions (``Quest.select``,
  ``Hybrid.select``; SparQ's ``top_r_dims``/``sparq_scores`` top-k; Exact-TopK's
  ``exact_scores`` top-k; the dense selector of SnapKV/SnapKV++ and of RocketKV within budget
  reads every valid slot, under the per-head mask for SnapKV), keeps the valid slots among the
  picks (what ``attend_selected`` attends to), then calls the original ``attend``. The prompt
  positions an evicting cache kept are recomputed from the shared prefill with the cache's own
  ``evict`` function (the call ``_store_prefilled`` made; the probe checks that the gathered
  keys equal the stored ones). SnapKV and SnapKV++ therefore score the tokens they kept, read
  densely: the exact attention mass over those tokens. Caches that evict inside a fixed
  capacity (StreamingLLM, H2O, DuoAttention: no selector) say which positions a step read
  (``read_positions``, called after the wrapped ``decode``); the generated positions' keys are
  the ones those decode calls received.
* ``kv_cache_bytes``: ``allocated_bytes()`` summed over layers (K/V and auxiliary buffers,
  e.g. page min/max keys); ``kv_bytes_per_step``: ``bytes_read_per_step()`` summed over layers
  (one decode step's K/V and approximation traffic, batch 1). Both are static per configuration.
* ``method_params``: ``caches[-1].method_params()`` (the derived parameters of the last layer).

Argmax ties go to the lowest token id (``torch.argmax``, as ``generate.sample`` does greedily).
Per-prompt values (``match_prefix_per_prompt``, ``teacher_forced_top1_per_prompt``,
``nll_per_token``, ``kl_per_token``, ``attention_recall_per_prompt``) are kept in the JSON, with
the prompts' token ids, the full cache's greedy continuations, ``prefill_s`` per prompt,
``eval_s`` (per prompt length) and ``runtime_s`` (the whole run, loading included).

Outputs: the markdown tables go to stdout; ``--out DIR`` writes ``DIR/fidelity.json`` (every
number), ``DIR/fidelity.md`` (the tables) and ``DIR/fidelity.png`` (perplexity, KL divergence
and attention recall against the budget, one line per method and prompt length, full's
perplexity as a horizontal line); ``--json PATH`` writes the same JSON to PATH. The JSON has
``runs`` (one result per prompt length) and ``rows`` (every row of every run, each with its
``prompt_tokens``). The progress bar (tqdm, when installed) goes to stderr. Torch runs on
``--threads`` CPU threads (default 1). Bad input: one ``error: ...`` line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from checkpoint import load_model, resolve_checkpoint  # noqa: E402
from compression import METHODS, NEEDS_ATTENTION_SUMS, UNBUDGETED, build_caches  # noqa: E402
from compression.sparse import (  # noqa: E402
    ExactTopK,
    Hybrid,
    Quest,
    SparQ,
    exact_scores,
    sparq_scores,
    top_r_dims,
)
from generate import (  # noqa: E402
    OneLineParser,
    PrefilledPrompt,
    check_positive,
    generate,
    prefill_once,
    write_json,
)
from kv_cache import CompressedKVCache, KVCache, Selector, gather_tokens  # noqa: E402
from model import ConfigError, Transformer  # noqa: E402
from scripts.eval_common import DEFAULT_BUDGETS, DEFAULT_METHODS, configurations  # noqa: E402
from scripts.make_prompt import text_files  # noqa: E402
from tokenizer import Tokenizer, load_tokenizer  # noqa: E402

TEXT_DIR = ROOT.parent / "shared" / "data" / "text"
ESSAYS_DIR = TEXT_DIR / "PaulGrahamEssays"
DEFAULT_TEXTS = (ESSAYS_DIR,)
TINYSTORIES_TEXTS = (TEXT_DIR / "tinystories_sample_cs336.txt",
                     TEXT_DIR / "tinystories_valid_excerpt_30KB.txt")
STORY_SEPARATOR = "<|endoftext|>"
DEFAULT_PROMPT_TOKENS = (2048,)
PREFILL_OBS_WINDOW = 64  # queries prefill_once records: >= every method's observation window
_BOS_PROBE = "The"


# --------------------------------------------------------------------------------------------
# Prompt set


@dataclass(frozen=True)
class Prompt:
    """One evaluation window: ``prompt`` (T ids, the tokenizer's BOS prefix first) and the
    ``continuation`` (m ids) that follows it in ``source`` (file name), document ``document``,
    from text token ``start``."""

    source: str
    document: int
    start: int
    prompt: list[int]
    continuation: list[int]


def prompt_record(p: Prompt) -> dict[str, Any]:
    """Where a prompt comes from, for the JSON: its file, document and first text token, its
    lengths and first 8 ids (the text itself is not copied into results; the rule above
    rebuilds it)."""
    return {"source": p.source, "document": p.document, "start": p.start,
            "prompt_tokens": len(p.prompt), "continuation_tokens": len(p.continuation),
            "prompt_head": p.prompt[:8]}


def read_documents(paths: Sequence[str | Path]) -> list[tuple[str, int, str]]:
    """``(file name, index, text)`` of every non-empty ``<|endoftext|>``-separated piece of
    every file of ``paths`` (directories expanded by ``text_files``)."""
    docs = []
    for path in text_files(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read text file {path}: {e}") from None
        pieces = [p.strip() for p in text.split(STORY_SEPARATOR)]
        docs += [(path.name, i, p) for i, p in enumerate(q for q in pieces if q)]
    return docs


def bos_prefix(tok: Tokenizer) -> list[int]:
    """The ids ``tok.encode(text, bos=True)`` puts before ``tok.encode(text, bos=False)``:
    ``[bos_id]`` where the tokenizer adds BOS (SentencePiece, tiktoken, Hugging Face with a
    BOS-adding post-processor), ``[]`` where it does not (SmolLM2)."""
    plain = tok.encode(_BOS_PROBE, bos=False)
    full = tok.encode(_BOS_PROBE, bos=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def document_windows(tok: Tokenizer, docs: list[tuple[str, int, str]], T: int,
                     m: int) -> list[Prompt]:
    """Every non-overlapping window of ``T + m - len(bos_prefix(tok))`` text tokens, with the
    BOS prefix prepended, in document order."""
    prefix = bos_prefix(tok)
    width = T + m - len(prefix)
    windows = []
    for source, index, text in docs:
        ids = tok.encode(text, bos=False)
        for start in range(0, len(ids) - width + 1, width):
            seq = prefix + ids[start:start + width]
            windows.append(Prompt(source, index, start, seq[:T], seq[T:]))
    return windows


def spread_pick(items: list, n: int) -> list:
    """Items ``floor(i * len(items) / n)`` for i = 0..n-1 (n <= len(items))."""
    return [items[i * len(items) // n] for i in range(n)]


def seeded_pick(items: list, n: int, seed: int) -> list:
    """``spread_pick`` for seed 0; otherwise n distinct items drawn by
    ``random.Random(seed).sample``, in their original order."""
    if seed == 0:
        return spread_pick(items, n)
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), n))]


def build_prompt_set(tok: Tokenizer, paths: Sequence[str | Path], T: int, m: int,
                     n: int, seed: int = 0) -> list[Prompt]:
    """The N prompts of the module docstring's rule; ConfigError when the text is too short."""
    windows = document_windows(tok, read_documents(paths), T, m)
    if len(windows) < n:
        raise ConfigError(f"the text holds only {len(windows)} windows of {T + m} tokens "
                          f"(--prompt-tokens {T} + --max-new-tokens {m}), {n} needed; "
                          "lower --num-prompts or --prompt-tokens")
    return seeded_pick(windows, n, seed)


# --------------------------------------------------------------------------------------------
# Runs through a cache


def attach_caches(model: Transformer, method: str, budget: int | None, T: int,
                  m: int) -> list[KVCache]:
    """Fresh caches of ``method`` at ``budget`` for a T-token prompt and m new tokens, attached
    to ``model`` (the per-configuration path: the caller prefills). Raises ConfigError for a
    budget the method rejects."""
    caches = build_caches(method, model.args, batch_size=1, prompt_len=T, max_new_tokens=m,
                          budget=budget, dtype=model.tok_embeddings.weight.dtype,
                          device=model.tok_embeddings.weight.device)
    model.setup_caches(caches, T + m)
    model._cache_spec = None  # generate.generate must not mistake these caches for its own
    return caches


def build_from_prefill(model: Transformer, pre: PrefilledPrompt, method: str,
                       budget: int | None, m: int) -> dict[str, Any]:
    """Caches of ``method`` at ``budget`` built from ``pre`` (room for m new tokens), left in
    ``model``: ``generate(max_new_tokens=0, reserve_tokens=m, prefilled=pre)``, whose report
    it returns. Raises ConfigError for a budget the method rejects."""
    return generate(model, pre.tokens, method=method, budget=budget, max_new_tokens=0,
                    reserve_tokens=m, prefilled=pre)


@torch.no_grad()
def teacher_forced_logprobs(model: Transformer, prompt: Sequence[int],
                            continuation: Sequence[int],
                            first_logits: Tensor | None = None) -> Tensor:
    """Log-probabilities (len(continuation), vocab), float32, through the model's caches: row j
    predicts ``continuation[j]`` from the prompt and ``continuation[:j]`` (row 0 from the
    prompt's logits, row j from the decode step that fed ``continuation[j - 1]`` at position
    T + j - 1).

    ``first_logits`` (1, vocab): the caches already hold the prompt (built from a shared
    prefill) and these are its last-position logits; None: prefill the prompt here.
    """
    device = model.tok_embeddings.weight.device
    T = len(prompt)
    if first_logits is None:
        first_logits = model.prefill(torch.tensor([list(prompt)], device=device))
    rows = [first_logits]
    for j, token in enumerate(continuation[:-1]):
        rows.append(model(torch.tensor([[token]], device=device),
                          torch.tensor([T + j], device=device)))
    return torch.cat(rows).float().log_softmax(dim=-1)


def greedy_continuation(model: Transformer, method: str, budget: int | None,
                        prompt: Sequence[int], m: int,
                        prefilled: PrefilledPrompt | None = None) -> dict[str, Any]:
    """``generate.generate``'s report for m greedy tokens (the first from prefill, then m - 1
    decode steps; no stop token) with fresh caches of ``method``, built from ``prefilled``
    when given; its ``token_ids[0]`` is the continuation."""
    return generate(model, prefilled.tokens if prefilled is not None else list(prompt),
                    method=method, budget=budget, max_new_tokens=m, prefilled=prefilled)


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def top1_matches(logprobs: Tensor, targets: Sequence[int]) -> int:
    """Rows of ``logprobs`` whose argmax is the target token."""
    return int((logprobs.argmax(dim=-1) == torch.tensor(list(targets))).sum())


def token_nlls(logprobs: Tensor, targets: Sequence[int]) -> list[float]:
    """-log p(target) per row (nats)."""
    idx = torch.tensor(list(targets))[:, None]
    return (-logprobs.gather(1, idx)[:, 0]).tolist()


def kl_rows(ref_logprobs: Tensor, logprobs: Tensor) -> list[float]:
    """KL(p_ref || p) per row in nats: sum_v p_ref(v) (log p_ref(v) - log p(v)), float32;
    both (n, vocab) log-probabilities."""
    ref = ref_logprobs.float()
    return (ref.exp() * (ref - logprobs.float())).sum(dim=-1).tolist()


def perplexity(nlls: Sequence[Sequence[float]]) -> float:
    """exp of the mean NLL over every token of every prompt."""
    flat = [x for row in nlls for x in row]
    return math.exp(sum(flat) / len(flat))


def cache_bytes(caches: Sequence[KVCache]) -> tuple[int, int]:
    """(allocated bytes, bytes read per decode step), summed over layers."""
    return (sum(c.allocated_bytes() for c in caches),
            sum(c.bytes_read_per_step() for c in caches))


# --------------------------------------------------------------------------------------------
# Attention recall


def selection_masses(p: Tensor, sel: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Attention mass a selection covers, and Exact-TopK's with as many tokens.

    Args:
        p: (B, H_kv, G, S) exact attention probabilities of each query head of each group over
            the S positions (float32; each row sums to 1).
        sel: (B, H_kv, 1, S) bool, the positions read, shared by the group; or (B, H_kv, G, S),
            one set per query head.
    Returns:
        covered, oracle, k, each (B, H_kv) float32. Shared sets: covered = sum_{i in S}
        P(i) / G with P = sum_g p_g; oracle = (sum of the k = |S| largest P) / G. Per-head
        sets: the same per query head (covered_g over S_g, oracle_g the |S_g| largest p_g),
        averaged over the group (k too). k = 0 gives oracle 0.
    """
    G = p.shape[2]
    if sel.shape[2] == 1:
        P = p.sum(dim=2)  # (B, H_kv, S)
        s = sel[:, :, 0]
        k = s.sum(dim=-1)
        covered = (P * s).sum(dim=-1) / G
        top = P.sort(dim=-1, descending=True).values.cumsum(dim=-1)
        oracle = top.gather(-1, (k - 1).clamp(min=0)[..., None])[..., 0] / G
        return covered, oracle.masked_fill(k == 0, 0.0), k.float()
    k = sel.sum(dim=-1)  # (B, H_kv, G)
    covered = (p * sel).sum(dim=-1)
    top = p.sort(dim=-1, descending=True).values.cumsum(dim=-1)
    oracle = top.gather(-1, (k - 1).clamp(min=0)[..., None])[..., 0].masked_fill(k == 0, 0.0)
    return covered.mean(dim=2), oracle.mean(dim=2), k.float().mean(dim=2)


def selected_slots(selector: Selector, cache: CompressedKVCache, q: Tensor,
                   valid: Tensor) -> Tensor | None:
    """Slots (B, H_kv, 1 or G, S) bool the selector's ``attend`` reads for q (B, H, 1, D) given
    ``valid`` (S,), recomputed with the selector's own functions; None for a selector this
    harness does not know."""
    B, Hkv, S = cache.batch_size, cache.n_kv_heads, cache.length
    if isinstance(selector, (Quest, Hybrid)):
        idx = selector.select(cache, q, valid)
    elif isinstance(selector, ExactTopK):
        idx = exact_scores(q, cache.k_cache, valid).topk(min(selector.k, S), dim=-1).indices
    elif isinstance(selector, SparQ):
        dims = top_r_dims(q, Hkv, selector.r)
        scores = sparq_scores(q, cache.k_cache, dims, valid).sum(dim=2)
        scores = scores.masked_fill(~valid, float("-inf"))
        idx = scores.topk(min(selector.k, S), dim=-1).indices
    elif type(selector) is Selector:  # dense over what the cache holds
        if cache.head_mask is not None:
            return valid & cache.head_mask  # (B, H_kv, G, S)
        return valid.expand(B, Hkv, 1, S)
    else:
        return None
    sel = torch.zeros(B, Hkv, S, dtype=torch.bool, device=valid.device)
    sel.scatter_(-1, idx, True)
    return (sel & valid)[:, :, None]  # attend_selected masks unwritten picks


class RecallProbe:
    """Measures ``attention_recall`` (module docstring) during decode steps, leaving the engine
    untouched: ``attach`` wraps each compressed cache's ``selector.attend`` (and each
    uncompressed layer's ``decode``) as instance attributes; ``detach`` removes them.

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
        self.unknown: list[str] = []
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

        def attend(cache_: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
            sel = selected_slots(selector, cache_, q, valid)
            out = original(cache_, q, valid)
            if sel is None:
                self.unknown.append(type(selector).__name__)
                return out
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
        if not self.records or self.unknown:
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


# --------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class _Acc:
    """Per-prompt values of one configuration."""

    prefix: list[int]
    top1: list[float]
    nlls: list[list[float]]
    kls: list[list[float]]
    recall: list[dict[str, Any]]


def evaluate_prompt(model: Transformer, prompt: Prompt, configs: Sequence[tuple[str, Any]],
                    m: int, *, errors: dict[tuple[str, Any], str],
                    tick: Callable[[], None] = lambda: None,
                    keep_raw: bool = False) -> dict[str, Any]:
    """Every configuration on one prompt from one prefill (the module docstring's passes).

    Returns {"reference": full greedy ids, "prefill_s", "configs": {(method, budget):
    {"match_prefix", "top1", "nlls", "kls", "recall" (``RecallProbe.summary``), "report"
    (the greedy run's ``generate`` report), "probe" (when keep_raw)}}}. A configuration whose
    budget the method rejects is added to ``errors`` (and skipped when already there).
    """
    pre = prefill_once(model, prompt.prompt, obs_window=PREFILL_OBS_WINDOW,
                       attention_sums=any(m in NEEDS_ATTENTION_SUMS for m, _ in configs))
    first = pre.logits
    ref_report = greedy_continuation(model, "full", None, prompt.prompt, m, pre)
    ref = ref_report["token_ids"][0]
    build_from_prefill(model, pre, "full", None, m)
    full_lp = teacher_forced_logprobs(model, prompt.prompt, prompt.continuation, first)
    tick()
    out: dict[tuple[str, Any], Any] = {}
    for method, budget in configs:
        if (method, budget) in errors:
            tick()
            continue
        try:
            report = ref_report if method == "full" else \
                greedy_continuation(model, method, budget, prompt.prompt, m, pre)
        except ConfigError as e:
            errors[(method, budget)] = str(e)
            tick()
            continue
        greedy = report["token_ids"][0]
        build_from_prefill(model, pre, method, budget, m)
        shared = all(c.shared_prefill for c in model.caches)
        # KeyDiff prefills block-wise: its own prompt logits (None: prefilled again here)
        own_first = first if shared else None
        top1 = top1_matches(teacher_forced_logprobs(model, prompt.prompt, ref, own_first),
                            ref) / m
        if method == "full":
            lp, probe, recall = full_lp, None, None
        elif not shared:  # its keys are not the shared prefill's: no recall against them
            lp, probe, recall = teacher_forced_logprobs(
                model, prompt.prompt, prompt.continuation), None, None
        else:
            build_from_prefill(model, pre, method, budget, m)
            probe = RecallProbe(pre, keep_raw)
            with probe.attached(model):
                lp = teacher_forced_logprobs(model, prompt.prompt, prompt.continuation, first)
            recall = None if method in UNBUDGETED else probe.summary(model.args.n_layers)
        out[(method, budget)] = {
            "match_prefix": matching_prefix(greedy, ref), "top1": top1,
            "nlls": token_nlls(lp, prompt.continuation), "kls": kl_rows(full_lp, lp),
            "recall": recall, "report": report, **({"probe": probe} if keep_raw else {})}
        tick()
    return {"reference": ref, "prefill_s": pre.prefill_s, "configs": out}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def evaluate(model: Transformer, prompts: Sequence[Prompt], methods: Sequence[str],
             budgets: Sequence[int], m: int, progress: bool = False, *,
             bar: Any = None) -> dict[str, Any]:
    """Every row for ``methods`` x ``budgets`` on ``prompts`` (equal lengths T, m new tokens
    each), one prefill per prompt. ``bar``: a tqdm bar to advance (one step per prompt and
    configuration, plus one per prompt for the reference); else one is made when
    ``progress``."""
    configs = configurations(methods, budgets)
    own = bar is None and progress
    if own:
        from scripts.eval_common import _progress

        bar = _progress(len(prompts) * (len(configs) + 1), True)
    tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    T = len(prompts[0].prompt)
    t0 = time.perf_counter()
    errors: dict[tuple[str, Any], str] = {}
    accs = {c: _Acc([], [], [], [], []) for c in configs}
    reports: dict[tuple[str, Any], dict[str, Any]] = {}
    refs, prefill_s = [], []
    for i, p in enumerate(prompts):
        if bar is not None:
            bar.set_description(f"T={T} prompt {i + 1}/{len(prompts)}")
        got = evaluate_prompt(model, p, configs, m, errors=errors, tick=tick)
        refs.append(got["reference"])
        prefill_s.append(got["prefill_s"])
        for c, r in got["configs"].items():
            a = accs[c]
            a.prefix.append(r["match_prefix"])
            a.top1.append(r["top1"])
            a.nlls.append(r["nlls"])
            a.kls.append(r["kls"])
            a.recall.append(r["recall"])
            reports[c] = r["report"]
    if own and bar is not None:
        bar.close()
    rows = []
    for method, budget in configs:
        row: dict[str, Any] = {"method": method, "budget": budget, "prompt_tokens": T}
        if (method, budget) in errors:
            row["error"] = errors[(method, budget)]
            rows.append(row)
            continue
        a, rep = accs[(method, budget)], reports[(method, budget)]
        row.update(kv_cache_bytes=rep["kv_cache_bytes"],
                   kv_bytes_per_step=rep["kv_bytes_per_step"], method_params=rep["method_params"],
                   match_prefix=_mean(a.prefix), match_prefix_per_prompt=a.prefix,
                   teacher_forced_top1=_mean(a.top1), teacher_forced_top1_per_prompt=a.top1,
                   perplexity=perplexity(a.nlls), nll_per_token=a.nlls,
                   kl_divergence=_mean([x for row_ in a.kls for x in row_]),
                   kl_per_token=a.kls)
        row.update(_recall_fields(a.recall))
        rows.append(row)
    return {"model": model.args.name, "prompt_tokens": T, "max_new_tokens": m,
            "num_prompts": len(prompts), "methods": list(methods), "budgets": list(budgets),
            "rows": rows, "reference_continuations": refs,
            "prompts": [prompt_record(p) for p in prompts], "prefill_s": prefill_s,
            "eval_s": time.perf_counter() - t0, "torch_version": torch.__version__}


_RECALL_KEYS = ("attention_recall", "attention_mass", "oracle_mass", "selected_tokens")


def _recall_fields(per_prompt: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """Row fields from the per-prompt ``RecallProbe.summary`` dicts (equal record counts per
    prompt, so the mean of the prompt means is the mean over every record)."""
    if any(s is None or s["attention_recall"] is None for s in per_prompt):
        return {k: None for k in _RECALL_KEYS} | {"attention_recall_per_prompt": None,
                                                  "attention_recall_per_layer": None}
    fields = {k: _mean([s[k] for s in per_prompt]) for k in _RECALL_KEYS}
    layers = [s["attention_recall_per_layer"] for s in per_prompt]
    fields["attention_recall_per_prompt"] = [s["attention_recall"] for s in per_prompt]
    fields["attention_recall_per_layer"] = [_mean(v) for v in zip(*layers)]
    return fields


# --------------------------------------------------------------------------------------------
# Report


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def format_params(params: dict[str, Any]) -> str:
    """``key=value`` pairs (floats to 3 significant digits), method and budget left out."""
    return ", ".join(f"{k}={_fmt(v)}" for k, v in params.items()
                     if k not in ("method", "budget"))


def format_table(result: dict[str, Any]) -> str:
    """Markdown table of one prompt length's ``result["rows"]``."""
    m = result["max_new_tokens"]
    lines = [f"| method | budget | match prefix (of {m}) | teacher-forced top-1 | perplexity "
             "| KL (nats) | attention recall | attention mass | KV bytes | KV bytes/step "
             "| params |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        budget = "-" if r["budget"] is None else str(r["budget"])
        if "error" in r:
            msg = r["error"].replace("|", "\\|")
            cells = ["n/a"] * 8 + [f"n/a: {msg}"]
        else:
            rec = r["attention_recall"]
            cells = [f"{r['match_prefix']:.2f}", f"{r['teacher_forced_top1']:.3f}",
                     f"{r['perplexity']:.3f}", f"{r['kl_divergence']:.4f}",
                     "-" if rec is None else f"{rec:.3f}",
                     "-" if rec is None else f"{r['attention_mass']:.3f}",
                     f"{r['kv_cache_bytes']:,}", f"{r['kv_bytes_per_step']:,}",
                     format_params(r["method_params"]).replace("|", "\\|")]
        lines.append("| " + " | ".join([r["method"], budget, *cells]) + " |")
    return "\n".join(lines)


def format_report(result: dict[str, Any]) -> str:
    """``fidelity.md``: the settings, then one table per prompt length."""
    runs = result["runs"]
    head = [f"# Fidelity: {result['model']}", "",
            f"checkpoint `{result['checkpoint']}`; text {', '.join(result['text_files'])}; "
            f"{runs[0]['num_prompts']} prompts per length, m = {result['max_new_tokens']} "
            f"tokens, seed {result['seed']}; runtime {result['runtime_s']:.0f} s "
            f"({result['threads']} threads, torch {result['torch_version']}).", "",
            "match prefix: leading greedy tokens equal to full's; top-1: teacher-forced on "
            "full's greedy continuation; perplexity and KL(full || method) (nats, mean per "
            "token): teacher-forced on the real continuation; attention recall: mass of exact "
            "attention on the tokens read / mass of Exact-TopK's with as many, mean over decode "
            "steps, layers and KV heads; attention mass: the raw covered mass. Definitions: "
            "`scripts/eval_accuracy.py`."]
    for r in runs:
        head += ["", f"## {r['prompt_tokens']} prompt tokens", "", format_table(r)]
    return "\n".join(head)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """``fidelity.png``: perplexity and KL divergence (log axes) and attention recall against the
    budget (log2 axis), one line per method (colour) and prompt length (line style); full's
    perplexity is a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = result["runs"]
    methods = [m for m in result["methods"] if m not in UNBUDGETED]
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    styles = ["-", "--", ":", "-."]
    panels = [("perplexity", "perplexity (real continuation)"),
              ("kl_divergence", "KL(full || method), nats/token"),
              ("attention_recall", "attention recall vs Exact-TopK")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (key, title) in zip(axes, panels):
        for j, run in enumerate(runs):
            style = styles[j % len(styles)]
            for method in methods:
                pts = [(r["budget"], r[key]) for r in run["rows"]
                       if r["method"] == method and "error" not in r and r.get(key) is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, style, marker="o", color=colors[method],
                            label=f"{method} T={run['prompt_tokens']}")
            full = next((r for r in run["rows"] if r["method"] == "full" and "error" not in r),
                        None)
            if key == "perplexity" and full is not None:
                ax.axhline(full["perplexity"], color="black", linestyle=style, linewidth=1,
                           label=f"full T={run['prompt_tokens']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["budgets"], [str(b) for b in result["budgets"]])
        ax.minorticks_off()
        ax.set_xlabel("token budget")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0)))
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(f"{result['model']}: fidelity vs budget ({runs[0]['num_prompts']} prompts, "
                 f"m = {result['max_new_tokens']})")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint (GGUF file, HF or converted directory, short name)")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's)")
    p.add_argument("--text", nargs="+", default=[str(t) for t in DEFAULT_TEXTS],
                   metavar="PATH", help="text files or directories of *.txt files for the "
                   f"prompt set (default: {ESSAYS_DIR})")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   choices=list(METHODS), metavar="METHOD",
                   help=f"any of {', '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS),
                   metavar="N", help="token budgets (default "
                   f"{' '.join(map(str, DEFAULT_BUDGETS))})")
    p.add_argument("--max-new-tokens", type=int, default=32, help="m (default 32)")
    p.add_argument("--prompt-tokens", nargs="+", type=int, default=list(DEFAULT_PROMPT_TOKENS),
                   metavar="T", help="prompt lengths T, BOS prefix included; one table each "
                   "(default 2048, for SmolLM2; stories260K needs <= 480)")
    p.add_argument("--num-prompts", type=int, default=4, help="N per prompt length (default 4)")
    p.add_argument("--limit", type=int, help="quick run: at most this many prompts per length")
    p.add_argument("--seed", type=int, default=0,
                   help="0 (default): evenly spread windows; other: a seeded random choice")
    p.add_argument("--out", metavar="DIR",
                   help="write fidelity.json, fidelity.md and fidelity.png to DIR")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(args: argparse.Namespace) -> None:
    """ConfigError for values no run can use."""
    check_positive(args, "max_new_tokens", "num_prompts", "threads", "limit")
    if args.seed < 0:
        raise ConfigError(f"--seed must not be negative, got {args.seed}")
    for name, values in (("prompt-tokens", args.prompt_tokens), ("budgets", args.budgets)):
        bad = [v for v in values if v <= 0]
        if bad:
            raise ConfigError(f"--{name} must be positive numbers of tokens, got {bad[0]}")
    if args.json:
        parent = Path(args.json).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"--json: directory {parent} does not exist")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_args(args)
        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        checkpoint = resolve_checkpoint(args.checkpoint)
        text_files(args.text)
        model = load_model(checkpoint, "cpu", torch.float32)
        tok = load_tokenizer(args.tokenizer or checkpoint)
        if tok.vocab_size > model.args.vocab_size:
            raise ConfigError(f"tokenizer has {tok.vocab_size} tokens, model only "
                              f"{model.args.vocab_size}")
        m = args.max_new_tokens
        lengths = list(dict.fromkeys(args.prompt_tokens))
        for T in lengths:
            if T + m > model.args.max_seq_len:
                raise ConfigError(f"--prompt-tokens {T} + --max-new-tokens {m} exceed the "
                                  f"model's context ({model.args.max_seq_len} tokens)")
        n = min(args.num_prompts, args.limit or args.num_prompts)
        prompt_sets = [build_prompt_set(tok, args.text, T, m, n, args.seed) for T in lengths]
        budgets = list(dict.fromkeys(args.budgets))
        methods = list(dict.fromkeys(args.methods))
        bar = None
        if not args.no_progress:
            from scripts.eval_common import _progress

            bar = _progress(len(lengths) * n * (len(configurations(methods, budgets)) + 1),
                            True)
        runs = [evaluate(model, ps, methods, budgets, m, bar=bar) for ps in prompt_sets]
        if bar is not None:
            bar.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"model": model.args.name, "checkpoint": args.checkpoint,
              "text_files": list(args.text), "prompt_tokens": lengths, "max_new_tokens": m,
              "num_prompts": n, "methods": methods, "budgets": budgets, "seed": args.seed,
              "threads": args.threads, "bos_prefix": bos_prefix(tok),
              "rows": [r for run in runs for r in run["rows"]], "runs": runs,
              "torch_version": torch.__version__, "runtime_s": time.perf_counter() - t0}
    print("\n\n".join(f"{r['prompt_tokens']} prompt tokens\n\n{format_table(r)}" for r in runs))
    if args.json:
        write_json(args.json, result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "fidelity.json", result)
        (out / "fidelity.md").write_text(format_report(result) + "\n")
        plot(result, out / "fidelity.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
