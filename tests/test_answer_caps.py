"""Each answer's token count and capped flag (the harness's ``Answers``): recorded by
``run_batch`` from the generated tokens (per item's own cap), kept in the result rows and the
partial file, passed to a RULER score (``ruler.score_item``), and used by ``evals.rescore``
instead of its re-tokenizing approximation where a file has them. On stories260K."""

import json
import pickle

import pytest

from rocketkv.engine.generate import generate
from rocketkv.evals import harness as ec
from rocketkv.evals.harness import Answers, Item, evaluate_items, run_batch
from rocketkv.evals.ruler import score_item
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError

FULL = [("full", None)]


@pytest.fixture(scope="module")
def tok(stories_dir):
    return load_tokenizer(str(stories_dir))


class StopTok:
    """The stories tokenizer with the stop tokens a test picks (its own has only ``</s>``,
    which stories260K does not emit within a few tokens)."""

    def __init__(self, tok, stop):
        self.tok, self.chat_stop_ids = tok, tuple(stop)

    def encode(self, text, bos=False):
        return self.tok.encode(text, bos=bos)

    def decode(self, ids):
        return self.tok.decode(ids)


def _prompts(tok, n, length):
    """``n`` different prompts of exactly ``length`` tokens (stories text repeated)."""
    texts = ["Once upon a time, there was a little girl named Lily.",
             "The dog ran to the park and saw a big red ball.",
             "Tom had a toy car. He liked to play with it every day.",
             "One day, a bird flew into the garden and sang a song."]
    out = []
    for t in texts[:n]:
        ids = tok.encode(t, bos=True)
        while len(ids) < length:
            ids += tok.encode(" " + t, bos=False)
        out.append(ids[:length])
    return out


def _items(prompts, caps):
    """Items of ``prompts`` (the last 3 tokens the question), one batch (``group``), each
    with its ``max_new_tokens`` where ``caps`` gives one (None: the run's default)."""
    return [Item(p[:-3], p[-3:], ("x",), {"group": 0} if c is None else
                 {"group": 0, "max_new_tokens": c}) for p, c in zip(prompts, caps)]


def _greedy(model, prompts, n):
    """The reference: each prompt's greedy tokens, ``n`` of them (fewer at the context's
    end), with no stop token."""
    return generate(model, prompts, max_new_tokens=n)["token_ids"]


def _a_stop_token(ref, stops_in, free_of, within):
    """A token at position k < ``within`` - 1 of ``ref[stops_in]`` that is not among its
    earlier tokens nor in the first ``within`` tokens of each row of ``free_of``: (token, k)."""
    row = ref[stops_in]
    for k in range(1, within - 1):
        t = row[k]
        if t not in row[:k] and all(t not in ref[j][:within] for j in free_of):
            return t, k
    raise AssertionError("no token stops one row alone: pick other prompts")


def test_answers_are_a_list_of_texts_that_carry_tokens_and_flags():
    a = Answers(["x", "y"], [3, 8], [False, True])
    assert a == ["x", "y"] and json.dumps(a) == '["x", "y"]'
    back = pickle.loads(pickle.dumps(a))  # a worker process's batch comes back pickled
    assert back == a and back.new_tokens == [3, 8] and back.capped == [False, True]
    assert Answers(["x"]).capped == [None] and Answers(["x"]).new_tokens == [None]
    with pytest.raises(ValueError, match="token counts"):
        Answers(["x", "y"], [3], [True, False])


def test_an_answer_ended_by_its_cap_is_capped_and_one_ended_by_a_stop_token_is_not(
        stories_model, tok):
    """Two prompts, cap 8: the stop token picked occurs in the first answer's greedy tokens
    only. The first answer ends there (its stop token counted, not capped), the second runs to
    the cap (8 tokens, capped), in both modes; the texts are the greedy tokens decoded, the
    stop token left out."""
    prompts = _prompts(tok, 2, 24)
    ref = _greedy(stories_model, prompts, 8)
    assert [len(r) for r in ref] == [8, 8]
    stop, k = _a_stop_token(ref, 0, [1], 8)
    got = run_batch(stories_model, StopTok(tok, [stop]), _items(prompts, [None, None]), FULL, 8,
                    modes=("standard", "question_agnostic"))
    for mode in ("standard", "question_agnostic"):
        ans = got[mode][("full", None)]
        assert isinstance(ans, Answers), mode
        assert ans.new_tokens == [k + 1, 8] and ans.capped == [False, True], mode
        assert list(ans) == [tok.decode(ref[0][:k]), tok.decode(ref[1])], mode


