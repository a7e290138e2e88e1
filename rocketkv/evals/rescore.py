"""Stored RULER answers rescored with the cut-value and per-key rules of ``evals.scoring``:
what the committed ``ruler.json`` tables become when a value cut by the token cap is neither
right nor wrong and niah_multiquery counts a value only under its own key.

    python scripts/rescore_ruler.py results/accuracy/M/ruler_4k/ruler.json ... \\
        --tokenizer ~/.cache/rocketkv-data/Qwen2.5-Coder-0.5B-Instruct.gguf \\
        --json rescored.json --md rescored.md

Input: result files of ``scripts/eval_ruler.py`` (``items``: each item's ``task``,
``outputs``, ``facts`` and ``max_new_tokens``; ``rows``: per method and budget the
``answers`` and ``scores`` in item order, and from files the harness wrote since it records
them, ``answer_capped`` and ``answer_tokens``: ``harness.evaluate_items``). They are read,
never written.

Per answer:

* **capped**, from one of two sources (each row counts its answers by source:
  ``capped_recorded`` and ``capped_approximated``; the summary adds them up):

  - **recorded**: the row's ``answer_capped`` holds True or False for the answer: the run's
    own flag (``harness.Answers.capped``: no stop token ended the answer and it holds at
    least its item's ``max_new_tokens`` tokens). Exact: used as it is.
  - **approximated** (older files, without ``answer_capped`` or with None for the answer):
    the answer, re-tokenized with the checkpoint's tokenizer (``encode(text, bos=False)``),
    counts at least ``max_new_tokens - 1`` tokens. An answer that ended at a stop token holds
    at most ``max_new_tokens - 1`` tokens of text (the stop token is not in the text), one
    the cap ended holds ``max_new_tokens``. This is an approximation: the stored text is the
    decoded answer, and re-tokenizing it may give a token more or fewer than were generated
    (merges across token boundaries, a stop token's neighbours), so an answer that stopped at
    a stop token one token short of the cap counts as capped too.

  Being capped changes a score only when the answer's last value ends at the very end of its
  text.
* the new score: ``ruler.score_task(task, answer, outputs, capped=capped, facts=facts)``;
  also the old rules alone (``score_task(task, answer, outputs)``: equal to the file's
  ``scores`` when the file was scored with the current rules), the cut rule alone and the
  per-key rule alone.

Per row (method, budget): the file's ``score``; the new score as ``ruler.task_rows`` makes
it (the mean over tasks of the per-task means, items scored None left out; None unless every
task has a score); the answers treated as capped, how many capped flags were recorded and how
many approximated, the cut values dropped, the items scored None, and per task the old and
new means.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rocketkv.engine.provenance import provenance
from rocketkv.errors import ConfigError
from rocketkv.evals.ruler import TASK_KINDS, TASKS, asked_keys, score_task, task_rows
from rocketkv.evals.scoring import cut_candidate
from rocketkv.formats.tokenizer import load_tokenizer

CountTokens = Callable[[str], int]


def is_capped(answer: str, max_new_tokens: int, count_tokens: CountTokens) -> bool:
    """Whether ``answer`` is treated as stopped by its cap: ``count_tokens(answer) >=
    max_new_tokens - 1`` (see the module docstring for the approximation)."""
    return count_tokens(answer) >= max_new_tokens - 1


def _is_text_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_list_of(value: Any, kind: type, n: int) -> bool:
    """``value`` is a list of ``n`` entries, each None or a ``kind`` (bool excluded from
    int)."""
    return isinstance(value, list) and len(value) == n and all(
        v is None or (isinstance(v, kind) and (kind is bool or not isinstance(v, bool)))
        for v in value)


def read_result(path: str | Path) -> dict[str, Any]:
    """The RULER result file at ``path``, its structure checked (no task names: those need
    ``evals.ruler``, ``check_tasks``).

    Raises:
        ConfigError: the file is missing, unreadable, not JSON, or lacks a field rescoring
            needs (the message names the file and the field).
    """
    path = Path(path)
    try:
        res = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(res, dict):
        raise ConfigError(f"{path}: not a result file (a JSON object with items and rows)")
    if res.get("task", "ruler") != "ruler":
        raise ConfigError(f"{path}: a {res['task']!r} result, not a RULER one")
    items, rows = res.get("items"), res.get("rows")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: no items (a RULER result lists its items)")
    if not isinstance(rows, list):
        raise ConfigError(f"{path}: no rows")
    for i, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("task"), str):
            raise ConfigError(f"{path}: item {i} has no task")
        if not _is_text_list(it.get("outputs")) or not it["outputs"]:
            raise ConfigError(f"{path}: item {i} has no outputs")
        m = it.get("max_new_tokens")
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
            raise ConfigError(f"{path}: item {i} has no positive max_new_tokens")
        if "facts" in it and not _is_text_list(it["facts"]):
            raise ConfigError(f"{path}: item {i}'s facts are not a list of strings")
        if it["task"] == "niah_multiquery" and "facts" not in it:
            raise ConfigError(f"{path}: item {i} (niah_multiquery) has no facts to give its keys")
    for j, r in enumerate(rows):
        if not isinstance(r, dict) or "method" not in r:
            raise ConfigError(f"{path}: row {j} has no method")
        if "error" in r:
            continue
        for key in ("answers", "scores"):
            if not isinstance(r.get(key), list) or len(r[key]) != len(items):
                raise ConfigError(f"{path}: row {j} ({r['method']}) has no {key} for its "
                                  f"{len(items)} items")
        if not all(a is None or isinstance(a, str) for a in r["answers"]):
            raise ConfigError(f"{path}: row {j} ({r['method']}) has an answer that is not text")
        for key, kind, what in (("answer_capped", bool, "true, false or null"),
                                ("answer_tokens", int, "whole numbers or null")):
            if key in r and not _is_list_of(r[key], kind, len(items)):
                raise ConfigError(f"{path}: row {j} ({r['method']}): {key} must list "
                                  f"{what} for its {len(items)} items")
    return res


def check_tasks(res: dict[str, Any], path: str | Path) -> None:
    """Every item's task is a RULER task whose facts fit it (``ruler.asked_keys``).

    Raises:
        ConfigError: an unknown task, or multiquery facts that are not its keys then values.
    """
    for i, it in enumerate(res["items"]):
        if it["task"] not in TASKS:
            raise ConfigError(f"{path}: item {i} has an unknown task {it['task']!r}")
        try:
            asked_keys(it["task"], it.get("facts", []), it["outputs"])
        except ValueError as e:
            raise ConfigError(f"{path}: item {i}: {e}") from None


def _tasks(res: dict[str, Any]) -> list[str]:
    listed = res.get("tasks")
    present = list(dict.fromkeys(it["task"] for it in res["items"]))
    if _is_text_list(listed) and set(present) <= set(listed):
        return [t for t in listed if t in present]
    return present


def _aggregate(scores: Sequence[float | None], items: Sequence[Any],
               tasks: Sequence[str]) -> tuple[float | None, dict[str, float | None]]:
    """(score, per_task) as ``ruler.task_rows`` gives them for one row of ``scores``."""
    (row,) = task_rows([{"scores": list(scores)}], items, tasks)
    return row["score"], row["per_task"]


def rescore_result(res: dict[str, Any], count_tokens: CountTokens) -> dict[str, Any]:
    """Every row of the (checked) result ``res`` rescored; see the module docstring.

    Returns:
        {"tasks", "mode", "rows": [per row: "method", "budget", "items" (answered),
        "unanswered", "capped" (answers treated as capped), "capped_recorded" (answers whose
        capped flag is the run's, ``answer_capped``), "capped_approximated" (answers whose flag
        is the re-tokenizing approximation), "cut" (values dropped as cut),
        "none" (items scored None), "score_old" (the file's), "score_old_rules",
        "score_new", "score_cut_only", "score_keys_only", "delta" (new - old, None when
        either is None), "per_task" {task: {"old", "new", "capped", "cut", "none"}},
        "scores_new" (per item), "capped_items" (their indices)] or {"method", "budget",
        "error"} for a row the file records as failed}.
    """
    items = res["items"]
    tasks = _tasks(res)
    metas = [SimpleNamespace(meta={"task": it["task"]}) for it in items]
    counts: dict[str, int] = {}

    def capped_answer(answer: str, it: dict[str, Any]) -> bool:
        if answer not in counts:
            counts[answer] = count_tokens(answer)
        return counts[answer] >= it["max_new_tokens"] - 1

    out_rows = []
    for r in res["rows"]:
        if "error" in r:
            out_rows.append({"method": r["method"], "budget": r.get("budget"),
                             "error": r["error"]})
            continue
        new: list[float | None] = []
        cut_only: list[float | None] = []
        keys_only: list[float | None] = []
        old_rules: list[float | None] = []
        capped_items, cut_items, none_items = [], [], []
        recorded_flags = r.get("answer_capped") or [None] * len(items)
        recorded = approximated = 0
        for i, (it, a) in enumerate(zip(items, r["answers"])):
            if a is None:  # not run (an unfinished row)
                for lst in (new, cut_only, keys_only, old_rules):
                    lst.append(None)
                continue
            task, outputs, facts = it["task"], it["outputs"], it.get("facts")
            if isinstance(recorded_flags[i], bool):  # the run's own flag
                capped = recorded_flags[i]
                recorded += 1
            else:
                capped = capped_answer(a, it)
                approximated += 1
            new.append(score_task(task, a, outputs, capped=capped, facts=facts))
            cut_only.append(score_task(task, a, outputs, capped=capped))
            keys_only.append(score_task(task, a, outputs, facts=facts))
            old_rules.append(score_task(task, a, outputs))
            if capped:
                capped_items.append(i)
                if cut_candidate(a, *TASK_KINDS[task], expected=outputs) is not None:
                    cut_items.append(i)
            if new[-1] is None:
                none_items.append(i)
        score_new, per_new = _aggregate(new, metas, tasks)
        score_old_stored, per_old_stored = _aggregate(r["scores"], metas, tasks)
        per_old = r.get("per_task") if isinstance(r.get("per_task"), dict) else per_old_stored
        score_old = r.get("score", score_old_stored)
        by_task: dict[str, dict[str, Any]] = {}
        for t in tasks:
            idx = [i for i, it in enumerate(items) if it["task"] == t]
            by_task[t] = {"old": per_old.get(t), "new": per_new[t],
                          "capped": sum(i in capped_items for i in idx),
                          "cut": sum(i in cut_items for i in idx),
                          "none": sum(i in none_items for i in idx)}
        out_rows.append({
            "method": r["method"], "budget": r.get("budget"),
            "items": sum(a is not None for a in r["answers"]),
            "unanswered": sum(a is None for a in r["answers"]),
            "capped": len(capped_items), "capped_recorded": recorded,
            "capped_approximated": approximated, "cut": len(cut_items), "none": len(none_items),
            "score_old": score_old, "score_old_rules": _aggregate(old_rules, metas, tasks)[0],
            "score_new": score_new, "score_cut_only": _aggregate(cut_only, metas, tasks)[0],
            "score_keys_only": _aggregate(keys_only, metas, tasks)[0],
            "delta": None if score_new is None or score_old is None else score_new - score_old,
            "per_task": by_task, "scores_new": new, "capped_items": capped_items})
    return {"tasks": tasks, "mode": res.get("mode"), "rows": out_rows}


def _summary(files: Sequence[dict[str, Any]]) -> dict[str, Any]:
    deltas = [r["delta"] for f in files for r in f["rows"] if r.get("delta") is not None]
    moves = {}
    for key in ("score_cut_only", "score_keys_only"):
        d = [r[key] - r["score_old_rules"] for f in files for r in f["rows"]
             if r.get(key) is not None and r.get("score_old_rules") is not None]
        moves[key] = {"mean": sum(d) / len(d) if d else None,
                      "min": min(d, default=None), "max": max(d, default=None)}
    return {"cells": len(deltas),
            "capped_recorded": sum(r.get("capped_recorded", 0) for f in files for r in f["rows"]),
            "capped_approximated": sum(r.get("capped_approximated", 0) for f in files
                                       for r in f["rows"]),
            "delta_mean": sum(deltas) / len(deltas) if deltas else None,
            "delta_min": min(deltas, default=None), "delta_max": max(deltas, default=None),
            "cells_up": sum(d > 1e-12 for d in deltas),
            "cells_down": sum(d < -1e-12 for d in deltas),
            "cut_rule_alone": moves["score_cut_only"],
            "key_rule_alone": moves["score_keys_only"],
            "old_rules_differ": sum(
                1 for f in files for r in f["rows"]
                if r.get("score_old") is not None and r.get("score_old_rules") is not None
                and not math.isclose(r["score_old"], r["score_old_rules"], abs_tol=1e-9))}


def rescore_files(paths: Sequence[str | Path], count_tokens: CountTokens) -> dict[str, Any]:
    """``rescore_result`` of each file (read and checked first): {"files": [{"path", ...}],
    "summary": {"cells", "capped_recorded", "capped_approximated" (answers over every row
    and file: those given the run's recorded flag, those given the approximation), "delta_mean",
    "delta_min", "delta_max", "cells_up", "cells_down", "cut_rule_alone", "key_rule_alone"
    (each rule's move from the old rules alone: mean, min, max), "old_rules_differ" (rows
    whose file score the old rules do not reproduce)}}.

    Raises:
        ConfigError: as ``read_result`` and ``check_tasks``.
    """
    return _rescore_all(_read_all(paths), count_tokens)


def _read_all(paths: Sequence[str | Path]) -> list[tuple[str | Path, dict[str, Any]]]:
    results = [(p, read_result(p)) for p in paths]
    for p, res in results:
        check_tasks(res, p)
    return results


def _rescore_all(results: Sequence[tuple[str | Path, dict[str, Any]]],
                 count_tokens: CountTokens) -> dict[str, Any]:
    files = [{"path": str(p), **rescore_result(res, count_tokens)} for p, res in results]
    return {"files": files, "summary": _summary(files)}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: a headline, then per file a table of its rows (scores in
    percent: old, new, their difference, each rule alone, the counts, per task old -> new)."""
    s = report["summary"]
    lines = ["# RULER answers rescored: cut values neither right nor wrong, multiquery per key",
             "",
             f"{s['cells']} cells (method, budget, file): new - old from "
             f"{_signed(s['delta_min'])} to {_signed(s['delta_max'])} points, mean "
             f"{_signed(s['delta_mean'])}; {s['cells_up']} up, {s['cells_down']} down. The cut "
             f"rule alone moves cells by {_signed(s['cut_rule_alone']['mean'])} points on "
             f"average ({_signed(s['cut_rule_alone']['min'])} to "
             f"{_signed(s['cut_rule_alone']['max'])}), the per-key rule alone by "
             f"{_signed(s['key_rule_alone']['mean'])} ({_signed(s['key_rule_alone']['min'])} "
             f"to {_signed(s['key_rule_alone']['max'])}). Capped flags: "
             f"{s['capped_recorded']} recorded by the run, "
             f"{s['capped_approximated']} approximated from the re-tokenized text.",
             "",
             "Columns: old (the file's score), new (both rules), cut / keys (one rule alone), "
             "capped (answers the run recorded as capped, or, without a recorded flag, whose "
             "re-tokenized text reaches max_new_tokens - 1 tokens), "
             "dropped (cut values dropped), None (items without a verdict, left out of the "
             "means); per task old -> new. Scores in percent."]
    if s["old_rules_differ"]:
        lines += ["", f"{s['old_rules_differ']} rows' file scores are not what the old rules "
                      "give their answers (scored with other rules): see score_old_rules."]
    for f in report["files"]:
        tasks = f["tasks"]
        lines += ["", f"## {f['path']}" + (f" ({f['mode']})" if f.get("mode") else ""), "",
                  "| method | budget | old | new | new - old | cut | keys | capped | dropped "
                  "| None | " + " | ".join(tasks) + " |",
                  "|---" * (10 + len(tasks)) + "|"]
        for r in f["rows"]:
            budget = "-" if r.get("budget") is None else str(r["budget"])
            if "error" in r:
                msg = str(r["error"]).replace("|", "\\|").replace("\n", " ")
                lines.append(f"| {r['method']} | {budget} | n/a: {msg} |" + " |" * (7 + len(tasks)))
                continue
            per = r["per_task"]
            lines.append(
                f"| {r['method']} | {budget} | {_pct(r['score_old'])} | {_pct(r['score_new'])} "
                f"| {_signed(r['delta'])} | {_pct(r['score_cut_only'])} "
                f"| {_pct(r['score_keys_only'])} | {r['capped']} | {r['cut']} | {r['none']} | "
                + " | ".join(f"{_pct(per[t]['old'])} -> {_pct(per[t]['new'])}" for t in tasks)
                + " |")
    return "\n".join(lines) + "\n"


def _check_outputs(args: Any) -> None:
    inputs = {Path(p).resolve() for p in args.files}
    for flag, out in (("--json", args.json), ("--md", args.md)):
        if out is None:
            continue
        if Path(out).resolve() in inputs:
            raise ConfigError(f"{flag} {out} is one of the input files; they are not written")
        parent = Path(out).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"{flag} {out}: no directory {parent}")


def run(args: Any) -> int:
    """``scripts/rescore_ruler.py``: ``args.files``, ``args.tokenizer``, ``args.json``,
    ``args.md``. Exit status 0, or 2 on bad input (one ``error:`` line on stderr, before the
    tokenizer loads; input files are read and checked first)."""
    try:
        _check_outputs(args)
        if not Path(args.tokenizer).exists():
            raise ConfigError(f"--tokenizer {args.tokenizer}: no such file or directory")
        results = _read_all(args.files)
        tok = load_tokenizer(args.tokenizer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def count(text: str) -> int:
        return len(tok.encode(text, bos=False))

    argv = ["scripts/rescore_ruler.py", *sys.argv[1:]]
    report = {"tokenizer": str(args.tokenizer),
              "capped_rule": "the run's recorded flag (the row's answer_capped) where the file "
                             "has one; else re-tokenized answer (bos=False) >= "
                             "max_new_tokens - 1 tokens",
              **_rescore_all(results, count),
              "provenance": provenance(None, argv)}
    md = markdown(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(md)
    print(md.split("\n\n")[1])  # the headline
    return 0
