"""The first-use self-check of the fused kernels (rocketkv/engine/kernel_check.py): a kernel
that raises or returns wrong numbers is switched off with one warning and the run gives the
PyTorch path's tokens; ``--kernels on`` makes the same faults an error. On CPU the kernels run
forced in Triton's interpreter (conftest.py); the test doubles replace the functions both the
self-check and the run call (``kernels.prefix_attention``, ``kernels.sparse_attention``,
``kernels.linear``)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from rocketkv import kernels
from rocketkv.cli import generate as generate_cli
from rocketkv.engine import checks as run_steps
from rocketkv.engine import generate as g
from rocketkv.engine import kernel_check as check
from rocketkv.model import ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=64,
                 vocab_size=48, max_seq_len=256, name="tiny")
PROMPT = torch.randint(0, 48, (80,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(autouse=True)
def _forced_and_fresh():
    """Kernels forced (the interpreter), dense ones off unless a test turns them on, and no
    self-check outcome or switched-off family left from another test."""
    mode, dense, strict = kernels.set_mode("force"), kernels.set_dense(False), \
        kernels.set_strict(False)
    kernels.reset_failures()
    check._outcomes.clear()
    yield
    kernels.set_mode(mode)
    kernels.set_dense(dense)
    kernels.set_strict(strict)
    kernels.reset_failures()
    check._outcomes.clear()


@pytest.fixture
def few_programs(monkeypatch):
    """Fewer, larger dense launches: the interpreter runs programs one after another."""
    dense = kernels.ops() and sys.modules["rocketkv.kernels.dense"]
    monkeypatch.setattr(dense, "TARGET_PROGRAMS", 8)


def tiny_model():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def pytorch_tokens(model, method, budget):
    previous = kernels.set_mode("off")
    try:
        r = g.generate(model, PROMPT, g.CacheRequest(method, budget), max_new_tokens=4)
        return r["token_ids"]
    finally:
        kernels.set_mode(previous)


def inject(monkeypatch, name, fault):
    """Replace ``kernels.<name>`` by a double that raises, or returns the kernel's output
    with its head dims reversed and doubled (wrong numbers of the right shape and dtype)."""
    real = getattr(kernels, name)

    def double(*args, **kwargs):
        if fault == "raise":
            raise RuntimeError("injected launch failure")
        return 2 * real(*args, **kwargs).flip(-1)

    monkeypatch.setattr(kernels, name, double)


CASES = [("full", None, "prefix_attention", "prefix"),
         ("rocketkv", 40, "sparse_attention", "sparse"),
         ("full", None, "linear", "dense")]


@pytest.mark.parametrize("fault", ["raise", "wrong"])
@pytest.mark.parametrize("method,budget,fn,family", CASES, ids=[c[3] for c in CASES])
def test_a_faulty_kernel_falls_back_to_the_pytorch_path(method, budget, fn, family, fault,
                                                        monkeypatch, capsys, few_programs):
    """The faulty family is switched off with one warning naming the device, the family and
    the reason; generate's tokens are the PyTorch path's; its result says why."""
    model = tiny_model()
    want = pytorch_tokens(model, method, budget)
    kernels.set_dense(family == "dense")
    inject(monkeypatch, fn, fault)
    r = g.generate(model, PROMPT, g.CacheRequest(method, budget), max_new_tokens=4)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert "cpu" in warnings[0] and kernels.FAMILIES[family] in warnings[0]
    reason = "injected launch failure" if fault == "raise" else "max relative error"
    assert reason in warnings[0]
    assert r["token_ids"] == want
    assert r["kernels"][family].startswith("pytorch (self-check: ") and \
        reason in r["kernels"][family]
    others = {f: v for f, v in r["kernels"].items() if f != family}
    assert all(v in ("fused", "unused", "pytorch (off)") for v in others.values()), others
    assert not kernels.family_on(family, "cpu")


def test_a_family_that_passes_stays_on():
    """Without a fault the self-check passes and the report says the kernels ran."""
    r = g.generate(tiny_model(), PROMPT, g.CacheRequest("full"), max_new_tokens=2)
    assert r["kernels"] == {"sparse": "unused", "write": "unused", "prefix": "fused",
                            "dense": "pytorch (off)"}


def test_strict_mode_makes_a_fault_an_error(monkeypatch):
    kernels.set_strict(True)
    inject(monkeypatch, "prefix_attention", "wrong")
    with pytest.raises(kernels.KernelCheckError, match="max relative error"):
        g.generate(tiny_model(), PROMPT, g.CacheRequest("full"), max_new_tokens=2)


@pytest.fixture
def tiny_cli(monkeypatch):
    """generate.main on the tiny model (``--checkpoint random:tiny``)."""
    monkeypatch.setattr(run_steps, "resolve_checkpoint", lambda c: c)
    monkeypatch.setattr(run_steps, "checkpoint_args", lambda c: ARGS)
    monkeypatch.setattr(run_steps, "load_model", lambda *a, **k: tiny_model())
    return ["--checkpoint", "random:tiny", "--device", "cpu", "--random-prompt", "24",
            "--max-new-tokens", "3", "--no-stream"]


def test_cli_kernels_on_turns_a_fault_into_one_error_line(tiny_cli, monkeypatch, capsys,
                                                          tmp_path):
    """``--kernels on``: exit 1 with one ``error:`` line; without it (the forced mode here
    standing for auto on a GPU) the warning, exit 0, and the JSON says why."""
    inject(monkeypatch, "prefix_attention", "raise")
    assert generate_cli.main([*tiny_cli, "--kernels", "on"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("load (weights and tokenizer)"), err  # printed when the load ends
    err = err.split("\n", 1)[1]
    assert err.startswith("error: kernel self-check on cpu") and err.count("\n") == 1, err
    assert "Traceback" not in err and "injected launch failure" in err
    check._outcomes.clear()
    kernels.set_strict(False)  # what --kernels on set (a process runs one command)
    kernels.set_dense(False)
    out = tmp_path / "run.json"
    assert generate_cli.main([*tiny_cli, "--json", str(out)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")
                and "step times vary" not in line]  # the load on this machine, not ours
    assert len(warnings) == 1 and "self-check" in warnings[0], err
    assert "kernels: sparse unused, write unused, prefix pytorch (self-check: " in err
    saved = json.loads(out.read_text())["kernels"]
    assert saved["prefix"] == "pytorch (self-check: RuntimeError: injected launch failure)"


def test_cli_turns_an_escaping_kernel_fault_into_one_error_line(tiny_cli, monkeypatch, capsys):
    """A CUDA error past the self-check (here raised by the decode step's attention after the
    check passed) is one ``error:`` line and exit 1, not a traceback."""
    real = kernels.prefix_attention
    calls = []

    def late_fault(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # the self-check's two inputs pass
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "prefix_attention", late_fault)
    assert generate_cli.main(tiny_cli) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: CUDA error: an illegal memory access")
    assert "Traceback" not in err


def test_the_fault_rule_names_kernel_errors_only():
    class CompilationError(Exception):
        pass

    CompilationError.__module__ = "triton.compiler.errors"
    assert kernels.fault(CompilationError("at 12:4: bad")) == \
        "Triton CompilationError: at 12:4: bad"
    assert kernels.fault(RuntimeError("CUDA error: misaligned address\nmore")) == \
        "CUDA error: misaligned address"
    assert kernels.fault(RuntimeError("shape mismatch")) is None
    assert kernels.fault(ValueError("CUDA error")) is None


def test_the_check_runs_alone_and_passes_every_family_on_cpu():
    """``python -m rocketkv.engine.kernel_check --device cpu``: one PASS line per family and
    variant, exit 0 (small head dim and group: the interpreter)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the check sets it itself for cpu
    p = subprocess.run([sys.executable, "-m", "rocketkv.engine.kernel_check", "--device", "cpu",
                        "--head-dim", "16", "--group", "2", "--groupsize", "32"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()[1:]
    assert {line.split()[1] for line in lines} == set(kernels.FAMILIES)
    assert all(line.startswith("PASS") for line in lines), p.stdout


def test_the_families_of_every_method_are_found_without_error():
    """Every registered method's caches: ``families`` names the selectors that launch the
    sparse kernels and passes over a cache whose ``selector`` is no Selector (OmniKV's is the
    name of its context rule: ``vars()`` of that string raised TypeError in every OmniKV run
    on CUDA, and under torchrun on CPU)."""
    from rocketkv.compression import METHODS
    from rocketkv.compression.selection import Selector

    model = tiny_model()
    previous = kernels.set_mode("off")  # the caches alone: nothing is checked or launched
    try:
        for name, method in METHODS.items():
            g.generate(model, [t % ARGS.vocab_size for t in range(1, 200)],
                       g.CacheRequest(name, 128 if method.budgeted else None), max_new_tokens=1)
            found = check.families(model)
            assert found["prefix"] == [None], name
            selectors = [c.selector for c in model.caches
                         if isinstance(getattr(c, "selector", None), Selector)
                         and type(c.selector).attend is not Selector.attend]
            assert bool(selectors) == ("sparse" in found), name
    finally:
        kernels.set_mode(previous)


# What Inductor's compile workers hand back when a Triton kernel fails to compile inside
# torch.compile (three of the four compile failures on the H200, 2026-11-27): the Triton error
# only as text in a SubprocException's traceback, re-raised as an InductorError.
SUBPROC_TEXT = """An exception occurred in a subprocess:

Name=_select_attend_kernel
Traceback (most recent call last):
  File "/opt/venv/lib/python3.12/site-packages/triton/language/core.py", line 43, in wrapper
    return fn(*args, **kwargs)
AssertionError: Both operands must be same dtype. Got fp64 and fp32

The above exception was the direct cause of the following exception:

triton.compiler.errors.CompilationError: at 15:33:
    s = _dot(q, tl.trans(kt), DOT) * scale
                                 ^
Both operands must be same dtype. Got fp64 and fp32
"""


def test_a_triton_error_handed_back_as_text_by_inductor_is_a_compile_fault():
    """``kernels.compile_fault`` finds the Triton error inside the text of Inductor's
    subprocess exception, so the compiled step falls back to the PyTorch path with one
    warning (``step.FallbackStep``) instead of ending the run in a traceback; a CUDA error
    in such text is still no compile fault, and text without Triton is nothing."""
    from torch._inductor.exc import InductorError

    class SubprocException(Exception):
        pass

    def inductor_error(text: str) -> Exception:
        inner = SubprocException(text)
        try:
            raise InductorError(inner, None) from inner  # as Inductor re-raises it
        except InductorError as e:
            return e

    err = inductor_error(SUBPROC_TEXT)
    assert "SubprocException: An exception occurred" in str(err)
    reason = kernels.compile_fault(err)
    assert reason == ("Triton CompilationError: at 15:33: ... Both operands must be same dtype. "
                      "Got fp64 and fp32")
    assert kernels.fault(err) == reason
    cuda = inductor_error(SUBPROC_TEXT + "\nRuntimeError: CUDA error: an illegal memory access")
    assert kernels.compile_fault(cuda) is None
    assert kernels.compile_fault(inductor_error("a C++ compiler failed")) is None


def test_the_compiled_step_falls_back_on_inductors_text_form(monkeypatch, capsys):
    """``step.FallbackStep`` given Inductor's text form of a Triton compile error: one
    ``warning:`` line, every kernel family off on the device, the PyTorch path's step runs."""
    from torch._inductor.exc import InductorError

    from rocketkv.engine.step import FallbackStep

    class SubprocException(Exception):
        pass

    calls = []

    def step(model, tokens, input_pos):
        calls.append(1)
        if len(calls) == 1:
            inner = SubprocException(SUBPROC_TEXT)
            raise InductorError(inner, None) from inner
        return "the PyTorch path's tokens"

    monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
    device = torch.device("cpu")
    try:
        fallback = FallbackStep(step, device)
        assert fallback(None, None, None) == "the PyTorch path's tokens"
        assert fallback.fault.startswith("Triton CompilationError: at 15:33:")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("warning: a fused kernel failed to compile")
        assert all(kernels.failure(f, device) == fallback.fault
                   for f in kernels.FAMILIES)
    finally:
        kernels.reset_failures()


def test_on_a_gpu_the_check_runs_the_split_and_merged_paths(monkeypatch):
    """Where the device has SMs (a GPU; simulated here, the kernels in the interpreter with
    small splits), the prefix case is long enough that ``attend_prefix`` splits and merges
    its programs, and the selection case has enough pages that the selection splits over
    programs: the paths real runs take, checked before a run trusts them."""
    from rocketkv.engine import kernel_check
    from rocketkv.kernels import sparse

    monkeypatch.setattr(kernels, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(sparse, "PREFIX_SPLIT", 8)  # 32 splits of 8 slots: 257 tokens
    monkeypatch.setattr(sparse, "MIN_SPLIT_PAGES", 4)  # 8 splits of 4 pages
    monkeypatch.setattr(kernel_check, "_outcomes", {})
    splits, prefixes = [], []
    real_split, real_prefix = sparse._split_selection, sparse.prefix_splits
    monkeypatch.setattr(sparse, "_split_selection",
                        lambda *a, **kw: splits.append(a[10]) or real_split(*a, **kw))
    monkeypatch.setattr(sparse, "prefix_splits",
                        lambda *a: prefixes.append(real_prefix(*a)) or prefixes[-1])
    from rocketkv.compression.hybrid import HybridSelector

    for family, variant in (("prefix", None), ("sparse", HybridSelector(4, 8, 16))):
        out = kernel_check.check_family(family, "cpu", torch.float32, 32, 2, variant)
        assert out.ok and out.note is None, (family, out)
    assert prefixes and max(prefixes) == 32
    assert splits and min(splits) >= 8
