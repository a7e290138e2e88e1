"""Fidelity of a compressed cache against the full cache on real text: the prompt set (windows
of documents), the greedy and teacher-forced passes through each method's caches, and the
numbers of every (method, budget). ``scripts/eval_accuracy.py`` runs it over prompt lengths and
writes the tables (``evals/fidelity_run.py``); ``scripts/eval_quantized.py`` runs the same
passes for quantized weights.
Definitions (``T`` = ``--context``, ``m`` = ``--max-new-tokens``, ``N`` =
``--num-prompts``, flags of ``scripts/eval_accuracy.py``):

Prompt set (deterministic). Documents: each ``--text`` path in order, a directory standing for
its ``*.txt`` files sorted by name (default: ``../shared/data/text/PaulGrahamEssays``, 49
essays, one document each; a ``.json`` file stands for its ``"text"`` field, e.g. RULER's
essay haystack ``RULER_PaulGrahamEssays.json``, whose 3.05M characters make windows of 16K and
32K tokens); each file is split on ``<|endoftext|>``, each piece stripped of
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
document order. Fewer than N windows is an error. Each ``--context`` value T gets its own
prompt set and its own table; nothing else is random (greedy decoding, no dropout), so a run is
reproducible for a given seed.

One prefill per prompt. Every method prefills with exact attention over the whole prompt, so the
prompt is prefilled once (``prefill.prefill_once``) and every (method, budget)'s caches are
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
  the method's caches (built by ``generate(CacheRequest(..., reserve_tokens=m),
  max_new_tokens=0, prefilled=pre)``; decode steps feed g_0..g_{m-2} at positions
  T..T+m-2); the fraction of the N*m predictions (the prefill logits, then each decode
  step's) whose argmax equals the next full-cache token g_j. The first prediction comes from
  the shared prefill, so it always agrees.
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
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import KVCache
from rocketkv.compression import METHODS, build_caches, needs_attention_sums
from rocketkv.data import ESSAYS
from rocketkv.engine.generate import CacheRequest, generate
from rocketkv.engine.measure import weight_bytes, weight_bytes_per_step
from rocketkv.engine.prefill import PrefilledPrompt, prefill_once
from rocketkv.engine.report import GenerateResult
from rocketkv.engine.step import retune_caches
from rocketkv.evals.harness import (
    DEV_SEED_OFFSET,
    configurations,
    open_partial,
    progress_bar,
    spec_fingerprint,
)
from rocketkv.evals.metrics import (
    kl_rows,
    matching_prefix,
    perplexity,
    token_nlls,
    top1_matches,
)
from rocketkv.evals.probes import RecallProbe
from rocketkv.evals.prompts import source_text, text_files
from rocketkv.formats.tokenizer import Tokenizer
from rocketkv.model import ConfigError, Transformer

DEFAULT_TEXTS = (ESSAYS,)
STORY_SEPARATOR = "<|endoftext|>"
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
    every file of ``paths`` (directories expanded by ``text_files``; a ``.json`` file is its
    ``"text"`` field, as RULER's essay haystack ``RULER_PaulGrahamEssays.json``, 3.05M
    characters: one document long enough for 32K-token windows)."""
    docs = []
    for path in text_files(paths):
        text = source_text(path, "text file ")
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


def split_prompts(tok, texts, T: int, m: int, n: int, seed: int, split: str):
    """The eval prompts (``seeded_pick``) or, for ``dev``, n windows disjoint from them."""
    windows = document_windows(tok, read_documents(texts), T, m)
    need = n if split == "eval" else 2 * n
    if len(windows) < need:
        raise ConfigError(f"the text holds only {len(windows)} windows of {T + m} tokens, "
                          f"{need} needed for --split {split}; lower --num-prompts or "
                          "--prompt-tokens")
    chosen = seeded_pick(windows, n, seed)
    if split == "eval":
        return chosen
    rest = [w for w in windows if w not in chosen]
    return seeded_pick(rest, n, seed + DEV_SEED_OFFSET)


# --------------------------------------------------------------------------------------------
# Runs through a cache


