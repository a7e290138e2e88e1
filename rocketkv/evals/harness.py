"""The accuracy harness: chat prompts split into document and question, batches of equal-length
prompts, one prefill per batch for every (method, budget), resuming, worker processes, and the
command-line options the needle, RULER-style and kept-tokens scripts share.

The tasks build ``Item`` lists (``evals.needle``, ``evals.ruler``); ``evaluate_items`` answers
and scores them; ``evals.reports`` writes the results.

Prompt layout (``chat_item``): the checkpoint's chat template with one user turn, the document
(context) then a blank line and the question, and the assistant's reply opened with an answer
prefix (``"The special magic number for X is"``), so a small model answers at once. The ids are
two pieces whose concatenation is the whole prompt:

* ``doc_ids``: the template up to the document, then the document's ids;
* ``question_ids``: the blank line, the question, the end of the user turn, the assistant's
  header and the answer prefix.

Two modes (``--modes``): ``standard`` prefills ``doc_ids + question_ids`` (the question inside
SnapKV's observation window); ``question_agnostic`` prefills and compresses ``doc_ids`` alone,
then appends ``question_ids`` as the conversation's next chunk
(``generate(continue_conversation=True)``), which attends to the compressed cache: the multi-
turn case of the RocketKV paper's SCBench results. The two modes feed the same tokens, so
``full`` gives the same answers in both.

Every method here prefills with exact attention over the whole prompt (RocketKV App. A.3), so a
batch of equal-length prompts is prefilled once (``prefill.prefill_once`` on the documents,
``prefill.extend_prefilled`` adds the questions for the standard mode) and each method's caches
at each budget are built from the same per-layer K/V; only decoding runs per configuration and
mode, for the whole batch at once. On CPU the prefill runs in one query block
(``prefill_chunk_size`` raised to the prompt length), SDPA's causal kernel being faster there
than block-wise masks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rocketkv.cli.common import check_positive, resolve_device
from rocketkv.compression import (
    METHODS,
    add_method_options,
    check_methods,
    needs_attention_sums,
    options_for,
    plan,
)
from rocketkv.data import ROOT
from rocketkv.engine.device import default_dtype
from rocketkv.engine.generate import CacheRequest, generate
from rocketkv.engine.prefill import OBSERVATION_WINDOW, extend_prefilled, prefill_once
from rocketkv.engine.provenance import checkpoint_sha256, commit_fields, cpu_has_native_bf16
from rocketkv.flags import DTYPE_NAMES, add_device_option, add_time_limit_option
from rocketkv.formats.checkpoint import (
    check_creatable,
    checkpoint_args,
    load_model,
    resolve_checkpoint,
)
from rocketkv.formats.tokenizer import Tokenizer, load_tokenizer
from rocketkv.model import ConfigError, ModelArgs, Transformer

DEFAULT_METHODS = ("full", "exact_topk", "snapkv", "snapkv_pp", "quest", "sparq", "hybrid",
                   "rocketkv")
DEFAULT_BUDGETS = (128, 256, 512)
DEV_SEED_OFFSET = 10_000  # --split dev draws from seed + this: prompts disjoint from eval's
_CONTEXT_MARK = "\u241fCONTEXT\u241f"  # stands for the document while the template renders
MODES = ("standard", "question_agnostic")


@dataclass
class Item:
    """One prompt: ``doc_ids`` + ``question_ids`` (see the module docstring), the strings a
    correct answer contains (``outputs``) and a description (``meta``: task, depth, ...)."""

    doc_ids: list[int]
    question_ids: list[int]
    outputs: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    head: int = 0  # template tokens at the start of doc_ids (padding goes after them)

    @property
    def tokens(self) -> int:
        return len(self.doc_ids) + len(self.question_ids)


def chat_pieces(tok: Tokenizer, question: str, answer_prefix: str = "",
                system: str | None = None) -> tuple[list[int], list[int]]:
    """Ids of the chat template around a document: (before it, after it through the answer
    prefix). The user turn is ``document + "\\n\\n" + question``.

    Raises:
        ConfigError: the tokenizer has no chat template.
    """
    text = tok.render_chat(f"{_CONTEXT_MARK}\n\n{question.strip()}", system=system)
    before, after = text.split(_CONTEXT_MARK)
    head = tok.encode_special(before)
    if not tok.chat_template and tok.fallback_prepends_bos and tok.bos_id is not None:
        head = [tok.bos_id] + head
    tail_text = after + (answer_prefix.strip() if answer_prefix else "")
    return head, tok.encode_special(tail_text)


def chat_item(tok: Tokenizer, context_ids: Sequence[int], question: str, answer_prefix: str,
              outputs: Sequence[str], meta: dict[str, Any] | None = None) -> Item:
    """An ``Item`` of the document ``context_ids`` and ``question`` in the chat template."""
    head, tail = chat_pieces(tok, question, answer_prefix)
    return Item(head + list(context_ids), tail, tuple(outputs), dict(meta or {}), len(head))


def pad_to_equal(items: Sequence[Item], pad_id: int) -> list[Item]:
    """Items of one batch made equal in length: ``pad_id`` (a newline token) repeated after
    the template's head of the document, and before the question (whose chunk starts with a
    blank line anyway), up to the batch's longest document and question. Padding stays within
    a generator's length tolerance (RULER-style contexts differ by at most 2%)."""
    nd = max(len(it.doc_ids) for it in items)
    nq = max(len(it.question_ids) for it in items)
    out = []
    for it in items:
        pd, pq = nd - len(it.doc_ids), nq - len(it.question_ids)
        doc = it.doc_ids[:it.head] + [pad_id] * pd + it.doc_ids[it.head:]
        out.append(Item(doc, [pad_id] * pq + it.question_ids, it.outputs,
                        {**it.meta, "padding": pd + pq}, it.head))
    return out


