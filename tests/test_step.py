"""step.py: one StepMode names generate's compile flags and bench's --compile-regime."""

import pytest
import torch

import rocketkv.evals.bench
from rocketkv.engine import step
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.engine.step import (
    CPU_COMPILE_MIN_STEPS,
    REGIMES,
    LayerCompiledStep,
    StepMode,
    decode_one_token,
    default_compile,
)
from rocketkv.formats.checkpoint import random_model
from rocketkv.model import ConfigError, ModelArgs


def test_step_mode_is_the_one_table_of_regimes():
    """bench's regimes (evals.bench.REGIMES, check_targets' table words) are StepMode's."""
    assert rocketkv.evals.bench.REGIMES is REGIMES
    assert [m.value for m in StepMode] == ["eager", "static", "dynamic", "graphs"]
    assert set(REGIMES) == {m.value for m in StepMode}
    assert StepMode("graphs").description == "a CUDA graph of the eager step (no torch.compile)"


@pytest.mark.parametrize("flags,mode", [
    ((False, False, None), StepMode.EAGER), ((False, False, True), StepMode.EAGER),
    ((True, False, None), StepMode.STATIC), ((True, False, False), StepMode.STATIC),
    ((True, False, True), StepMode.DYNAMIC), ((False, True, None), StepMode.GRAPHS),
    ((True, True, True), StepMode.GRAPHS)])
def test_generate_flags_name_one_mode(flags, mode):
    assert StepMode.of(*flags) is mode


@pytest.mark.parametrize("mode", list(StepMode))
def test_a_modes_options_name_it_back(mode):
    o = mode.options
    assert StepMode.of(o["compile"] is not False, o["cuda_graphs"], o["compile_dynamic"]) is mode


def test_graphs_need_cuda_and_eager_runs_the_plain_step():
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="^--compile-regime graphs needs a CUDA device, not cpu"):
        StepMode.GRAPHS.check_device(cpu, "--compile-regime graphs")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        StepMode.GRAPHS.step(cpu)
    for mode in (StepMode.EAGER, StepMode.STATIC, StepMode.DYNAMIC):
        mode.check_device(cpu)
    assert StepMode.EAGER.step(cpu, warmup_steps=3) == (decode_one_token, 0)


def test_the_eager_mode_runs_uncompiled():
    model = random_model(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                                   intermediate_size=16, vocab_size=64, max_seq_len=64),
                         "cpu", torch.float32)
    r = generate(model, [1, 2, 3], max_new_tokens=4, step=StepConfig.of(StepMode.EAGER))
    assert r["compiled"] is False and r["cuda_graphs"] is False and r["compile_s"] is None


