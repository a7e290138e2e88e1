"""step.py: one StepMode names generate's compile flags and bench's --compile-regime."""

import pytest
import torch

import evals.bench
from checkpoint import random_model
from generate import generate
from model import ConfigError, ModelArgs
from step import REGIMES, StepMode, decode_one_token


def test_step_mode_is_the_one_table_of_regimes():
    """bench's regimes (evals.bench.REGIMES, check_targets' table words) are StepMode's."""
    assert evals.bench.REGIMES is REGIMES
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
    r = generate(model, [1, 2, 3], max_new_tokens=4, **StepMode.EAGER.options)
    assert r["compiled"] is False and r["cuda_graphs"] is False and r["compile_s"] is None


def test_the_default_compiles_on_cuda_only():
    """The CLI's and the API's default: compiled where the caches allow on CUDA, eager on CPU;
    a choice made is kept."""
    from step import default_compile

    assert default_compile(None, torch.device("cpu")) is False
    assert default_compile(None, torch.device("cuda")) is None
    assert default_compile(True, torch.device("cpu")) is True
    assert default_compile(False, torch.device("cuda")) is False