# --------------------------------------------------------------------------------------------
# Running configurations


def configurations(methods: Sequence[str], budgets: Sequence[int],
                   per_method: dict[str, Sequence[int]] | None = None
                   ) -> list[tuple[str, Any]]:
    """(method, budget) pairs in table order (every script's rows, the benchmarks' too): each
    budgeted method at every budget (``per_method[name]`` instead where given), a method
    without a budget (``full``, ``gptfast_dense``) once, with None. Repeated names are kept;
    callers drop them first where they want.

    Raises:
        ConfigError: a name that is not a method (``compression.check_methods``).
    """
    check_methods(list(methods))
    per_method = per_method or {}
    return [(m, b) if METHODS[m].budgeted else (m, None) for m in methods
            for b in (per_method.get(m, budgets) if METHODS[m].budgeted else [None])]


def parse_method_specs(specs: Sequence[str]) -> tuple[list[str], dict[str, list[int]]]:
    """``--methods`` of the accuracy scripts: each ``METHOD`` (at every ``--budgets``) or
    ``METHOD@B1,B2,...`` (at those budgets instead, in tokens). Returns (the method names in
    order, repeats dropped; {name: its own budgets}).

    Raises:
        ConfigError: an unknown method (the choices listed), a budget that is not a positive
            integer, or budgets given to a method that takes none (``full``).
    """
    names: list[str] = []
    own: dict[str, list[int]] = {}
    for spec in specs:
        name, at, rest = spec.partition("@")
        if name not in METHODS:
            raise ConfigError(f"--methods: unknown method {name!r} (choose from "
                              f"{', '.join(METHODS)}; METHOD@B1,B2 gives it its own budgets)")
        if name not in names:
            names.append(name)
        if not at:
            continue
        if not METHODS[name].budgeted:
            raise ConfigError(f"--methods {spec}: {name} takes no budget")
        try:
            budgets = [int(b) for b in rest.split(",")]
        except ValueError:
            budgets = []
        if not budgets or min(budgets) <= 0:
            raise ConfigError(f"--methods {spec}: budgets must be positive numbers of tokens, "
                              "comma-separated (e.g. rocketkv@256,512)")
        own[name] = list(dict.fromkeys(own.get(name, []) + budgets))
    return names, own


def run_configurations(args: argparse.Namespace) -> tuple[list[tuple[str, Any]], list[int]]:
    """(the (method, budget) pairs an accuracy script runs, the budgets of its table columns
    in order: ``--budgets`` where some method takes them, then the methods' own) from
    ``check_common``'s parsed ``--methods`` and ``--budgets``."""
    own = getattr(args, "method_budgets", {})
    budgets = list(dict.fromkeys(args.budgets))
    configs = configurations(list(dict.fromkeys(args.methods)), budgets, own)
    used = [b for _, b in configs if b is not None]
    columns = [b for b in budgets if b in used]
    columns += sorted({b for b in used if b not in columns})
    return configs, columns


class Answers(list):
    """One configuration's greedy answers to a batch (``run_batch``): a ``list`` of the answer
    texts, one ``str`` per item in batch order (stop tokens left out), as ``run_batch``
    returned before, with two lists of the same length beside them:

    * ``new_tokens``: per item, the tokens the answer generated, its stop token counted (an
      answer the cap ended holds exactly its cap; the batch's cap where the item's is
      smaller: answers are not cut to their item's cap); None where not recorded;
    * ``capped``: per item, True when the answer ended at its token cap, not at a stop token:
      no stop token and at least the item's ``max_new_tokens`` tokens (``evals.scoring``'s
      cut rule: its last value may be cut mid-way); None where not recorded.

    Equality, iteration and JSON see the texts alone (a list of strings equals it); pickling
    (the worker processes) keeps both lists.

    Raises:
        ValueError: a list given whose length is not the number of texts.
    """

    def __init__(self, texts: Sequence[str] = (), new_tokens: Sequence[int | None] | None = None,
                 capped: Sequence[bool | None] | None = None) -> None:
        super().__init__(texts)
        n = len(self)
        self.new_tokens: list[int | None] = [None] * n if new_tokens is None else list(new_tokens)
        self.capped: list[bool | None] = [None] * n if capped is None else list(capped)
        if len(self.new_tokens) != n or len(self.capped) != n:
            raise ValueError(f"{n} answers need {n} token counts and capped flags, got "
                             f"{len(self.new_tokens)} and {len(self.capped)}")

    def info(self) -> dict[str, list]:
        """{"new_tokens", "capped"}: the per-item lists, as a partial file keeps them."""
        return {"new_tokens": list(self.new_tokens), "capped": list(self.capped)}


def _answers(tok: Tokenizer, rows: Sequence[Sequence[int]], stop: set[int],
             caps: Sequence[int]) -> Answers:
    """``Answers`` of ``generate``'s ``token_ids`` rows (each cut after its first stop token,
    kept): the texts without stop tokens, each row's length, and capped = the row ends in no
    stop token and holds at least its item's cap (``caps``, tokens)."""
    return Answers([tok.decode([t for t in row if t not in stop]) for row in rows],
                   [len(row) for row in rows],
                   [bool(row) and row[-1] not in stop and len(row) >= cap
                    for row, cap in zip(rows, caps)])


