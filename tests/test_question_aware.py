"""Question-aware documents (``api.Document`` with ``question_aware``): the document's whole K/V
kept once, each question prefilled after it and the method's caches built from document +
question, so an answer is the one a single run of document + question gives."""

import json
import warnings

import pytest
import torch

import rocketkv
from rocketkv.cli import generate as generate_cli
from rocketkv.compression import METHODS
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError

# every method whose caches can be built from a shared prefill, at a budget that evicts part
# of a 300-token document on stories260K (DuoAttention needs head patterns: test_eviction)
EVICTING = [("snapkv", 96), ("snapkv_pp", 64), ("rocketkv", 64), ("h2o", 64),
            ("streamingllm", 64), ("quest", 64), ("hybrid", 64), ("exact_topk", 64)]


@pytest.fixture(scope="module")
def engine(stories_model, stories_dir):
    return rocketkv.Engine(stories_model, load_tokenizer(stories_dir))


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOC, QUESTIONS = _ids(300, 0), [_ids(12, 1), _ids(20, 2)]


@pytest.mark.parametrize("method,budget", EVICTING)
def test_each_answer_is_the_single_runs(engine, method, budget):
    """Token for token the answer of one run of document + question, for every question in
    turn; the document is prefilled once, the questions after it."""
    doc = engine.prefill_document(DOC, method=method, budget=budget, reserve_tokens=64)
    assert doc.question_aware and doc.note is None and doc.snapshot_bytes == 0
    for q in QUESTIONS:
        single = engine.generate(DOC + q, method=method, budget=budget, max_new_tokens=16,
                                 stop_ids=())
        answer = doc.ask(q, max_new_tokens=16, stop_ids=())
        assert answer.tokens == single.tokens, (method, q)
        assert answer.metrics["method_params"] == single.metrics["method_params"]
        assert answer.metrics["question_tokens"] == len(q)
        assert answer.metrics["document_prefill_s"] == doc.prefill_s


def test_an_evicting_method_answers_differently_question_agnostic(engine):
    """The reason for the mode: SnapKV++ compressing the document before the question gives
    another answer than the single run on this prompt (it would not if the check above could
    not fail)."""
    single = engine.generate(DOC + QUESTIONS[0], method="snapkv_pp", budget=64,
                             max_new_tokens=16, stop_ids=())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agnostic = engine.prefill_document(DOC, method="snapkv_pp", budget=64,
                                           reserve_tokens=64, question_aware=False)
    assert not agnostic.question_aware and agnostic.note is not None
    assert agnostic.ask(QUESTIONS[0], max_new_tokens=16, stop_ids=()).tokens != single.tokens


def test_the_document_is_prefilled_once(engine, prefill_starts):
    starts = prefill_starts
    doc = engine.prefill_document(DOC, method="rocketkv", budget=64, reserve_tokens=64)
    for q in QUESTIONS:
        doc.ask(q, max_new_tokens=4)
    assert starts == [(0, 300), (300, 12), (300, 20)]


def test_the_default_follows_the_method(engine):
    """Question-aware when the budget compresses and the caches can be built from a shared
    prefill; KeyDiff (its own blocks) and an uncompressed run stay question-agnostic, and
    asking KeyDiff for it is refused before any prefill."""
    assert not engine.prefill_document(DOC, reserve_tokens=64).question_aware
    with pytest.warns(UserWarning, match="keydiff prefills in blocks of its own"):
        assert not engine.prefill_document(DOC, method="keydiff", budget=64,
                                           reserve_tokens=64).question_aware
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not engine.prefill_document(DOC, method="rocketkv", budget=4000,
                                           reserve_tokens=64).question_aware
    assert not METHODS["keydiff"].shared_prefill
    with pytest.raises(ConfigError, match="keydiff prefills the prompt in blocks"):
        engine.prefill_document(DOC, method="keydiff", budget=64, reserve_tokens=64,
                                question_aware=True)
    doc = engine.prefill_document(DOC, method="full", reserve_tokens=64, question_aware=True)
    assert doc.question_aware and doc.held_bytes == doc.metrics["document_kv_bytes"] > 0


