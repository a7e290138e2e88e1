"""One document, many questions: what reusing the document's prefill saves and costs, and
whether the answers stay those of a single run (``scripts/document_reuse.py``).

Per method and budget, the same questions are answered three ways (greedy):

* ``single``: one run of document + question per question (``Engine.generate``), the reference;
* ``question_aware``: the document prefilled once and its whole K/V kept; each question
  prefilled after it and the method's caches built from document + question
  (``Engine.prefill_document(question_aware=True)``, ``Document.ask``);
* ``question_agnostic``: the document prefilled and compressed once; each question attends to
  what the method kept (``question_aware=False``).

Per way: the prefill seconds in all (the document's once, each question's own, with the caches'
build where there is one), the bytes held between questions (``Document.held_bytes``: the
document's K/V, or its compressed cache with the rewind snapshot), and per question whether the
answer equals the single run's, token for token. Times are wall seconds on the machine that ran
it (the load average is recorded beside them); the answers do not depend on it.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from rocketkv import api
from rocketkv.cli.common import check_json_path, write_json
from rocketkv.engine.measure import weights_label
from rocketkv.engine.provenance import load_average, provenance
from rocketkv.evals.answer_length import readme_prompt
from rocketkv.evals.harness import configurations, parse_method_specs
from rocketkv.model import ConfigError

QUESTIONS = ("What is the hidden code of the emerald quarry archive?",
             "Who wrote these essays, and what are they about?",
             "What does the author say about startups?",
             "Summarize the document in one sentence.")
WAYS = ("single", "question_aware", "question_agnostic")


def split_readme_prompt(tokenizer) -> tuple[str, str]:
    """The README's document question (``answer_length.readme_prompt``) as its document and
    its question (the last paragraph)."""
    document, question = readme_prompt(tokenizer).rstrip().rsplit("\n\n", 1)
    return document, question


def compare(engine: api.Engine, document: str, questions: Sequence[str], method: str,
            budget: int | None, max_new_tokens: int) -> dict[str, Any]:
    """The three ways for one method and budget (see the module docstring): per way the
    prefill seconds, the bytes held and the answers; per question whether each way's answer
    equals the single run's.

    Raises:
        ConfigError: what the engine rejects (a budget too small for the document...).
    """
    out: dict[str, Any] = {"method": method, "budget": budget}
    answers: dict[str, list[list[int]]] = {}
    single, t0 = [], time.perf_counter()
    for q in questions:
        r = engine.generate(f"{document.rstrip()}\n\n{q}", method=method, budget=budget,
                            max_new_tokens=max_new_tokens)
        single.append(r)
    out["single"] = {"prefill_s": sum(r.metrics["prefill_s"] for r in single),
                     "wall_s": time.perf_counter() - t0, "held_bytes": 0,
                     "texts": [r.text for r in single]}
    answers["single"] = [r.tokens for r in single]
    # room for the longest question (its template's tokens included, roughly) and its answer
    reserve = max(len(engine.encode(q, chat=False)) for q in questions) + max_new_tokens + 16
    for way, aware in (("question_aware", True), ("question_agnostic", False)):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eviction note: recorded below instead
            doc = engine.prefill_document(document, method=method, budget=budget,
                                          reserve_tokens=reserve, question_aware=aware)
        rs = [doc.ask(q, max_new_tokens=max_new_tokens) for q in questions]
        summary = doc.prefill_summary()
        out[way] = {"question_aware": doc.question_aware,
                    "prefill_s": summary["document_prefill_s"]
                    + sum(summary["question_prefill_s"]),
                    "document_prefill_s": summary["document_prefill_s"],
                    "question_prefill_s": summary["question_prefill_s"],
                    "wall_s": time.perf_counter() - t0, "held_bytes": doc.held_bytes,
                    "note": doc.note, "texts": [r.text for r in rs]}
        answers[way] = [r.tokens for r in rs]
    for way in WAYS[1:]:
        out[way]["same_as_single"] = [a == s for a, s in zip(answers[way], answers["single"])]
        out[way]["prefill_saved_s"] = out["single"]["prefill_s"] - out[way]["prefill_s"]
    out["document_tokens"] = len(doc.ids)
    return out


def table(rows: Sequence[dict[str, Any]], questions: Sequence[str]) -> str:
    """The rows as a Markdown table: per method and way, the prefill seconds in all, the
    seconds saved against single runs, the MiB held, the answers equal to the single run's."""
    lines = [f"{len(questions)} questions about one document; prefill seconds in all, against "
             "one single run per question.", "",
             "| method | budget | way | prefill s | saved s | held MiB | same answer as "
             "single run |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['budget']} | - | - | - | - | {r['error']} |")
            continue
        for way in WAYS:
            w = r[way]
            same = "(reference)" if way == "single" else \
                f"{sum(w['same_as_single'])} of {len(w['same_as_single'])}"
            saved = "-" if way == "single" else f"{w['prefill_saved_s']:.2f}"
            lines.append(f"| {r['method']} | {r['budget'] or '-'} | {way} | "
                         f"{w['prefill_s']:.2f} | {saved} | {w['held_bytes'] / 2**20:.1f} | "
                         f"{same} |")
    return "\n".join(lines) + "\n"


def run(args, argv: Sequence[str] | None = None) -> int:
    """``scripts/document_reuse.py`` with its parsed arguments: the checks before the model
    loads, then ``compare`` per configuration, the table on stdout, ``--json`` and ``--md``.
    Exit status 0 when every question-aware answer equals its single run, 1 otherwise, 2 on
    bad input (one ``error:`` line)."""
    try:
        if args.max_new_tokens <= 0:
            raise ConfigError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
        check_json_path(args.json)
        check_json_path(args.md, "--md")
        names, per_method = parse_method_specs(args.methods)
        configs = configurations(names, args.budgets, per_method)
        document = questions = None
        if args.document is not None:
            with open(args.document, encoding="utf-8") as f:
                document = f.read()
        if args.questions is not None:
            with open(args.questions, encoding="utf-8") as f:
                questions = [line.strip() for line in f if line.strip()]
            if not questions:
                raise ConfigError(f"{args.questions} holds no question")
        if args.threads:
            torch.set_num_threads(args.threads)
        engine = api.load(args.checkpoint, dtype=args.dtype, gguf_weights=args.gguf_weights)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if document is None:
        document, question = split_readme_prompt(engine.tokenizer)
        questions = questions or [question, *QUESTIONS[1:]]
    questions = questions or list(QUESTIONS)
    rows, load_before = [], load_average()
    for method, budget in configs:
        try:
            rows.append(compare(engine, document, questions, method, budget,
                                args.max_new_tokens))
        except ConfigError as e:
            rows.append({"method": method, "budget": budget, "error": str(e)})
        print(f"{method} {budget}: done", file=sys.stderr, flush=True)
    text = table(rows, questions)
    print(text)
    record = {"questions": questions, "max_new_tokens": args.max_new_tokens, "rows": rows,
              "load_average": {"before": load_before, "after": load_average()},
              "threads": torch.get_num_threads(),
              "weights": weights_label(engine.model),
              "provenance": provenance(engine.checkpoint)}
    if args.json:
        write_json(args.json, record)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)
    aware_ok = all(all(r["question_aware"]["same_as_single"]) for r in rows if "error" not in r)
    return 0 if aware_ok and all("error" not in r for r in rows) else 1