@torch.no_grad()
def run_batch(model: Transformer, tok: Tokenizer, items: Sequence[Item],
              configs: Sequence[tuple[str, Any]], max_new_tokens: int, *,
              modes: Sequence[str] = ("standard",), options: dict[str, Any] | None = None,
              tick: Callable[[], None] = lambda: None) -> dict[str, dict[tuple[str, Any], Any]]:
    """Greedy answers of every configuration in every mode for a batch of items of equal
    lengths.

    The documents are prefilled once (``prefill_once``); the question is then recorded after
    them (``extend_prefilled``) for the standard mode, so both modes share the document's
    prefill, and each configuration's caches are built from those K/V. A method that prefills
    its own way (``Method.shared_prefill`` False: KeyDiff) prefills the prompt itself, and a
    batch of such methods alone skips the shared prefill. Question-agnostic runs
    store and compress the document alone, then append the question as the conversation's next
    chunk.

    The batch decodes up to ``max_new_tokens`` (the largest of its items' caps, as
    ``evaluate_items`` passes it); item i's own cap is ``min(meta["max_new_tokens"],
    max_new_tokens)`` (``max_new_tokens`` without one), which decides its ``capped`` flag
    only: answers are not cut to it.

    Returns {mode: {(method, budget): answers (``Answers``: a list of one string per item,
    with per item ``new_tokens`` and ``capped``) or "error message" for a budget the method
    rejects}}.
    """
    options = dict(options or {})
    doc = torch.tensor([it.doc_ids for it in items])
    question = torch.tensor([it.question_ids for it in items])
    stop = tuple(sorted(set(tok.chat_stop_ids)))
    caps = [min(it.meta.get("max_new_tokens", max_new_tokens), max_new_tokens) for it in items]
    model.prefill_chunk_size = max(model.prefill_chunk_size, doc.shape[1] + question.shape[1])
    pre_doc = None  # no shared prefill where no method uses one (KeyDiff alone)
    if any(METHODS[m].shared_prefill for m, _ in configs):
        pre_doc = prefill_once(model, doc, obs_window=max(OBSERVATION_WINDOW,
                                                             options.get("window") or 0),
                               attention_sums=needs_attention_sums(m for m, _ in configs))
    out: dict[str, dict[tuple[str, Any], Any]] = {}
    for mode in modes:
        qa = mode == "question_agnostic"
        pre = pre_doc if qa or pre_doc is None else extend_prefilled(model, pre_doc, question)
        prompt = doc if qa else torch.cat([doc, question], dim=1)
        out[mode] = {}
        for method, budget in configs:
            opts = options_for(method, options)  # each method gets the options it takes
            try:
                if qa:
                    generate(model, prompt,
                             CacheRequest(method, budget, opts,
                                          question.shape[1] + max_new_tokens),
                             max_new_tokens=0, prefilled=pre)
                    r = generate(model, question, continue_conversation=True,
                                 max_new_tokens=max_new_tokens, stop_ids=stop)
                else:
                    r = generate(model, prompt, CacheRequest(method, budget, options=opts),
                                 max_new_tokens=max_new_tokens, stop_ids=stop, prefilled=pre)
                out[mode][(method, budget)] = _answers(tok, r["token_ids"], set(stop), caps)
            except ConfigError as e:
                out[mode][(method, budget)] = str(e)
            tick()
        del pre
    return out


def batches_of(items: Sequence[Item], batch_size: int) -> list[list[int]]:
    """Indices of ``items`` grouped by ``meta["group"]`` (default: the item's document and
    question lengths), in order, at most ``batch_size`` per batch."""
    groups: dict[Any, list[int]] = {}
    for i, it in enumerate(items):
        key = it.meta.get("group", (len(it.doc_ids), len(it.question_ids)))
        groups.setdefault(key, []).append(i)
    batches = []
    for idx in groups.values():
        batches += [idx[s:s + batch_size] for s in range(0, len(idx), batch_size)]
    return batches


def code_digest() -> str:
    """sha256 (hex) of the project's Python sources that this process has imported (the
    engine, every method under ``compression/``, the harness): answers saved by other code are
    not reused, while files the run does not load (benchmarks, other scripts, tests) do not
    count."""
    loaded = {Path(f).resolve() for m in list(sys.modules.values())
              if isinstance(f := getattr(m, "__file__", None), str) and Path(f).is_absolute()}
    files = sorted({f for f in loaded if f.suffix == ".py" and f.is_relative_to(ROOT)
                    and f.relative_to(ROOT).parts[0] != "tests"}
                   | set(ROOT.glob("rocketkv/compression/**/*.py")))
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def run_spec(items: Sequence[Item], configs: Sequence[tuple[str, Any]], max_new_tokens: int,
             modes: Sequence[str], options: dict[str, Any] | None, batch_size: int,
             run_key: Any = None) -> dict[str, Any]:
    """The JSON-able settings a batch's answers depend on: every item's token ids and
    per-item answer length, the configurations, modes, method options, batch size and
    ``run_key`` (the caller's checkpoint, dtype and device); ``spec_fingerprint`` hashes
    them with the code (the run's fingerprint) or alone (its settings)."""
    return {"items": [[it.doc_ids, it.question_ids, it.meta.get("max_new_tokens")]
                      for it in items],
            "configs": [list(c) for c in configs], "max_new_tokens": max_new_tokens,
            "modes": list(modes), "options": options or {}, "batch_size": batch_size,
            "run_key": run_key}


def readable_spec(spec: dict[str, Any], width: int = 160) -> dict[str, Any]:
    """``spec`` (``run_spec``) as a partial file's header keeps it, so that a refused resume
    can name the settings that differ: each value as it is, or, when its JSON is longer than
    ``width`` characters (the prompts' token ids), ``"sha256 <12 hex> (<n> chars)"``."""
    out = {}
    for key, value in spec.items():
        text = json.dumps(value, sort_keys=True, default=str)
        out[key] = value if len(text) <= width else (
            f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]} ({len(text)} chars)")
    return json.loads(json.dumps(out, default=str))


def _differences(saved: Any, now: dict[str, Any] | None) -> str:
    """``"; differs: KEY (saved X, now Y), ..."`` between two ``readable_spec`` headers, or
    "" when either is missing."""
    if not isinstance(saved, dict) or now is None:
        return ""
    keys = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    return ("; differs: " + ", ".join(
        f"{k} (saved {json.dumps(saved.get(k))}, now {json.dumps(now.get(k))})"
        for k in keys)) if keys else ""


