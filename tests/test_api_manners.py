"""The Python API's manners (``rocketkv/api.py``): errors in Python terms (types checked at the
boundary, parameter names rather than the CLI's flags), readable reprs, a text streaming
callback, chat mode from the checkpoint's template, a warning when the budget covers the whole
sequence."""

import json
import warnings

import pytest
import torch
from conftest import SMOLLM2_GGUF, shared_file

import rocketkv
from rocketkv.cli import generate as generate_cli
from rocketkv.engine import checks as run_steps
from rocketkv.engine.report import TextStreamer
from rocketkv.formats.tokenizer import load_tokenizer

PROMPT = "Once upon a time"
DOC = "The secret code is 1679215. Paris is the capital of France."


@pytest.fixture(scope="module")
def stories_engine(stories_model, stories_dir):
    return rocketkv.Engine(stories_model, load_tokenizer(stories_dir),
                           checkpoint=str(stories_dir))


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct (a GGUF with a chat template), loaded once."""
    return rocketkv.load(str(shared_file(SMOLLM2_GGUF)), device="cpu")


@pytest.fixture
def no_prefill(stories_engine, monkeypatch):
    """Fail the test if a prefill starts: the checks come first."""
    def prefill(*a, **kw):
        raise AssertionError("prefilled before the error")

    # on the instance's dict: undone, it leaves no instance attribute that would hide a
    # later test's patch of Transformer.prefill (conftest's prefill_starts)
    monkeypatch.setitem(stories_engine.model.__dict__, "prefill", prefill)
    return stories_engine


# ---- 1. errors in Python terms

TYPE_ERRORS = [
    (dict(method="rocketkv", budget="256"), "budget must be a positive int, got '256'"),
    (dict(method="rocketkv", budget=256.5), "budget must be a positive int, got 256.5"),
    (dict(method="rocketkv", budget=True), "budget must be a positive int, got True"),
    (dict(max_new_tokens="4"), "max_new_tokens must be a positive int, got '4'"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be a positive int, got 2.0"),
    (dict(temperature="0.7"), "temperature must be a number >= 0, got '0.7'"),
    (dict(top_k=5.0), "top_k must be a positive int, got 5.0"),
    (dict(top_p="0.9"), "top_p must be a number in (0, 1], got '0.9'"),
    (dict(seed="1"), "seed must be an int, got '1'"),
    (dict(method="quest", budget=64, page_size="16"), "page_size must be an int, got '16'"),
]


@pytest.mark.parametrize("kwargs,message", TYPE_ERRORS, ids=[m for _, m in TYPE_ERRORS])
def test_a_setting_of_the_wrong_type_is_a_config_error(no_prefill, kwargs, message):
    with pytest.raises(rocketkv.ConfigError) as e:
        no_prefill.generate(PROMPT, **kwargs)
    assert str(e.value) == message or str(e.value).startswith(message), str(e.value)
    assert isinstance(e.value, ValueError)


def test_a_numpy_int_budget_is_an_int(stories_engine):
    np = pytest.importorskip("numpy")
    r = stories_engine.generate(PROMPT * 20, method="rocketkv", budget=np.int64(64),
                                max_new_tokens=2, stop_ids=())
    assert r.metrics["budget"] == 64 and type(r.metrics["budget"]) is int


# (call, message the API gives): no flag of the CLI in any
API_WORDS = [
    (lambda e: e.generate("   "), "the prompt is empty"),
    (lambda e: e.generate(PROMPT, system="be brief", chat=False), "system needs chat=True"),
    (lambda e: e.generate(PROMPT, max_new_tokens=0), "max_new_tokens must be positive, got 0"),
    (lambda e: e.generate(PROMPT, top_p=2.0), "top_p must lie in (0, 1], got 2.0"),
    (lambda e: e.generate(PROMPT, temperature=-1.0), "temperature must be a finite number"),
    (lambda e: e.generate(PROMPT, budget=64), "method full reads every cached token and takes "
                                              "no budget"),
    (lambda e: e.generate(PROMPT, method="rocketkv"), "method rocketkv needs budget"),
    (lambda e: e.generate(PROMPT, method="rocketkv", budget=0),
     "budget must be a positive number of tokens, got 0"),
    (lambda e: e.generate(PROMPT, method="quest", budget=64, rocket_split="sqrt"),
     "rocket_split does not apply to method quest (its options: page_size, skip_layers)"),
    (lambda e: e.generate(PROMPT, method="quest", budget=64, page_size=0),
     "page_size must be positive, got 0"),
    (lambda e: e.prefill_document("  "), "the document is empty"),
    (lambda e: e.prefill_document(PROMPT, system="be brief", chat=False),
     "system needs chat=True"),
    (lambda e: rocketkv.Engine(e.model).generate(PROMPT), "a text prompt needs a tokenizer"),
]


@pytest.mark.parametrize("call,message", API_WORDS, ids=[m for _, m in API_WORDS])
def test_errors_name_the_parameters_not_the_cli_flags(no_prefill, call, message):
    with pytest.raises(rocketkv.ConfigError) as e:
        call(no_prefill)
    assert message in str(e.value), str(e.value)
    assert "--" not in str(e.value), str(e.value)


def test_the_cli_keeps_its_flags_in_the_same_errors(stories_dir, capsys):
    for argv, message in ((["-p", "  "], "--prompt-text is empty"),
                          (["-p", PROMPT, "--max-new-tokens", "0"],
                           "--max-new-tokens must be positive"),
                          (["-p", PROMPT, "--budget", "64"], "takes no --budget")):
        assert generate_cli.main(["--checkpoint", str(stories_dir), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err


def test_a_question_too_long_for_the_reserve_names_max_new_tokens(stories_engine):
    doc = stories_engine.prefill_document(PROMPT, reserve_tokens=8)
    with pytest.raises(rocketkv.ConfigError, match="max_new_tokens 64 exceed") as e:
        doc.ask("Who?", max_new_tokens=64)
    assert "--" not in str(e.value)
    with pytest.raises(rocketkv.ConfigError, match="max_new_tokens must be a positive int"):
        doc.ask("Who?", max_new_tokens="4")
    with pytest.raises(rocketkv.ConfigError, match="reserve_tokens must be a positive int"):
        stories_engine.prefill_document(PROMPT, reserve_tokens=8.0)


# ---- 2. readable reprs

def test_reprs_are_readable(stories_engine, stories_dir):
    text = repr(stories_engine)
    assert text == (f"Engine(checkpoint={str(stories_dir)!r}, model="
                    f"{stories_engine.model.args.name!r}, device=cpu, dtype=float32, "
                    "weights=float)"), text
    r = stories_engine.generate(PROMPT, max_new_tokens=40, stop_ids=())
    text = repr(r)
    assert text.startswith(f"Result(text={r.text!r}, tokens=[{r.tokens[0]}, ")
    assert "40 ids" in text and str(r.tokens) not in text and "metrics" not in text
    assert text.endswith("stop_reason='max_new_tokens')") and len(text) < 400, text
    short = stories_engine.generate(PROMPT, max_new_tokens=3, stop_ids=())
    assert f"tokens={short.tokens}," in repr(short)  # a short answer's ids in full
    doc = stories_engine.prefill_document(PROMPT * 3, method="streamingllm", budget=12,
                                          reserve_tokens=16)
    assert repr(doc) == (f"Document(tokens={len(doc.ids)}, method='streamingllm', budget=12, "
                         "chat=False, question_aware=True, questions_asked=0)")
    doc.ask("Who?", max_new_tokens=2)
    assert repr(doc).endswith("questions_asked=1)")


# ---- 3. on_text

def test_the_text_streamer_emits_whole_characters(stories_dir):
    """tok512 spells characters outside its vocabulary as bytes: a piece ending inside a
    character waits for the next token, so every piece is whole text."""
    tok = load_tokenizer(stories_dir)
    text = "Lily said: café, naïve, 日本 and ☃!"
    ids = tok.encode(text, bos=False)
    assert len(ids) > len(text) // 2  # several byte tokens
    pieces: list[str] = []
    streamer = TextStreamer(tok, (), emit=pieces.append)
    for n in range(1, len(ids) + 1):
        streamer(torch.tensor([ids[:n]]))
    streamer.flush(tok.decode(ids))
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces) and len(pieces) > 5


def test_on_text_gets_each_new_piece_and_on_token_the_ids(stories_engine):
    pieces: list[str] = []
    ids: list[torch.Tensor] = []
    r = stories_engine.generate(PROMPT, max_new_tokens=12, stop_ids=(), on_text=pieces.append,
                                on_token=lambda t: ids.append(t.clone()))
    assert "".join(pieces) == r.text and len(pieces) > 3
    assert ids[-1].shape == (1, 12) and ids[-1][0].tolist() == r.tokens  # as documented
    doc = stories_engine.prefill_document(PROMPT * 3, reserve_tokens=32)
    pieces.clear()
    answer = doc.ask("Who was Lily?", max_new_tokens=10, stop_ids=(), on_text=pieces.append)
    assert "".join(pieces) == answer.text and len(pieces) > 3


# ---- 4. chat from the checkpoint's template

def test_chat_follows_the_checkpoints_template(smol, stories_engine, no_prefill):
    """An instruct GGUF answers a document's question (the default ``chat=False`` gave '');
    a string prompt is a user turn; ``chat=False`` forces plain text. stories260K has no
    template of its own: plain text."""
    doc = smol.prefill_document(DOC, reserve_tokens=48)
    assert "chat=True" in repr(doc)
    answer = doc.ask("What is the secret code?", max_new_tokens=10)
    assert answer.text.strip(), answer
    question = "What is the capital of France?"
    tok = smol.tokenizer
    r = smol.generate(question, max_new_tokens=2)
    assert r.metrics["prompt_token_ids"] == [tok.encode_chat(question)]
    plain = smol.generate(question, max_new_tokens=2, chat=False)
    assert plain.metrics["prompt_token_ids"] == [tok.encode(question)]
    assert smol.encode(question) == tok.encode_chat(question)
    assert stories_engine.encode(PROMPT) == stories_engine.tokenizer.encode(PROMPT)
    with pytest.raises(rocketkv.ConfigError, match="system needs chat=True"):
        no_prefill.generate(PROMPT, system="be brief")  # no template: plain, no system


def test_cli_chat_defaults_to_the_checkpoints_template(smol, stories_dir, tmp_path,
                                                       monkeypatch, capsys):
    monkeypatch.setattr(run_steps, "load_model", lambda *a, **k: smol.model)
    question, out = "What is the capital of France?", tmp_path / "r.json"
    tok = smol.tokenizer
    base = ["--checkpoint", str(shared_file(SMOLLM2_GGUF)), "-p", question,
            "--max-new-tokens", "2", "--no-stream", "--json", str(out)]
    for flags, ids in (([], tok.encode_chat(question)), (["--chat"], tok.encode_chat(question)),
                       (["--no-chat"], tok.encode(question))):
        assert generate_cli.main([*base, *flags]) == 0, capsys.readouterr().err
        assert json.loads(out.read_text())["prompt_token_ids"] == [ids], flags
    capsys.readouterr()
    assert generate_cli.main([*base, "--no-chat", "--system", "be brief"]) == 2
    assert "--system needs --chat" in capsys.readouterr().err
    monkeypatch.undo()
    # stories260K has no template of its own: plain text, as before
    s = tmp_path / "s.json"
    assert generate_cli.main(["--checkpoint", str(stories_dir), "-p", PROMPT,
                              "--max-new-tokens", "2", "--no-stream", "--json", str(s)]) == 0
    stories_tok = load_tokenizer(stories_dir)
    assert json.loads(s.read_text())["prompt_token_ids"] == [stories_tok.encode(PROMPT)]


# ---- 7. a budget that covers the whole sequence

def test_a_budget_covering_the_sequence_warns_once(stories_engine):
    with pytest.warns(UserWarning) as caught:
        r = stories_engine.generate(PROMPT, method="rocketkv", budget=100000, max_new_tokens=4,
                                    stop_ids=())
    T = len(r.metrics["prompt_token_ids"][0])
    notes = [str(w.message) for w in caught if "no compression" in str(w.message)]
    assert len(notes) == 1, notes
    assert f"all {T + 4} tokens" in notes[0] and "100000" in notes[0]
    assert caught[0].filename == __file__  # points at the caller's line
    with pytest.warns(UserWarning, match="no compression"):
        stories_engine.prefill_document(PROMPT, method="snapkv", budget=100000,
                                        reserve_tokens=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compressing run warns nothing
        stories_engine.generate(PROMPT * 20, method="rocketkv", budget=64, max_new_tokens=2)
