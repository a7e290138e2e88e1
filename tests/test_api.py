"""The Python API (``rocketkv.py``) and one document with many questions (``documents.py``,
``generate.py --questions``): issue 46, items 1 and 2."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ESSAYS, SMOLLM2_GGUF, shared_file

import rocketkv
from rocketkv.cli import generate as generate_cli
from rocketkv.engine import checks as run_steps
from rocketkv.engine import generate as g
from rocketkv.engine.documents import document_ids, question_ids
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    """The first Python block of the README's "Python" section."""
    section = (ROOT / "README.md").read_text().split("\n## Python\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def run_readme_example(checkpoint: Path) -> dict:
    """The README's example as written, on ``checkpoint`` (its one ``rocketkv.load`` path
    replaced) and on the CPU: its namespace."""
    code, n = re.subn(r'rocketkv\.load\("[^"]*"', f'rocketkv.load({str(checkpoint)!r}, '
                      'device="cpu"', readme_example())
    assert n == 1 and len(code.strip().splitlines()) <= 7
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    return ns


@pytest.fixture(scope="module")
def smol():
    """The README's example run on the SmolLM2 GGUF (one load for the tests below)."""
    return run_readme_example(shared_file(SMOLLM2_GGUF))


@pytest.fixture(scope="module")
def stories_engine(stories_model, stories_dir):
    return rocketkv.Engine(stories_model, load_tokenizer(stories_dir),
                           checkpoint=str(stories_dir))


def test_readme_example_runs_on_stories260K(stories_dir, capsys):
    ns = run_readme_example(stories_dir)
    result = ns["result"]
    assert isinstance(result.text, str) and result.text.strip()
    assert capsys.readouterr().out == result.text + "\n"
    assert result.tokens == result.metrics["token_ids"][0] and len(result.tokens) <= 32
    assert result.metrics["method"] == "rocketkv"


def test_readme_example_runs_on_smollm2_and_stops_at_the_end_of_the_turn(smol):
    engine, result = smol["engine"], smol["result"]
    assert "Paris" in result.text
    # the default stop: the template's end of turn ends the answer, and is not in the text
    im_end = engine.tokenizer.special_tokens()["<|im_end|>"]
    assert im_end in engine.stop_ids
    assert result.stop_reason == "eos" and result.tokens[-1] in engine.stop_ids
    assert "<|im_end|>" not in result.text and "user" not in result.text
    # without stop tokens the same run goes on past the end of the turn (the defect)
    n = len(result.tokens)
    past = engine.generate(smol["chat"], method="rocketkv", budget=256, max_new_tokens=n + 3,
                           stop_ids=())
    assert past.tokens[:n] == result.tokens and len(past.tokens) == n + 3
    assert past.stop_reason == "max_new_tokens"


def test_chat_string_equals_the_message_list(smol):
    engine = smol["engine"]
    as_text = engine.generate("What is the capital of France?", chat=True, max_new_tokens=2)
    as_messages = engine.generate(smol["chat"], max_new_tokens=2)
    assert as_text.metrics["prompt_token_ids"] == as_messages.metrics["prompt_token_ids"]
    assert as_text.tokens == as_messages.tokens


def test_a_str_prompt_is_text(stories_engine, stories_model):
    text = "Once upon a time"
    r = stories_engine.generate(text, max_new_tokens=8, stop_ids=())
    ids = stories_engine.tokenizer.encode(text)
    low = g.generate(stories_model, ids, max_new_tokens=8)
    assert r.metrics["prompt_token_ids"] == [ids] and r.tokens == low["token_ids"][0]
    assert r.text == stories_engine.tokenizer.decode(r.tokens)
    # the low-level call takes ids: text is one clear error, not torch's TypeError
    with pytest.raises(ConfigError, match="token ids, not text"):
        g.generate(stories_model, text, max_new_tokens=2)


def test_metrics_hold_every_figure_of_the_cli_json(stories_engine, stories_dir, tmp_path):
    out = tmp_path / "r.json"
    assert generate_cli.main(["--checkpoint", str(stories_dir), "-p", "Once upon a time",
                   "--max-new-tokens", "6", "--json", str(out), "--no-stream"]) == 0
    cli = json.loads(out.read_text())
    api = stories_engine.generate("Once upon a time", max_new_tokens=6,
                                  stop_ids=stories_engine.tokenizer.stop_ids)
    assert cli["provenance"]["command"]  # the file's, not a figure of the run
    assert set(cli) - {"provenance"} <= set(api.metrics)
    assert api.tokens == cli["token_ids"][0] and [api.text] == cli["text"]


ERRORS = [
    (dict(method="snapkv", budget=20, max_new_tokens=32), "smallest valid budget"),
    (dict(budget=64), "takes no budget"),
    (dict(method="magic"), "unknown method 'magic'"),
    (dict(top_p=2.0), "top_p must lie in (0, 1]"),
    (dict(max_new_tokens=0), "max_new_tokens must be positive"),
    (dict(temperature=float("nan")), "finite number"),
    (dict(method="quest", budget=64, rocket_split="sqrt"),
     "rocket_split does not apply to method quest"),
    # an unbudgeted method's options: check_options's words, the one check of them
    (dict(page_size=16), "page_size does not apply to method full (its options: none)"),
    (dict(system="be brief"), "system needs chat=True"),
]


@pytest.mark.parametrize("kwargs,message", ERRORS, ids=[e[1] for e in ERRORS])
def test_errors_have_the_cli_checks_in_python_words_before_any_prefill(
        stories_engine, monkeypatch, kwargs, message):
    """The CLI's checks, worded with the parameters' names (``python_words``)."""
    def prefill(*a, **kw):
        raise AssertionError("prefilled before the error")

    # on the instance's dict: undone, it leaves no instance attribute that would hide a
    # later test's patch of Transformer.prefill (conftest's prefill_starts)
    monkeypatch.setitem(stories_engine.model.__dict__, "prefill", prefill)
    with pytest.raises(ConfigError) as e:
        stories_engine.generate("Once upon a time", **kwargs)
    assert message in str(e.value)
    with pytest.raises(ConfigError, match="leaves no room"):
        stories_engine.generate("Once upon a time " * 200)
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        rocketkv.Engine(stories_engine.model).generate("Once upon a time")


DOC = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
       "park. " * 8)
