"""Scores: of an answer against the expected strings, and of a compressed cache's outputs and
attention against the full cache's.

* Answers: ``string_match_all`` / ``string_match_part`` (RULER's, for the needle and RULER-style
  tasks), ``rouge1_recall`` (a free-text needle answer).
* Token streams and distributions (``evals.fidelity``): ``matching_prefix``, ``top1_matches``,
  ``token_nlls``, ``perplexity``, ``kl_rows``.
* Attention: ``selection_masses``, the attention mass a selection covers against Exact-TopK's
  with as many tokens (``evals.probes.RecallProbe`` records it at every decode step).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
from torch import Tensor

from rocketkv.engine.prefix_cache import matching_prefix  # noqa: F401 (re-exported)

_WORD = re.compile(r"[a-z0-9]+")


def rouge1_recall(prediction: str, reference: str) -> float:
    """ROUGE-1 recall: the fraction of the reference's words (lower-case alphanumeric runs,
    with multiplicity) that the prediction contains."""
    ref = _WORD.findall(reference.lower())
    if not ref:
        return 0.0
    pred: dict[str, int] = {}
    for w in _WORD.findall(prediction.lower()):
        pred[w] = pred.get(w, 0) + 1
    hit = 0
    for w in ref:
        if pred.get(w, 0) > 0:
            pred[w] -= 1
            hit += 1
    return hit / len(ref)


def _found(prediction: str, outputs: Sequence[str]) -> list[bool]:
    if not outputs:
        raise ValueError("string matching needs at least one expected output")
    pred = prediction.lower()
    return [o.lower() in pred for o in outputs]


def string_match_all(prediction: str, outputs: Sequence[str]) -> float:
    """Fraction of ``outputs`` that occur in ``prediction`` as substrings, ignoring case.

    Raises:
        ValueError: ``outputs`` is empty.
    """
    found = _found(prediction, outputs)
    return sum(found) / len(found)


def string_match_part(prediction: str, outputs: Sequence[str]) -> float:
    """1.0 when any of ``outputs`` occurs in ``prediction`` (ignoring case), else 0.0.

    Raises:
        ValueError: ``outputs`` is empty.
    """
    return float(any(_found(prediction, outputs)))


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
