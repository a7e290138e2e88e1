"""Typed run settings (``engine/request.py``, ``step.Sampling``, ``step.StepConfig``), checked
when made; a method planned once per run, by the command line and the API alike, which share
one flow (``checks.plan_run`` then ``api.Engine.run``)."""

import pytest
import torch

import rocketkv
from rocketkv.cli import generate as generate_cli
from rocketkv.compression import registry
from rocketkv.engine import checks, request
from rocketkv.engine.generate import CacheRequest, Sampling, StepConfig, generate
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError


@pytest.mark.parametrize("make, message", [
    (lambda: CacheRequest("no_such_method"), "no_such_method"),
    (lambda: CacheRequest("rocketkv"), "needs --budget"),
    (lambda: CacheRequest("rocketkv", 0), "--budget must be a positive number"),
    (lambda: CacheRequest("full", 64), "takes no --budget"),
    (lambda: CacheRequest("snapkv", 64, {"page_size": 16}), "page-size"),
    (lambda: CacheRequest("full", reserve_tokens=-1), "reserve_tokens must not be negative"),
    (lambda: Sampling(-0.5), "--temperature must be a finite number >= 0"),
    (lambda: Sampling(float("nan")), "--temperature"),
    (lambda: Sampling(1.0, top_k=0), "--top-k must be positive"),
    (lambda: Sampling(1.0, top_p=1.5), r"--top-p must lie in \(0, 1\]"),
    (lambda: StepConfig(stop_check_every=0), "stop_check_every must be at least 1"),
    (lambda: StepConfig(warmup_steps=-1), "warmup_steps must not be negative"),
])
def test_a_bad_setting_is_refused_when_made(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_request_keeps_only_the_options_given():
    r = CacheRequest("quest", 64, {"page_size": 16, "rocket_split": None, "skip_layers": False})
    assert r.options == {"page_size": 16}
    assert r.replace(budget=128).budget == 128 and r.budgeted
    assert not CacheRequest().budgeted and CacheRequest().method == "full"


def test_a_plan_is_for_one_prompt_length_and_model(stories_model):
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    plan = CacheRequest("rocketkv", 64).plan(stories_model.args, prompt_len=300,
                                             max_new_tokens=4)
    assert plan.params is not None and plan.note is None and plan.new_tokens == 4
    r = generate(stories_model, ids, plan, max_new_tokens=4)
    assert r.method_params["budget"] == 64
    # the same run from the request: the same tokens
    assert generate(stories_model, ids, CacheRequest("rocketkv", 64),
                    max_new_tokens=4).token_ids == r.token_ids
    with pytest.raises(ConfigError, match="300-token prompt and 4 positions"):
        generate(stories_model, ids[:200], plan, max_new_tokens=4)
    with pytest.raises(ConfigError, match="300-token prompt and 4 positions"):
        generate(stories_model, ids, plan, max_new_tokens=8)
    other = stories_model.args.__class__(**{**vars(stories_model.args), "name": "other"})
    with pytest.raises(ConfigError, match="another model"):
        plan.check_run(other, 300, 4)


def test_a_budget_that_covers_the_sequence_plans_the_full_cache(stories_model):
    plan = CacheRequest("rocketkv", 256).plan(stories_model.args, prompt_len=100,
                                              max_new_tokens=50)
    assert plan.params is None
    assert plan.note == ("no compression: the budget (256) covers all 150 tokens (prompt 100 + "
                         "up to 50 new); rocketkv runs with the full cache")
    assert CacheRequest("full").plan(stories_model.args, prompt_len=100,
                                     max_new_tokens=50).note is None


def test_a_continuation_takes_no_cache(stories_model):
    generate(stories_model, [1, 403, 407], max_new_tokens=2)
    with pytest.raises(ConfigError, match="pass no cache"):
        generate(stories_model, [261], CacheRequest("full"), continue_conversation=True)


@pytest.fixture
def derive_calls(monkeypatch):
    """How many times a method is planned (``compression.plan_checked``, which every plan
    runs: ``CacheRequest.plan`` and ``compression.plan``, hence ``build_caches`` unplanned).
    Re-deriving as the cache grows (``Method.at_length``) is decoding, not planning."""
    real, calls = registry.plan_checked, []

    def counting(*a, **kw):
        calls.append(kw.get("prompt_len"))
        return real(*a, **kw)

    monkeypatch.setattr(registry, "plan_checked", counting)
    monkeypatch.setattr(request, "plan_checked", counting)
    return calls


def test_the_command_line_plans_the_method_once(stories_dir, derive_calls, capsys):
    """Checked and planned before the load, the caches built from that plan: one plan (two
    before the command line ran on ``Engine.run``: ``check_fit`` and ``build_caches``)."""
    assert generate_cli.main(["--checkpoint", str(stories_dir), "--random-prompt", "300",
                              "--method", "rocketkv", "--budget", "64", "--max-new-tokens", "4",
                              "--device", "cpu", "--no-progress"]) == 0
    assert "method rocketkv  budget 64" in capsys.readouterr().err
    assert len(derive_calls) == 1


def test_the_api_plans_the_method_once(stories_model, stories_dir, derive_calls):
    engine = rocketkv.Engine(stories_model, load_tokenizer(stories_dir))
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    r = engine.generate(ids, method="rocketkv", budget=64, max_new_tokens=4)
    assert r.metrics["method"] == "rocketkv" and len(derive_calls) == 1
    derive_calls.clear()
    doc = engine.prefill_document(ids, method="rocketkv", budget=64, reserve_tokens=16)
    assert derive_calls == [300]
    doc.ask([261, 378], max_new_tokens=4)  # question-aware: its run, planned once
    assert derive_calls == [300, 302]
    derive_calls.clear()
    doc = engine.prefill_document(ids, method="rocketkv", budget=64, reserve_tokens=16,
                                  question_aware=False)
    doc.ask([261, 378], max_new_tokens=4)
    assert derive_calls == [300]  # question-agnostic: the answer runs on the document's caches


def test_the_command_line_and_the_api_run_one_flow(stories_model, stories_dir, monkeypatch,
                                                   capsys):
    """``generate.py`` runs through ``Engine.run``, with the run ``checks.plan_run`` made before
    the load; its JSON record is the API's ``Result.metrics``."""
    runs = []
    real = rocketkv.Engine.run

    def spy(self, run, **kw):
        runs.append(run)
        return real(self, run, **kw)

    monkeypatch.setattr(rocketkv.Engine, "run", spy)
    assert generate_cli.main(["--checkpoint", str(stories_dir), "--prompt-text",
                              "Once upon a time", "--max-new-tokens", "6", "--ignore-eos",
                              "--device", "cpu", "--no-progress"]) == 0
    cli_text = capsys.readouterr().out.strip()
    assert len(runs) == 1 and isinstance(runs[0], checks.Run)
    assert runs[0].plan.request == CacheRequest() and runs[0].max_new_tokens == 6
    engine = rocketkv.Engine(stories_model, load_tokenizer(stories_dir))
    api = engine.generate("Once upon a time", max_new_tokens=6, stop_ids=(), chat=False)
    assert runs[1].ids == runs[0].ids and api.text.strip() == cli_text


def test_errors_keep_the_command_lines_words_in_the_command_line(stories_dir, capsys):
    """The CLI runs on the API, whose errors speak Python (``pass compile=False``); within the
    command line they keep its flags (``--no-compile``)."""
    code = generate_cli.main(["--checkpoint", str(stories_dir), "--random-prompt", "300",
                              "--method", "omnikv", "--budget", "64", "--offload",
                              "--compile", "--max-new-tokens", "4", "--device", "cpu",
                              "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "use --no-compile" in err, err
