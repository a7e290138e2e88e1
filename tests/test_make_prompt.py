"""evals/prompts.py and scripts/make_prompt.py: sentences, token budget, needle depth, sources,
bad input."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, SHARED, shared_file

from rocketkv.evals.prompts import (
    build_document,
    chars_per_4,
    insert_at_depth,
    join_sentences,
    make_prompt,
    needle_index,
    split_sentences,
)
from scripts.make_prompt import main

ESSAYS = SHARED / "text" / "PaulGrahamEssays"
RULER = SHARED / "text" / "RULER_PaulGrahamEssays.json"
LLAMA2_TOK = SHARED / "tokenizers" / "llama2_tokenizer.model"
SCRIPT = ROOT / "scripts" / "make_prompt.py"

TEXT = ("The first sentence is here. A second one follows!  Does a third ask?\n"
        "It ends the line.The next one lost its space. Dr. Smith, e.g. the doctor, came.\n\n"
        "A heading\n\nAnd \"a quoted end.\" Then 3 more. [1] A note.")


@pytest.fixture(scope="module")
def llama2_count():
    from rocketkv.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(shared_file(LLAMA2_TOK))
    return lambda text: len(tok.encode(text, bos=False))


def test_split_sentences_keeps_text_and_finds_ends():
    s = split_sentences("  " + TEXT)
    assert "".join(s) == TEXT  # nothing lost, leading whitespace dropped
    assert [x.strip() for x in s] == [
        "The first sentence is here.", "A second one follows!", "Does a third ask?",
        "It ends the line.", "The next one lost its space.", "Dr.",
        "Smith, e.g. the doctor, came.", "A heading", 'And "a quoted end."', "Then 3 more.",
        "[1] A note."]
    assert split_sentences(" \n\t ") == []
    assert split_sentences("no end at all") == ["no end at all"]


def test_build_document_takes_whole_sentences_up_to_n():
    texts = [TEXT, "Second text. With two sentences."]
    doc = build_document(texts, 30)
    assert chars_per_4(join_sentences(doc)) <= 30
    longer = split_sentences(TEXT)[:len(doc) + 1]
    assert chars_per_4(join_sentences(longer)) > 30
    assert doc == split_sentences(TEXT)[:len(doc)]
    everything = build_document(texts, 10_000)  # short texts: all of them, in order
    assert join_sentences(everything).endswith("With two sentences.")
    assert "[1] A note.\n\nSecond text." in join_sentences(everything)  # a text ends a paragraph


def test_insert_at_depth_sentence_boundary_and_fraction():
    sentences = split_sentences(TEXT * 3)
    for depth in (0.0, 0.1, 0.37, 0.5, 0.9, 1.0):
        out = insert_at_depth(sentences, "THE NEEDLE.", depth)
        i = out.index("THE NEEDLE. ") if "THE NEEDLE. " in out else out.index(" THE NEEDLE. ")
        assert out[:i] + out[i + 1:] == sentences  # inserted between whole sentences
        assert i == needle_index(sentences, depth)
        before = sum(len(s) for s in sentences[:i])
        total = sum(len(s) for s in sentences)
        longest = max(len(s) for s in sentences)
        assert abs(before - depth * total) <= longest / 2 + 1e-9  # nearest boundary
    out = insert_at_depth(["No space after.", "Next."], "N.", 0.5, count_tokens=len)
    assert join_sentences(out) == "No space after. N. Next."


def test_make_prompt_real_tokenizer_count_and_depth(llama2_count):
    texts = [(shared_file(ESSAYS) / name).read_text() for name in
             sorted(p.name for p in ESSAYS.glob("*.txt"))[:3]]
    n = 1500
    prompt, info = make_prompt(texts, n, llama2_count, depth=0.3, seed=5)
    assert info["prompt_tokens"] == llama2_count(prompt) <= n
    doc, question = prompt.split("\n\n" + info["question"])[0], info["question"]
    assert prompt.endswith("\n\n" + question)
    # one more sentence would not fit: within a sentence of N
    sentences = split_sentences("\n\n".join(t.strip() for t in texts))
    longest = max(llama2_count(s) for s in sentences[:info["sentences"] + 1])
    assert n - info["prompt_tokens"] <= longest + 2
    # the needle stands between sentences at ~30% of the document's tokens
    assert info["answer"] in info["needle"] and len(info["answer"]) == 7
    assert doc.count(info["needle"]) == 1
    pos = doc.index(info["needle"])
    assert doc[pos - 1].isspace() and doc[:pos].rstrip()[-1] in ".!?\"')]"
    frac = llama2_count(doc[:pos]) / llama2_count(doc)
    assert abs(frac - 0.3) <= longest / llama2_count(doc)
    assert abs(info["needle_depth"] - 0.3) <= longest / llama2_count(doc)


def test_make_prompt_is_deterministic_and_seeded():
    texts = [TEXT * 20]
    a = make_prompt(texts, 200, seed=7)
    assert a == make_prompt(texts, 200, seed=7)
    b = make_prompt(texts, 200, seed=8)
    assert a[1]["answer"] != b[1]["answer"]
    custom = make_prompt(texts, 200, needle="Bob owns a red kite.",
                         question="What colour is Bob's kite?", answer="red")
    assert "Bob owns a red kite." in custom[0] and custom[0].endswith("What colour is Bob's kite?")
    assert custom[1]["answer"] == "red" and custom[1]["key"] is None


def test_cli_directory_source(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "b.txt").write_text("Bravo one. Bravo two. Bravo three.")
    (d / "a.txt").write_text("Alpha one. Alpha two.")
    (d / "skip.md").write_text("Not read.")
    out, ans = tmp_path / "p.txt", tmp_path / "a.json"
    assert main(["--text", str(d), "--context", "1000", "--prompt-out", str(out),
                 "--answer-json", str(ans), "--depth", "1"]) == 0
    text = out.read_text()
    info = json.loads(ans.read_text())
    assert text.index("Alpha one.") < text.index("Bravo one.") and "Not read" not in text
    assert text.endswith(info["question"] + "\n")
    assert f"Bravo three.\n\n{info['needle']}\n\n{info['question']}" in text  # at the end
    assert info["text_exhausted"] and info["token_counter"] == "characters/4"
    assert info["seed"] == 0 and info["depth"] == 1.0 and info["needle_depth"] == 1.0
    assert main(["--text", str(d), "--context", "1000", "--prompt-out", str(tmp_path / "q.txt"),
                 "--depth", "1"]) == 0
    assert (tmp_path / "q.txt").read_text() == text  # deterministic


def test_cli_json_source_with_tokenizer(tmp_path, capsys):
    out, ans = tmp_path / "p.txt", tmp_path / "a.json"
    assert main(["--text", str(shared_file(RULER)), "--context", "800", "--prompt-out", str(out),
                 "--tokenizer", str(shared_file(LLAMA2_TOK)), "--answer-json", str(ans),
                 "--seed", "3"]) == 0
    info = json.loads(ans.read_text())
    assert "tokens counted with the tokenizer" in capsys.readouterr().err
    assert 700 < info["prompt_tokens"] <= 800 and not info["text_exhausted"]
    assert out.read_text().startswith("July 2010What hard liquor")
    assert info["needle"] in out.read_text()


def test_bad_input_one_error_line_exit_2(tmp_path, capsys):
    good = tmp_path / "t.txt"
    good.write_text(TEXT)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n ")
    bad_json = tmp_path / "x.json"
    bad_json.write_text('{"body": "no text field"}')
    out = tmp_path / "out.txt"
    cases = {
        "missing": ["--text", str(tmp_path / "nope.txt"), "--prompt-out", str(out)],
        "empty": ["--text", str(empty), "--prompt-out", str(out)],
        "json": ["--text", str(bad_json), "--prompt-out", str(out)],
        "depth": ["--text", str(good), "--depth", "1.5", "--prompt-out", str(out)],
        "tokens": ["--text", str(good), "--context", "0", "--prompt-out", str(out)],
        "out": ["--text", str(good), "--prompt-out", str(tmp_path / "no" / "dir" / "p.txt")],
        "outdir": ["--text", str(good), "--prompt-out", str(tmp_path)],
        "json_out": ["--text", str(good), "--prompt-out", str(out), "--answer-json",
                     str(tmp_path / "no" / "a.json")],
        "needle": ["--text", str(good), "--needle", "A fact.", "--prompt-out", str(out)],
    }
    for name, argv in cases.items():  # in-process: every case
        assert main(argv) == 2, name
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, captured.err)
        assert captured.out == ""
    # as a program (three cases, run side by side: each process imports torch)
    procs = {name: subprocess.Popen([sys.executable, str(SCRIPT), *cases[name]], text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in ("missing", "depth", "out")}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, (name, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, stderr)
        assert stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "t.txt", "x.json"]