def spec_fingerprint(spec: dict[str, Any], code: bool = True) -> str:
    """sha256 (hex) of a run's JSON-able ``spec`` and, unless ``code`` is False, the engine
    code (``code_digest``): the key under which a partial file's results are reused."""
    spec = {**spec, "code": code_digest() if code else None}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


def _saved_commit(lines: Sequence[str]) -> str | None:
    """The commit in the first tagged batch line of a partial file, or None."""
    for line in lines:
        try:
            tag = json.loads(line).get("tag")
        except json.JSONDecodeError:
            return None
        if isinstance(tag, dict) and tag.get("commit"):
            return str(tag["commit"])
    return None


def _read_partial(path: Path, fingerprint: str, settings: str,
                  restart: bool = False, spec: dict[str, Any] | None = None
                  ) -> list[dict[str, Any]]:
    """The finished units (batches of the harness, prompts of ``evals.fidelity``) saved in
    ``path`` after a header line by a run with this ``fingerprint`` (settings and code;
    ``settings``: without the code); [] when the file is absent or empty. A last line cut off
    mid-write is dropped. ``spec``: this run's ``readable_spec``; a header that keeps one
    lets the error name the settings that differ.

    Raises:
        ConfigError: the file holds another run's results (other items or settings, named
            when the header keeps them, or other engine code: the error names the commit that
            saved them), unless ``restart``: hours of saved answers are never overwritten
            unasked.
    """
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    try:
        header = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        header = {}
    if lines and header.get("fingerprint") != fingerprint:
        if restart:
            print(f"note: {path} holds another run's results; starting afresh (--restart)",
                  file=sys.stderr)
            return []
        commit = _saved_commit(lines[1:])
        by = f" (saved at commit {commit[:12]})" if commit else ""
        if header.get("settings") == settings:
            why = (f"its results were computed by other engine code{by}: resume with that "
                   "code (a clone at that commit)")
        elif "settings" in header:
            why = ("its results are another run's (other prompts or settings"
                   f"{_differences(header.get('spec'), spec)})")
        else:
            why = f"its results are another run's or other code's{by}"
        raise ConfigError(f"{path}: {why}, or pass --restart to discard them (or another "
                          "--out)")
    done = []
    for line in lines[1:]:
        try:
            done.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the line a killed run was writing
    return done


def _refuse_a_complete_run(results: Sequence[Path], fingerprint: str) -> None:
    """Raise ConfigError when one of ``results`` (a run's result JSONs) records this
    ``fingerprint`` (as its ``run_fingerprint``) with nothing unfinished: the run is complete,
    and running it again would spend its hours to overwrite the same answers."""
    for path in results:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if (isinstance(data, dict) and data.get("run_fingerprint") == fingerprint
                and not data.get("unfinished")):
            raise ConfigError(f"{path} already holds this run, complete (the same prompts, "
                              "settings and engine code): nothing to run; --restart runs it "
                              "again (or another --out)")


def open_partial(path: Path, spec: dict[str, Any], restart: bool = False,
                 complete: Sequence[Path] = ()):
    """(the units ``path`` holds for this run (``_read_partial``), the file open for appending
    one JSON line per finished unit, the run's fingerprint), for a run of ``spec`` (its
    settings: ``run_spec``, ``fidelity.fidelity_spec``): the file rewritten first as its
    header (the fingerprint of ``spec`` and the code, that of ``spec`` alone, and
    ``readable_spec(spec)``) and those units (without a line cut off mid-write). Raises
    ConfigError as ``_read_partial``, and when ``path`` holds nothing of this run but one of
    ``complete`` (result JSONs) records it as complete (its ``run_fingerprint``, nothing
    unfinished), unless ``restart``."""
    fingerprint, settings = spec_fingerprint(spec), spec_fingerprint(spec, code=False)
    readable = readable_spec(spec)
    kept = _read_partial(path, fingerprint, settings, restart, readable)
    if not kept and not restart:
        _refuse_a_complete_run(complete, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"fingerprint": fingerprint, "settings": settings, "spec": readable}
    path.write_text("".join(json.dumps(x) + "\n" for x in [header, *kept]))
    return kept, path.open("a"), fingerprint


def _saved_entry(method: str, budget: Any, ans: Any) -> list[Any]:
    """A configuration's answers as a partial file's batch line keeps them: ``[method,
    budget, texts, {"new_tokens", "capped"}]`` (``Answers.info``), or ``[method, budget,
    answers]`` for an error message or answers with nothing recorded beside them."""
    if isinstance(ans, Answers):
        return [method, budget, list(ans), ans.info()]
    return [method, budget, ans]


def _saved_answers(entry: Sequence[Any]) -> Any:
    """The answers of a partial file's ``[method, budget, answers(, info)]`` (``_saved_entry``):
    ``Answers`` with the saved token counts and capped flags where the entry has them (lists
    of the answers' length), else as saved (a line of three, written before they were
    recorded, reads as texts alone; an error message stays a string)."""
    ans = entry[2]
    info = entry[3] if len(entry) > 3 else None
    if not isinstance(ans, list) or not isinstance(info, dict):
        return ans
    n_tok, flags = info.get("new_tokens"), info.get("capped")
    if not (isinstance(n_tok, list) and isinstance(flags, list)
            and len(n_tok) == len(flags) == len(ans)):
        return ans
    return Answers(ans, n_tok, flags)


