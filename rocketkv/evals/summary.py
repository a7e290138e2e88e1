"""The accuracy summary: result files of the needle, RULER-style and fidelity runs merged by
prompt, each cell with its interval, each comparison paired over the same prompts
(``summarize``). ``scripts/accuracy_summary.py`` is its command; its docstring describes
the tables, the rules for merging files and the statistics."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from rocketkv.compression import METHODS
from rocketkv.evals.needle import VARIANTS
from rocketkv.evals.ruler import PASS_FAIL_TASKS, score_task
from rocketkv.evals.scoring import first_value_pass
from rocketkv.evals.stats import EQUIVALENCE_MARGIN, cell_stats, holm, paired_comparison

ORACLES = ("full", "exact_topk")
REFERENCE = "rocketkv"
MODES = ("standard", "question_agnostic")
WEAK_BELOW = 0.5  # full's score under which a (task, length) is reported apart
ALPHA = 0.05
PERCENT_FIELDS = ("diff", "ci_low", "ci_high", "ci90_low", "ci90_high", "mdd")  # in points
# the benchmarks' headings, in report order: the needle per variant, then RULER
_VARIANT_HEADINGS = {"paraphrase": "paraphrased question (no content word shared with it)"}
BENCHES = {"needle": "Needle",
           **{f"needle_{v}": "Needle, " + _VARIANT_HEADINGS.get(v, f"{v} variant")
              for v in VARIANTS if v != "standard"},
           "ruler": "RULER-style tasks"}


def bench_of(res: dict[str, Any]) -> str:
    """A result file's benchmark: ``ruler``, ``needle`` (the standard needle, and files from
    before ``variant`` was recorded) or ``needle_<variant>``."""
    variant = res.get("variant") or "standard"
    return res["task"] if res["task"] != "needle" or variant == "standard" \
        else f"needle_{variant}"


def is_needle(bench: str) -> bool:
    return bench == "needle" or bench.startswith("needle_")


def task_of(bench: str, item: dict[str, Any]) -> str:
    """An item's task: ``needle`` for every needle variant, else the RULER task."""
    return "needle" if is_needle(bench) else item["task"]


def _item_key(item: dict[str, Any], bench: str) -> str:
    return bench + json.dumps(item, sort_keys=True)