def attach_caches(model: Transformer, method: str, budget: int | None, T: int,
                  m: int) -> list[KVCache]:
    """Fresh caches of ``method`` at ``budget`` for a T-token prompt and m new tokens, attached
    to ``model`` (the per-configuration path: the caller prefills). Raises ConfigError for a
    budget the method rejects."""
    caches = build_caches(method, model.args, batch_size=1, prompt_len=T, max_new_tokens=m,
                          budget=budget, dtype=model.dtype,
                          device=model.device)
    model.setup_caches(caches, T + m)
    return caches


def build_from_prefill(model: Transformer, pre: PrefilledPrompt, method: str,
                       budget: int | None, m: int) -> GenerateResult:
    """Caches of ``method`` at ``budget`` built from ``pre`` (room for m new tokens), left in
    ``model``: ``generate(CacheRequest(..., reserve_tokens=m), max_new_tokens=0,
    prefilled=pre)``, whose report it returns. Raises ConfigError for a budget the method
    rejects."""
    return generate(model, pre.tokens, CacheRequest(method, budget, reserve_tokens=m),
                    max_new_tokens=0, prefilled=pre)


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
    device = model.device
    T = len(prompt)
    if first_logits is None:
        first_logits = model.prefill(torch.tensor([list(prompt)], device=device))
    rows = [first_logits]
    retune_at = T  # parameters that follow the caches' length, as the decode loop does
    for j, token in enumerate(continuation[:-1]):
        if T + j >= retune_at:
            _, retune_at = retune_caches(model.caches, T + j, force=j == 0)
        rows.append(model(torch.tensor([[token]], device=device),
                          torch.tensor([T + j], device=device)))
    return torch.cat(rows).float().log_softmax(dim=-1)


def greedy_continuation(model: Transformer, method: str, budget: int | None,
                        prompt: Sequence[int], m: int,
                        prefilled: PrefilledPrompt | None = None) -> GenerateResult:
    """``generate.generate``'s report for m greedy tokens (the first from prefill, then m - 1
    decode steps; no stop token) with fresh caches of ``method``, built from ``prefilled``
    when given; its ``token_ids[0]`` is the continuation."""
    return generate(model, prefilled.tokens if prefilled is not None else list(prompt),
                    CacheRequest(method, budget), max_new_tokens=m, prefilled=prefilled)


def cache_bytes(caches: Sequence[KVCache]) -> tuple[int, int]:
    """(allocated bytes, bytes read per decode step), summed over layers."""
    return (sum(c.allocated_bytes() for c in caches),
            sum(c.bytes_read_per_step() for c in caches))


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
                       attention_sums=needs_attention_sums(m for m, _ in configs))
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
        shared = METHODS[method].shared_prefill
        T = len(prompt.prompt)
        if shared:
            build_from_prefill(model, pre, method, budget, m)
        else:  # KeyDiff prefills block-wise: fresh caches, its own prefill in each pass
            attach_caches(model, method, budget, T, m)
        own_first = first if shared else None
        top1 = top1_matches(teacher_forced_logprobs(model, prompt.prompt, ref, own_first),
                            ref) / m
        if method == "full":
            lp, probe, recall = full_lp, None, None
        elif not shared:  # its keys are not the shared prefill's: no recall against them
            attach_caches(model, method, budget, T, m)
            lp, probe, recall = teacher_forced_logprobs(
                model, prompt.prompt, prompt.continuation), None, None
        else:
            build_from_prefill(model, pre, method, budget, m)
            probe = RecallProbe(pre, keep_raw)
            with probe.attached(model):
                lp = teacher_forced_logprobs(model, prompt.prompt, prompt.continuation, first)
            recall = probe.summary(model.args.n_layers) if METHODS[method].budgeted else None
        out[(method, budget)] = {
            "match_prefix": matching_prefix(greedy, ref), "top1": top1,
            "nlls": token_nlls(lp, prompt.continuation), "kls": kl_rows(full_lp, lp),
            "recall": recall, "report": report, **({"probe": probe} if keep_raw else {})}
        tick()
    return {"reference": ref, "prefill_s": pre.prefill_s, "configs": out}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def fidelity_fingerprint(prompts: Sequence[Prompt], configs: Sequence[tuple[str, Any]],
                         m: int, run_key: Any = None, code: bool = True) -> str:
    """sha256 (hex) of what a prompt's numbers depend on: every prompt's and continuation's
    token ids, the configurations, m, ``run_key`` (the caller's checkpoint, dtype, threads)
    and the code (``harness.code_digest``; left out with ``code`` False)."""
    return spec_fingerprint(fidelity_spec(prompts, configs, m, run_key), code)


