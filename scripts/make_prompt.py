"""Build a document-question prompt: real text with one fact ("needle") hidden in it.

    python scripts/make_prompt.py --text ../shared/data/text/PaulGrahamEssays --context 3000 \\
        --prompt-out prompt.txt \\
        [--tokenizer ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--depth 0.5] \\
        [--seed 0] [--answer-json answer.json]
    python generate.py --checkpoint SmolLM2.gguf --chat --method rocketkv --budget 256 \\
        --prompt prompt.txt

The document is whole sentences of the text, in order: a ``.txt`` file, every ``*.txt`` file of
a directory (sorted by name), or a JSON file with a ``"text"`` field (RULER's haystack); several
``--text`` sources are read one after the other, each ending a paragraph. Sentences are taken
from the start until the whole prompt (document, needle, blank line, question) holds at most
``--context`` tokens, so it falls short of that by less than one sentence. Tokens are counted with
``--tokenizer`` (``encode(text, bos=False)``: no BOS, no chat template) or, without one,
estimated as characters / 4; a line on stderr says which.

The needle goes in at the sentence boundary nearest ``--depth`` (0 = start, 1 = end) of the
document, measured in tokens. The default needle is a made-up fact with a 7-digit number and a
key phrase, both drawn from ``--seed``; the question after the document asks for the number.
``--needle``/``--question`` (and ``--answer``, the expected reply) replace them.

Output: the prompt file (document, blank line, question, final newline) and, with
``--answer-json``, the expected answer with the needle, the depth asked for and the depth
reached, the token counts and the seed. Both files are written whole (temporary file, then
rename). Bad input prints one ``error: ...`` line and exits with status 2.

The text and prompt functions are in ``evals/prompts.py`` (``split_sentences``,
``build_document``, ``insert_at_depth``, ``make_prompt``, ``read_texts``, ...).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import OneLineParser, deprecated_alias


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", nargs="+", required=True, metavar="PATH",
                   help="text source(s): a .txt file, a directory of .txt files (sorted), or "
                        'a JSON file with a "text" field')
    p.add_argument("--context", type=int, default=3000, metavar="N",
                   help="prompt length in tokens, at most (default 3000)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="count tokens with this tokenizer (a file or checkpoint directory); "
                        "default: estimate characters / 4")
    p.add_argument("--depth", type=float, default=0.5,
                   help="where the needle goes: 0 = start of the document, 1 = end (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="draws the default needle (default 0)")
    p.add_argument("--needle", help="your own fact sentence (with --question)")
    p.add_argument("--question", help="your own question about it (with --needle)")
    p.add_argument("--answer", help="the expected answer to your own question (for --answer-json)")
    p.add_argument("--prompt-out", required=True, metavar="PATH",
                   help="prompt text file (- for stdout; required)")
    p.add_argument("--answer-json", metavar="PATH",
                   help="write the expected answer, depth, token count and seed here")
    deprecated_alias(p, "--tokens", "--context")
    deprecated_alias(p, "--out", "--prompt-out")  # --out is a folder elsewhere
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
from rocketkv.evals.prompts import chars_per_4, make_prompt, read_texts
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError


def _check_writable(path: str, flag: str) -> None:
    if path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"{flag}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{flag}: {path} is not writable")


def write_whole(outputs: Sequence[tuple[str, str]]) -> None:
    """Write each (path, text) whole: every temporary file first, then the renames, so a
    failure leaves no output half-written. Path ``-`` is stdout."""
    pending = []
    try:
        for path, text in outputs:
            if path == "-":
                continue
            tmp = Path(f"{path}.tmp")
            pending.append((tmp, path))
            tmp.write_text(text, encoding="utf-8")
        for tmp, path in pending:
            os.replace(tmp, path)
    except OSError as e:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {e.filename or 'output'}: {e.strerror or e}") from None
    for path, text in outputs:
        if path == "-":
            sys.stdout.write(text)


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args) -> int:
    """Write the prompt the parsed arguments ``args`` describe; the exit status."""
    try:
        if args.context <= 0:
            raise ConfigError(f"--context must be positive, got {args.context}")
        if not 0.0 <= args.depth <= 1.0:
            raise ConfigError(f"--depth must lie in [0, 1], got {args.depth}")
        if args.answer is not None and args.needle is None:
            raise ConfigError("--answer goes with --needle and --question")
        _check_writable(args.prompt_out, "--prompt-out")
        if args.answer_json:
            _check_writable(args.answer_json, "--answer-json")
            if args.answer_json != "-" and Path(args.answer_json).resolve() == \
                    Path(args.prompt_out).resolve():
                raise ConfigError("--prompt-out and --answer-json name the same file")
        texts = read_texts(args.text)
        if args.tokenizer:
            tok = load_tokenizer(args.tokenizer)

            def count(text: str) -> int:
                return len(tok.encode(text, bos=False))

            counter = f"tokenizer {args.tokenizer}"
            how = (f"tokens counted with the tokenizer {args.tokenizer} (no BOS, no chat "
                   "template)")
        else:
            count = chars_per_4
            counter = "characters/4"
            how = "tokens estimated as characters / 4 (give --tokenizer for exact counts)"
        prompt, info = make_prompt(texts, args.context, count, depth=args.depth, seed=args.seed,
                                   needle=args.needle, question=args.question,
                                   answer=args.answer)
        info.update(token_counter=counter, sources=list(args.text), prompt_file=args.prompt_out)
        outputs = [(args.prompt_out, prompt + "\n")]
        if args.answer_json:
            outputs.append((args.answer_json, json.dumps(info, indent=1) + "\n"))
        write_whole(outputs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(how, file=sys.stderr)  # after the checks: a bad input gets one error line only
    if info["text_exhausted"]:
        print(f"note: the text ran out: the prompt has {info['prompt_tokens']} tokens, fewer "
              f"than --context {args.context}", file=sys.stderr)
    print(f"wrote {args.prompt_out}: {info['prompt_tokens']} tokens ({counter}), "
          f"{info['sentences']} sentences, needle at depth {info['needle_depth']:.3f} "
          f"(asked {args.depth:g}); answer: {info['answer']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run(ARGS))