QUESTIONS = ["Who was Lily?", "Where did she play? Tell me all about the park and what she "
             "did there"]


@pytest.mark.filterwarnings("ignore:.*before any question was seen")
@pytest.mark.parametrize("method,budget", [("streamingllm", 140), ("h2o", 140),
                                           ("keydiff", 140), ("rocketkv", 140)])
def test_each_answer_starts_from_the_document_as_the_method_left_it(stories_engine, method,
                                                                    budget):
    """Question-agnostic: the second question after the first gets the answer it gets first
    thing after a fresh prefill of the document: the first question and answer are rewound
    away, the method's state (a ring, heavy-hitter scores, evictions) included."""
    doc = stories_engine.prefill_document(DOC, method=method, budget=budget,
                                          reserve_tokens=64, question_aware=False)
    doc.ask(QUESTIONS[0], max_new_tokens=12, stop_ids=())
    second = doc.ask(QUESTIONS[1], max_new_tokens=12, stop_ids=())
    fresh = stories_engine.prefill_document(DOC, method=method, budget=budget,
                                            reserve_tokens=64, question_aware=False)
    assert fresh.ask(QUESTIONS[1], max_new_tokens=12, stop_ids=()).tokens == second.tokens
    assert second.metrics["document_prefill_s"] == doc.prefill_s
    with pytest.raises(ConfigError, match="replaced by a later"):
        doc.ask(QUESTIONS[0])  # the fresh document owns the caches now
    with pytest.raises(ConfigError, match="reserve"):
        fresh.ask(QUESTIONS[0], max_new_tokens=64)


@pytest.fixture(scope="module")
def stories_4k(stories_dir, tmp_path_factory):
    """stories260K with a 4096-token context (RoPE positions past its 512 training length:
    the text is nonsense, the arithmetic is the same), so that a 3K-token document costs
    a second of prefill."""
    d = tmp_path_factory.mktemp("stories4k")
    shutil.copytree(stories_dir, d, dirs_exist_ok=True)
    margs = json.loads((d / "model_args.json").read_text())
    (d / "model_args.json").write_text(json.dumps({**margs, "max_seq_len": 4096}))
    return d


