"""Bad input gets one ``error:`` line and exit status 2 before any slow work, never a
traceback, never anything half-written: an unwritable ``--out`` of the accuracy scripts, a
``--context`` past the model's context in bench.py, quantize.py's int4 without a group size,
Ctrl-C during quantize.py, a truncated GGUF file; and the accuracy scripts' ``--help`` and
``--dtype``."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, SMOLLM2_GGUF, shared_file, sigint_default

from rocketkv.evals import harness
from scripts.eval_needle import build_parser as needle_parser
from scripts.eval_needle import main as needle_main
from scripts.eval_ruler import build_parser as ruler_parser
from scripts.eval_ruler import main as ruler_main

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _no_load(*a, **kw):
    raise AssertionError("the weights were loaded before the input was checked")


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    return lines[0]


# 1. --out of the accuracy scripts: checked before the weights load


def _impossible_outs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder would go")
    # under a regular file (refused to root too), and /proc, which takes no new folders
    return [blocker / "sub", "/proc/zz"]


@pytest.mark.parametrize("script", ["needle", "ruler"])
def test_an_out_no_folder_can_be_made_in_is_refused_before_the_load(script, tmp_path, capsys,
                                                                       monkeypatch):
    """``eval_needle.py --out /proc/zz`` loaded the model, ran nothing and died with a
    traceback (mkdir of the partial file); the harness (``check_common``) now refuses it in one
    line before the load, for every script built on it."""
    monkeypatch.setattr(harness, "load_model", _no_load)
    main = needle_main if script == "needle" else ruler_main
    gguf = str(shared_file(SMOLLM2_GGUF))
    for out in _impossible_outs(tmp_path):
        rc = main(["--checkpoint", gguf, "--out", str(out), "--context", "256", "--methods",
                   "full", "--limit", "1", "--no-progress"])
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and line.startswith(f"error: --out {out}: "), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no probe left behind


def test_an_unwritable_out_is_one_line_from_the_command_line(tmp_path):
    """The same as a command: exit 2, one line, no traceback, in seconds (no model load)."""
    out = _impossible_outs(tmp_path)[0]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_needle.py"),
                        "--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--out", str(out),
                        "--context", "256", "--methods", "full", "--limit", "1"],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert _one_error_line(p.stderr).startswith(f"error: --out {out}: ")
    assert "Traceback" not in p.stderr and time.perf_counter() - t0 < 60


# 2. bench.py --context past the model's context: refused before the load


def test_bench_refuses_a_context_past_the_models_before_the_load(tmp_path, capsys, monkeypatch):
    """SmolLM2's header says 8192 tokens: ``--context 20000`` is one ``error:`` line before
    the weights load (it loaded them, measured the copy bandwidth and wrote a JSON of one
    failed row); so is a context whose new tokens do not fit, for a named shape too."""
    from rocketkv.evals import sweep
    from scripts import bench

    monkeypatch.setattr(sweep, "load_weights", _no_load)
    gguf = str(shared_file(SMOLLM2_GGUF))
    for argv, first in (
            (["--checkpoint", gguf, "--context", "20000"], "--context 20000 + 64 new tokens"),
            (["--checkpoint", gguf, "--context", "1024", "8190"], "--context 8190 + 64"),
            (["--config", "stories260K", "--context", "510", "--max-new-tokens", "4"],
             "--context 510 + 4 new tokens")):
        rc = bench.main([*argv, "--device", "cpu", "--methods", "full", "--out", str(tmp_path),
                         "--no-plots", "--no-progress"])
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and line.startswith(f"error: {first}"), line
        assert "exceed the model's context" in line
    assert not list(tmp_path.iterdir())  # nothing written


# 3. quantize.py --mode int4 without --groupsize: a usage error before torch


def _quantize(argv, cwd, **kw):
    return subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "quantize.py"), *argv],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=cwd, **kw)


def _without_import_log(stderr: str) -> tuple[list[str], bool]:
    """(the stderr lines that are not ``-X importtime``'s, whether torch was imported)."""
    lines = stderr.splitlines()
    log = [x for x in lines if x.startswith("import time:")]
    return ([x for x in lines if not x.startswith("import time:")],
            any(x.split("|")[-1].strip() == "torch" for x in log))


def test_quantize_int4_without_a_group_size_is_a_usage_error_before_torch(tmp_path):
    """``--mode int4`` without ``--groupsize`` (and int8 with one) is one line, exit 2, before
    torch loads; ``--help`` says int4 needs ``--groupsize`` and which values it takes."""
    for argv, message in (
            (["--checkpoint", "x", "--mode", "int4"],
             "error: --mode int4 needs --groupsize (32, 64, 128, 256)"),
            (["--checkpoint", "x", "--mode", "int8", "--groupsize", "32"],
             "error: --groupsize applies to int4 only (int8 is per output channel)")):
        p = _quantize(argv, tmp_path)
        err, torch_loaded = _without_import_log(p.stderr)
        assert p.returncode == 2 and err == [message], p.stderr[-2000:]
        assert not torch_loaded
    p = _quantize(["--help"], tmp_path)
    text = " ".join(p.stdout.split())
    assert p.returncode == 0
    assert "required with --mode int4 (one of 32, 64, 128, 256" in text
    assert "int4: one scale and zero per group of input features, needs --groupsize" in text


# 4. Ctrl-C during quantize.py: 130 and nothing written, or 0 and the whole folder


QUANTIZED_FILES = {"model.safetensors", "model_args.json", "quantization.json"}


def _start_quantize(checkpoint: str, out, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "quantize.py"), "--checkpoint", checkpoint, "--mode",
         "int8", "--out", str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=ENV, cwd=out.parent, preexec_fn=sigint_default)