def degenerate(method: str, budget: int | None, margs: ModelArgs, items: Sequence[Item],
               max_new_tokens: int, options: dict[str, Any] | None) -> str | None:
    """Why ``method`` is degenerate at ``budget`` for these items (``Params.degenerate``,
    planned for the longest prompt), or None."""
    if budget is None or not items:
        return None
    try:
        params = plan(method, margs, prompt_len=max(it.tokens for it in items),
                      max_new_tokens=max_new_tokens, budget=budget,
                      **options_for(method, options or {}))
    except ConfigError:
        return None  # the rows' errors say why
    return None if params is None else params.degenerate


def evaluate_items(model: Transformer, tok: Tokenizer, items: Sequence[Item],
                   configs: Sequence[tuple[str, Any]], max_new_tokens: int,
                   score: Callable[..., float | None], *, modes: Sequence[str] = ("standard",),
                   options: dict[str, Any] | None = None, batch_size: int = 10,
                   progress: bool = True, partial: str | Path | None = None,
                   run_key: Any = None, tag: Any = None, restart: bool = False,
                   complete: Sequence[str | Path] = (),
                   stop: Callable[[], bool] | None = None, workers: int = 1,
                   load_worker: Callable[[], tuple[Transformer, Tokenizer]] | None = None,
                   header: str | None = None) -> dict[str, Any]:
    """Answers and scores of every configuration on every item in every mode
    (``max_new_tokens`` unless an item's ``meta["max_new_tokens"]`` says otherwise; a batch
    decodes its items' largest, and each answer records whether its own cap ended it).

    ``score(answer, item, capped=flag)`` gives an answer's score (None: no verdict, left out
    of the mean), with the flag the run recorded for that answer (``Answers.capped``: True
    when the answer ended at its item's token cap, not at a stop token; None where the batch
    recorded none: one saved by a ``run_batch`` that did not); a score with no use for it
    (the needle's) ignores it.

    A budget the method rejects for some items (a longer answer leaves less of the budget to
    the prompt) fails those items only: their ``scores`` and ``answers`` are None, ``score``
    is the mean over the items that ran, and the row adds ``items_run`` and ``item_errors``
    {item index: message}. A row is an error only when every item failed.

    ``partial``: a JSON-lines file that keeps every finished batch's answers as the run goes (a
    header line with the run's fingerprint, then one line per batch: per configuration its
    answers with their token counts and capped flags, ``_saved_entry``; a line saved without
    them still loads, its flags None). A run that finds the file with the same fingerprint skips
    the batches it holds, so a run that was killed (or cut by a GPU lease's time limit)
    continues where it stopped with the same answers; a file of another run (other prompts,
    settings or engine code) is a ConfigError naming the commit that saved it, or with
    ``restart`` overwritten. The caller deletes it once the results are written (and keeps it
    while some items are unfinished). ``complete``: the result JSONs such a run writes; when the
    partial file holds nothing of this run and one of them records this run's fingerprint
    (``spec_fingerprint`` of ``run_spec``, the result's ``fingerprint``) with no item
    unfinished, the run is complete: a ConfigError, before any batch, unless ``restart``.

    ``stop``: asked before each batch; once it says True no new batch starts, and the items
    of the batches not run are unfinished: their scores and answers are None, and rows score
    the finished items (``items_run``). With ``partial``, the same call later runs only the
    unfinished batches.

    ``header``: a line printed on stderr once the saved results are read, before the first
    batch (``run_header``).

    ``tag``: a JSON value saved with each batch (the run's code: ``{"commit", "dirty"}``);
    ``item_tags`` in the result gives each item the tag of the run that answered it (a batch
    resumed from a file saved without tags: None), so a run resumed at a later commit says so
    (the fingerprint's ``code_digest`` refuses batches of other engine code; a commit that
    changed only files the run does not load keeps them).

    ``workers`` > 1: that many processes (``load_worker``, a picklable function, loads each
    one's model and tokenizer) run batches side by side, each batch whole in one process;
    ``model`` is then not used. The answers do not depend on the process a batch runs in.
    On this project's 2-core VM, two one-thread processes ran the needle harness 1.47x
    faster than one two-thread process: eager decoding at these sizes is bound by per-operator
    overhead, which a second thread does not share.

    Returns {"modes": {mode: {"rows": [{"method", "budget", "score" (mean over the items that
    ran, 0..1; None when none did), "scores", "answers", "answer_tokens" (per item: the tokens
    the answer generated, its stop token counted), "answer_capped" (per item: the answer
    ended at its token cap, not at a stop token)[, "items_run", "item_errors"]} or {"method",
    "budget", "error"}]}} (per-item lists in item order, None for an item not run or not
    recorded), "eval_s" (this process's seconds), "batches",
    "batches_resumed", "unfinished" (items not run), "workers" (processes used), "item_tags",
    "partial", "fingerprint" (``spec_fingerprint`` of ``run_spec``, with ``partial``; else
    None)}."""
    batches = batches_of(items, batch_size)
    pad_id = tok.encode("\n", bos=False)[-1]
    t0 = time.perf_counter()
    answers = {mode: {c: [None] * len(items) for c in configs} for mode in modes}
    new_tokens = {mode: {c: [None] * len(items) for c in configs} for mode in modes}
    capped = {mode: {c: [None] * len(items) for c in configs} for mode in modes}
    errors: dict[str, dict[tuple[str, Any], dict[int, str]]] = {
        mode: {c: {} for c in configs} for mode in modes}  # per item: the budget error
    item_tags: list[Any] = [None] * len(items)

    def record(idx: list[int], got: dict[str, dict[tuple[str, Any], Any]]) -> None:
        for mode, res in got.items():
            for c, ans in res.items():
                if isinstance(ans, str):  # this batch's items only (their lengths, answers)
                    errors[mode][c].update({i: ans for i in idx})
                    continue
                info = ans if isinstance(ans, Answers) else Answers(ans)
                for i, a, n, k in zip(idx, info, info.new_tokens, info.capped):
                    answers[mode][c][i] = a
                    new_tokens[mode][c][i] = n
                    capped[mode][c][i] = k

    saved = None
    done: set[tuple[int, ...]] = set()
    if partial is not None:
        partial = Path(partial)
        kept, saved, fingerprint = open_partial(
            partial, run_spec(items, configs, max_new_tokens, modes, options, batch_size,
                              run_key), restart, [Path(p) for p in complete])
        for line in kept:
            record(line["batch"], {mode: {(e[0], e[1]): _saved_answers(e) for e in res}
                                   for mode, res in line["got"].items()})
            done.add(tuple(line["batch"]))
            for i in line["batch"]:
                item_tags[i] = line.get("tag")
        if done:
            print(f"resuming: {len(done)} of {len(batches)} batches from {partial}",
                  file=sys.stderr)
    if header:
        print(header, file=sys.stderr)
    todo = [idx for idx in batches if tuple(idx) not in done]
    bar = progress_bar(len(batches) * len(configs) * len(modes), progress)
    if bar is not None and done:
        bar.update((len(batches) - len(todo)) * len(configs) * len(modes))
    finished = {i for idx in done for i in idx}

    def batch_args(idx: list[int]) -> tuple:
        batch = pad_to_equal([items[i] for i in idx], pad_id)  # copies: meta is theirs
        for it in batch:  # each item's own cap, for its capped flag (run_batch)
            it.meta.setdefault("max_new_tokens", max_new_tokens)
        if bar is not None:
            bar.set_description(f"{batch[0].tokens} tokens x {len(batch)}")
        m = max(it.meta.get("max_new_tokens", max_new_tokens) for it in batch)
        return batch, configs, m, modes, options

    def finish(idx: list[int], got: dict[str, dict[tuple[str, Any], Any]]) -> None:
        record(idx, got)
        finished.update(idx)
        for i in idx:
            item_tags[i] = tag
        if saved is not None:
            saved.write(json.dumps({"batch": idx, "tag": tag, "got": {
                mode: [_saved_entry(m_, b, ans) for (m_, b), ans in res.items()]
                for mode, res in got.items()}}) + "\n")
            saved.flush()

    tick = (lambda n=1: bar.update(n)) if bar is not None else (lambda n=1: None)
    try:
        if workers > 1 and todo:  # a last single batch too: the same threads per process
            if load_worker is None:
                raise ValueError("workers > 1 needs load_worker")
            _run_in_workers(todo, batch_args, finish, tick, stop, workers, load_worker)
        else:
            for idx in todo:
                if stop is not None and stop():
                    break
                batch, configs_, m, modes_, options_ = batch_args(idx)
                finish(idx, run_batch(model, tok, batch, configs_, m, modes=modes_,
                                      options=options_, tick=tick))
    finally:
        if saved is not None:
            saved.close()
        if bar is not None:
            bar.close()
    result: dict[str, Any] = {"modes": {}, "batches": len(batches),
                              "batches_resumed": len(batches) - len(todo),
                              "unfinished": len(items) - len(finished),
                              "workers": workers if workers > 1 and todo else 1,
                              "partial": None if partial is None else str(partial),
                              "fingerprint": None if partial is None else fingerprint,
                              "item_tags": item_tags}
    reasons = {} if model is None else {  # per configuration, whatever the mode
        (m, b): degenerate(m, b, model.args, items, max_new_tokens, options) for m, b in configs}
    for mode in modes:
        rows = []
        for method, budget in configs:
            row: dict[str, Any] = {"method": method, "budget": budget}
            if reasons.get((method, budget)):  # marked in the tables; no ranking uses the row
                row["degenerate"] = reasons[(method, budget)]
            errs = errors[mode][(method, budget)]
            if errs and len(errs) == len(finished):
                row["error"] = next(iter(errs.values()))
            else:
                ans = answers[mode][(method, budget)]
                flags = capped[mode][(method, budget)]
                scores = [score(a, it, capped=flags[i])
                          if i in finished and i not in errs else None
                          for i, (a, it) in enumerate(zip(ans, items))]
                ran = [x for x in scores if x is not None]
                row.update(score=sum(ran) / len(ran) if ran else None, scores=scores,
                           answers=ans, answer_tokens=new_tokens[mode][(method, budget)],
                           answer_capped=flags)
                if len(ran) < len(items):
                    row["items_run"] = len(ran)
                if errs:
                    row["item_errors"] = {str(i): msg for i, msg in sorted(errs.items())}
            rows.append(row)
        result["modes"][mode] = {"rows": rows}
    result["eval_s"] = time.perf_counter() - t0
    return result


