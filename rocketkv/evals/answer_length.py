"""Does an answer depend on how many tokens were asked for? Each method answers one prompt
twice, with a short and a long ``max_new_tokens``, greedy; the first ``short`` tokens of the two
answers must be the same token ids, since a method's parameters follow the tokens in its cache
(``compression.registry.decode_horizon``), never the requested length.

``scripts/answer_length.py`` runs it and writes one JSON row per method (``compare``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from rocketkv import api
from rocketkv.cli.common import check_json_path, command_line, write_json
from rocketkv.data import ESSAYS
from rocketkv.engine.provenance import commit_fields, cpu_model, load_average
from rocketkv.evals.harness import configurations, parse_method_specs
from rocketkv.evals.prompts import make_prompt, read_texts
from rocketkv.model import ConfigError


def compare(engine, prompt_ids: Sequence[int], configurations: Iterable[tuple[str, int | None,
            dict[str, Any]]], short: int, long: int, *, compile: bool | None = False,
            on_row=None) -> list[dict[str, Any]]:
    """Answer ``prompt_ids`` with every (method, budget, options) of ``configurations`` at
    ``max_new_tokens`` ``short`` and ``long`` (greedy, the engine's stop tokens).

    Args:
        engine: a ``rocketkv.Engine``.
        prompt_ids: the prompt's token ids (chat template applied by the caller where wanted).
        short, long: new tokens asked for (short < long).
        compile: the decode step of both runs: False (default) eager, so the two differ only
            in what they ask for; None the engine's default, which on a CPU compiles a run of
            1,024 steps or more (``step.default_compile``), whose arithmetic differs from the
            eager step's in the last bits (a near tie may then fall the other way).
        on_row: called with each row as it is made (progress, partial files).
    Returns:
        one dict per configuration: method, budget, options, the two answers' token ids
        (``short_ids``, ``long_ids``), ``first_difference`` (index of the first token where
        they differ within the short answer's length, or None), ``same`` (bool), the
        parameters the long run reported and the seconds each run took.
    """
    rows = []
    for method, budget, options in configurations:
        runs = {}
        for label, n in (("short", short), ("long", long)):
            t0 = time.perf_counter()
            r = engine.generate(list(prompt_ids), method=method, budget=budget,
                                max_new_tokens=n, compile=compile, **options)
            runs[label] = (list(r.tokens), time.perf_counter() - t0, r.metrics)
        a, b = runs["short"][0], runs["long"][0][:len(runs["short"][0])]
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                    None if len(a) == len(b) else min(len(a), len(b)))
        row = {"method": method, "budget": budget, "options": options,
               "short_new_tokens": short, "long_new_tokens": long,
               "short_ids": runs["short"][0], "long_ids": runs["long"][0],
               "first_difference": diff, "same": diff is None,
               "long_params": runs["long"][2].get("method_params"),
               "short_s": round(runs["short"][1], 2), "long_s": round(runs["long"][1], 2)}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def readme_prompt(tokenizer, tokens: int = 3000) -> str:
    """The README's document question: ``scripts/make_prompt.py --text <essays> --context
    3000 --tokenizer <the checkpoint's>`` (default seed and depth), as text."""
    texts = read_texts([str(ESSAYS)])

    def count(text: str) -> int:
        return len(tokenizer.encode(text, bos=False))

    return make_prompt(texts, tokens, count)[0]


def run(args, argv: Sequence[str] | None = None) -> int:
    """``scripts/answer_length.py`` with its parsed arguments ``args``: every check before the
    model loads, then ``compare``, a line per row on stdout and the JSON file (``--json``).
    Returns the exit status: 0 when every answer agrees, 1 when one differs, 2 on bad input."""
    try:
        if not 0 < args.short < args.long:
            raise ConfigError(f"need 0 < --short < --long, got {args.short} and {args.long}")
        check_json_path(args.json)
        names, per_method = parse_method_specs(args.methods)
        configs = configurations(names, args.budgets, per_method)
        if args.prompt is not None:
            with open(args.prompt, encoding="utf-8") as f:
                text = f.read()
        engine = api.load(args.checkpoint, dtype=args.dtype)
        if args.prompt is None:
            text = readme_prompt(engine.tokenizer)
        ids = engine.encode(text, chat=args.chat)
        if len(ids) + args.long > engine.model.args.max_seq_len:
            raise ConfigError(f"prompt {len(ids)} + --long {args.long} tokens exceed the "
                              f"model's context ({engine.model.args.max_seq_len})")
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    done: list[dict[str, Any]] = []

    def save(complete: bool) -> None:
        if args.json:
            write_json(args.json, {"command": command_line("answer_length.py", argv),
                                   **commit_fields(), "cpu": cpu_model(),
                                   "load_average": load_average(),
                                   "checkpoint": engine.checkpoint, "prompt_tokens": len(ids),
                                   "step": args.step, "complete": complete, "rows": done})

    def show(row: dict[str, Any]) -> None:
        same = "same" if row["same"] else f"differ at token {row['first_difference']}"
        print(f"{row['method']:>13} {row['budget'] or '':>5}: {same} "
              f"({len(row['short_ids'])} and {len(row['long_ids'])} tokens; "
              f"{row['short_s']} s, {row['long_s']} s)", flush=True)
        done.append(row)
        save(False)  # a run cut short keeps its rows

    rows = compare(engine, ids, [(m, b, {}) for m, b in configs], args.short, args.long,
                   compile=None if args.step == "default" else False, on_row=show)
    save(True)
    return 0 if all(r["same"] for r in rows) else 1