def load(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(file name, result dict) of the needle / RULER result files among ``paths`` (files or
    directories), in order.

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
            results.append((str(f), data))
    if not results:
        raise ValueError("no needle or RULER-style result file among the paths given")
    return results


def commit_of(name: str, res: dict[str, Any]) -> tuple[str, str]:
    """(group, label) of a file's code: its commit (12 hex digits, ``+dirty`` for a dirty
    tree) for both; a file without one is ("unknown:FILE", "commit unknown")."""
    prov = res.get("provenance") or {}
    commit = res.get("commit") or prov.get("commit")
    if not commit:
        return f"unknown:{name}", "commit unknown"
    return (_label(commit, prov.get("dirty")),) * 2


def _label(commit: str, dirty: bool | None) -> str:
    return commit[:12] + ("+dirty" if dirty else "")


def item_commits(name: str, res: dict[str, Any]) -> list[tuple[str, str]]:
    """(group, label) per item: the item's own commit where the file records one per item
    (``item_commits``: a run resumed at a later commit), else the file's (``commit_of``)."""
    whole = commit_of(name, res)
    per_item = res.get("item_commits") or [None] * len(res["items"])
    return [(_label(t["commit"], t.get("dirty")),) * 2 if t and t.get("commit") else whole
            for t in per_item]


def _scorers(res: dict[str, Any]) -> tuple[bool, Callable[[str, dict], float] | None]:
    """(binary by default, rescoring function or None when the stored scores are current).
    RULER files are pooled under one rule, ``boundary_f1`` (``score_task`` without the token
    cap's or niah_multiquery's key rule): files scored so (``"scoring": "boundary_f1"``) as
    they are, others (older rules, or ``boundary_f1_capped`` from the answers' recorded caps)
    rescored from their stored answers."""
    if res["task"] == "needle":
        if res.get("scoring") in ("first_number", "rouge1_recall"):
            return res["scoring"] != "rouge1_recall", None
        return True, lambda a, it: first_value_pass(a, str(it["answer"]), "number")
    if res.get("scoring") == "boundary_f1":
        return False, None
    return False, lambda a, it: score_task(it["task"], a, it["outputs"])


class Collected:
    """Every prompt's score per (bench, mode, method, budget), the prompts' units and the
    files' commits (``collect``)."""

    def __init__(self) -> None:
        # (bench, mode, method, budget) -> prompt key -> (score | None, substring | None, label)
        self.scores: dict[tuple, dict[str, tuple]] = defaultdict(dict)
        self.unit: dict[str, tuple[str, str, int]] = {}  # prompt -> (bench, task, length)
        self.binary: dict[str, bool] = {}
        self.budgets: set[int] = set()
        # (bench, mode, method, budget) -> why the method is degenerate there (the row's
        # ``degenerate``, ``Params.degenerate``): marked in the tables, no claim uses it
        self.degenerate: dict[tuple, str] = {}
        self.files: list[dict[str, Any]] = []
        # prompts of unfinished batches that no file ran: prompt -> (bench, task, length)
        self.not_run: dict[str, tuple[str, str, int]] = {}

    def prompts(self, bench: str, task: str | None = None,
                length: int | None = None) -> set[str]:
        return {k for k, (b, t, n) in self.unit.items() if b == bench
                and (task is None or t == task) and (length is None or n == length)}

    def not_run_at(self, bench: str, length: int) -> dict[str, int]:
        """{task: prompts not run} of ``bench`` at ``length``."""
        out: dict[str, int] = defaultdict(int)
        for b, t, n in self.not_run.values():
            if (b, n) == (bench, length):
                out[t] += 1
        return dict(sorted(out.items()))

    def cell(self, bench: str, mode: str, method: str, budget: int | None) -> dict[str, tuple]:
        return self.scores.get((bench, mode, method, budget if METHODS[method].budgeted
                                else None), {})


def collect(results: list[tuple[str, dict[str, Any]]]) -> Collected:
    """Merge the files by prompt. A prompt belongs to a unit (bench, task, length) once some
    method ran or rejected it; a prompt of an unfinished batch that no file ran is counted in
    ``not_run`` (the report marks its length incomplete)."""
    c = Collected()
    listed: dict[str, tuple[str, str, int]] = {}
    for name, res in results:
        bench = bench_of(res)
        mode = "question_agnostic" if res.get("question_agnostic") else "standard"
        per_item = item_commits(name, res)
        binary_default, rescore = _scorers(res)
        for group, label in dict.fromkeys(per_item):
            c.files.append({"path": name, "commit": label, "group": group,
                            "rescored": rescore is not None})
        keys = [_item_key(it, bench) for it in res["items"]]
        for key, it in zip(keys, res["items"]):
            listed.setdefault(key, (bench, task_of(bench, it), int(it["length"])))
        for row in res["rows"]:
            if row.get("budget") is not None:
                c.budgets.add(int(row["budget"]))
            cell = c.scores[(bench, mode, row["method"], row.get("budget"))]
            if row.get("degenerate"):
                c.degenerate[(bench, mode, row["method"], row.get("budget"))] = row["degenerate"]
            if "error" in row:  # rejected before any prompt ran
                for k, (_, label) in zip(keys, per_item):
                    cell.setdefault(k, (None, None, label))
                continue
            if rescore is not None and "answers" not in row:
                raise ValueError(f"{name}: scored by substring and without the answers to "
                                 "rescore them")
            subs = row.get("scores_substring")
            for i, (key, s) in enumerate(zip(keys, row["scores"])):
                if s is None and str(i) not in row.get("item_errors", {}):
                    continue  # not run (an unfinished batch)
                it = res["items"][i]
                sub = None
                if s is not None:
                    if rescore is not None:
                        s, sub = rescore(row["answers"][i], it), s
                    elif subs is not None:
                        sub = subs[i]
                if s is not None or cell.get(key, (None,))[0] is None:
                    cell[key] = (s, sub, per_item[i][1])
                task = task_of(bench, it)
                c.unit[key] = (bench, task, int(it["length"]))
                c.binary[key] = binary_default if is_needle(bench) else task in PASS_FAIL_TASKS
    c.not_run = {k: u for k, u in listed.items() if k not in c.unit}
    return c


# --------------------------------------------------------------------------------------------
# Cells and comparisons


def cell_of(c: Collected, bench: str, mode: str, method: str, budget: int | None,
            keys: set[str], strata: Callable[[str], Hashable] | None = None
            ) -> dict[str, Any] | None:
    """One cell over ``keys``: None when not run, {"rejected": True, ...} when the method
    rejected the budget for some prompt, else ``evals.stats.cell_stats`` (fractions) with
    ``n_prompts`` (len(keys)), ``score_substring`` and ``commits``."""
    cell = c.cell(bench, mode, method, budget)
    got = sorted(k for k in keys if k in cell)  # sorted: the same sums every run
    if not got:
        return None
    commits = sorted({cell[k][2] for k in got})
    if any(cell[k][0] is None for k in got):
        return {"rejected": True, "n": len(got), "n_prompts": len(keys), "commits": commits}
    values = [cell[k][0] for k in got]
    labels = None if strata is None else [strata(k) for k in got]
    out = cell_stats(values, binary=all(c.binary[k] for k in got), strata=labels)
    subs = [cell[k][1] for k in got]
    if all(s is not None for s in subs):
        out["score_substring"] = cell_stats(subs, strata=labels)["score"]
    else:
        out["score_substring"] = None
    out.update(n_prompts=len(keys), commits=commits)
    reason = c.degenerate.get((bench, mode, method, budget if METHODS[method].budgeted
                               else None))
    if reason:
        out["degenerate"] = reason
    return out


def _short(label: str) -> str:
    """A commit label for a cell: 7 hex digits (``+dirty`` kept), or "unknown"."""
    if label == "commit unknown":
        return "unknown"
    return label.removesuffix("+dirty")[:7] + ("+dirty" if label.endswith("+dirty") else "")


def fmt_cell(cell: dict[str, Any] | None, mixed: bool) -> str:
    """``score [lo, hi] n=k[/N][ sub X][ @commits]`` in percent; ``n/a``; or empty."""
    if cell is None:
        return ""
    if cell.get("rejected"):
        return "n/a"
    n = f"n={cell['n']}" + (f"/{cell['n_prompts']}" if cell["n"] < cell["n_prompts"] else "")
    text = (f"{100 * cell['score']:.1f} [{100 * cell['ci_low']:.1f}, "
            f"{100 * cell['ci_high']:.1f}] {n}")
    sub = cell.get("score_substring")
    if sub is not None and abs(sub - cell["score"]) > 5e-4:
        text += f" sub {100 * sub:.1f}"
    if mixed:
        text += " @" + "+".join(_short(x) for x in cell["commits"])
    if cell.get("degenerate"):
        text += " (degenerate)"
    return text


def methods_in(c: Collected, bench: str, keys: set[str]) -> list[str]:
    """The methods that ran some of ``keys``, in the registry's order."""
    return [m for m in METHODS if any(k[0] == bench and k[2] == m and any(p in v for p in keys)
                                      for k, v in c.scores.items())]


def comparisons(c: Collected, bench: str, mode: str, budget: int, keys: set[str],
                strata: Callable[[str], Hashable] | None = None) -> list[dict[str, Any]]:
    """RocketKV at ``budget`` against every other method that ran some of ``keys`` (at the
    same budget; full without), paired over the prompts both scored
    (``evals.stats.paired_comparison``)."""
    ref = c.cell(bench, mode, REFERENCE, budget)
    out = []
    for m in methods_in(c, bench, keys):
        if m == REFERENCE:
            continue
        other = c.cell(bench, mode, m, budget)
        common = sorted(k for k in keys if ref.get(k, (None,))[0] is not None
                        and other.get(k, (None,))[0] is not None)
        if not common:
            continue
        a, b = [ref[k][0] for k in common], [other[k][0] for k in common]
        res = paired_comparison(a, b, strata=None if strata is None
                                else [strata(k) for k in common])
        row = {"a": REFERENCE, "b": m, "budget": budget,
               "b_budget": budget if METHODS[m].budgeted else None, "mode": mode, **res}
        reason = c.degenerate.get((bench, mode, m, row["b_budget"]))
        if reason:
            row["degenerate"] = reason
        out.append(row)
    return out


def fmt_comparison(r: dict[str, Any]) -> str:
    """One comparison's line: the difference, its 95% interval, the test's p and the p the
    claim uses (``p_holm``: Holm-adjusted within its family, ``Report.claims``), and the
    claim: higher or lower where the adjusted p is under ``ALPHA``; else equivalent within
    the margin where the two one-sided tests say so (its 90% interval inside it); else no
    detectable difference, with the smallest difference the prompts could have detected."""
    b = f"{r['b']}@{r['b_budget']}" if r["b_budget"] is not None else r["b"]
    head = (f"- {r['a']}@{r['budget']} vs {b} (n = {r['n']}): "
            f"{100 * r['diff']:+.1f} points [{100 * r['ci_low']:+.1f}, {100 * r['ci_high']:+.1f}]"
            f", p = {r['p']:.3g}, Holm {r['p_holm']:.3g} ({r['test']}; {r['wins']} better, "
            f"{r['losses']} worse): ")
    if r.get("degenerate"):
        return head + f"{r['b']} degenerate at this budget ({r['degenerate']}): no claim"
    if r["p_holm"] < ALPHA:
        return head + f"{r['a']} {'higher' if r['diff'] > 0 else 'lower'}"
    if r["equivalent"]:
        return head + (f"equivalent within {100 * EQUIVALENCE_MARGIN:.0f} points (90% "
                       f"[{100 * r['ci90_low']:+.1f}, {100 * r['ci90_high']:+.1f}])")
    mdd = "n/a" if r["mdd"] is None else "over 100 points" if r["mdd"] > 1 else \
        f"{100 * r['mdd']:.0f} points"
    return head + f"no detectable difference (MDD {mdd} at n = {r['n']})"


# --------------------------------------------------------------------------------------------
# The report


class Report:
    """Builds the Markdown and the JSON entries together."""

    def __init__(self, c: Collected, mixed: bool):
        self.c, self.mixed = c, mixed
        self.budgets = sorted(c.budgets)
        # the modes some file ran (a table has no empty question-agnostic columns)
        self.modes = [m for m in MODES if any(key[1] == m for key in c.scores)]
        self.lines: list[str] = []
        self.cells: list[dict[str, Any]] = []
        self.comparisons: list[dict[str, Any]] = []
        self.weak: list[dict[str, Any]] = []
        self.not_run: list[dict[str, Any]] = []

    def _entry(self, cell: dict[str, Any] | None, **where: Any) -> None:
        if cell is None:
            return
        e: dict[str, Any] = {**where, "n": cell["n"], "n_prompts": cell["n_prompts"],
                             "commit": ", ".join("unknown" if x == "commit unknown" else x
                                                 for x in cell["commits"])}
        if cell.get("rejected"):
            e.update(score=None, ci_low=None, ci_high=None, rejected=True)
        else:
            sub = cell["score_substring"]
            e.update(score=100 * cell["score"], ci_low=100 * cell["ci_low"],
                     ci_high=100 * cell["ci_high"], interval=cell["interval"],
                     score_substring=None if sub is None else 100 * sub)
        if cell.get("degenerate"):
            e["degenerate"] = cell["degenerate"]
        self.cells.append(e)

    def table(self, bench: str, task: str, length: Any, keys: set[str],
              strata: Callable[[str], Hashable] | None = None) -> None:
        """A method x (mode, budget) table over ``keys`` (and its JSON cells)."""
        c = self.c
        head = ["|", "method", "|"]
        for mode in self.modes:
            for i, b in enumerate(self.budgets):
                head += [f"q-agnostic {b}" if mode != "standard" and i == 0 else str(b), "|"]
        self.lines += [" ".join(head), "|---" * (len(self.modes) * len(self.budgets) + 1) + "|"]
        for m in methods_in(c, bench, keys):
            row = []
            for mode in self.modes:
                done = False
                for b in self.budgets:
                    cell = cell_of(c, bench, mode, m, b, keys, strata)
                    row.append(fmt_cell(cell, self.mixed))
                    if not done or METHODS[m].budgeted:
                        self._entry(cell, bench=bench, task=task, length=length, method=m,
                                    budget=b if METHODS[m].budgeted else None, mode=mode)
                    done = True
            self.lines.append(f"| {m} | " + " | ".join(row) + " |")
        self.lines.append("")

    def claims(self, bench: str, length: Any, keys: set[str],
               strata: Callable[[str], Hashable] | None = None) -> None:
        """The comparisons of ``bench`` at ``length`` (or pooled), every mode and budget: one
        family, whose p values are Holm-adjusted together (``stats.holm``); a comparison with
        a method degenerate at its budget is listed but claims nothing and stays out of the
        family (its ``p_holm`` is its own p)."""
        family = [(mode, b, comparisons(self.c, bench, mode, b, keys, strata))
                  for mode in self.modes for b in self.budgets]
        adjusted = iter(holm([r["p"] for _, _, got in family for r in got
                              if not r.get("degenerate")]))
        for mode, b, got in family:
            if not got:
                continue
            self.lines.append(f"{mode}, budget {b}:")
            for r in got:
                r["p_holm"] = r["p"] if r.get("degenerate") else next(adjusted)
                self.lines.append(fmt_comparison(r))
                self.comparisons.append({"bench": bench, "length": length, **r})
            self.lines.append("")

    @staticmethod
    def _not_run_line(bench: str, missing: dict[str, int], ran: int) -> str:
        """The line under an incomplete length's heading: how many of its prompts (of which
        tasks) no run has answered yet."""
        total = sum(missing.values())
        text = f"Incomplete: {total} of this length's {total + ran} prompts not run yet"
        if not is_needle(bench):
            text += " (" + ", ".join(f"{t} {n}" for t, n in missing.items()) + ")"
        return text + ("; the cells cover the prompts run.\n" if ran else ".\n")

    def weak_units(self, bench: str, length: int, tasks: Sequence[str]) -> dict[str, float]:
        """{task: full's standard score} of the tasks at ``length`` where full scores under
        ``WEAK_BELOW``; tasks full did not run are kept (not judged)."""
        weak = {}
        for t in tasks:
            cell = cell_of(self.c, bench, "standard", "full", None,
                           self.c.prompts(bench, t, length))
            if cell is not None and not cell.get("rejected") and cell["score"] < WEAK_BELOW:
                weak[t] = cell["score"]
                self.weak.append({"bench": bench, "task": t, "length": length,
                                  "full_score": 100 * cell["score"]})
        return weak

    def build(self) -> None:
        c = self.c
        units = [*c.unit.values(), *c.not_run.values()]
        for bench in dict.fromkeys([*BENCHES, *sorted({b for b, _, _ in units})]):
            name = BENCHES.get(bench, bench)  # a variant this code does not know: its name
            lengths = sorted({n for b, _, n in units if b == bench})
            pooled: set[str] = set()
            incomplete: list[str] = []
            for length in lengths:
                keys = c.prompts(bench, length=length)
                missing = c.not_run_at(bench, length)
                if missing:
                    self.not_run += [{"bench": bench, "task": t, "length": length,
                                      "prompts": n} for t, n in missing.items()]
                    incomplete.append(f"{length} ({sum(missing.values())} prompts not run)")
                if not keys:
                    self.lines.append(f"## {name}, {length} tokens (not run)\n")
                    self.lines.append(self._not_run_line(bench, missing, 0))
                    continue
                tasks = sorted({c.unit[k][1] for k in keys})
                weak = self.weak_units(bench, length, tasks)
                kept = {k for k in keys if c.unit[k][1] not in weak}
                if not missing:  # an incomplete length would weigh the tasks that ran first
                    pooled |= kept
                self.lines.append(f"## {name}, {length} tokens ({len(keys)} prompts"
                                  + ("; incomplete" if missing else "") + ")\n")
                if missing:
                    self.lines.append(self._not_run_line(bench, missing, len(keys)))
                apart = ", ".join(f"{t} (full {100 * s:.1f})" for t, s in weak.items())
                if is_needle(bench):
                    if weak:
                        self.lines.append(f"Full scores under {100 * WEAK_BELOW:.0f} here: "
                                          "reported apart, not pooled over lengths.\n")
                    self.table(bench, "needle", length, keys)
                else:
                    self.lines.append(
                        f"Mean over the tasks where full scores {100 * WEAK_BELOW:.0f} or "
                        f"more ({len(tasks) - len(weak)} of {len(tasks)})"
                        + (f"; reported apart: {apart}" if weak else "") + ":\n")
                    if kept:
                        self.table(bench, "pooled", length, kept, lambda k: c.unit[k][1])
                    for t in tasks:
                        self.lines.append(f"### {t}, {length} tokens"
                                          + (" (full under 50: apart)" if t in weak else "")
                                          + "\n")
                        self.table(bench, t, length, c.prompts(bench, t, length))
                if is_needle(bench):  # a weak length's comparisons are shown, not pooled
                    self.lines.append(f"Paired comparisons at {length} tokens"
                                      + (" (full under 50: apart)" if weak else "") + ":\n")
                    self.claims(bench, length, keys)
                elif kept:
                    self.lines.append(f"Paired comparisons at {length} tokens (pooled "
                                      "tasks):\n")
                    self.claims(bench, length, kept, lambda k: c.unit[k][1])
            if len({c.unit[k][2] for k in pooled}) > 1:
                self.lines.append(f"## {name}, pooled over lengths ({len(pooled)} prompts; "
                                  "weak units left out"
                                  + (f"; incomplete lengths left out: {', '.join(incomplete)}"
                                     if incomplete else "") + ")\n")
                strata = (lambda k: c.unit[k][2]) if is_needle(bench) else \
                    (lambda k: c.unit[k][1:])
                self.table(bench, "needle" if is_needle(bench) else "pooled", "pooled",
                           pooled, strata)
                self.lines.append("Paired comparisons, pooled over lengths:\n")
                self.claims(bench, "pooled", pooled, strata)


def same_model(results: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """{"name", "sha256", "dtype"} that every file shares (None where no file records it).
    Files that record different checkpoints (their sha256, ``evals/provenance.py``) or
    different dtypes are never merged: a prompt would pair answers of different models or of
    different arithmetic.

    Raises:
        ValueError: two files record different checkpoints, or different dtypes."""
    seen: dict[str, dict[str, list[str]]] = {"sha256": {}, "dtype": {}}
    name = None
    for path, res in results:
        ckpt = (res.get("provenance") or {}).get("checkpoint") or {}
        for key, value in (("sha256", ckpt.get("sha256")), ("dtype", res.get("dtype"))):
            if value:
                seen[key].setdefault(str(value), []).append(path)
        name = name or res.get("model")
    for key, what in (("sha256", "checkpoints"), ("dtype", "dtypes")):
        if len(seen[key]) > 1:
            parts = "; ".join(f"{v[:12] if key == 'sha256' else v}: {files[0]}"
                              + (f" and {len(files) - 1} more" if len(files) > 1 else "")
                              for v, files in seen[key].items())
            raise ValueError(f"the files come from different {what} ({parts}): summarise "
                             "each on its own")
    return {"name": name, **{k: next(iter(v), None) for k, v in seen.items()}}


def summarize(results: list[tuple[str, dict[str, Any]]], allow_mixed: bool = False
              ) -> tuple[str, dict[str, Any]]:
    """(Markdown, summary dict) of the result files.

    Raises:
        ValueError: files of different commits without ``allow_mixed``; files of different
            checkpoints or dtypes (``same_model``), whatever ``allow_mixed`` says.
    """
    model = same_model(results)
    c = collect(results)
    groups = list(dict.fromkeys(f["group"] for f in c.files))
    labels = list(dict.fromkeys(f["commit"] for f in c.files))
    if len(groups) > 1 and not allow_mixed:
        names = ", ".join(labels)
        raise ValueError(f"the files come from different code ({len(groups)} groups: {names}; "
                         "a file without a commit is a group of its own): pass --allow-mixed "
                         "to merge them, each cell then names its commits")
    r = Report(c, mixed=len(groups) > 1)
    r.build()
    paths = {f["path"]: f["rescored"] for f in c.files}  # a resumed file: one entry a commit
    rescored = sum(paths.values())
    head = ["Commit: " + (labels[0] if len(groups) == 1 else
                          "mixed (--allow-mixed; each cell names its commits after @): "
                          + ", ".join(labels)) + ".",
            "",
            "A cell: score % [95% interval] n=prompts (n=k/N: k of the length's N prompts "
            "ran); sub: the old substring score where it differs; n/a: the method rejected "
            "the budget; a length marked incomplete lists the prompts no run has answered "
            "yet, and is left out of the cells pooled over lengths. Intervals: Wilson "
            "(pass/fail), the stratified score interval (pass/fail pooled over lengths of "
            "different sizes), bootstrap over prompts (partial credit). Comparisons: paired "
            "over the same prompts, Tango's score interval (pass/fail; stratified over lengths "
            "of different sizes) or the bootstrap, and the exact McNemar or sign-flip test; p "
            "values Holm-adjusted within a family (one length's comparisons, or the pooled "
            "ones), and a difference stated only where the adjusted p < 0.05; "
            f"\"equivalent\" only where the two one-sided tests at a {100 * EQUIVALENCE_MARGIN:.0f}"
            "-point margin say so (the 90% interval inside it); else \"no detectable "
            "difference\" with the minimum detectable difference (MDD: 80% power, two-sided "
            "5%, normal approximation from the prompts' differences)."
            + (f" {rescored} of {len(paths)} files were scored by substring and are "
               "rescored here from their answers." if rescored else ""), ""]
    if model["sha256"] or model["dtype"]:
        head[1:1] = ["Model: " + ", ".join(
            x for x in (model["name"] and str(model["name"]),
                        model["sha256"] and f"sha256 {model['sha256'][:12]}",
                        model["dtype"] and f"{model['dtype']} activations") if x) + "."]
    summary = {"units": "percent", "commits": labels, "mixed": len(groups) > 1,
               "model": model,
               "files": [{k: v for k, v in f.items() if k != "group"} for f in c.files],
               "weak_below": 100 * WEAK_BELOW, "weak": r.weak, "not_run": r.not_run,
               "cells": r.cells,
               "equivalence_margin": 100 * EQUIVALENCE_MARGIN,
               "comparisons": [{**x, **{k: None if x[k] is None else 100 * x[k]
                                        for k in PERCENT_FIELDS}} for x in r.comparisons]}
    return "\n".join(head + r.lines), summary