def _check_outcome(p: subprocess.Popen, out, stdout: bytes, stderr: bytes) -> int:
    """The rule: exit 130 with one line saying nothing was written and nothing in ``out``'s
    folder (no output, no temporary copy), or exit 0 with the whole folder and ``wrote``."""
    err = stderr.decode()
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    if p.returncode == 130:
        last = err.replace("\r", "\n").strip().splitlines()[-1]
        assert last == "error: interrupted; nothing was written", err[-2000:]
        assert not list(out.parent.iterdir()), list(out.parent.iterdir())
    else:
        assert p.returncode == 0, (p.returncode, err[-2000:])
        assert stdout.decode().strip() == f"wrote {out}"
        assert QUANTIZED_FILES <= {f.name for f in out.iterdir()}
        assert [f.name for f in out.parent.iterdir()] == [out.name]
    return p.returncode


def test_ctrl_c_after_the_files_are_complete_does_not_fail_the_run(tmp_path):
    """The filed report: "Ctrl-C to quantize.py exits 130 with nothing said and leaves a
    complete-looking output folder". Ctrl-C as the process ended (its ``wrote`` line out, the
    interpreter shutting down, which restores SIGINT's default action) killed it: status 130
    (-2 here), not a word, beside the complete folder. From the moment every file is written
    Ctrl-C is now ignored: status 0, the folder, ``wrote``."""
    out = tmp_path / "work" / "o"
    out.parent.mkdir()
    p = _start_quantize("random:stories260K", out, "--no-progress")
    line = p.stdout.readline()
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=300)
    assert line.decode().strip() == f"wrote {out}"
    assert p.returncode == 0, (p.returncode, stderr.decode()[-2000:])
    assert _check_outcome(p, out, line + stdout, stderr) == 0
    assert stderr == b""