def test_items_of_different_caps_in_one_batch_get_their_own_flags(stories_model, tok):
    """One batch of four items whose prompts leave 5 tokens of the model's 512-token context:
    caps 3, 8, none (the run's default, 5) and 8, the batch asking for 8. Without a stop
    token an answer holds the 5 tokens the context leaves: capped for caps 3 and 5 (they were
    reached), not for cap 8 (the context ended it). The fourth item's answer ends at a stop
    token: not capped, its length up to that token. The scores receive those flags."""
    prompts = _prompts(tok, 4, 507)
    ref = _greedy(stories_model, prompts, 8)
    assert [len(r) for r in ref] == [5] * 4  # what the context leaves
    stop, k = _a_stop_token(ref, 3, [0, 1, 2], 5)
    seen = []

    def score(answer, item, *, capped):
        seen.append((item.meta.get("max_new_tokens"), capped))
        return 1.0

    items = _items(prompts, [3, 8, None, 8])
    res = evaluate_items(stories_model, StopTok(tok, [stop]), items, FULL, 5, score,
                         batch_size=4, progress=False)
    (row,) = res["modes"]["standard"]["rows"]
    assert res["batches"] == 1
    assert row["answer_capped"] == [True, False, True, False]
    assert row["answer_tokens"] == [5, 5, 5, k + 1]
    assert row["answers"][:3] == [tok.decode(r) for r in ref[:3]]
    assert seen == [(3, True), (8, False), (None, True), (8, False)]
    assert "max_new_tokens" not in items[2].meta  # the caller's items are left as they were


def _essay_items():
    return [Item([1] * 4, [2], ("7975559",), {"task": "niah_single_essay", "group": 0}),
            Item([1] * 4, [2], ("7975559",), {"task": "niah_single_essay", "group": 0})]


class _Tok:
    def encode(self, text, bos=False):
        return [0]


