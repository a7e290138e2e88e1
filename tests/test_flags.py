"""One flag vocabulary (issue 46): every entry point's parser spells a concept the same way, in
the same unit. Each script's parser is taken from its own ``main`` (``parse_args`` stopped
before it parses), so a flag added anywhere is checked."""

import argparse
import importlib

import pytest
from conftest import ROOT

from rocketkv.flags import (
    DTYPE_NAMES,
    OneLineParser,
    add_time_limit_option,
    deprecated_alias,
    is_deprecated,
)

ENTRY_POINTS = sorted(f"{d}/{p.name}" for d in ("scripts", "tools")
                      for p in (ROOT / d).glob("*.py")
                      if p.name not in ("__init__.py", "_here.py")) \
    + ["rocketkv/cli/quantize.py", "rocketkv/engine/kernel_check.py"]

# The canonical spelling of each concept (flags.VOCABULARY says what each means) and the other
# spellings of the same concept seen in this project or common elsewhere: an entry point may
# accept one of these only as a deprecated alias (flags.deprecated_alias) of the canonical one.
OTHER_SPELLINGS = {
    "--checkpoint": ["--model", "--gguf", "--weights-path", "--ckpt", "--model-path"],
    "--config": ["--model-config", "--shape", "--model-name"],
    "--context": ["--prompt-tokens", "--lengths", "--tokens", "--prompt-length",
                  "--prompt-len", "--seq-len", "--context-length", "--contexts", "--length"],
    "--max-new-tokens": ["--new-tokens", "--max-tokens", "--gen-tokens", "--num-tokens"],
    "--time-limit": ["--time-limit-min", "--minutes", "--timeout", "--max-time"],
    "--out": ["--out-dir", "--outdir", "--output-dir", "--output"],
    "--json": ["--json-out", "--output-json", "--results-json"],
}
# Devices other than the engine's rule (cuda if available, else cpu), with the reason.
DEVICE_EXCEPTIONS = {
    "rocketkv/cli/quantize.py":
        "the arithmetic runs on cpu by default: a model that fits the GPU only "
        "once quantized can be quantized",
}


class Parsed(BaseException):
    """Raised by the patched ``parse_args``: the parser that was about to parse."""

    def __init__(self, parser):
        self.parser = parser