def test_the_default_compiles_on_cuda_and_long_cpu_runs():
    """The CLI's and the API's default: compiled where the caches allow on CUDA; on CPU from
    CPU_COMPILE_MIN_STEPS decode steps when a C++ compiler is there, else eager; a choice made
    is kept."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_compile(None, cpu) is False
    assert default_compile(None, cpu, CPU_COMPILE_MIN_STEPS - 1) is False
    assert default_compile(None, cpu, CPU_COMPILE_MIN_STEPS) is (
        None if step.cpp_compiler_found() else False)
    assert default_compile(None, cuda) is None
    assert default_compile(None, cuda, 1) is None
    assert default_compile(True, cpu) is True
    assert default_compile(False, cuda) is False
    assert default_compile(False, cpu, 10 * CPU_COMPILE_MIN_STEPS) is False


def test_the_cpu_default_stays_eager_without_a_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert not step.cpp_compiler_found()
    assert default_compile(None, torch.device("cpu"), 10 * CPU_COMPILE_MIN_STEPS) is False


def test_the_cpu_compiled_step_compiles_a_layer_once_and_decodes_as_eager(stories_model):
    """Inductor on CPU (a C++ compiler needed): each layer through one compiled graph shared
    by the model's 5 layers (one graph per method), the same greedy tokens as eager, the
    compile reported apart. Two compiles: 43 s with a cold Inductor cache, 5 s warm (2 loaded
    cores)."""
    if not step.cpp_compiler_found():
        pytest.skip("no C++ compiler for Inductor's CPU backend")
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    step._compiled.clear()
    dynamo_utils.counters.clear()
    prompt = torch.randint(1, 512, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    for method, budget in (("full", None), ("rocketkv", 48)):
        cache = CacheRequest(method, budget)
        eager = generate(stories_model, prompt, cache, max_new_tokens=8)
        compiled = generate(stories_model, prompt, cache, max_new_tokens=8,
                            step=StepConfig(compile=True))
        assert compiled["token_ids"] == eager["token_ids"], method
        assert compiled["compiled"] and compiled["compile_s"] > 0
        assert eager["compiled"] is False
    assert isinstance(step.compiled_decode(torch.device("cpu")), LayerCompiledStep)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2  # not one per layer


# A Triton compile error as triton raises it (its class lives in a ``triton`` module).
TritonCompilationError = type("CompilationError", (Exception,),
                              {"__module__": "triton.compiler.errors"})


def failing_backend(fails: int, error=None):
    """A torch.compile backend whose first ``fails`` compiles raise ``error`` (default: a
    Triton compile error, raised from inside, as Inductor raises its own error from the
    kernel's), then runs the traced graph as is; ``calls`` counts the compiles."""
    def backend(gm, example_inputs):
        backend.calls += 1
        if backend.calls <= fails:
            try:
                raise error or TritonCompilationError(
                    "at 7:15:\ndef _dot(a, b):\n    ^\nBoth operands must be same dtype. "
                    "Got fp64 and fp32")
            except Exception as e:
                raise RuntimeError("InductorError: compiling the decode step") from e
        return gm.forward
    backend.calls = 0
    return backend


def tiny_model():
    return random_model(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                                  intermediate_size=16, vocab_size=64, max_seq_len=64),
                        "cpu", torch.float32)


def test_a_kernel_that_fails_to_compile_costs_a_warning(capsys):
    """The compiled step whose compile fails in a Triton kernel warns once, switches every
    kernel family off on the device (the result's ``kernels`` entry names the cause),
    compiles again and gives the eager run's tokens: the run is not lost."""
    from rocketkv import kernels

    model = tiny_model()
    ref = generate(model, [1, 2, 3], max_new_tokens=6)["token_ids"]
    backend = failing_backend(1)
    torch._dynamo.reset()
    try:
        r = generate(model, [1, 2, 3], max_new_tokens=6,
                     step=StepConfig(compile=True, backend=backend))
        err = capsys.readouterr().err
        assert r["token_ids"] == ref and backend.calls == 2
        assert "warning: a fused kernel failed to compile in the decode step (Triton " \
               "CompilationError: at 7:15: ... Both operands must be same dtype. Got fp64 and " \
               "fp32); the kernels are off on cpu" in err
        why = "Triton CompilationError: at 7:15: ... Both operands must be same dtype. Got " \
              "fp64 and fp32"
        assert all(kernels.failure(f, "cpu") == why for f in kernels.FAMILIES)
        assert r["fused_kernels"] is False and r["dense_kernels"] is False
        assert all(v in ("unused", f"pytorch (compile: {why})") for v in r["kernels"].values())
        mode = kernels.set_mode("force")  # report names the cause where the kernels run
        try:
            if kernels.missing() is None:
                assert kernels.report("cpu")["prefix"] == f"pytorch (compile: {why})"
        finally:
            kernels.set_mode(mode)
    finally:
        kernels.reset_failures()
        torch._dynamo.reset()


@pytest.mark.parametrize("error,fails", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), 1),  # sticky
    (ValueError("not a kernel"), 1),
    (None, 2)])  # a second fault
def test_other_compile_failures_are_raised(error, fails):
    from rocketkv import kernels

    backend = failing_backend(fails, error)
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="InductorError"):
            generate(tiny_model(), [1, 2, 3], max_new_tokens=6,
                     step=StepConfig(compile=True, backend=backend))
    finally:
        kernels.reset_failures()
        torch._dynamo.reset()
