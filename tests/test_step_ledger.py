"""The CPU step ledger (``rocketkv/engine/step_ledger.py``): what it records per step shape,
when it turns a short run's default step into a compiled one, and the Engine's use of it."""

import json
import os

import pytest
import torch

from rocketkv import api
from rocketkv.engine import checks, step_ledger
from rocketkv.engine.request import CacheRequest
from rocketkv.engine.step import Sampling
from rocketkv.engine.step_ledger import StepLedger, compile_note


def test_the_ledger_records_first_and_cached_compiles_and_the_step_times(tmp_path):
    ledger = StepLedger(tmp_path / "l.json")
    assert ledger.get("k") is None and not ledger.worth_compiling("k", 10**6)
    ledger.record("k", compiled=True, compile_s=12.0, step_ms=10.0, label="m")
    assert ledger.get("k") == {"compiles": 1, "compile_s_first": 12.0, "compiled_ms": 10.0,
                               "label": "m"}
    ledger.record("k", compiled=False, compile_s=None, step_ms=14.0)
    assert not ledger.worth_compiling("k", 10**6)  # no cached compile measured yet
    ledger.record("k", compiled=True, compile_s=2.0, step_ms=9.0)
    e = ledger.get("k")
    assert (e["compiles"], e["compile_s_first"], e["compile_s_cached"], e["compiled_ms"],
            e["eager_ms"]) == (2, 12.0, 2.0, 9.0, 14.0)
    # 5 ms saved a step: 2 s repaid above 400 steps
    assert not ledger.worth_compiling("k", 400) and ledger.worth_compiling("k", 401)
    assert compile_note(e).startswith("compiling the decode step: 2.0 s from the on-disk")


def test_a_ledger_that_cannot_be_read_counts_as_empty(tmp_path):
    path = tmp_path / "l.json"
    path.write_text("{not json")
    ledger = StepLedger(path)
    assert ledger.get("k") is None
    ledger.record("k", compiled=False, compile_s=None, step_ms=3.0)
    assert json.loads(path.read_text()) == {"k": {"compiles": 0, "eager_ms": 3.0}}


def test_inductor_keeps_its_cache_under_the_engine_folder_unless_told(monkeypatch, tmp_path):
    monkeypatch.setenv("ROCKETKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    step_ledger.persistent_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    step_ledger.persistent_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


@pytest.fixture
def engine(stories_model):
    return api.Engine(stories_model)


def _run(model, compile=None, new=8):
    ids = list(range(3, 40))
    return checks.plan_run(model.args, ids, CacheRequest("full"), Sampling(),
                           max_new_tokens=new, stop_ids=(), compile=compile,
                           device=torch.device("cpu"))


def test_an_eager_run_is_recorded_and_a_measured_cached_compile_turns_on(engine):
    """(the ledger is the test's own: conftest's ``$ROCKETKV_CACHE_DIR``)"""
    run = _run(engine.model)
    assert run.compile is False and run.compile_default  # short: eager by default
    engine.run(run)
    key = engine.step_key(run)
    entry = StepLedger().get(key)
    assert entry["compiles"] == 0 and entry["eager_ms"] > 0
    assert engine.resolve_compile(run) is run  # nothing compiled here yet
    StepLedger().record(key, compiled=True, compile_s=30.0, step_ms=0.0)  # first compile
    StepLedger().record(key, compiled=True, compile_s=1e-6, step_ms=0.0)  # then cached
    assert engine.resolve_compile(run).compile is None  # compiled by default now
    chosen = _run(engine.model, compile=False)  # the caller's choice stands
    assert not chosen.compile_default and engine.resolve_compile(chosen) is chosen
    other = _run(engine.model, new=9)  # another shape: its own entry
    assert engine.step_key(other) != key and engine.resolve_compile(other) is other
