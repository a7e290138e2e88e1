"""Whether two runs of the same prompts answer alike: the needle, RULER-style or any harness
result file (``harness.run``'s JSON: ``items`` and per-configuration ``rows`` of ``answers``
and ``scores`` in the items' order) compared prompt by prompt. ``scripts/agreement.py`` is its
command; it measures what a change of commit, machine or dtype does to the answers, apart
from what a change of method does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The fields that name a prompt (not its outputs): what two runs must share to be compared
ITEM_KEY = ("task", "length", "sample", "depth", "needle", "variant", "seed")


def item_key(item: dict[str, Any]) -> tuple:
    """The prompt ``item`` names (its ``ITEM_KEY`` fields present)."""
    return tuple((k, item[k]) for k in ITEM_KEY if k in item)


def config_of(row: dict[str, Any], res: dict[str, Any]) -> tuple[str, int | None, str]:
    """(method, budget, mode) of a result ``row`` of the file ``res``."""
    mode = "question_agnostic" if res.get("question_agnostic") else res.get("mode", "standard")
    return row["method"], row["budget"], mode


def agreement(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per configuration both result files ran, over the prompts both ran (by ``item_key``):
    ``n``, how many answers are identical (``same_answers``) and how many scores
    (``same_scores``), each run's mean score over those prompts (percent) and the prompts
    whose scores differ (their keys, with both scores).

    Raises:
        ValueError: the files share no prompt.
    """
    index_b = {item_key(it): i for i, it in enumerate(b["items"])}
    pairs = [(i, index_b[item_key(it)]) for i, it in enumerate(a["items"])
             if item_key(it) in index_b]
    if not pairs:
        raise ValueError("the two result files share no prompt")
    rows_b = {config_of(r, b): r for r in b["rows"]}
    out = []
    for row_a in a["rows"]:
        row_b = rows_b.get(config_of(row_a, a))
        if row_b is None:
            continue
        same_ans = sum(row_a["answers"][i] == row_b["answers"][j] for i, j in pairs)
        differ = [{"prompt": dict(item_key(a["items"][i])), "a": row_a["scores"][i],
                   "b": row_b["scores"][j]}
                  for i, j in pairs if row_a["scores"][i] != row_b["scores"][j]]
        n = len(pairs)
        out.append({"method": row_a["method"], "budget": row_a["budget"],
                    "mode": config_of(row_a, a)[2], "n": n, "same_answers": same_ans,
                    "same_scores": n - len(differ),
                    "score_a": 100 * sum(row_a["scores"][i] for i, _ in pairs) / n,
                    "score_b": 100 * sum(row_b["scores"][j] for _, j in pairs) / n,
                    "differ": differ})
    return out


def markdown(rows: Sequence[dict[str, Any]], name_a: str, name_b: str) -> str:
    """``agreement``'s rows as a Markdown table, the prompts whose scores differ below it."""
    lines = [f"| method | budget | mode | n | same answers | same scores | {name_a} | {name_b} |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['budget'] or '-'} | {r['mode']} | {r['n']} | "
                     f"{r['same_answers']} | {r['same_scores']} | {r['score_a']:.1f} | "
                     f"{r['score_b']:.1f} |")
    total = sum(r["n"] for r in rows)
    same = sum(r["same_scores"] for r in rows)
    lines.append("")
    lines.append(f"Scores identical on {same} of {total} (prompt, configuration) pairs; "
                 f"answers identical on {sum(r['same_answers'] for r in rows)}.")
    for r in rows:
        for d in r["differ"]:
            lines.append(f"- {r['method']} @{r['budget'] or '-'}: {d['prompt']}: "
                         f"{d['a']:.2f} -> {d['b']:.2f}")
    return "\n".join(lines) + "\n"
