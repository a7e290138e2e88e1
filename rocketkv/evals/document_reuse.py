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

Needle mode (``needle_compare``, ``--needle-prompts N``): does question-aware reuse find the
needle wherever a single run does? Over needle-in-a-haystack prompts of ``evals.needle``
(``scripts/eval_needle.py``'s grid: one context length, ``depth_grid`` depths, the first N
prompts), each prompt is answered twice, greedy: a single run of document + question
(``Engine.generate`` on the prompt's token ids) and question-aware reuse (the document's ids
prefilled with ``Engine.prefill_document(question_aware=True)``, the question and answer
prefix asked after it with ``Document.ask``). Each answer is scored pass/fail by
``needle.score_answer`` (the first number of 4+ digits it states is the needle's). Per method
and budget: the prompts each way found, those the single run found and reuse missed (the
verdict ``within_one``: at most one), the answers equal token for token, and each way's
prefill seconds in all.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rocketkv import api
from rocketkv.cli.common import check_json_path, write_json
from rocketkv.data import ESSAYS
from rocketkv.engine.measure import weights_label
from rocketkv.engine.provenance import load_average, provenance
from rocketkv.evals import needle
from rocketkv.evals.answer_length import readme_prompt
from rocketkv.evals.harness import Item, configurations, parse_method_specs
from rocketkv.evals.prompts import read_texts
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


NEEDLE_META = ("length", "depth", "depth_reached", "region", "needle", "answer")


def needle_items(tokenizer, texts: Sequence[str], prompts: int, context: int,
                 depths: int) -> list[Item]:
    """The first ``prompts`` needle prompts of ``scripts/eval_needle.py``'s grid at one context
    length: ``needle.build_items`` over ``context`` tokens (the whole prompt), ``depths``
    depths from 0 to 1 and ceil(prompts / depths) needles, seed 0, the ``eval`` split, the
    haystack of ``texts`` (eval_needle's default: the essays, ``read_texts([ESSAYS])``).

    Raises:
        ConfigError: a count below 1; a context too short for the template, needle and
            question; a text with no sentence (``needle.build_items``, ``needle.Haystack``).
    """
    if prompts < 1 or depths < 1 or context < 1:
        raise ConfigError(f"needle prompts ({prompts}), depths ({depths}) and context "
                          f"({context} tokens) must be positive")
    hay = needle.Haystack(tokenizer, texts)
    needles = -(-prompts // depths)  # ceil
    items = needle.build_items(tokenizer, hay, [context], needle.depth_grid(depths), needles,
                               seed=0, split="eval")
    return items[:prompts]


def needle_compare(engine: api.Engine, items: Sequence[Item], method: str,
                   budget: int | None, max_new_tokens: int,
                   progress: Callable[[int, dict[str, Any]], Any] | None = None
                   ) -> dict[str, Any]:
    """Each needle prompt answered by a single run and by question-aware reuse (see the
    module docstring), greedy, with the engine's default stop ids, scored by
    ``needle.score_answer`` (1.0 found, 0.0 not).

    Single: ``engine.generate(item.doc_ids + item.question_ids)``. Reuse:
    ``engine.prefill_document(item.doc_ids, question_aware=True)`` with ``reserve_tokens`` =
    len(question ids) + ``max_new_tokens`` + 16, then ``Document.ask(item.question_ids)``.

    Args:
        items: needle prompts (``needle_items``; ``doc_ids`` the chat head and document,
            ``question_ids`` the question and answer prefix, ``outputs[0]`` the needle).
        method, budget: the cache (``Engine.generate``); budget in tokens, None for full.
        max_new_tokens: generated tokens at most per answer.
        progress: called after each prompt with its index and its record.
    Returns:
        ``method``, ``budget``, ``prompts`` (per prompt: the meta fields of ``NEEDLE_META``,
        ``single_text``/``single_score``, ``reuse_text``/``reuse_score``, ``same_tokens``)
        and the totals: ``n``, ``found_single``, ``found_reuse``,
        ``found_by_single_not_reuse``, ``found_by_reuse_not_single``, ``same_tokens``,
        ``prefill_s`` per way (seconds in all: single, the sum of each run's
        ``metrics["prefill_s"]``; reuse, each document's prefill plus its question's, from
        ``Document.prefill_summary``) and ``within_one`` (``found_by_single_not_reuse`` <= 1).
    Raises:
        ConfigError: what the engine rejects (a budget too small for the prompt, a prompt
            that does not fit the context, a method that cannot be question-aware: KeyDiff).
    """
    prompts: list[dict[str, Any]] = []
    single_s = reuse_s = 0.0
    for i, item in enumerate(items):
        doc_ids, question = list(item.doc_ids), list(item.question_ids)
        r = engine.generate(doc_ids + question, method=method, budget=budget,
                            max_new_tokens=max_new_tokens)
        single_s += r.metrics["prefill_s"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a budget covering the document: as generate's
            doc = engine.prefill_document(doc_ids, method=method, budget=budget,
                                          reserve_tokens=len(question) + max_new_tokens + 16,
                                          question_aware=True)
        a = doc.ask(question, max_new_tokens=max_new_tokens)
        summary = doc.prefill_summary()
        reuse_s += summary["document_prefill_s"] + sum(summary["question_prefill_s"])
        rec = {k: item.meta.get(k) for k in NEEDLE_META}
        rec |= {"single_text": r.text, "single_score": needle.score_answer(r.text, item, False),
                "reuse_text": a.text, "reuse_score": needle.score_answer(a.text, item, False),
                "same_tokens": list(r.tokens) == list(a.tokens)}
        prompts.append(rec)
        if progress is not None:
            progress(i, rec)
    single = [p["single_score"] >= 1 for p in prompts]
    reuse = [p["reuse_score"] >= 1 for p in prompts]
    missed = sum(s and not q for s, q in zip(single, reuse))
    return {"method": method, "budget": budget, "n": len(prompts),
            "found_single": sum(single), "found_reuse": sum(reuse),
            "found_by_single_not_reuse": missed,
            "found_by_reuse_not_single": sum(q and not s for s, q in zip(single, reuse)),
            "same_tokens": sum(p["same_tokens"] for p in prompts),
            "prefill_s": {"single": single_s, "reuse": reuse_s},
            "within_one": missed <= 1, "prompts": prompts}


def needle_table(rows: Sequence[dict[str, Any]], context: int) -> str:
    """The needle rows as a Markdown table: per method and budget, the prompts, those found
    by the single run and by question-aware reuse, those the single run found and reuse
    missed, the answers equal token for token, and each way's prefill seconds in all."""
    n = max((r["n"] for r in rows if "error" not in r), default=0)
    lines = [f"{n} needle prompts of {context} tokens: the single run (document + question) "
             "against question-aware reuse (the document prefilled once, the question after "
             "it).", "",
             "| method | budget | prompts | found single | found reuse | found by single, not "
             "reuse | same tokens | prefill s single | prefill s reuse |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['budget'] or '-'} | - | - | - | - | - | - | "
                         f"{r['error']} |")
            continue
        lines.append(f"| {r['method']} | {r['budget'] or '-'} | {r['n']} | "
                     f"{r['found_single']} | {r['found_reuse']} | "
                     f"{r['found_by_single_not_reuse']} | {r['same_tokens']} of {r['n']} | "
                     f"{r['prefill_s']['single']:.2f} | {r['prefill_s']['reuse']:.2f} |")
    return "\n".join(lines) + "\n"


def run(args, argv: Sequence[str] | None = None) -> int:
    """``scripts/document_reuse.py`` with its parsed arguments: the checks before the model
    loads, then per configuration ``compare`` (the README mode) or, with
    ``args.needle_prompts``, ``needle_compare``; the table on stdout, ``--json`` and ``--md``.
    ``argv``: the command line recorded in the JSON (default ``sys.argv[1:]``).

    Returns:
        the exit status. README mode: 0 when every question-aware answer equals its single
        run, 1 otherwise. Needle mode: 0 when for every configuration reuse misses at most one
        prompt the single run found (``within_one``), 1 otherwise. Either: 1 when a
        configuration failed (its row's ``error``), 2 on bad input (one ``error:`` line on
        stderr; the flags' checks before the model loads).
    """
    needle_mode = getattr(args, "needle_prompts", None) is not None
    try:
        if args.max_new_tokens <= 0:
            raise ConfigError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
        if needle_mode:
            if args.needle_prompts <= 0:
                raise ConfigError(f"--needle-prompts must be positive, got {args.needle_prompts}")
            if args.context <= 0:
                raise ConfigError(f"--context must be positive, got {args.context}")
            if args.depths < 1:
                raise ConfigError(f"--depths must be at least 1, got {args.depths}")
            if args.document is not None or args.questions is not None:
                raise ConfigError("--needle-prompts asks the needle prompts' own questions: "
                                  "it does not take --document or --questions")
        check_json_path(args.json)
        check_json_path(args.md, "--md")
        names, per_method = parse_method_specs(args.methods)
        configs = configurations(names, args.budgets, per_method)
        document = questions = texts = None
        if needle_mode:
            texts = read_texts([str(ESSAYS)])
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
        if needle_mode:
            room = engine.model.args.max_seq_len
            if args.context + args.max_new_tokens + 16 > room:
                raise ConfigError(f"--context {args.context} and --max-new-tokens "
                                  f"{args.max_new_tokens} (+16) exceed the model's context "
                                  f"({room} tokens)")
            items = needle_items(engine.tokenizer, texts, args.needle_prompts, args.context,
                                 args.depths)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = ["scripts/document_reuse.py", *(sys.argv[1:] if argv is None else argv)]
    if needle_mode:
        return _run_needle(args, engine, items, configs, command)
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
              "provenance": provenance(engine.checkpoint), "command": command}
    _write(args, record, text)
    aware_ok = all(all(r["question_aware"]["same_as_single"]) for r in rows if "error" not in r)
    return 0 if aware_ok and all("error" not in r for r in rows) else 1


def _write(args, record: dict[str, Any], text: str) -> None:
    if args.json:
        write_json(args.json, record)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)


def _run_needle(args, engine: api.Engine, items: Sequence[Item],
                configs: Sequence[tuple[str, int | None]], command: list[str]) -> int:
    """``run``'s needle mode, once the model and the prompts are loaded."""
    rows, load_before = [], load_average()
    for method, budget in configs:
        def progress(i: int, rec: dict[str, Any], method=method, budget=budget) -> None:
            print(f"{method} {budget}: prompt {i + 1}/{len(items)} single "
                  f"{rec['single_score']:.0f} reuse {rec['reuse_score']:.0f} same tokens "
                  f"{rec['same_tokens']}", file=sys.stderr, flush=True)
        try:
            rows.append(needle_compare(engine, items, method, budget, args.max_new_tokens,
                                       progress=progress))
        except ConfigError as e:
            rows.append({"method": method, "budget": budget, "error": str(e)})
        print(f"{method} {budget}: done", file=sys.stderr, flush=True)
    text = needle_table(rows, args.context)
    print(text)
    record = {"mode": "needle", "needle_prompts": args.needle_prompts, "context": args.context,
              "depths": needle.depth_grid(args.depths), "seed": 0, "split": "eval",
              "text": str(ESSAYS), "max_new_tokens": args.max_new_tokens, "rows": rows,
              "load_average": {"before": load_before, "after": load_average()},
              "threads": torch.get_num_threads(),
              "weights": weights_label(engine.model),
              "provenance": provenance(engine.checkpoint), "command": command}
    _write(args, record, text)
    ok = all("error" not in r and r["within_one"] for r in rows)
    return 0 if ok else 1
