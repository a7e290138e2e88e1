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
    check_document,
    check_fit,
    check_request,
    load_weights,
    open_checkpoint,
    result_text,
)
from rocketkv.engine.device import default_dtype
from rocketkv.engine.documents import (
    CacheSnapshot,
    document_ids,
    prefill_summary,
    question_agnostic_note,
    question_ids,
    read_questions,
    summary_line,
)
from rocketkv.engine.generate import generate
from rocketkv.engine.provenance import provenance
from rocketkv.engine.report import (
    TextStreamer,
    bar_step,
    format_report,
    prefill_bar,
)
from rocketkv.engine.session import rewind_conversation
from rocketkv.engine.step import StepMode, default_compile
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
        if args.threads:
            torch.set_num_threads(args.threads)
        options = given_options(args)
        check_request(args.method, args.budget, options, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
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
        if args.questions is not None:  # one document, many questions: rocketkv.py
            if world > 1:
                raise ConfigError("--questions runs in one process, not under torchrun")
            compile = default_compile(args.compile, device, args.max_new_tokens)
            return _answer_questions(args, checkpoint, margs, tok, text, chat, device,
                                     dtype, options, compile, t_load)
        if text is not None:
            ids = tok.encode_chat(text, system=args.system) if chat else tok.encode(text)
        else:
            gen = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(0, margs.vocab_size, (args.random_prompt,),
                                generator=gen).tolist()
        tp.check_world(margs, world)
        # every method setting is checked here, before the weights load
        room, note = check_fit(args.method, margs, len(ids), args.max_new_tokens, args.budget,
                              options)
        if note is not None and rank == 0:
            print(f"note: {note}", file=sys.stderr)
        # the decode steps the context leaves room for (CPU's default compiles long runs only)
        compile = default_compile(args.compile, device, min(args.max_new_tokens, room))
        model = load_weights(checkpoint, margs, device, dtype, gguf_weights=args.gguf_weights,
                             batch_size=args.batch_size, seq_len=len(ids) + args.max_new_tokens,
                             shard=(rank, world), local_args=tp.local_args(margs, world))
        load_s = time.perf_counter() - t_load
        if rank == 0:  # now, not after the prefill: a long prefill would hide a finished load
            print(f"load (weights and tokenizer) {load_s:.1f} s", file=sys.stderr, flush=True)
        prompt = torch.tensor([ids] * args.batch_size)
        if room < args.max_new_tokens:
            print(f"note: --max-new-tokens {args.max_new_tokens} exceeds the {room} tokens the "
                  f"model's context ({model.args.max_seq_len}) leaves after the {len(ids)}-token "
                  "prompt; generation stops at the context end", file=sys.stderr)
        stop_ids = () if (tok is None or args.ignore_eos) else (
            tok.chat_stop_ids if chat else tok.stop_ids)
        streamer = TextStreamer(tok, stop_ids) if (
            tok is not None and args.batch_size == 1 and args.stream and rank == 0) else None
        bar = prefill_bar(model.args.n_layers, len(ids), args.no_progress or rank != 0)
        try:
            res = generate(model, prompt, method=args.method, budget=args.budget,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           stop_ids=stop_ids, compile=compile, method_options=options,
                           cuda_graphs=args.cuda_graphs,
                           on_token=streamer,
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

    result = {**res.to_dict(), "world_size": world}  # the JSON record: the CLI's keys added
    if world > 1:  # every rank's share (a collective: all ranks take part); rank 0 reports
        shares = tp.gather({k: result[k] for k in ("kv_cache_bytes", "kv_bytes_per_step",
                                                   "weight_bytes", "peak_memory_bytes")})
        result["per_rank"] = shares
        for k in ("kv_cache_bytes", "kv_bytes_per_step", "weight_bytes"):
            result[f"{k}_all_ranks"] = sum(s[k] for s in shares)
        tp.shutdown()
        if rank != 0:
            return 0
    result["text"] = result_text(tok, result["token_ids"], stop_ids)
    result["checkpoint"] = args.checkpoint
    result["model"] = model.args.name
    result["load_s"] = load_s
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
                      device: torch.device,
                      dtype: torch.dtype, options: dict[str, Any], compile: bool | None,
                      t_load: float) -> int:
    """``--questions``: the document prefilled once, then per question its answer block on
    stdout (``==> question i: ... <==``) and a line on stderr, each answered from the
    document's cache rewound (``rewind_conversation``); the prefill paid once on stderr and
    in ``--json`` (``document``, one record per question in ``questions``). Everything is
    checked before the weights load."""
    if text is None:
        raise ConfigError("--questions needs a text document (--prompt or --prompt-text)")
    if args.batch_size != 1:
        raise ConfigError("--questions answers one sequence: --batch-size must be 1")
    questions = read_questions(args.questions)
    doc = document_ids(tok, text, chat, args.system)
    asks = [question_ids(tok, q, chat, text, args.system) for q in questions]
    reserve = min(max(map(len, asks)) + args.max_new_tokens - 1, margs.max_seq_len - len(doc))
    note = check_document(args.method, margs, len(doc), reserve, args.budget, options)
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
    model = load_weights(checkpoint, margs, device, dtype, gguf_weights=args.gguf_weights,
                         seq_len=len(doc) + reserve)
    load_s = time.perf_counter() - t_load
    print(f"load (weights and tokenizer) {load_s:.1f} s", file=sys.stderr, flush=True)
    bar = prefill_bar(model.args.n_layers, len(doc), args.no_progress)
    try:
        first = generate(model, doc, method=args.method, budget=args.budget, max_new_tokens=0,
                         reserve_tokens=reserve, compile=compile, method_options=options,
                         on_prefill_layer=None if bar is None else bar_step(bar))
    finally:
        if bar is not None:
            bar.close()
    agnostic = question_agnostic_note(args.method, first.to_dict())
    if agnostic is not None:
        print(f"note: {agnostic}", file=sys.stderr)
    snapshot = CacheSnapshot(model.caches)
    stop_ids = () if args.ignore_eos else (tok.chat_stop_ids if chat else tok.stop_ids)
    records: list[dict[str, Any]] = []
    for i, (question, ids) in enumerate(zip(questions, asks), 1):
        write_stdout(f"==> question {i}: {question} <==\n")
        streamer = TextStreamer(tok, stop_ids) if args.stream else None
        rewind_conversation(model, len(doc), snapshot)
        r = generate(model, ids, continue_conversation=True,
                     max_new_tokens=min(args.max_new_tokens, reserve - len(ids) + 1),
                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                     seed=args.seed, stop_ids=stop_ids, compile=compile, on_token=streamer)
        r = {**r.to_dict(), "question": question,
             "text": result_text(tok, r["token_ids"], stop_ids),
             "document_prefill_s": first.prefill_s}
        if streamer is not None:
            streamer.finish(r["text"][0])
        else:
            write_stdout(r["text"][0] + "\n")
        records.append(r)
        print(f"question {i}: {r['prompt_tokens']} tokens prefilled in "
              f"{r['prefill_s'] * 1e3:.1f} ms, {r['new_tokens']} generated ({r['stop_reason']})",
              file=sys.stderr)
        if r["stop_reason"] == "interrupted":
            break
    summary = prefill_summary(len(doc), first.prefill_s, records)
    print(summary_line(summary), file=sys.stderr)
    if args.json:
        try:
            write_json(args.json, {"checkpoint": args.checkpoint, "model": model.args.name,
                                   "load_s": load_s, "document": first.to_dict(), **summary,
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