def test_questions_cli_answers_each_as_a_separate_run_with_one_prefill(stories_4k, tmp_path,
                                                                       prefill_starts, capsys):
    essay = sorted(shared_file(Path(ESSAYS)).glob("*.txt"))[0].read_text()
    text = essay[:essay.index(". ", 5200) + 1]  # about 3000 tokens of tok512
    (tmp_path / "doc.txt").write_text(text + "\n")
    questions = ["What did the author work on?", "Where did he study?",
                 "What happened next?"]
    (tmp_path / "q.txt").write_text(f"{questions[0]}\n\n{json.dumps({'question': questions[1]})}"
                                    f"\n{questions[2]}\n")
    starts = prefill_starts
    out = tmp_path / "q.json"
    rc = generate_cli.main(["--checkpoint", str(stories_4k), "--prompt", str(tmp_path / "doc.txt"),
                 "--questions", str(tmp_path / "q.txt"), "--max-new-tokens", "8",
                 "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    doc_tokens = r["document"]["prompt_tokens"]
    assert 2800 <= doc_tokens <= 3300 and r["document_tokens"] == doc_tokens
    assert [s for s in starts if s[0] == 0] == [(0, doc_tokens)]  # one document prefill
    assert len(starts) == 4 and all(s[0] == doc_tokens for s in starts[1:])
    assert [q["question"] for q in r["questions"]] == questions
    assert r["prefill_saved_s"] == pytest.approx(2 * r["document_prefill_s"])
    captured = capsys.readouterr()
    assert captured.out.count("==> question ") == 3
    assert "prefilled once" in captured.err
    for i, (q, rec) in enumerate(zip(questions, r["questions"])):
        assert f"==> question {i + 1}: {q} <==\n{rec['text'][0]}\n" in captured.out
        one = tmp_path / f"one{i}.json"  # a separate run of the document and the question
        assert generate_cli.main(["--checkpoint", str(stories_4k), "-p", f"{text}\n\n{q}",
                       "--max-new-tokens", "8", "--json", str(one), "--no-stream"]) == 0
        sep = json.loads(one.read_text())
        assert sep["prompt_token_ids"][0] == (r["document"]["prompt_token_ids"][0]
                                              + rec["prompt_token_ids"][0])
        assert sep["token_ids"] == rec["token_ids"] and sep["text"] == rec["text"]
    assert len([s for s in starts if s[0] == 0]) == 4  # the separate runs: one prefill each


QUESTION_ERRORS = [
    (["--random-prompt", "64"], "q.txt", "--questions needs a text document"),
    (["-p", "Once upon a time"], "empty.txt", "holds no question"),
    (["-p", "Once upon a time"], "bad.txt", "line 2: a JSON line needs a \"question\""),
    (["-p", "Once upon a time", "--batch-size", "2"], "q.txt", "--batch-size must be 1"),
    (["-p", "Once upon a time", "--method", "snapkv", "--budget", "20"], "q.txt",
     "smallest valid budget"),
]


@pytest.mark.parametrize("argv,qfile,message", QUESTION_ERRORS,
                         ids=[e[2] for e in QUESTION_ERRORS])
def test_questions_errors_are_one_line_before_the_weights_load(stories_dir, tmp_path,
                                                               monkeypatch, capsys, argv,
                                                               qfile, message):
    (tmp_path / "q.txt").write_text("Who was Lily?\n")
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "bad.txt").write_text('Who?\n{"q": "no"}\n')

    def load(*a, **kw):
        raise AssertionError("the weights were loaded before the error")

    monkeypatch.setattr(run_steps, "load_model", load)
    rc = generate_cli.main(["--checkpoint", str(stories_dir), *argv, "--questions",
                 str(tmp_path / qfile)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_document_and_question_ids_are_the_whole_prompt_split(smol):
    """The ids a document and a question are fed as are those of the prompt a separate run
    gets (plain and chat), trailing white space of the document included."""

    tok = smol["engine"].tokenizer
    for doc in ("The code is 1679215. Paris is in France.", "Hello world \n"):
        for chat in (False, True):
            whole = smol["engine"].encode(doc.rstrip() + "\n\nWhat is the code?", chat=chat)
            ids = document_ids(tok, doc, chat) + question_ids(tok, " What is the code?", chat,
                                                               doc)
            assert ids == whole, (doc, chat)


def test_engine_dtype_and_device(stories_dir):
    with pytest.raises(ConfigError, match="unknown dtype"):
        rocketkv.load(str(stories_dir), device="cpu", dtype="float8")
    e = rocketkv.load(str(stories_dir), device="cpu", dtype="bfloat16")
    assert e.model.tok_embeddings.weight.dtype == torch.bfloat16 and e.load_s > 0


def test_a_document_evicted_before_its_question_says_so(stories_engine):
    """Question-agnostic, a method that evicts part of the document at its prefill chose
    without the question: ``prefill_document`` warns so (the accuracy grid's
    question-agnostic mode); one that kept every token (full, or a selecting method such as
    Quest) does not, nor does a question-aware document (the default)."""
    with pytest.warns(UserWarning, match="before any question was seen"):
        stories_engine.prefill_document(DOC, method="rocketkv", budget=140, reserve_tokens=64,
                                        question_aware=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stories_engine.prefill_document(DOC, method="full", reserve_tokens=64)
        stories_engine.prefill_document(DOC, method="quest", budget=140, reserve_tokens=64,
                                        question_aware=False)
        stories_engine.prefill_document(DOC, method="rocketkv", budget=140, reserve_tokens=64)
