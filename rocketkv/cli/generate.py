"""Generate text with a (compressed) static KV cache and measure latency and memory.

The command line of ``generate.py`` (``python generate.py ...`` and ``rocketkv generate ...``
run ``main`` here, over the decode loop ``rocketkv.engine.generate.generate``):

    python generate.py --checkpoint DIR --prompt FILE [--method full] [--budget N] [--json OUT]
    python generate.py --checkpoint model.gguf --chat --method rocketkv --budget 256 --prompt FILE
    python generate.py --checkpoint random:llama-3.1-8b --random-prompt 32768 --max-new-tokens 64
    python generate.py --checkpoint model.gguf --chat --prompt doc.txt --questions q.txt

Parsing, the checks before the load (``checks.py``), the load, the tensor-parallel gather,
the exit statuses (``main``), SIGTERM as Ctrl-C, and ``--questions`` (one document prefilled
once, ``session.rewind_conversation`` before each question).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from rocketkv import kernels, tp
from rocketkv.api import Engine, command_line_words
from rocketkv.cli.common import (
    apply_kernels_option,
    check_json_path,
    check_positive,
    read_prompt,
    resolve_device,
    write_json,
    write_stdout,
)
from rocketkv.cli.generate_flags import build_parser
from rocketkv.compression import given_options
from rocketkv.engine.checks import (
    NO_TOKENIZER,
    chat_mode,
    check_request,
    encode_prompt,
    load_weights,
    open_checkpoint,
    plan_document,
    plan_run,
)
from rocketkv.engine.device import default_dtype
from rocketkv.engine.documents import (
    document_ids,
    document_line,
    prefill_summary,
    question_ids,
    read_questions,
    summary_line,
)
from rocketkv.engine.provenance import provenance
from rocketkv.engine.report import (
    TextStreamer,
    bar_step,
    format_report,
    prefill_bar,
)
from rocketkv.engine.request import CacheRequest
from rocketkv.engine.step import Sampling, StepMode
from rocketkv.engine.step_ledger import StepLedger, compile_note
from rocketkv.formats.checkpoint import (
    default_checkpoint,
)
from rocketkv.formats.tokenizer import Tokenizer
from rocketkv.model import ConfigError


def main(argv: Sequence[str] | None = None, args: argparse.Namespace | None = None) -> int:
    """The command line: the generated text on stdout (a ``==> sequence i <==`` header before
    each when the batch has several), the report on stderr, ``--json`` for every figure.

    Exit status: 0; 2 for bad input (one ``error:`` line, before any slow work where it can
    be checked); 1 out of memory or an unwritable JSON; 130 after Ctrl-C and 143 after SIGTERM
    (what was generated, the report and the JSON are kept). Under ``torchrun`` (``tp.py``)
    only rank 0 prints and writes; a collective that fails (another rank stopped) or times
    out ends each rank with one ``error:`` line and status 1. ``args``: ``argv`` parsed
    already (``python generate.py`` parses before torch loads: ``generate_flags``)."""
    if args is None:
        args = build_parser().parse_args(argv)
    signals: list[int] = []

    def on_sigterm(signum, frame):  # what `timeout` and job schedulers send: as Ctrl-C
        signals.append(signum)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: leave SIGTERM alone
        previous = None
    try:
        with command_line_words():  # the library's errors in this command's words
            code = _main(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 128 + signal.SIGTERM if signals and code == 130 else code


def _kernel_fault(e: Exception) -> int:
    """1, after one ``error:`` line, for a kernel's fault that escaped the self-check (a
    failed ``--kernels on`` self-check, a Triton compile error, a CUDA error:
    ``kernels.fault``); any other exception is raised again."""
    reason = kernels.fault(e)
    if reason is None:
        raise e
    print(f"error: {reason}" + ("" if isinstance(e, kernels.KernelCheckError) else
                                "; --kernels off runs the PyTorch path"), file=sys.stderr)
    return 1


def _main(args: argparse.Namespace) -> int:
    rank, world = tp.rank(), 1  # world 1 until torchrun's process group is joined
    try:
        check_positive(args, "batch_size", "random_prompt", "threads")
        if args.question_agnostic and args.questions is None:
            raise ConfigError("--question-agnostic applies to --questions")
        if args.threads:
            torch.set_num_threads(args.threads)
        options = given_options(args)
        cache, sampling = check_request(
            args.method, args.budget, options, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        if args.temperature == 0 and (args.top_k or args.top_p is not None) and rank == 0:
            print("note: --top-k and --top-p shape sampling; at --temperature 0 (greedy, the "
                  "default) they change nothing", file=sys.stderr)
        check_json_path(args.json)
        device = resolve_device(args.device)
        StepMode.of(False, args.cuda_graphs).check_device(device)
        rank, world = tp.init(device.type)  # torchrun: this process is one rank of world
        dtype = default_dtype(args.dtype, device)
        apply_kernels_option(args)
        if args.chat and args.random_prompt is not None:
            raise ConfigError("--chat needs a text --prompt or --prompt-text")
        text = args.prompt_text if args.prompt_text is not None else \
            read_prompt(args.prompt) if args.prompt is not None else None
        if text is not None and not text.strip():
            raise ConfigError("--prompt-text is empty")

        t_load = time.perf_counter()
        if args.checkpoint is None:
            args.checkpoint = default_checkpoint()
            if rank == 0:
                print(f"checkpoint {args.checkpoint} (no --checkpoint given)", file=sys.stderr)
        checkpoint, margs, tok = open_checkpoint(args.checkpoint, args.tokenizer)
        if tok is None and text is not None:
            raise ConfigError(NO_TOKENIZER)
        # --chat, --no-chat, or (auto) whether the checkpoint has a chat template of its own
        chat = text is not None and chat_mode(args.chat, tok)
        if args.system is not None and not chat:
            raise ConfigError("--system needs --chat (it is a message of the chat template)")
        if args.questions is not None:  # one document, many questions (api.Document)
            if world > 1:
                raise ConfigError("--questions runs in one process, not under torchrun")
            return _answer_questions(args, checkpoint, margs, tok, text, chat, device,
                                     dtype, cache, sampling, t_load)
        if text is not None:
            ids = encode_prompt(tok, text, chat, args.system)
        else:
            gen = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(0, margs.vocab_size, (args.random_prompt,),
                                generator=gen).tolist()
        tp.check_world(margs, world)
        stop_ids = () if (tok is None or args.ignore_eos) else (
            tok.chat_stop_ids if chat else tok.stop_ids)
        # every method setting is checked and the method planned here, before the weights load
        run = plan_run(margs, ids, cache, sampling, max_new_tokens=args.max_new_tokens,
                       stop_ids=stop_ids, compile=args.compile, device=device,
                       batch_size=args.batch_size, cuda_graphs=args.cuda_graphs)
        if run.note is not None and rank == 0:
            print(f"note: {run.note}", file=sys.stderr)
        model = load_weights(checkpoint, margs, device, dtype, gguf_weights=args.gguf_weights,
                             batch_size=args.batch_size, seq_len=len(ids) + args.max_new_tokens,
                             shard=(rank, world), local_args=tp.local_args(margs, world))
        load_s = time.perf_counter() - t_load
        if rank == 0:  # now, not after the prefill: a long prefill would hide a finished load
            print(f"load (weights and tokenizer) {load_s:.1f} s", file=sys.stderr, flush=True)
        room = margs.max_seq_len - len(ids)
        if room < args.max_new_tokens and rank == 0:
            print(f"note: --max-new-tokens {args.max_new_tokens} exceeds the {room} tokens the "
                  f"model's context ({margs.max_seq_len}) leaves after the {len(ids)}-token "
                  "prompt; generation stops at the context end", file=sys.stderr)
        engine = Engine(model, tok, checkpoint=args.checkpoint, load_s=load_s)
        streamer = TextStreamer(tok, stop_ids) if (
            tok is not None and args.batch_size == 1 and args.stream and rank == 0) else None
        bar = prefill_bar(model.args.n_layers, len(ids), args.no_progress or rank != 0)
        run = engine.resolve_compile(run)
        if rank == 0 and device.type == "cpu" and run.compile is not False:
            print(compile_note(StepLedger().get(engine.step_key(run))), file=sys.stderr,
                  flush=True)
        try:
            res = engine.run(run, on_token=streamer,
                             on_prefill_layer=None if bar is None else bar_step(bar))
        finally:
            if bar is not None:
                bar.close()
    except ConfigError as e:
        if rank == 0:  # every rank runs the same checks: one line, not one per rank
            print(f"error: {e}", file=sys.stderr)
        elif tp.launched():  # let rank 0 print before torchrun ends the ranks
            tp.wait_for_rank_0()
        return 2
    except torch.OutOfMemoryError as e:  # (a RuntimeError: before that clause)
        print(f"error: out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # gloo and NCCL report a peer that stopped this way
        if world == 1:
            return _kernel_fault(e)
        print(f"error: rank {rank} of {world}: {tp.failure(e)}", file=sys.stderr)
        tp.exit_now(1)  # a broken process group aborts the interpreter's exit: skip it
    except KeyboardInterrupt:  # before decoding started: nothing generated yet
        if rank == 0:  # torchrun signals every rank, and ends the rest once one has stopped
            print("error: interrupted before any token was generated", file=sys.stderr)
        return 130
    except Exception as e:  # a Triton compile error is no RuntimeError
        return _kernel_fault(e)

    result = {**res.metrics, "world_size": world}  # the JSON record (``api.Result.metrics``)
    if world > 1:  # every rank's share (a collective: all ranks take part); rank 0 reports
        shares = tp.gather({k: result[k] for k in ("kv_cache_bytes", "kv_bytes_per_step",
                                                   "weight_bytes", "peak_memory_bytes")})
        result["per_rank"] = shares
        for k in ("kv_cache_bytes", "kv_bytes_per_step", "weight_bytes"):
            result[f"{k}_all_ranks"] = sum(s[k] for s in shares)
        tp.shutdown()
        if rank != 0:
            return 0
    interrupted = result["stop_reason"] == "interrupted"
    result["interrupted"] = interrupted
    if streamer is not None:
        streamer.finish(result["text"][0])
    elif result["text"] is not None:
        for i, text in enumerate(result["text"]):
            header = f"==> sequence {i} <==\n" if len(result["text"]) > 1 else ""
            write_stdout(f"{header}{text}\n")
    write_stdout("")
    print(format_report(result, load_line=False), file=sys.stderr)
    if args.json:
        try:  # the code and libraries behind the figures (the checkpoint is not hashed: an
            # 8B one takes half a minute)
            write_json(args.json, {**result, "provenance": provenance()})
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 130 if interrupted else 0


def _answer_questions(args: argparse.Namespace, checkpoint: str, margs,
                      tok: Tokenizer | None, text: str | None, chat: bool,
                      device: torch.device, dtype: torch.dtype, cache: CacheRequest,
                      sampling: Sampling, t_load: float) -> int:
    """``--questions``: the document prefilled once (``api.Engine.open_document``), then per
    question its answer block on stdout (``==> question i: ... <==``) and a line on stderr,
    each answered from the document's cache rewound (``api.Document.ask``); the prefill paid
    once on stderr and in ``--json`` (``document``, one record per question in
    ``questions``). Everything is checked and planned before the weights load."""
    if text is None:
        raise ConfigError("--questions needs a text document (--prompt or --prompt-text)")
    if args.batch_size != 1:
        raise ConfigError("--questions answers one sequence: --batch-size must be 1")
    questions = read_questions(args.questions)
    doc_ids = document_ids(tok, text, chat, args.system)
    asks = [question_ids(tok, q, chat, text, args.system) for q in questions]
    reserve = min(max(map(len, asks)) + args.max_new_tokens - 1,
                  margs.max_seq_len - len(doc_ids))
    run = plan_document(margs, doc_ids, cache.replace(reserve_tokens=reserve),
                        compile=args.compile, device=device)
    if run.note is not None:
        print(f"note: {run.note}", file=sys.stderr)
    model = load_weights(checkpoint, margs, device, dtype, gguf_weights=args.gguf_weights,
                         seq_len=len(doc_ids) + reserve)
    load_s = time.perf_counter() - t_load
    print(f"load (weights and tokenizer) {load_s:.1f} s", file=sys.stderr, flush=True)
    engine = Engine(model, tok, checkpoint=args.checkpoint, load_s=load_s)
    bar = prefill_bar(model.args.n_layers, len(doc_ids), args.no_progress)
    try:
        doc = engine.open_document(run, chat=chat, system=args.system, text=text,
                                   compile=args.compile,
                                   question_aware=False if args.question_agnostic else None,
                                   on_prefill_layer=None if bar is None else bar_step(bar))
    finally:
        if bar is not None:
            bar.close()
    print(document_line(doc.method, doc.question_aware, len(doc.ids), doc.held_bytes),
          file=sys.stderr)
    if doc.note is not None:
        print(f"note: {doc.note}", file=sys.stderr)
    stop_ids = () if args.ignore_eos else (tok.chat_stop_ids if chat else tok.stop_ids)
    records: list[dict[str, Any]] = []
    for i, (question, ids) in enumerate(zip(questions, asks), 1):
        write_stdout(f"==> question {i}: {question} <==\n")
        streamer = TextStreamer(tok, stop_ids) if args.stream else None
        r = doc.ask(ids, max_new_tokens=min(args.max_new_tokens, reserve - len(ids) + 1),
                    temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p, seed=sampling.seed, stop_ids=stop_ids,
                    on_token=streamer)
        record = {**r.metrics, "question": question}
        if streamer is not None:
            streamer.finish(r.text)
        else:
            write_stdout(r.text + "\n")
        records.append(record)
        print(f"question {i}: {record['question_tokens']} tokens prefilled in "
              f"{record['prefill_s'] * 1e3:.1f} ms, {record['new_tokens']} generated "
              f"({record['stop_reason']})", file=sys.stderr)
        if record["stop_reason"] == "interrupted":
            break
    summary = prefill_summary(len(doc_ids), doc.prefill_s, records)
    print(summary_line(summary), file=sys.stderr)
    if args.json:
        try:
            write_json(args.json, {"checkpoint": args.checkpoint, "model": model.args.name,
                                   "load_s": load_s, "document": doc.metrics, **summary,
                                   "questions": records, "provenance": provenance()})
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 130 if records[-1]["stop_reason"] == "interrupted" else 0


def entry(args: argparse.Namespace | None = None) -> None:
    """``python generate.py`` and the ``rocketkv generate`` console command: ``main``'s exit
    status as the process's (under ``torchrun``, every rank leaves at once: ``tp.exit_now``)."""
    code = main(args=args)
    tp.exit_now(code) if tp.launched() else sys.exit(code)
