"""Per-length accuracy tables from needle and RULER-style result files, merged across runs.

    python scripts/accuracy_summary.py results/accuracy/qwen2.5-coder-0.5b/*/ \
        --out results/accuracy/qwen2.5-coder-0.5b/tables.md

Reads the JSON files of ``scripts/eval_needle.py`` and ``scripts/eval_ruler.py`` (files, or
directories whose ``*.json`` are read; other JSON files there are skipped) and writes, per
benchmark and prompt length, one Markdown table: a line per method, a column per token budget
and mode (standard, then question-agnostic), each cell the mean score (%) over that length's
prompts. Runs that evaluated different methods or tasks on the same prompts are merged by
prompt: a prompt is one ``items`` entry, and the same entry in two files is the same prompt
(a later file's score replaces an earlier one's). Cells:

* ``n/a``: the method rejected the budget for at least one of its prompts (the files' rows say
  why, e.g. SnapKV's budget below its observation window);
* ``(k/n)`` after a score: the method ran on k of the n prompts of that length that any run
  evaluated, so its mean is over a different set of prompts than a complete row's;
* empty: not run.

Under each table, the RocketKV paper's claim (Section 5, RocketKV close to the full cache and
to Exact-TopK and ahead of the other non-oracle methods) is checked at each budget in
standard mode, on the prompts every method in the table ran at that budget (the line says so
when that is fewer than the length's prompts): RocketKV's score, its difference from full and
from Exact-TopK, and the other methods scoring at least as high (``full`` and ``exact_topk``
are the oracles). Exit status 0, or 2 on bad input.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from cli import OneLineParser
from compression import METHODS

ORACLES = ("full", "exact_topk")
MODES = (False, True)  # question_agnostic


def _item_key(item: dict[str, Any], bench: str) -> str:
    return bench + json.dumps(item, sort_keys=True)


def load(paths: list[str]) -> list[dict[str, Any]]:
    """The needle / RULER result dicts among ``paths`` (files or directories), in order.

    Raises:
        ValueError: a path that does not exist, a file that is not JSON, or no result file.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"{p}: no such file or directory")
    results = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: not a readable JSON file ({e})") from None
        if isinstance(data, dict) and data.get("task") in ("needle", "ruler") \
                and "items" in data and "rows" in data:
            results.append(data)
    if not results:
        raise ValueError("no needle or RULER-style result file among the paths given")
    return results


def collect(results: list[dict[str, Any]]):
    """``scores[(bench, question_agnostic, method, budget)][prompt] = score or None`` (None:
    the method rejected the budget for that prompt), ``lengths[bench][length] = set of
    prompts`` that some method ran or rejected one by one (a prompt of an unfinished batch
    that nothing ran is left out) and ``budgets``, the budgets seen. A score beats a rejection
    of the same prompt whatever the order of ``results``: a later run that could serve a
    budget (e.g. DuoAttention once a head pattern exists) fills the cells an earlier run
    left n/a."""
    scores: dict[tuple, dict[str, float | None]] = defaultdict(dict)
    lengths: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    budgets: set[int] = set()
    for res in results:
        bench, qa = res["task"], bool(res["question_agnostic"])
        keys = [_item_key(it, bench) for it in res["items"]]
        for row in res["rows"]:
            if row.get("budget") is not None:
                budgets.add(int(row["budget"]))
            cell = scores[(bench, qa, row["method"], row.get("budget"))]
            if "error" in row:  # rejected before any prompt ran
                for k in keys:
                    cell.setdefault(k, None)
                continue
            for i, (key, s) in enumerate(zip(keys, row["scores"])):
                if s is None and str(i) not in row.get("item_errors", {}):
                    continue  # not run (an unfinished batch)
                if s is not None or cell.get(key) is None:
                    cell[key] = s
                lengths[bench][int(res["items"][i]["length"])].add(key)  # a prompt that ran
    return scores, lengths, sorted(budgets)


def _mean(cell: dict[str, float | None], prompts: set[str]) -> tuple[float | None, int, bool]:
    """(mean score, prompts run, any rejected) of one method/budget/mode over ``prompts``."""
    got = [cell[p] for p in sorted(prompts) if p in cell]  # sorted: the same sum every run
    if any(s is None for s in got):
        return None, len(got), True
    return (sum(got) / len(got) if got else None), len(got), False


