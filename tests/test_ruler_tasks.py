"""evals/ruler.py's tasks: determinism, context length with SmolLM2's tokenizer, expected
outputs in the context, needle depth, scoring (evals/metrics.py) and errors."""

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter

import pytest
from conftest import ESSAYS, ROOT, SMOLLM2_GGUF, shared_file

from rocketkv.evals.metrics import string_match_all, string_match_part
from rocketkv.evals.prompts import read_texts
from rocketkv.evals.ruler import TASKS, Sample, load_essays, make_sample, tolerance

NIAH = ("niah_single_noise", "niah_single_essay", "niah_single_uuid", "niah_multikey",
        "niah_multivalue", "niah_multiquery")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def cheap(text: str) -> int:
    return len(text) // 4


@pytest.fixture(scope="module")
def essays() -> str:
    text = load_essays(shared_file(ESSAYS))
    assert text == "\n\n".join(t.strip() for t in read_texts([str(ESSAYS)]))
    return text


@pytest.fixture(scope="module")
def smollm2_count():
    from rocketkv.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(shared_file(SMOLLM2_GGUF))
    return lambda text: len(tok.encode(text, bos=False))


def needle_start(sample: Sample) -> int:
    """Character offset of the first needle (in the context) whose value is expected."""
    if sample.task == "vt":
        return sample.context.index(f"VAR {sample.outputs[0]} = ")
    return min(sample.context.rindex("One of the special magic", 0, sample.context.index(v))
               for v in sample.outputs)