_WORKER: dict[str, Any] = {}  # in a worker process: its model, tokenizer and tick queue


def _worker_start(load_worker: Callable[[], tuple[Transformer, Tokenizer]], ticks,
                  parent: int | None = None) -> None:
    """A worker process's start: Ctrl-C is the parent's to handle; a failed load is reported
    by the worker's first batch (a pool restarts workers whose start raises). With ``parent``
    (its pid) the worker exits within ``ORPHAN_CHECK_S`` of the parent's death: a parent
    killed by a signal (``kill``, a lease's end) runs no cleanup, and its workers would
    otherwise run their batches to the end on cores a resumed run needs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        _WORKER.update(zip(("model", "tok"), load_worker()), ticks=ticks)
    except BaseException as e:  # noqa: BLE001  (re-raised in _worker_batch)
        _WORKER["error"] = e


ORPHAN_CHECK_S = 1.0  # how often a worker checks that its parent process lives


def _exit_with_parent(parent: int) -> None:
    """Exit this process (status 1, no cleanup) once its parent is no longer ``parent``."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(1)


def _worker_batch(batch: list[Item], configs: Sequence[tuple[str, Any]], max_new_tokens: int,
                  modes: Sequence[str], options: dict[str, Any] | None):
    if "error" in _WORKER:
        raise _WORKER["error"]
    ticks = _WORKER["ticks"]
    return run_batch(_WORKER["model"], _WORKER["tok"], batch, configs, max_new_tokens,
                     modes=modes, options=options, tick=lambda: ticks.put(1))