def fidelity_spec(prompts: Sequence[Prompt], configs: Sequence[tuple[str, Any]], m: int,
                  run_key: Any = None) -> dict[str, Any]:
    """The JSON-able settings ``fidelity_fingerprint`` hashes (without the code)."""
    return {"prompts": [[p.prompt, p.continuation] for p in prompts],
            "configs": [list(c) for c in configs], "m": m, "run_key": run_key}


_REPORT_KEYS = ("kv_cache_bytes", "kv_bytes_per_step", "method_params")


def _saved_prompt(i: int, got: dict[str, Any], new_errors: dict[tuple[str, Any], str],
                  tag: Any) -> dict[str, Any]:
    """One line of a fidelity partial file: prompt ``i``'s numbers (``evaluate_prompt``'s
    result without the raw reports, which the rows do not read), the budgets it found
    rejected and the code's ``tag``."""
    return {"prompt": i, "tag": tag, "reference": got["reference"],
            "prefill_s": got["prefill_s"],
            "errors": [[m_, b, msg] for (m_, b), msg in new_errors.items()],
            "configs": [[m_, b, {**{k: v for k, v in r.items() if k not in ("report", "probe")},
                                 "report": {k: r["report"][k] for k in _REPORT_KEYS}}]
                        for (m_, b), r in got["configs"].items()]}