def parser_of(script: str, monkeypatch) -> argparse.ArgumentParser:
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))

    def stop(self, args=None, namespace=None):
        raise Parsed(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            module.main([])
        except Parsed as p:
            return p.parser
    pytest.fail(f"{script}: main returned before parsing its arguments")


def divergences(script: str, parser: argparse.ArgumentParser) -> list[str]:
    """Each option of ``parser`` that names a concept of the vocabulary another way, or the
    canonical name in another meaning or unit."""
    other = {old: new for new, olds in OTHER_SPELLINGS.items() for old in olds}
    bad = []
    for a in parser._actions:
        if is_deprecated(a):
            continue
        for flag in a.option_strings:
            if flag in other:
                bad.append(f"{script}: {flag} is another spelling of {other[flag]}")
        flags = set(a.option_strings)
        if "--checkpoint" in flags and (a.choices is not None or a.metavar == "NAME"):
            bad.append(f"{script}: --checkpoint names a model shape: spell it --config")
        if "--time-limit" in flags and a.metavar != "SECONDS":
            bad.append(f"{script}: --time-limit must be in seconds (metavar SECONDS), "
                       f"not {a.metavar}")
        if "--out" in flags and a.metavar != "DIR":
            bad.append(f"{script}: --out is a folder (metavar DIR), not {a.metavar}")
        if "--dtype" in flags and tuple(a.choices or ()) != DTYPE_NAMES:
            bad.append(f"{script}: --dtype offers {a.choices}, not every dtype "
                       f"{DTYPE_NAMES}")
        if "--json" in flags and a.metavar != "PATH":
            bad.append(f"{script}: --json is one file (metavar PATH), not {a.metavar}")
        if "--device" in flags and script not in DEVICE_EXCEPTIONS and (
                a.default is not None or "cuda if available" not in (a.help or "")):
            bad.append(f"{script}: --device must default to the engine's rule (None, its help "
                       f"saying 'cuda if available, else cpu'), not {a.default!r}, "
                       f"{a.help!r}")
    return bad


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_every_entry_point_speaks_the_vocabulary(script, monkeypatch):
    parser = parser_of(script, monkeypatch)
    bad = divergences(script, parser)
    assert not bad, "\n".join(bad)


def test_generate_speaks_the_vocabulary(monkeypatch):
    assert not divergences("generate.py", parser_of("rocketkv/cli/generate.py", monkeypatch))


def test_the_walk_finds_a_divergent_spelling():
    """The checks fail on each kind of divergence and pass a deprecated alias."""
    p = OneLineParser()
    p.add_argument("--prompt-tokens", type=int)
    p.add_argument("--checkpoint", choices=["a"])
    p.add_argument("--out", metavar="PATH")
    p.add_argument("--time-limit", type=float, metavar="MINUTES")
    p.add_argument("--device", default="cpu")
    assert len(divergences("x.py", p)) == 5
    q = OneLineParser()
    q.add_argument("--context", type=int)
    deprecated_alias(q, "--prompt-tokens", "--context")
    assert divergences("x.py", q) == []


def test_time_limit_minutes_become_seconds_with_a_note(capsys):
    """A script that took minutes: --time-limit is seconds with a note that the unit changed,
    --time-limit-min still takes minutes (stored as seconds) with a deprecation note."""
    p = OneLineParser()
    add_time_limit_option(p, "h", was_minutes=True)
    assert p.parse_args(["--time-limit", "90"]).time_limit == 90
    assert "seconds now" in capsys.readouterr().err
    assert p.parse_args(["--time-limit-min", "1.5"]).time_limit == 90
    err = capsys.readouterr().err
    assert err.startswith("note: --time-limit-min is deprecated; use --time-limit SECONDS")
    assert p.parse_args([]).time_limit is None


def test_an_old_spelling_still_runs_with_a_note(tmp_path, capsys):
    """make_prompt.py's old --tokens and --out (a file) still work, with one note each."""
    from scripts.make_prompt import main

    text = tmp_path / "t.txt"
    text.write_text("The sky is blue. " * 400)
    out = tmp_path / "p.txt"
    assert main(["--text", str(text), "--tokens", "200", "--out", str(out)]) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert out.exists()
    assert notes == ["note: --tokens is deprecated; use --context",
                     "note: --out is deprecated; use --prompt-out"]


def test_a_shape_given_as_checkpoint_still_means_the_shape(capsys, tmp_path, monkeypatch):
    """bench.py: --config NAME, or --checkpoint weights; --checkpoint NAME of a shape (and no
    such path) is the shape of before, with a note; neither gives the default."""
    from rocketkv.flags import named_config

    configs = {"stories260K": {}, "llama-3.1-8b": {}}
    monkeypatch.chdir(tmp_path)

    def ns(config=None, checkpoint=None):
        return argparse.Namespace(config=config, checkpoint=checkpoint)

    assert named_config(ns(config="stories260K"), configs, "llama-3.1-8b") == "stories260K"
    assert named_config(ns(), configs, "llama-3.1-8b") == "llama-3.1-8b"
    assert named_config(ns(checkpoint="random:stories260K"), configs, "llama-3.1-8b") is None
    assert capsys.readouterr().err == ""
    assert named_config(ns(checkpoint="stories260K"), configs, "llama-3.1-8b") == "stories260K"
    assert capsys.readouterr().err.startswith(
        "note: --checkpoint stories260K for a model shape is deprecated; use --config")
    (tmp_path / "stories260K").mkdir()  # a path of that name: the weights
    assert named_config(ns(checkpoint="stories260K"), configs, "llama-3.1-8b") is None


def test_an_alias_keeps_the_rules_of_its_option(capsys):
    """An old spelling is in its option's mutually exclusive group, and gives a required
    option (one ``note:`` line, then the usual error when neither spelling is given)."""
    p = OneLineParser()
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--context", type=int)
    p.add_argument("--prompt-out", required=True)
    deprecated_alias(p, "--prompt-tokens", "--context")
    deprecated_alias(p, "--out", "--prompt-out")
    args = p.parse_args(["--prompt-tokens", "5", "--out", "f"])
    assert (args.context, args.prompt_out) == (5, "f")
    for argv in (["--prompt-tokens", "5", "--prompt", "x", "--out", "f"], ["--context", "5"]):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: the following arguments are required: --prompt-out"
    assert "error: argument --prompt: not allowed with argument --prompt-tokens" in err


def test_generates_random_prompt_is_named_for_what_it_is(capsys):
    """``generate.py --random-prompt N`` is a prompt of N random token ids (not llama.cpp's
    ``-c``, the context size); the old spelling ``--context`` still parses, with a note."""
    from rocketkv.cli.generate_flags import build_parser

    p = build_parser()
    assert p.parse_args(["--random-prompt", "64"]).random_prompt == 64
    assert capsys.readouterr().err == ""
    assert p.parse_args(["--context", "64"]).random_prompt == 64
    assert capsys.readouterr().err == "note: --context is deprecated; use --random-prompt\n"
    help_text = p.format_help()
    assert "--random-prompt N" in help_text and "--context" not in help_text


HELP_ENTRY_POINTS = ENTRY_POINTS + ["rocketkv/cli/generate.py"]


@pytest.mark.parametrize("script", HELP_ENTRY_POINTS)
def test_every_help_speaks_to_users(script, monkeypatch):
    """``--help`` of every entry point, like README.md and docs/ (tests/test_docs.py's
    patterns), names no issue number and no wording of the project's GPU visits."""
    import re

    from test_docs import FORBIDDEN

    text = parser_of(script, monkeypatch).format_help()
    found = [f"{name}: {m.group(0)!r}" for name, pattern in FORBIDDEN.items()
             for m in re.finditer(pattern, text, re.I)]
    assert not found, f"{script} --help: " + "; ".join(found)