def test_a_ruler_score_uses_the_recorded_flag_and_the_partial_file_keeps_it(monkeypatch,
                                                                            tmp_path):
    """The same answer " 79755" (the expected 7975559 cut after five digits) twice: recorded
    capped it is neither right nor wrong (None, out of the mean), recorded stopped it is a
    wrong number (0). A score that takes no ``capped`` scores both 0 as before. A resumed run
    reads the flags back from the partial file; a batch line saved without them (the older
    format) still loads, its answers scored as not capped."""
    calls = []

    def fake_run_batch(model, tok, batch, configs, m, modes, options, tick):
        calls.append(m)
        return {mode: {c: Answers([" 79755"] * 2, [4, 3], [True, False]) for c in configs}
                for mode in modes}

    monkeypatch.setattr(ec, "run_batch", fake_run_batch)
    items = _essay_items()

    def evaluate(score, partial=None):
        return ec.evaluate_items(None, _Tok(), items, FULL, 4, score, progress=False,
                                 partial=partial, run_key=["x"])["modes"]["standard"]["rows"][0]

    row = evaluate(score_item)
    assert row["scores"] == [None, 0.0] and row["score"] == 0.0 and row["items_run"] == 1
    assert row["answer_capped"] == [True, False] and row["answer_tokens"] == [4, 3]
    old = evaluate(lambda a, it, capped=None: score_item(a, it))  # a score ignoring the flag
    assert old["scores"] == [0.0, 0.0] and old["answer_capped"] == [True, False]

    path = tmp_path / "ruler.partial.jsonl"
    first = evaluate(score_item, path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and len(calls) == 3
    (entry,) = json.loads(lines[1])["got"]["standard"]
    assert entry == ["full", None, [" 79755"] * 2, {"new_tokens": [4, 3],
                                                    "capped": [True, False]}]
    assert evaluate(score_item, path) == first and len(calls) == 3  # resumed, not run
    line = json.loads(lines[1])
    line["got"]["standard"] = [entry[:3]]  # as saved before the flags were recorded
    path.write_text(lines[0] + "\n" + json.dumps(line) + "\n")
    resumed = evaluate(score_item, path)
    assert len(calls) == 3 and resumed["answers"] == [" 79755"] * 2
    assert resumed["answer_capped"] == [None, None] and resumed["answer_tokens"] == [None, None]
    assert resumed["scores"] == [0.0, 0.0]


def test_a_run_batch_that_records_nothing_leaves_the_flags_none(monkeypatch):
    """Plain lists of texts (a ``run_batch`` that records nothing beside them) still work:
    no flag recorded, and a score taking ``capped`` is given None (``score_item``: not
    capped)."""
    monkeypatch.setattr(ec, "run_batch", lambda model, tok, batch, configs, m, modes, options,
                        tick: {"standard": {FULL[0]: [" 79755", " 7975559."]}})
    row = ec.evaluate_items(None, _Tok(), _essay_items(), FULL, 4, score_item,
                            progress=False)["modes"]["standard"]["rows"][0]
    assert row["scores"] == [0.0, 1.0] and row["answer_capped"] == [None, None]


# --------------------------------------------------------------------------------------------
# rescore: recorded flags where the file has them


class _WordTokenizer:
    def encode(self, text, bos=True):
        return ([0] if bos else []) + [1] * len(text.split())


def _result(path, rows):
    items = [{"task": "niah_single_essay", "outputs": [v], "max_new_tokens": 4}
             for v in ("7975559", "1234567", "5555555")]
    answers = [" 79755",  # 1 word: the approximation says not capped
               " the answer is 12345",  # 4 words: the approximation says capped
               " is 5555555"]  # 2 words: not capped, right
    res = {"task": "ruler", "mode": "standard", "tasks": ["niah_single_essay"], "items": items,
           "rows": [{"method": m, "budget": b, "score": 0.0, "scores": [0.0, 0.0, 1.0],
                     "answers": answers, **extra} for m, b, extra in rows]}
    path.write_text(json.dumps(res))


def test_rescore_uses_recorded_flags_where_present_and_the_approximation_elsewhere(tmp_path):
    from rocketkv.evals.rescore import markdown, rescore_files

    path = tmp_path / "ruler.json"
    _result(path, [("full", None, {"answer_capped": [True, False, None],
                                   "answer_tokens": [4, 3, None]}),
                   ("quest", 16, {})])
    tok = _WordTokenizer()
    report = rescore_files([path], lambda text: len(tok.encode(text, bos=False)))
    full, quest = report["files"][0]["rows"]
    # recorded: 79755 capped (cut: no verdict), 12345 stopped (a wrong number);
    # approximated: " is 5555555" not capped (right)
    assert full["scores_new"] == [None, 0.0, 1.0] and full["capped_items"] == [0]
    assert (full["capped_recorded"], full["capped_approximated"]) == (2, 1)
    # no recorded flags: 79755 not capped (wrong), 12345 capped (cut: no verdict)
    assert quest["scores_new"] == [0.0, None, 1.0] and quest["capped_items"] == [1]
    assert (quest["capped_recorded"], quest["capped_approximated"]) == (0, 3)
    s = report["summary"]
    assert (s["capped_recorded"], s["capped_approximated"]) == (2, 4)
    assert "Capped flags: 2 recorded by the run, 4 approximated" in markdown(report)


def test_rescore_refuses_recorded_flags_of_the_wrong_shape(tmp_path):
    from rocketkv.evals.rescore import read_result

    for bad in ({"answer_capped": [True, False]}, {"answer_capped": ["yes", None, None]},
                {"answer_tokens": [1, 2, True]}):
        path = tmp_path / "bad.json"
        _result(path, [("full", None, bad)])
        with pytest.raises(ConfigError, match=next(iter(bad))):
            read_result(path)