def table(scores, bench: str, prompts: set[str], budgets: list[int]) -> str:
    """One Markdown table and the claim lines for ``bench`` over one length's ``prompts``."""
    methods = [m for m in METHODS if any(k[0] == bench and k[2] == m and
                                         any(p in scores[k] for p in prompts) for k in scores)]
    n = len(prompts)

    def cell(m: str, qa: bool, b: int) -> dict[str, float | None]:
        return scores.get((bench, qa, m, b if METHODS[m].budgeted else None), {})

    head = ("| method | " + " | ".join(str(b) for b in budgets) + " | "
            + " | ".join(f"q-agnostic {b}" if i == 0 else str(b) for i, b in enumerate(budgets))
            + " |")
    lines = [head, "|---" * (2 * len(budgets) + 1) + "|"]
    for m in methods:
        cells = []
        for qa in MODES:
            for b in budgets:
                mean, k, rejected = _mean(cell(m, qa, b), prompts)
                if rejected:
                    cells.append("n/a")
                elif mean is None:
                    cells.append("")
                else:
                    cells.append(f"{100 * mean:.1f}" + (f" ({k}/{n})" if k < n else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    for b in budgets:  # every method compared on the same prompts: those all of them ran
        common = set.intersection(*({p for p in prompts if p in cell(m, False, b)}
                                    for m in methods))
        line = claim_line({(m, False, b): _mean(cell(m, False, b), common) for m in methods},
                          methods, b, len(common))
        if len(common) < n:
            line += f" (over the {len(common)} of {n} prompts every method ran)"
        lines.append(line)
    return "\n".join(lines)


def claim_line(means, methods: list[str], budget: int, n: int) -> str:
    """The paper's claim at one budget in standard mode from ``means[(method, False,
    budget)]`` = (mean, prompts run, any rejected), each over the same ``n`` prompts."""
    head = f"- standard, budget {budget}: "
    if not {"rocketkv", *ORACLES} <= set(methods):
        return head + "not checked (rocketkv, full and exact_topk are not all in the table)"
    if n == 0:
        return head + "not checked (no prompt that every method ran)"
    rk = means[("rocketkv", False, budget)][0]
    if rk is None:
        return head + "not checked (rocketkv n/a)"
    full = means[("full", False, budget)][0]
    top = means[("exact_topk", False, budget)][0]
    parts = [f"rocketkv {100 * rk:.1f}"]
    for name, v in (("full", full), ("exact_topk", top)):
        # rounded, plus 0.0: equal scores summed in another order print +0.0, not -0.0
        parts.append(f"{name} {100 * v:.1f} ({round(100 * (rk - v), 1) + 0.0:+.1f})"
                     if v is not None
                     else f"{name} n/a")
    at_least = [f"{m} {100 * means[(m, False, budget)][0]:.1f}" for m in methods
                if m not in ORACLES and m != "rocketkv" and means[(m, False, budget)][0]
                is not None and means[(m, False, budget)][0] >= rk]
    parts.append("other methods at or above rocketkv: " + (", ".join(at_least) or "none"))
    return head + "; ".join(parts)


def markdown(results: list[dict[str, Any]]) -> str:
    scores, lengths, budgets = collect(results)
    out = []
    for bench in ("needle", "ruler"):
        for length in sorted(lengths.get(bench, {})):
            prompts = lengths[bench][length]
            name = "Needle" if bench == "needle" else "RULER-style tasks"
            out.append(f"## {name}, {length} tokens ({len(prompts)} prompts)\n")
            out.append(table(scores, bench, prompts, budgets) + "\n")
    return "\n".join(out)


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="result JSON files or directories of them")
    p.add_argument("--out", metavar="PATH", help="write the Markdown here (default: stdout)")
    a = p.parse_args(argv)
    try:
        text = ("# Accuracy per prompt length\n\n`scripts/accuracy_summary.py` over "
                + ", ".join(f"`{r}`" for r in a.results) + ". A cell is the mean score (%) over "
                "the length's prompts; n/a: the method rejected the budget; (k/n): it ran k of "
                "the n prompts.\n\n" + markdown(load(a.results)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.out:
        try:
            Path(a.out).write_text(text)
        except OSError as e:
            print(f"error: cannot write {a.out}: {e.strerror or e}", file=sys.stderr)
            return 2
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