def _run_in_workers(todo: list[list[int]], batch_args: Callable[[list[int]], tuple],
                    finish: Callable, tick: Callable[[int], None],
                    stop: Callable[[], bool] | None, workers: int,
                    load_worker: Callable[[], tuple[Transformer, Tokenizer]]) -> None:
    """``evaluate_items``' batches in ``workers`` spawned processes, at most one batch per
    process at a time, so that ``stop`` is asked before each batch starts and a stopped run
    has started nothing past it. Finished batches are handed to ``finish`` in the order they
    end. An error in a worker is raised here; the workers are killed on the way out."""
    ctx = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools
    ticks = ctx.Queue()
    pool = ctx.Pool(min(workers, len(todo)), initializer=_worker_start,
                    initargs=(load_worker, ticks, os.getpid()))
    queue, running = list(todo), []
    try:
        while queue or running:
            while queue and len(running) < workers and not (stop is not None and stop()):
                idx = queue.pop(0)
                running.append((idx, pool.apply_async(_worker_batch, batch_args(idx))))
            if stop is not None and queue and stop():
                queue.clear()  # no batch starts after the limit; the running ones finish
            time.sleep(0.2)
            n = 0
            while not ticks.empty():
                ticks.get_nowait()
                n += 1
            if n:
                tick(n)
            for job in [j for j in running if j[1].ready()]:
                running.remove(job)
                finish(job[0], job[1].get())  # a worker's exception is raised here
    finally:
        pool.terminate()
        pool.join()