def test_ctrl_c_while_the_files_are_written_leaves_nothing_or_everything(tmp_path):
    """Ctrl-C once the temporary folder beside ``--out`` exists (the files being written):
    exit 130, one line saying nothing was written, no output folder and no temporary one; or,
    when the run reached its last file first, exit 0 with the whole folder."""
    out = tmp_path / "work" / "o"
    out.parent.mkdir()
    p = _start_quantize(str(shared_file(SMOLLM2_GGUF)), out, "--no-progress")
    deadline = time.monotonic() + 300
    while p.poll() is None and not any(f.name.startswith(".o.") for f in out.parent.iterdir()):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=300)
    if _check_outcome(p, out, stdout, stderr) == 130:
        assert stderr == b"error: interrupted; nothing was written\n"


def test_ctrl_c_just_after_a_progress_frame_puts_the_error_on_its_own_line(tmp_path, capsys,
                                                                         monkeypatch):
    """Ctrl-C landing in tqdm between drawing a frame and recording that it drew one (its
    constructor, ``update``) left the frame's line open: tqdm's close then thought nothing was
    drawn, and the error line followed the frame on the same line. quantize.py ends the line."""
    import tqdm.std

    from rocketkv.cli.quantize import main

    real = tqdm.std.tqdm.refresh

    def refresh(self, *a, **kw):
        real(self, *a, **kw)
        raise KeyboardInterrupt  # as if Ctrl-C landed just after the frame was drawn

    monkeypatch.setattr(tqdm.std.tqdm, "refresh", refresh)
    rc = main(["--checkpoint", "random:stories260K", "--mode", "int8", "--out",
               str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 130 and "quantize int8" in err, err
    assert err.endswith("\nerror: interrupted; nothing was written\n"), repr(err)
    assert not list(tmp_path.iterdir())


def test_ctrl_c_just_as_the_temporary_folder_is_made_leaves_nothing(tmp_path, capsys,
                                                                    monkeypatch):
    """Ctrl-C between ``write_directory`` making its temporary folder and the ``try`` that
    removes it on failure (the window the test above aims at) left ``.o.XXXXXXXX`` behind;
    ``checkpoint.write_directory`` removes it."""
    import tempfile

    from rocketkv.cli.quantize import main

    real = tempfile.mkdtemp

    def mkdtemp(*a, **kw):
        made = real(*a, **kw)
        if os.path.basename(made).startswith(".o."):
            raise KeyboardInterrupt  # as if Ctrl-C landed just after the folder was made
        return made

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    rc = main(["--checkpoint", "random:stories260K", "--mode", "int8", "--out",
               str(tmp_path / "o"), "--no-progress"])
    assert rc == 130
    assert capsys.readouterr().err == "error: interrupted; nothing was written\n"
    assert not list(tmp_path.iterdir())


# 5. A truncated GGUF file: one line naming it, from the reader


@pytest.mark.parametrize("size", ["half", 1000])
def test_a_truncated_gguf_is_named_as_incomplete(size, tmp_path):
    """A download cut short was reported in numpy's words ("When changing to a larger
    dtype...", "cannot reshape array..."); the GGUF reader now says where the file ends, so
    every command prints one line."""
    src = shared_file(SMOLLM2_GGUF)
    n = src.stat().st_size // 2 if size == "half" else size
    copy = tmp_path / "cut.gguf"
    with open(src, "rb") as f, open(copy, "wb") as g:
        g.write(f.read(n))
    p = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--checkpoint", str(copy),
                        "-p", "hi"], capture_output=True, text=True, timeout=300, env=ENV,
                       cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    line = _one_error_line(p.stderr)
    assert line.startswith(f"error: {copy}: not a complete GGUF file (")
    assert line.endswith("; re-download it)")
    if size == "half":
        from rocketkv.formats.gguf_reader import open_gguf

        assert f"truncated at byte {n - open_gguf(src).data_offset:,} of the tensor data" \
            in line, line
    else:
        assert "truncated or corrupt: its header runs past the end of the file at byte 1,000;" \
            in line, line


def test_truncation_at_every_stage_of_the_file(tmp_path):
    """In the magic's version field, the metadata, the tensor table, the first and the last
    tensor byte: always ``not a complete GGUF file``, the byte named; the whole file reads."""
    from rocketkv.errors import ConfigError
    from rocketkv.formats.gguf_reader import open_gguf

    src = shared_file(SMOLLM2_GGUF)
    data = src.read_bytes()
    reader = open_gguf(src)
    start = reader.data_offset
    for n in (6, 25, 1003, start - 1, start, start + 1, len(data) - 1):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(ConfigError, match="not a complete GGUF file") as e:
            open_gguf(cut)
        assert "re-download it" in str(e.value)
        assert (f"byte {n:,}" if n < start else f"at byte {n - start:,} of the tensor data") \
            in str(e.value)


# 6. The accuracy scripts' --help and --dtype


@pytest.mark.parametrize("parser", [needle_parser, ruler_parser])
def test_help_states_what_flags_do_not_their_history(parser, capsys):
    """No deprecation history in ``--help`` (``--time-limit`` said "it was minutes:
    --time-limit-min still takes minutes for one release"); the old spellings still work,
    hidden, with their note."""
    p = parser()
    text = " ".join(p.format_help().split())
    for word in ("minutes", "release", "deprecated", "--time-limit-min", "--lengths"):
        assert word not in text, word
    assert "start no batch after this many seconds of evaluation:" in text
    args = p.parse_args(["--checkpoint", "c", "--time-limit-min", "1.5", "--lengths", "512"])
    assert args.time_limit == 90 and args.context == [512]
    assert "deprecated" in capsys.readouterr().err


@pytest.mark.parametrize("parser", [needle_parser, ruler_parser])
def test_dtype_takes_float16_and_defaults_as_generate_does(parser, monkeypatch, capsys):
    """``--dtype float16`` is accepted; without ``--dtype`` the harness loads in the dtype
    ``generate.py`` and the API default to (float32 on CPU, bfloat16 on cuda), whether or not
    the CPU has native bfloat16; the run's header line names it."""
    from rocketkv.engine.device import default_dtype as _dtype

    assert parser().parse_args(["--checkpoint", "c", "--dtype", "float16"]).dtype == "float16"
    got = []

    def record(checkpoint, device, dtype, **kw):
        got.append(dtype)
        raise KeyboardInterrupt  # stop before the weights are read

    monkeypatch.setattr(harness, "load_model", record)
    monkeypatch.setattr(harness, "cpu_has_native_bf16", lambda: True)
    for name in ("float16", None):
        got.clear()
        args = parser().parse_args(["--checkpoint", str(shared_file(SMOLLM2_GGUF)),
                                    "--device", "cpu"] + (["--dtype", name] if name else []))
        with pytest.raises(KeyboardInterrupt):
            harness.load(args)
        assert got == [torch.float16 if name else _dtype(None, torch.device("cpu"))]
    assert got == [torch.float32]
    assert _dtype(None, torch.device("cuda")) == torch.bfloat16
    header = harness.run_header("needle", "SmolLM2-135M-Instruct", torch.device("cpu"),
                                "float32", True, 2, 1)
    assert header == ("needle: SmolLM2-135M-Instruct on cpu in float32 (the default on cpu; "
                      "--dtype to change), 2 processes x 1 thread")


def test_a_run_prints_its_dtype_in_its_header_line(tmp_path, capsys):
    """The dtype a bare command runs in is on its header line, since the default changed on
    CPUs with native bfloat16 (the saved batches' resume key includes it)."""
    from rocketkv.formats.checkpoint import checkpoint_args

    name = checkpoint_args(str(shared_file(SMOLLM2_GGUF))).name
    rc = needle_main(["--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--out", str(tmp_path),
                      "--context", "256", "--depths", "1", "--needles", "1", "--methods",
                      "full", "--modes", "standard", "--threads", "1", "--workers", "1",
                      "--no-progress"])
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    header = [x for x in err if x.startswith("needle: ")]
    assert header == [f"needle: {name} on cpu in float32 (the default on cpu; --dtype to "
                      "change), 1 process x 1 thread"], err