def test_task_names():
    assert TASKS == ("niah_single_noise", "niah_single_essay", "niah_single_uuid",
                     "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_sample_other_seed_other_sample(task, essays):
    random.seed(1)  # the global generator plays no part
    a = make_sample(task, 1500, cheap, 7, essays)
    random.seed(2)
    b = make_sample(task, 1500, cheap, 7, essays)
    c = make_sample(task, 1500, cheap, 8, essays)
    assert a == b
    assert a.context != c.context and a.outputs != c.outputs
    assert a.task == task and a.max_new_tokens > 0


def test_same_sample_in_another_process(essays):
    """No dependence on Python's per-process string hashing."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]);"
            "from rocketkv.evals.ruler import TASKS, make_sample, load_essays;"
            "e = load_essays(sys.argv[2]);"
            "print(json.dumps([repr(make_sample(t, 800, lambda s: len(s) // 4, 3, e))"
            " for t in TASKS]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    p = subprocess.run([sys.executable, "-c", code, str(ROOT), str(ESSAYS)], env=env,
                       capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(p.stdout) == [repr(make_sample(t, 800, cheap, 3, essays)) for t in TASKS]


@pytest.mark.parametrize("context_tokens", [1024, 4096])
@pytest.mark.parametrize("task", TASKS)
def test_context_length_with_smollm2_tokenizer(task, context_tokens, smollm2_count, essays):
    s = make_sample(task, context_tokens, smollm2_count, 0, essays)
    n = smollm2_count(s.context)
    assert context_tokens - max(16, context_tokens // 50) <= n <= context_tokens
    assert tolerance(context_tokens) == max(16, context_tokens // 50)
    # the expected answer fits in max_new_tokens with room to spare
    assert smollm2_count(", ".join(s.outputs)) + 8 <= s.max_new_tokens
    if s.depth is not None:  # depth is the token fraction before the needle
        assert s.depth == pytest.approx(
            smollm2_count(s.context[:needle_start(s)].rstrip()) / n, abs=0.01)


@pytest.mark.parametrize("task", NIAH)
def test_niah_needles_are_in_the_context(task, essays):
    s = make_sample(task, 3000, cheap, 5, essays)
    kind = "uuid" if task == "niah_single_uuid" else "number"
    needles = re.findall(rf"One of the special magic {kind}s for ([a-z]+-[a-z]+) is: (\S+)\.",
                         s.context)
    found = dict.fromkeys(v for _, v in needles)
    assert len(needles) == (1 if task.startswith("niah_single") else 4)
    assert all(v in found for v in s.outputs)
    asked = [k for k, v in needles if v in s.outputs]
    assert all(k in s.question and k in s.answer_prefix for k in asked)
    if task == "niah_single_uuid":
        assert UUID.match(s.outputs[0])
    else:
        assert all(re.fullmatch(r"[1-9]\d{6}", v) for v in s.outputs)
    if task == "niah_multikey":  # one asked, three distractors with other keys
        assert len(s.outputs) == 1 and len({k for k, _ in needles}) == 4
        assert sum(k in s.question for k, _ in needles) == 1
    elif task == "niah_multivalue":  # four values of one key, all expected
        assert len({k for k, _ in needles}) == 1 and len(set(s.outputs)) == 4
    elif task == "niah_multiquery":  # four keys, all asked
        assert len({k for k, _ in needles}) == 4 and len(set(s.outputs)) == 4
    assert s.answer_prefix.startswith(f"The special magic {kind}")
    noise = "The grass is green. The sky is blue." in s.context
    assert noise == (task == "niah_single_noise")


def test_vt_chain_is_in_the_context_in_order():
    s = make_sample("vt", 3000, cheap, 5)
    value = re.search(r"assigned the value (\d{5})", s.question).group(1)
    assert value in s.answer_prefix and len(s.outputs) == 5
    assert all(re.fullmatch(r"[A-Z]{5}", v) for v in s.outputs)
    chain = [f"VAR {s.outputs[0]} = {value}."]
    chain += [f"VAR {b} = VAR {a}." for a, b in zip(s.outputs, s.outputs[1:])]
    where = [s.context.index(c) for c in chain]
    assert where == sorted(where)
    assert s.context.count("VAR ") == 9  # 5 statements, 4 of them referring to another


def test_cwe_common_words_are_the_ten_most_common():
    s = make_sample("cwe", 3000, cheap, 5)
    lines = s.context.split("\n")
    assert [int(line.split(". ", 1)[0]) for line in lines] == list(range(1, len(lines) + 1))
    counts = Counter(line.split(". ", 1)[1] for line in lines)
    common = {counts[w] for w in s.outputs}
    assert len(s.outputs) == 10 and len(common) == 1  # the ten share one frequency ...
    f_common = common.pop()
    rest = [c for w, c in counts.items() if w not in s.outputs]
    assert rest and 2 * max(rest) <= f_common  # ... at least twice every other word's
    assert not any(a != b and a in b for a in s.outputs for b in counts)  # no substring hits


def test_fwe_outputs_are_the_three_most_frequent():
    s = make_sample("fwe", 3000, cheap, 5)
    counts = Counter(s.context.split(" "))
    ranked = counts.most_common()
    assert tuple(w for w, _ in ranked[:3]) == s.outputs
    assert ranked[2][1] > ranked[3][1]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts)


@pytest.mark.parametrize("task", [*NIAH, "vt"])
def test_depth_is_where_the_needle_is(task, essays):
    depths = []
    for seed in range(12):
        s = make_sample(task, 1024, cheap, seed, essays)
        before = cheap(s.context[:needle_start(s)].rstrip())
        assert s.depth == pytest.approx(before / cheap(s.context), abs=1e-9)
        depths.append(s.depth)
    if task.startswith("niah_single"):  # drawn uniformly: spread over the document
        assert min(depths) < 0.3 and max(depths) > 0.7


@pytest.mark.parametrize("task", ["cwe", "fwe"])
def test_list_tasks_have_no_depth(task):
    assert make_sample(task, 1024, cheap, 0).depth is None


def test_string_match_all_and_part():
    pred = "The special magic numbers are 1234567 and 7654321."
    assert string_match_all(pred, ["1234567", "7654321"]) == 1.0
    assert string_match_all(pred, ["1234567", "1111111"]) == 0.5
    assert string_match_all(pred, ["1234567", "1111111", "2222222", "7654321"]) == 0.5
    assert string_match_all(pred, ["1111111"]) == 0.0
    assert string_match_all("they are: ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO"]) == \
        pytest.approx(2 / 3)
    assert string_match_all("", ["x"]) == 0.0
    assert string_match_part(pred, ["1111111", "7654321"]) == 1.0
    assert string_match_part(pred, ["1111111", "2222222"]) == 0.0
    assert string_match_part("APPLE pie", ["apple"]) == 1.0
    with pytest.raises(ValueError):
        string_match_all(pred, [])


@pytest.mark.parametrize("task", TASKS)
def test_too_small_context_raises(task, essays):
    with pytest.raises(ValueError, match="too small"):
        make_sample(task, 20, cheap, 0, essays)


def test_bad_arguments_raise(essays):
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("niah", 1024, cheap, 0, essays)
    with pytest.raises(ValueError, match="positive"):
        make_sample("vt", 0, cheap, 0)
    with pytest.raises(ValueError, match="essays"):
        make_sample("niah_single_essay", 1024, cheap, 0)
    with pytest.raises(ValueError, match="no sentence"):
        make_sample("niah_multikey", 1024, cheap, 0, essays="   ")
    # tasks without an essay haystack ignore essays
    assert make_sample("fwe", 512, cheap, 0) == make_sample("fwe", 512, cheap, 0, essays)


def test_grid_items_draw_independent_facts(essays, monkeypatch):
    """Every (task, length, sample) has its own hashed seed, and no fact (key, value, name,
    word, cwe's set) occurs in two prompts of a grid: a sample repeating one is redrawn."""
    from rocketkv.evals import ruler
    from rocketkv.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(shared_file(SMOLLM2_GGUF))
    tasks = ["niah_multikey", "vt", "fwe"]
    items = ruler.build_items(tok, essays, tasks, [400, 500], 2, seed=0)
    assert len(items) == 12 and len({it.meta["seed"] for it in items}) == 12
    facts = [f for it in items for f in it.meta["facts"]]
    assert len(facts) == len(set(facts)) == 2 * 2 * (8 + 6 + 3)
    for it in items:  # the expected values are among the facts, the seed is the documented one
        assert set(it.outputs) <= set(it.meta["facts"])
        assert it.meta["seed"] == ruler.sample_seed(it.meta["task"], it.meta["length"],
                                                    it.meta["sample"], 0, "eval")
    dev = ruler.build_items(tok, essays, ["vt"], [400], 2, seed=0, split="dev")
    assert {it.meta["seed"] for it in dev}.isdisjoint(it.meta["seed"] for it in items)
    # a draw that repeats a fact is redrawn with the next attempt's seed
    real = ruler.make_sample
    calls = []

    def repeating(task, n, count, seed, essays=None):
        calls.append(seed)
        first = ruler.sample_seed("vt", 400, 0, 0, "eval")
        return real(task, n, count, first if len(calls) == 3 else seed, essays)

    monkeypatch.setattr(ruler, "make_sample", repeating)
    again = ruler.build_items(tok, essays, ["vt"], [400], 2, seed=0)
    assert again[1].meta["seed"] == ruler.sample_seed("vt", 400, 1, 0, "eval", attempt=1)
    assert set(again[0].meta["facts"]).isdisjoint(again[1].meta["facts"])