def default_workers(device: torch.device) -> int:
    """Processes for ``--workers`` when not given: 1 on a GPU; on CPU one per core, at most
    one per 10 GiB of memory (a worker running SmolLM2-135M's 8K-token needle batches of 10
    in bfloat16 peaked at 9.0 GB resident on this project's VM: the document's prefill and the
    question's, their K/V, a full cache per configuration, allocator slack)."""
    if device.type != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return max(1, min(cores, memory // (10 << 30)))


def _load_worker(spec: dict[str, Any]) -> tuple[Transformer, Tokenizer]:
    """A worker's model and tokenizer (``load`` with the parent's resolved settings)."""
    model, tok, _ = load(argparse.Namespace(**spec))
    return model, tok


def progress_bar(total: int, enabled: bool = True, **kwargs: Any):
    """A tqdm bar on stderr (``unit`` "config" unless given; ``disable`` when not
    ``enabled``), or None when tqdm is not installed (the GPU machine needs torch alone)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, disable=not enabled, file=sys.stderr, **{"unit": "config", **kwargs})


# --------------------------------------------------------------------------------------------
# CLI pieces


def add_common_args(p: argparse.ArgumentParser, default_out: str) -> None:
    """--checkpoint, --methods, --budgets, --out, --limit, --seed, --modes, --batch-size,
    --time-limit (seconds), --device, --dtype, --threads, --workers, --restart and the method
    options
    (flags.VOCABULARY's spellings)."""
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint (GGUF file, HF or converted directory) with a chat template")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="METHOD",
                   help=f"{', '.join(METHODS)}; METHOD@B1,B2 runs that method at those "
                        f"budgets instead of --budgets (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS),
                   metavar="N", help="token budgets (default 128 256 512)")
    p.add_argument("--out", default=default_out, metavar="DIR",
                   help=f"output directory (default {default_out})")
    p.add_argument("--limit", type=int, help="quick run: at most this many prompts")
    p.add_argument("--seed", type=int, default=0, help="draws of needles, keys and values")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="standard: the question is in the prompt (inside SnapKV's observation "
                        "window); question_agnostic: the document is prefilled and compressed "
                        "first, then the question is appended as the next chunk (multi-turn). "
                        "Both share the document's prefill (default: both)")
    p.add_argument("--batch-size", type=int, default=10,
                   help="equal-length prompts decoded together (default 10)")
    add_time_limit_option(
        p, "start no batch after this many seconds of evaluation: the results cover the "
           "prompts finished (the JSON's 'unfinished' counts the rest) and the same command "
           "later runs only the rest", was_minutes=True)
    add_device_option(p)
    p.add_argument("--dtype", choices=list(DTYPE_NAMES), default=None,
                   help="of the weights and the KV cache (default, as generate.py: bfloat16 on "
                        "cuda, float32 on cpu)")
    p.add_argument("--threads", type=int,
                   help="CPU threads for torch, shared among the workers (default: all cores)")
    p.add_argument("--workers", type=int,
                   help="processes running batches side by side, each with threads / "
                        "workers threads (default: 1 on a GPU; on CPU one per core, at most "
                        "one per 10 GiB of memory)")
    p.add_argument("--restart", action="store_true",
                   help="discard the saved batches of another run (other prompts, settings "
                        "or engine code) in --out's TASK.partial.jsonl instead of stopping")
    p.add_argument("--no-progress", action="store_true")
    add_method_options(p.add_argument_group(
        "method options (applied to every method that takes them)"))


def check_common(args: argparse.Namespace) -> None:
    """ConfigError for values no run can use, an ``--out`` where no folder can be made or
    written (a file in its way, a read-only filesystem, ``/proc``: ``checkpoint.
    check_creatable``), all before the weights load; ``--methods`` parsed into
    ``args.methods`` (names) and ``args.method_budgets`` (``parse_method_specs``)."""
    check_positive(args, "limit", "batch_size", "threads", "time_limit", "workers")
    args.methods, args.method_budgets = parse_method_specs(args.methods)
    bad = [b for b in args.budgets if b <= 0]
    if bad:
        raise ConfigError(f"--budgets must be positive numbers of tokens, got {bad[0]}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    check_creatable(args.out, out)  # before the weights load: the results need a folder


def check_runs(args: argparse.Namespace, lengths: Sequence[int], new_tokens: int) -> None:
    """Every run the script will make checked before the weights load, as ``generate.py``
    checks its one run: each length with ``new_tokens`` inside the model's context, and each
    method at each budget planned at each length (``compression.plan``: a budget too small
    for a method names the smallest valid one). ``eval_needle.py --budgets 16`` prefilled
    for minutes before; now it is one ``error:`` line.

    Raises:
        ConfigError: a length not positive, the first length or (method, budget, length)
            that cannot run.
    """
    bad = [n for n in lengths if n <= 0]
    if bad:
        raise ConfigError(f"--context must be a positive number of tokens, got {bad[0]}")
    margs = checkpoint_args(resolve_checkpoint(args.checkpoint))
    too_long = [n for n in lengths if n + new_tokens > margs.max_seq_len]
    if too_long:
        raise ConfigError(f"--context {too_long[0]} + {new_tokens} new tokens exceed the "
                          f"model's context ({margs.max_seq_len} tokens)")
    for method, budget in run_configurations(args)[0]:
        for n in lengths:
            plan(method, margs, prompt_len=n, max_new_tokens=new_tokens, budget=budget,
                 **options_for(method, args))


def load(args: argparse.Namespace):
    """(model, tokenizer, device) for the run; the tokenizer must have a chat template.
    ``--dtype`` defaults as ``generate.py``'s and the API's (``device.default_dtype``): bfloat16 on
    cuda, float32 on cpu (``run_header`` names the dtype a run used)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = default_dtype(args.dtype, device)  # default: bfloat16 on cuda, float32 on cpu
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        print("note: this CPU has no native bfloat16 (AMX or AVX512-BF16): bfloat16 is "
              "emulated, several times slower than float32", file=sys.stderr)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model = load_model(checkpoint, device, dtype)
    tok = load_tokenizer(args.tokenizer or checkpoint)
    if tok.active_chat_template is None:
        raise ConfigError("the harness needs a chat template (the checkpoint's tokenizer has "
                          "none)")
    return model, tok, device


def input_identity(value: str | None) -> str | None:
    """What a run's answers depend on in a ``--checkpoint`` or ``--tokenizer`` value, for a
    resume key: the sha256 (hex) of the file or directory it resolves to
    (``provenance.checkpoint_sha256``, cached per file), so that the same checkpoint under
    another path resumes its saved answers and another file under the same path does not;
    the value itself for ``random:NAME`` (and a value that names nothing on disk); None for
    None."""
    if value is None:
        return None
    return checkpoint_sha256(resolve_checkpoint(value)) or value


def resume_options(args: argparse.Namespace, task: str, model: Transformer,
                   device: torch.device) -> dict[str, Any]:
    """``evaluate_items``' ``partial`` (``TASK.partial.jsonl`` in ``--out``), ``tag`` (this
    code's commit and dirty flag, saved with each batch), ``restart`` (``--restart``),
    ``complete`` (``TASK.json`` and ``TASK_qa.json`` in ``--out``, as ``report_modes`` writes
    them), ``run_key``
    (checkpoint and tokenizer by content (``input_identity``), device, dtype, threads per
    process: in bfloat16 the thread count changes sums' order and so, rarely, an answer),
    ``stop`` (``--time-limit``, counted from
    this call), ``workers`` (``--workers`` or ``default_workers``) and ``load_worker`` (the
    model as loaded here, with ``--threads`` or all cores shared among the workers) and
    ``header`` (``run_header``: the line ``evaluate_items`` prints before the first batch)
    for a script's run."""
    dtype = next(model.parameters()).dtype
    t0, limit = time.perf_counter(), args.time_limit
    workers = getattr(args, "workers", None) or default_workers(device)
    threads = getattr(args, "threads", None) or torch.get_num_threads()
    spec = {"threads": max(1, threads // workers), "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "checkpoint": args.checkpoint,
            "tokenizer": args.tokenizer}
    return {"partial": Path(args.out) / f"{task}.partial.jsonl",
            "complete": [Path(args.out) / f"{task}.json", Path(args.out) / f"{task}_qa.json"],
            "run_key": [input_identity(args.checkpoint), input_identity(args.tokenizer),
                        device.type, str(dtype),
                        spec["threads"] if workers > 1 else threads],  # sums' order
            "stop": None if limit is None else lambda: time.perf_counter() - t0 > limit,
            "tag": commit_fields(), "restart": getattr(args, "restart", False),
            "workers": workers, "load_worker": partial(_load_worker, spec),
            "header": run_header(task, model.args.name, device, spec["dtype"],
                                 getattr(args, "dtype", None) is None, workers,
                                 spec["threads"] if workers > 1 else threads)}


def run_header(task: str, model_name: str, device: torch.device, dtype: str, default: bool,
               workers: int, threads: int) -> str:
    """The line a run starts with on stderr, naming what its answers depend on beyond the
    command: ``needle: SmolLM2-135M-Instruct on cpu in float32 (the default on cpu; --dtype
    to change), 2 processes x 1 thread``. The dtype is named because its default followed the
    machine before (bfloat16 on CPUs with native bfloat16) and is generate.py's rule now:
    a bare command's answers, and the resume key of its saved batches, depend on it."""
    why = f" (the default on {device.type}; --dtype to change)" if default else ""
    procs = f"{workers} processes" if workers > 1 else "1 process"
    return (f"{task}: {model_name} on {device} in {dtype}{why}, {procs} x {threads} "
            f"thread{'s' if threads != 1 else ''}")