def evaluate(model: Transformer, prompts: Sequence[Prompt], methods: Sequence[str],
             budgets: Sequence[int], m: int, progress: bool = False, *,
             bar: Any = None, partial: str | Path | None = None, run_key: Any = None,
             tag: Any = None, restart: bool = False,
             stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Every row for ``methods`` x ``budgets`` on ``prompts`` (equal lengths T, m new tokens
    each), one prefill per prompt. ``bar``: a tqdm bar to advance (one step per prompt and
    configuration, plus one per prompt for the reference); else one is made when
    ``progress``.

    ``partial``: a JSON-lines file keeping each finished prompt's numbers (a header with
    ``fidelity_fingerprint``, then one line per prompt, tagged with ``tag``); a run that finds
    it with the same fingerprint skips the prompts it holds and gives the same rows as a run
    that never stopped. A file of other prompts, settings or engine code is a ConfigError
    (``harness.open_partial``), or with ``restart`` overwritten. ``stop``: asked before each
    prompt; once True no prompt starts, the rows cover the prompts finished
    (``prompts_run``; ``unfinished`` counts the rest; no rows when none finished) and the
    same call later runs the rest. The caller deletes the file once every prompt ran.
    The result's ``fingerprint`` (with ``partial``; else None) marks the run, so that a caller
    can tell a complete run from its result file.
    """
    configs = configurations(methods, budgets)
    own = bar is None and progress
    if own:
        bar = progress_bar(len(prompts) * (len(configs) + 1), True)
    tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    T = len(prompts[0].prompt)
    t0 = time.perf_counter()
    errors: dict[tuple[str, Any], str] = {}
    done: dict[int, dict[str, Any]] = {}
    saved = None
    if partial is not None:
        partial = Path(partial)
        kept, saved, fingerprint = open_partial(
            partial, fidelity_spec(prompts, configs, m, run_key), restart)
        done = {line["prompt"]: line for line in kept}
        for line in kept:
            errors.update({(m_, b): msg for m_, b, msg in line["errors"]})
        if done:
            print(f"resuming: {len(done)} of {len(prompts)} prompts of {T} tokens from "
                  f"{partial}", file=sys.stderr)
            if bar is not None:
                bar.update(len(done) * (len(configs) + 1))
    try:
        for i, p in enumerate(prompts):
            if i in done:
                continue
            if stop is not None and stop():
                break
            if bar is not None:
                bar.set_description(f"T={T} prompt {i + 1}/{len(prompts)}")
            before = dict(errors)
            got = evaluate_prompt(model, p, configs, m, errors=errors, tick=tick)
            new = {c: e for c, e in errors.items() if c not in before}
            done[i] = _saved_prompt(i, got, new, tag)
            if saved is not None:
                saved.write(json.dumps(done[i]) + "\n")
                saved.flush()
    finally:
        if saved is not None:
            saved.close()
    if own and bar is not None:
        bar.close()
    order = sorted(done)
    accs = {c: _Acc([], [], [], [], []) for c in configs}
    reports: dict[tuple[str, Any], dict[str, Any]] = {}
    for i in order:
        for m_, b, r in done[i]["configs"]:
            a = accs[(m_, b)]
            a.prefix.append(r["match_prefix"])
            a.top1.append(r["top1"])
            a.nlls.append(r["nlls"])
            a.kls.append(r["kls"])
            a.recall.append(r["recall"])
            reports[(m_, b)] = r["report"]
    rows = []
    for method, budget in configs if order else ():
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
            "num_prompts": len(prompts), "prompts_run": len(order),
            "unfinished": len(prompts) - len(order), "methods": list(methods),
            "budgets": list(budgets), "rows": rows,
            "reference_continuations": [done[i]["reference"] for i in order],
            "prompts": [prompt_record(prompts[i]) for i in order],
            "prefill_s": [done[i]["prefill_s"] for i in order],
            "prompt_tags": [done[i]["tag"] for i in order],
            "fingerprint": fingerprint if partial is not None else None,
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


def run_variant(model: Transformer, prompts, configs, m: int, reference: dict | None,
                bar=None) -> tuple[list[dict], dict]:
    """Rows for one model over ``configs`` [(method, budget)]; ``reference`` holds the float
    full-cache log-probs and greedy tokens per prompt (None: this is the float model, whose
    full-cache pass becomes the reference, returned)."""
    acc = {c: {"kl": [], "top1": [], "nll": [], "match": [], "kv": None} for c in configs}
    ref = reference or {"logprobs": [], "greedy": []}
    for i, p in enumerate(prompts):
        pre = prefill_once(model, p.prompt)
        for method, budget in configs:
            a = acc[(method, budget)]
            report = build_from_prefill(model, pre, method, budget, m)
            a["kv"] = report["kv_bytes_per_step"]
            lp = teacher_forced_logprobs(model, p.prompt, p.continuation, first_logits=pre.logits)
            greedy = greedy_continuation(model, method, budget, p.prompt, m,
                                         prefilled=pre)["token_ids"][0]
            if reference is None and method == "full":
                ref["logprobs"].append(lp)
                ref["greedy"].append(greedy)
            a["nll"] += token_nlls(lp, p.continuation)
            a["kl"] += kl_rows(ref["logprobs"][i], lp)
            a["top1"].append(float((lp.argmax(-1) == ref["logprobs"][i].argmax(-1))
                                   .float().mean()))
            a["match"].append(matching_prefix(greedy, ref["greedy"][i]))
            if bar is not None:
                bar.update(1)
    rows = []
    for (method, budget), a in acc.items():
        rows.append({
            "method": method, "budget": budget,
            "kl_vs_float": sum(a["kl"]) / len(a["kl"]),
            "top1_vs_float": sum(a["top1"]) / len(a["top1"]),
            "perplexity": perplexity([a["nll"]]),
            "match_prefix": sum(a["match"]) / len(a["match"]),
            "match_prefix_per_prompt": a["match"], "kv_bytes_per_step": a["kv"],
            "weight_bytes": weight_bytes(model),
            "weight_bytes_per_step": weight_bytes_per_step(model)})
    return rows, ref
