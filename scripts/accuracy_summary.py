"""Per-length accuracy tables with 95% intervals and paired tests, from needle and RULER-style
result files merged across runs, and ``summary.json`` beside them.

    python scripts/accuracy_summary.py results/accuracy/qwen2.5-coder-0.5b/*/ \\
        --markdown results/accuracy/qwen2.5-coder-0.5b/tables.md [--allow-mixed] [--json PATH]

Reads the JSON files of ``scripts/eval_needle.py`` and ``scripts/eval_ruler.py`` (files, or
directories whose ``*.json`` are read; other JSON files there are skipped). Runs that evaluated
different methods or tasks on the same prompts are merged by prompt: a prompt is one ``items``
entry, and the same entry in two files is the same prompt (a later file's score replaces an
earlier one's; a score beats a rejection of the same prompt whatever the order).

Commits. Every file records the ``commit`` it ran (``evals/provenance.py``; a dirty tree is a
group of its own, ``<commit>+dirty``). Files of different commits are not merged unless
``--allow-mixed`` is given; then every cell names the commits of its prompts (``@abc1234``).
A file without a commit (written before provenance was recorded) is "commit unknown" and a
group of its own: alone it is summarised, with any other file it needs ``--allow-mixed``. A
run resumed at a later commit records each prompt's commit (``item_commits``); its prompts count
under those commits (the file is listed once per commit).

Models. Files that record different checkpoints (sha256) or dtypes are never merged, with or
without ``--allow-mixed`` (one error line): summarise each model and dtype on its own. The
header and ``summary.json`` (``model``) name the one they share.

Scores. Cells use the boundary-aware score (``evals/scoring.py``: the first value stated for
one-answer tasks, pass/fail; F1 for list tasks). Files scored before it (needle ``scoring``
"exact", RULER files without ``scoring``) are rescored from their saved answers; their stored
substring scores become the ``sub`` column. A cell shows ``score [ci_low, ci_high] n=k``
(``n=k/N`` when the method ran k of the length's N prompts: an incomplete cell), then
``sub X`` when the old substring score differs; ``n/a``: the method rejected the budget for
some prompt; empty: not run. A length whose run stopped before every batch ran
(``--time-limit``) is marked incomplete, with the prompts (per task) no run has answered yet;
its cells cover the prompts run, and it is left out of the cells and comparisons pooled over
lengths until it is complete (its tasks run in order: the first would weigh alone).
Intervals (``evals/stats.py``, ``cell_stats``): Wilson for pass/fail cells, the stratified
score interval for pass/fail cells pooled over lengths of different sizes, percentile
bootstrap over prompts (seeded, stratified by task or length for pooled cells) otherwise.

Needle variants. A needle file's ``variant`` (``scripts/eval_needle.py --variant``) is a
benchmark of its own: the paraphrased needle (``paraphrase``) gets its own tables, pooled cells
and comparisons (bench ``needle_paraphrase`` in ``summary.json``), never pooled with the
standard needle (``needle``), whose question shares the needle's words.

Weak tasks. A (task, length) where ``full`` scores under 50 in standard mode is reported apart
(its own table line) and left out of every pooled cell and pooled comparison: at 32K full
answers no cwe prompt, and a method's difference there says nothing about the method.

Comparisons. Per mode, budget and length, and pooled over lengths: RocketKV against every
other method at the same budget (``full`` has none), paired over the prompts both ran:
the mean difference in points, its 95% interval (Tango's score interval for pass/fail, its
stratified form for pass/fail pooled over lengths of different sizes, the bootstrap for
partial credit), and an exact paired test (McNemar for
pass/fail, sign-flip for partial credit or pooled strata). A difference is stated only
where p < 0.05; otherwise the line says "no detectable difference at n = ...". The p-values
are per comparison, not corrected for the many comparisons made.

``summary.json`` (beside ``--markdown``, or ``--json``): ``cells`` (one per bench x task x length x
method x budget x mode, plus the pooled ones with task or length "pooled": ``n``, ``score``,
``ci_low``, ``ci_high`` in percent, ``interval``, ``score_substring``, ``commit``),
``comparisons``, ``weak`` units, ``not_run`` (per bench, task and length: the prompts of
unfinished batches that no file has answered; the Markdown marks those lengths incomplete),
the ``files`` read with their commits. Exit status 0, or 2 on
bad input (one ``error:`` line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.cli.common import OneLineParser, deprecated_alias
from rocketkv.evals.summary import load, summarize


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="result JSON files or directories of them")
    p.add_argument("--markdown", metavar="PATH", help="write the Markdown here (default: "
                   "stdout); summary.json goes beside it")
    p.add_argument("--json", metavar="PATH", help="write the summary JSON here instead")
    deprecated_alias(p, "--out", "--markdown")  # --out is a folder elsewhere
    p.add_argument("--allow-mixed", action="store_true",
                   help="merge files of different commits (each cell names its commits)")
    a = p.parse_args(argv)
    try:
        md, summary = summarize(load(a.results), a.allow_mixed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = ("# Accuracy per prompt length\n\n`scripts/accuracy_summary.py` over "
            + ", ".join(f"`{r}`" for r in a.results) + ".\n\n" + md)
    json_path = a.json or (str(Path(a.markdown).parent / "summary.json") if a.markdown
                           else None)
    try:
        if a.markdown:
            Path(a.markdown).write_text(text)
        else:
            print(text)
        if json_path:
            Path(json_path).write_text(json.dumps(summary, indent=1) + "\n")
    except OSError as e:
        print(f"error: cannot write {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