def test_it_holds_the_documents_kv_and_outlives_other_runs(engine, stories_model):
    """Its bytes are the recorded K/V (and queries); a later ``generate`` does not stop it
    from answering (it keeps its own K/V), and the answer is unchanged."""
    doc = engine.prefill_document(DOC, method="snapkv", budget=96, reserve_tokens=64)
    a = stories_model.args
    kv = 2 * a.n_layers * a.n_kv_heads * 300 * a.head_dim * 4  # float32
    assert kv < doc.held_bytes == doc.metrics["document_kv_bytes"] < 2 * kv
    first = doc.ask(QUESTIONS[0], max_new_tokens=8, stop_ids=())
    engine.generate(_ids(50, 9), max_new_tokens=4)
    assert doc.ask(QUESTIONS[0], max_new_tokens=8, stop_ids=()).tokens == first.tokens
    with pytest.raises(ConfigError, match="room the model's context leaves"):
        doc.ask(QUESTIONS[0], max_new_tokens=300)


def test_questions_cli_is_question_aware_unless_told(stories_dir, tmp_path, capsys):
    (tmp_path / "q.txt").write_text("Who was Lily?\nWhere did she play?\n")
    doc = "Once upon a time, there was a little girl named Lily. She played in the park. " * 10
    (tmp_path / "doc.txt").write_text(doc)
    base = ["--checkpoint", str(stories_dir), "--prompt", str(tmp_path / "doc.txt"),
            "--questions", str(tmp_path / "q.txt"), "--method", "snapkv_pp", "--budget", "64",
            "--max-new-tokens", "8", "--no-stream", "--ignore-eos"]
    assert generate_cli.main([*base, "--json", str(tmp_path / "a.json")]) == 0
    err = capsys.readouterr().err
    assert "question-aware: its whole K/V kept" in err and "note:" not in err
    aware = json.loads((tmp_path / "a.json").read_text())
    assert all(q["question_aware"] for q in aware["questions"])
    for q, rec in zip(["Who was Lily?", "Where did she play?"], aware["questions"]):
        one = tmp_path / "one.json"
        assert generate_cli.main(["--checkpoint", str(stories_dir), "-p",
                                  f"{doc.rstrip()}\n\n{q}", "--method", "snapkv_pp",
                                  "--budget", "64", "--max-new-tokens", "8", "--no-stream",
                                  "--ignore-eos", "--json", str(one)]) == 0
        assert json.loads(one.read_text())["token_ids"] == rec["token_ids"]
    capsys.readouterr()
    assert generate_cli.main([*base, "--question-agnostic"]) == 0
    err = capsys.readouterr().err
    assert "question-agnostic" in err and "note: snapkv_pp kept" in err
    assert generate_cli.main(["--checkpoint", str(stories_dir), "-p", "Hi",
                              "--question-agnostic"]) == 2
    assert "--question-agnostic applies to --questions" in capsys.readouterr().err


def test_the_readme_document_answers_its_question_as_a_single_run(smollm2_model):
    """The README's document (SmolLM2, 3,000 tokens of essays with one made-up fact) asked its
    question with RocketKV at 256: the single run's answer, the fact included. Compressed
    before the question (question-agnostic), RocketKV loses the fact on this prompt."""
    from conftest import SMOLLM2_GGUF, shared_file

    from rocketkv.evals.answer_length import readme_prompt

    tok = load_tokenizer(str(shared_file(SMOLLM2_GGUF)))
    engine = rocketkv.Engine(smollm2_model, tok)
    document, question = readme_prompt(tok).rstrip().rsplit("\n\n", 1)
    single = engine.generate(f"{document.rstrip()}\n\n{question}", method="rocketkv",
                             budget=256, max_new_tokens=24)
    assert "1679215" in single.text
    doc = engine.prefill_document(document, method="rocketkv", budget=256, reserve_tokens=64)
    assert doc.question_aware
    answer = doc.ask(question, max_new_tokens=24)
    assert answer.tokens == single.tokens and "1679215" in answer.text
