"""The accuracy harness (evals/harness.py, needle.py, ruler.py's items, reports.py) and its
scripts (eval_needle.py, eval_ruler.py, kept_tokens.py) on SmolLM2."""

import argparse
import hashlib
import json
import os
import subprocess

import pytest
import torch
from conftest import ESSAYS, SMOLLM2_GGUF, shared_file

from rocketkv.data import ROOT, data_dir
from rocketkv.engine.provenance import cpu_fields
from rocketkv.evals import harness as ec
from rocketkv.evals.harness import (
    Item,
    batches_of,
    chat_pieces,
    configurations,
    cpu_has_native_bf16,
    evaluate_items,
    pad_to_equal,
)
from rocketkv.evals.metrics import rouge1_recall
from rocketkv.evals.needle import Haystack, build_items, depth_grid, insert_needle, needle_fact
from rocketkv.evals.prompts import read_texts
from rocketkv.evals.reports import accuracy_table, ruler_table
from rocketkv.evals.ruler import task_rows
from rocketkv.model import ConfigError
from scripts.eval_needle import main as needle_main
from scripts.eval_ruler import main as ruler_main
from scripts.kept_tokens import main as kept_main


@pytest.fixture(scope="module")
def tok():
    from rocketkv.formats.tokenizer import load_tokenizer

    return load_tokenizer(str(shared_file(SMOLLM2_GGUF)))


@pytest.fixture(scope="module")
def hay(tok):
    return Haystack(tok, read_texts([str(shared_file(ESSAYS))]))


def test_the_data_directory_is_shared_data_unless_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.delenv("ROCKETKV_DATA", raising=False)
    assert data_dir() == ROOT.parent / "shared" / "data"
    monkeypatch.setenv("ROCKETKV_DATA", str(tmp_path))
    assert data_dir() == tmp_path


def test_rouge1_recall_by_hand():
    assert rouge1_recall("eat a sandwich in Dolores Park", "Eat a sandwich.") == 1.0
    assert rouge1_recall("a sandwich", "eat a sandwich") == pytest.approx(2 / 3)
    assert rouge1_recall("the the", "the the the cat") == 0.5  # multiplicity counts
    assert rouge1_recall("anything", "") == 0.0


def test_insert_needle_at_the_nearest_sentence_boundary():
    pieces = [[1, 2], [3, 4, 5, 6], [7, 8]]  # boundaries at 0, 2, 6, 8 tokens
    assert insert_needle(pieces, [9], 0.0) == ([9, 1, 2, 3, 4, 5, 6, 7, 8], 0.0)
    assert insert_needle(pieces, [9], 0.5) == ([1, 2, 9, 3, 4, 5, 6, 7, 8], 0.25)  # 4: tie->2
    assert insert_needle(pieces, [9], 0.7)[1] == 0.75
    assert insert_needle(pieces, [9], 1.0) == ([1, 2, 3, 4, 5, 6, 7, 8, 9], 1.0)
    assert depth_grid(3) == [0.0, 0.5, 1.0] and depth_grid(1) == [0.5]


def test_chat_pieces_frame_the_document_as_the_template_does(tok):
    head, tail = chat_pieces(tok, "What is it?", "It is")
    body = tok.encode(" Some document.", bos=False)
    rendered = tok.render_chat(" Some document.\n\nWhat is it?")
    whole = tok.encode_special(rendered + "It is")
    assert tok.decode(head + body + tail) == tok.decode(whole)  # the same text (specials too:)
    special = set(tok.special_tokens().values())
    assert [t for t in head + tail if t in special] == [t for t in whole if t in special]


def test_needle_prompts_have_the_asked_length_and_depth(tok, hay):
    depths = depth_grid(5)
    items = build_items(tok, hay, [700, 1500], depths, 2, seed=3)
    assert len(items) == 2 * 2 * 5
    assert all(it.tokens == it.meta["length"] for it in items)  # exactly, every depth
    # needle by needle over the grid (a run cut short has whole needles), a batch per length,
    # the longest first
    assert [(it.meta["needle"], it.meta["length"]) for it in items] == \
        [(j, n) for j in range(2) for n in (1500, 700) for _ in depths]
    assert [[items[i].meta["depth"] for i in b] for b in batches_of(items, 10)] == [depths] * 4
    for it in items:
        assert abs(it.meta["depth_reached"] - it.meta["depth"]) < 0.08  # a sentence or so
        needle = tok.encode(" " + needle_fact(it.meta["seed"])["needle"], bos=False)
        ids = it.doc_ids
        at = next(i for i in range(len(ids)) if ids[i:i + len(needle)] == needle)
        hay_tokens = len(ids) - it.head - len(needle)
        assert (at - it.head) / hay_tokens == pytest.approx(it.meta["depth_reached"])
        assert it.outputs[0] in tok.decode(ids)
    again = build_items(tok, hay, [700, 1500], depths, 2, seed=3)
    assert [it.doc_ids for it in again] == [it.doc_ids for it in items]
    dev = build_items(tok, hay, [700], depths, 2, seed=3, split="dev")
    assert {it.outputs for it in dev}.isdisjoint({it.outputs for it in items})


def test_needle_grid_prompts_draw_independent_facts(tok, hay, monkeypatch):
    """Every (length, needle, depth) has its own hashed seed, key, number and haystack start;
    a fact repeating a key or number of the grid is redrawn; ``region`` places depth 0 in
    the sink, depth 1 in the recent window and the interior in the middle."""
    from rocketkv.evals import needle as nd

    depths = depth_grid(4)
    items = build_items(tok, hay, [1200, 1500], depths, 3, seed=0)
    keys = [it.meta["key"] for it in items]
    numbers = [it.outputs[0] for it in items]
    assert len(set(keys)) == len(set(numbers)) == len(items) == 24
    assert len({it.meta["haystack_start"] for it in items}) > 12
    for it in items:
        m = it.meta
        assert m["seed"] == nd.needle_seed(m["length"], m["needle"], depths.index(m["depth"]))
        needle = tok.encode(" " + needle_fact(m["seed"])["needle"], bos=False)
        ids = it.doc_ids + it.question_ids
        assert ids[m["tokens_before"]:m["tokens_before"] + len(needle)] == needle
        assert m["tokens_after"] == len(ids) - m["tokens_before"] - len(needle)
        expected = {0.0: "sink", 1.0: "recent"}.get(m["depth"], "middle")
        assert m["region"] == expected
    para = build_items(tok, hay, [700], [0.5], 2, seed=0, variant="paraphrase")
    assert all("assigned" in tok.decode(it.question_ids) for it in para)
    # a repeated fact is redrawn with the next attempt's seed
    real, calls = nd.needle_fact, []

    def repeating(seed, variant="standard"):
        calls.append(seed)
        return real(nd.needle_seed(700, 0, 0) if len(calls) == 2 else seed, variant)

    monkeypatch.setattr(nd, "needle_fact", repeating)
    again = nd.build_items(tok, hay, [700], [0.2, 0.8], 1, seed=0)
    assert again[1].meta["seed"] == nd.needle_seed(700, 0, 1, attempt=1)
    assert again[0].meta["key"] != again[1].meta["key"]


def test_padding_makes_a_batch_equal_and_keeps_the_content():
    a = Item([1, 2, 10, 11], [5, 6], ("x",), {}, head=2)
    b = Item([1, 2, 10, 11, 12], [5], ("y",), {}, head=2)
    pa, pb = pad_to_equal([a, b], 0)
    assert pa.doc_ids == [1, 2, 0, 10, 11] and pa.question_ids == [5, 6]
    assert pb.doc_ids == [1, 2, 10, 11, 12] and pb.question_ids == [0, 5]


def test_question_agnostic_full_answers_like_one_prefill(smollm2_model, tok, hay):
    """The conversation-append path (document, then question as the next chunk) gives the
    full cache's answers of the single prefill; a compressing method answers either way."""
    items = build_items(tok, hay, [600], [0.2, 0.8], 1, seed=1)
    configs = configurations(["full", "snapkv_pp"], [96])
    got = evaluate_items(smollm2_model, tok, items, configs, 12, lambda a, it, capped=None: 0.0,
                         modes=["standard", "question_agnostic"], progress=False)["modes"]
    std, qa = got["standard"]["rows"], got["question_agnostic"]["rows"]
    alone = evaluate_items(smollm2_model, tok, items, configs[:1], 12,
                           lambda a, it, capped=None: 0.0,
                           modes=["question_agnostic"], progress=False)["modes"]
    assert std[0]["answers"] == qa[0]["answers"] == alone["question_agnostic"]["rows"][0][
        "answers"]
    assert all(it.outputs[0] in a for a, it in zip(std[0]["answers"], items))  # full finds it
    assert len(std[1]["answers"]) == len(qa[1]["answers"]) == 2


def test_methods_that_prefill_their_own_way_alone_skip_the_shared_prefill(smollm2_model, tok,
                                                                         hay, monkeypatch):
    """A batch of KeyDiff alone does not prefill the prompt once for nothing, and answers
    as it does beside a method that shares the prefill, in both modes."""
    items = build_items(tok, hay, [600], [0.5], 1, seed=0)
    modes = ("standard", "question_agnostic")
    both = ec.run_batch(smollm2_model, tok, items, configurations(["keydiff", "full"], [128]),
                        8, modes=modes)
    calls = []
    real = ec.prefill_once
    monkeypatch.setattr(ec, "prefill_once", lambda *a, **k: calls.append(1) or real(*a, **k))
    alone = ec.run_batch(smollm2_model, tok, items, configurations(["keydiff"], [128]), 8,
                         modes=modes)
    assert calls == []
    for mode in modes:
        assert alone[mode][("keydiff", 128)] == both[mode][("keydiff", 128)], mode
        assert isinstance(both[mode][("keydiff", 128)], list)


def test_needle_cli_quick_run_writes_json_table_and_heatmaps(tmp_path, capsys):
    argv = ["--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--out", str(tmp_path),
            "--context", "512", "--depths", "2", "--needles", "1", "--methods",
            "full", "quest", "sparq@64,96", "--budgets", "64", "--threads", "1",
            "--workers", "1", "--no-progress", "--modes", "standard"]
    rc = needle_main(argv)
    assert rc == 0
    # the same command again: the run is complete, nothing is run or rewritten
    written = (tmp_path / "needle.json").read_text()
    capsys.readouterr()
    assert needle_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert f"{tmp_path / 'needle.json'} already holds this run, complete" in err
    assert (tmp_path / "needle.json").read_text() == written
    result = json.loads((tmp_path / "needle.json").read_text())
    rows = {(r["method"], r["budget"]): r for r in result["rows"]}
    # METHOD@B1,B2: that method at its own budgets, the others at --budgets
    assert list(rows) == [("full", None), ("quest", 64), ("sparq", 64), ("sparq", 96)]
    assert result["budgets"] == [64, 96]
    rows = {m: r for (m, _), r in rows.items()}
    assert rows["full"]["score"] == 1.0 and len(rows["quest"]["scores"]) == 2
    assert (tmp_path / "needle.png").stat().st_size > 0
    assert "| quest |" in (tmp_path / "needle.md").read_text()
    assert result["batches"] == 1 and result["batches_resumed"] == 0
    assert result["unfinished"] == 0 and result["device"] == "cpu"
    assert result["dtype"] == "float32"  # generate.py's default on the CPU, native bf16 or not
    assert not (tmp_path / "needle.partial.jsonl").exists()  # removed once the results are out
    # provenance: the commit git reports, the checkpoint's sha256 and GGUF tensor types
    prov = result["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert result["commit"] == prov["commit"] == head and isinstance(prov["dirty"], bool)
    gguf = shared_file(SMOLLM2_GGUF)
    assert prov["checkpoint"]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert prov["checkpoint"]["quantization"]["tensor_types"]["Q4_1"] > 0
    assert prov["torch"] == torch.__version__
    assert prov["argv"][:2] == ["scripts/eval_needle.py", "--checkpoint"]
    # the machine: bfloat16 sums' order depends on whether the CPU has native bfloat16
    assert prov["cpu"]["native_bf16"] == cpu_has_native_bf16()
    assert prov["cpu"]["cores"] == os.cpu_count()
    # the boundary-aware score, with the old substring score beside it
    assert result["scoring"] == "first_number" and result["variant"] == "standard"
    assert rows["full"]["score_substring"] == 1.0


def test_cpu_fields_read_the_model_and_native_bf16_from_cpuinfo():
    xeon = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    epyc = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n"
    sapphire_no_bf16 = "model name\t: X\nflags\t\t: avx512f avx512_bf16x avx512_vnni\n"
    assert cpu_fields(xeon) == {"model": "Intel(R) Xeon(R) Platinum 8480+",
                                "cores": os.cpu_count(), "native_bf16": True,
                                "isa": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]}
    assert cpu_fields(epyc)["isa"] == ["avx2", "fma"]
    assert cpu_fields(sapphire_no_bf16)["isa"] == ["avx512f", "avx512_vnni"]
    assert cpu_fields(epyc)["model"] == "AMD EPYC" and not cpu_fields(epyc)["native_bf16"]
    assert not cpu_has_native_bf16(sapphire_no_bf16)  # a whole flag, not a prefix
    assert cpu_has_native_bf16("flags : amx_bf16\n") and not cpu_has_native_bf16("")


def test_load_notes_emulated_bfloat16_and_defaults_to_float32_there(monkeypatch, capsys):
    args = argparse.Namespace(threads=1, device="cpu", dtype="bfloat16", tokenizer=None,
                              checkpoint=str(shared_file(SMOLLM2_GGUF)))
    monkeypatch.setattr(ec, "cpu_has_native_bf16", lambda: False)
    model, _, _ = ec.load(args)
    assert next(model.parameters()).dtype == torch.bfloat16  # as asked, with a note
    assert "no native bfloat16" in capsys.readouterr().err
    args.dtype = None
    model, _, _ = ec.load(args)
    assert next(model.parameters()).dtype == torch.float32 and capsys.readouterr().err == ""
    monkeypatch.setattr(ec, "cpu_has_native_bf16", lambda: True)  # the same default there
    model, _, _ = ec.load(args)
    assert next(model.parameters()).dtype == torch.float32 and capsys.readouterr().err == ""


def test_kept_tokens_reports_what_each_cache_holds(tmp_path):
    rc = kept_main(["--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--out", str(tmp_path),
                    "--context", "512", "--depths", "1", "--needles", "1", "--methods",
                    "snapkv_pp", "keydiff", "quest", "--budgets", "128", "--threads", "1"])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "kept.json").read_text())["rows"]}
    T = 512
    # SnapKV++ keeps t prompt tokens (no room for new ones here), the observation window
    # among them; KeyDiff t - 1 per KV head; Quest drops nothing
    assert rows["snapkv_pp"]["overall"] == pytest.approx(100 * 128 / T)
    assert rows["snapkv_pp"]["recent"] == 100.0
    assert rows["keydiff"]["overall"] == pytest.approx(100 * 127 / T)
    assert rows["quest"]["overall"] == rows["quest"]["needle"] == 100.0
    assert "| keydiff | 128 |" in (tmp_path / "kept.md").read_text()


def test_ruler_cli_quick_run(tmp_path):
    rc = ruler_main(["--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--out", str(tmp_path),
                     "--context", "600", "--samples", "1", "--tasks", "niah_single_noise",
                     "vt", "--methods", "full", "hybrid", "--budgets", "96", "--threads", "1",
                     "--workers", "1", "--no-progress", "--modes", "question_agnostic"])
    assert rc == 0
    result = json.loads((tmp_path / "ruler_qa.json").read_text())
    full = result["rows"][0]
    assert set(full["per_task"]) == {"niah_single_noise", "vt"}
    assert full["score"] == sum(full["per_task"].values()) / 2
    assert all(abs(it["tokens"] - 600) <= 30 for it in result["items"])
    assert (tmp_path / "ruler_qa.png").exists() and (tmp_path / "ruler_qa.md").exists()
    # boundary-aware scores with the substring ones beside them, intervals in the table
    assert result["scoring"] == "boundary_f1_capped" and set(full["per_task_substring"]) == \
        {"niah_single_noise", "vt"}
    assert result["commit"] == result["provenance"]["commit"]
    full_line = (tmp_path / "ruler_qa.md").read_text().splitlines()[2]
    assert full_line.startswith("| full | - |") and full_line.count("[") == 3
    assert not (tmp_path / "ruler.partial.jsonl").exists()


def test_method_specs_give_a_method_its_own_budgets():
    names, own = ec.parse_method_specs(["full", "rocketkv@256,512", "quest", "rocketkv@1024"])
    assert names == ["full", "rocketkv", "quest"] and own == {"rocketkv": [256, 512, 1024]}
    import argparse
    args = argparse.Namespace(methods=names, method_budgets=own, budgets=[128, 256])
    configs, columns = ec.run_configurations(args)
    assert configs == [("full", None), ("rocketkv", 256), ("rocketkv", 512), ("rocketkv", 1024),
                       ("quest", 128), ("quest", 256)]
    assert columns == [128, 256, 512, 1024]
    for spec, message in [("nosuch", "unknown method 'nosuch'"), ("full@256", "takes no budget"),
                          ("quest@0", "positive"), ("quest@x", "positive"), ("quest@", "positive")]:
        with pytest.raises(ConfigError, match=message):
            ec.parse_method_specs([spec])


def test_bad_arguments_exit_2(capsys):
    assert needle_main(["--checkpoint", "x", "--budgets", "0"]) == 2
    assert "budgets" in capsys.readouterr().err
    assert ruler_main(["--checkpoint", "x", "--samples", "0"]) == 2
    assert "samples" in capsys.readouterr().err
    for main in (needle_main, ruler_main):
        assert main(["--checkpoint", "x", "--context", "-5"]) == 2
        assert capsys.readouterr().err == ("error: --context must be a positive number of "
                                           "tokens, got -5\n")


def test_a_budget_no_run_can_use_is_one_line_before_the_weights_load(capsys, monkeypatch):
    """``eval_needle.py --budgets 16`` prefilled for minutes and then died in matplotlib;
    like ``generate.py`` it now names the smallest valid budget before anything loads (the
    loader is made to fail the test); so does a length past the model's context."""
    from rocketkv.evals import harness

    def no_load(*a, **kw):
        raise AssertionError("the weights were loaded before the runs were checked")

    monkeypatch.setattr(harness, "load_model", no_load)
    gguf = str(shared_file(SMOLLM2_GGUF))
    assert needle_main(["--checkpoint", gguf, "--methods", "rocketkv", "--budgets", "16",
                        "--context", "1024", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "smallest valid budget" in err
    assert len(err.strip().splitlines()) == 1
    assert ruler_main(["--checkpoint", gguf, "--methods", "full", "--context", "8190",
                       "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "exceed the model's context (8192 tokens)" in err and len(err.splitlines()) == 1


def test_a_budget_error_fails_only_the_items_it_concerns(monkeypatch):
    """A method that rejects the budget for one group of items (a task whose long answer
    leaves t - m under the observation window) fails those items only: the row keeps the
    others' mean, marks the failed ones, and the RULER table shows n/a for that task and for
    the average (over fewer tasks it would not compare); a row fails whole only when every
    item did."""
    class Tok:
        def encode(self, text, bos=False):
            return [0]

    items = [ec.Item([1] * 4, [2], ("a",), {"task": "short", "group": 1}),
             ec.Item([1] * 4, [2], ("a",), {"task": "short", "group": 1}),
             ec.Item([1] * 6, [2], ("a",), {"task": "long", "group": 2})]

    def run_batch(model, tok, batch, configs, m, modes, options, tick):
        long = len(batch[0].doc_ids) == 6
        return {"standard": {("snapkv", 128): "budget too small" if long else ["a", "b"],
                             ("full", None): ["a"] * len(batch)}}

    monkeypatch.setattr(ec, "run_batch", run_batch)
    res = ec.evaluate_items(None, Tok(), items, [("snapkv", 128), ("full", None)], 8,
                            lambda ans, it, capped=None: float(ans == it.outputs[0]),
                            progress=False)
    snap, full = res["modes"]["standard"]["rows"]
    assert snap["score"] == 0.5 and snap["scores"] == [1.0, 0.0, None]
    assert snap["items_run"] == 2 and snap["item_errors"] == {"2": "budget too small"}
    assert accuracy_table([snap, full], [128]).splitlines()[2] == \
        "| snapkv | 50.0 [9.5, 90.5] (2/3) |"  # Wilson's 95% interval of 1/2
    assert "items_run" not in full and full["score"] == 1.0
    rows = task_rows([snap, full], items, ["short", "long"])
    assert rows[0]["per_task"] == {"short": 0.5, "long": None} and rows[0]["score"] is None
    assert ruler_table(rows, ["short", "long"]).splitlines()[2] == \
        "| snapkv | 128 | 50.0 | n/a | n/a |"

    def all_fail(model, tok, batch, configs, m, modes, options, tick):
        return {"standard": {("snapkv", 128): "budget too small"}}

    monkeypatch.setattr(ec, "run_batch", all_fail)
    row = ec.evaluate_items(None, Tok(), items, [("snapkv", 128)], 8,
                            lambda a, it, capped=None: 1.0,
                            progress=False)["modes"]["standard"]["rows"][0]
    assert row == {"method": "snapkv", "budget": 128, "error": "budget too small"}


def test_a_killed_run_resumes_from_its_saved_batches(monkeypatch, tmp_path):
    """evaluate_items(partial=...) saves each finished batch; a run with the same items and
    settings skips those batches and ends with the answers of an uninterrupted run. A line cut
    off mid-write is dropped (and rewritten), and another run's file is not reused."""
    class Tok:
        def encode(self, text, bos=False):
            return [0]

    items = [ec.Item([i % 3 + 1] * (4 + i // 2), [2], (str(i),), {}) for i in range(6)]
    configs = [("snapkv", 128), ("full", None)]
    calls = []

    def run_batch(model, tok, batch, configs, m, modes, options, tick):
        calls.append(len(batch[0].doc_ids))
        if len(calls) == limit[0]:
            raise KeyboardInterrupt  # the run is killed in its next batch
        n = len(batch[0].doc_ids)
        return {mode: {c: "budget too small" if c[1] and n == 6 else
                       [f"{mode} {c[0]} {x.outputs[0]}" for x in batch]
                       for c in configs} for mode in modes}

    def evaluate(path, configs=configs, restart=False):
        return ec.evaluate_items(None, Tok(), items, configs, 8,
                                 lambda a, it, capped=None: float(a.endswith(it.outputs[0])),
                                 modes=("standard", "question_agnostic"), batch_size=2,
                                 progress=False, partial=path, run_key=["x"],
                                 tag={"commit": "abcdef1234567890"}, restart=restart)

    monkeypatch.setattr(ec, "run_batch", run_batch)
    limit = [0]
    whole = evaluate(None)
    assert whole["batches"] == 3 and whole["batches_resumed"] == 0 and len(calls) == 3
    path = tmp_path / "needle.partial.jsonl"
    calls.clear()
    limit = [3]  # two batches finish, the third is killed
    with pytest.raises(KeyboardInterrupt):
        evaluate(path)
    assert len(path.read_text().splitlines()) == 1 + 2
    with path.open("a") as f:
        f.write('{"batch": [4, 5], "got": {"stan')  # a line cut off by the kill
    calls.clear()
    limit = [0]
    resumed = evaluate(path)
    assert calls == [6] and resumed["batches_resumed"] == 2  # only the unfinished batch ran
    assert resumed["modes"] == whole["modes"]
    assert len(path.read_text().splitlines()) == 1 + 3
    # another run's file (other settings, or other engine code): refused, nothing lost,
    # unless --restart
    saved = path.read_text()
    calls.clear()
    with pytest.raises(ConfigError, match="another run's .*--restart") as refused:
        evaluate(path, configs=[("full", None)])
    # the header keeps the settings, so the error names the one that differs (and only it)
    why = str(refused.value)
    assert 'differs: configs (saved [["snapkv", 128], ["full", null]], now [["full", null]])' \
        in why and "run_key" not in why and "items" not in why
    monkeypatch.setattr(ec, "code_digest", lambda: "other code")
    with pytest.raises(ConfigError, match="other engine code \\(saved at commit abcdef123456"):
        evaluate(path)
    assert path.read_text() == saved and not calls
    other = evaluate(path, configs=[("full", None)], restart=True)  # all batches again
    assert len(calls) == 3 and other["batches_resumed"] == 0


def test_the_resume_key_names_a_checkpoint_by_its_content(tmp_path):
    """input_identity: the same file under another path (a symlink, a copy) gives the same
    key, so a resume from another clone or spelling of the path finds its answers; another
    file under the same path gives another key; random:NAME and None are kept as they are."""
    ck = tmp_path / "model.gguf"
    ck.write_bytes(b"weights v1")
    (tmp_path / "link.gguf").symlink_to(ck)
    copy = tmp_path / "sub" / "model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(b"weights v1")
    first = ec.input_identity(str(ck))
    assert first == hashlib.sha256(b"weights v1").hexdigest()
    assert ec.input_identity(str(tmp_path / "link.gguf")) == first
    assert ec.input_identity(str(copy)) == first
    assert ec.input_identity(os.path.relpath(ck)) == first
    ck.write_bytes(b"weights v2, re-downloaded")
    assert ec.input_identity(str(ck)) == hashlib.sha256(b"weights v2, re-downloaded").hexdigest()
    assert ec.input_identity("random:tiny") == "random:tiny"
    assert ec.input_identity(None) is None


def test_a_complete_run_is_not_run_again_unless_restart(monkeypatch, tmp_path):
    """A run whose results were written (the partial file deleted) and whose result JSON
    records its fingerprint with nothing unfinished is refused before any batch; an
    unfinished result, another run's fingerprint or ``restart`` runs."""
    class Tok:
        def encode(self, text, bos=False):
            return [0]

    items = [ec.Item([1] * 4, [2], (str(i),), {}) for i in range(4)]
    calls = []

    def run_batch(model, tok, batch, configs, m, modes, options, tick):
        calls.append(len(batch))
        return {"standard": {c: [x.outputs[0] for x in batch] for c in configs}}

    monkeypatch.setattr(ec, "run_batch", run_batch)
    partial, result = tmp_path / "needle.partial.jsonl", tmp_path / "needle.json"

    def evaluate(configs=(("full", None),), restart=False):
        return ec.evaluate_items(None, Tok(), items, list(configs), 8,
                                 lambda a, it, capped=None: 1.0,
                                 batch_size=2, progress=False, partial=partial,
                                 run_key=["x"], restart=restart, complete=[result])

    first = evaluate()
    assert len(calls) == 2 and len(first["fingerprint"]) == 64
    partial.unlink()  # as report_modes does once every item ran
    result.write_text(json.dumps({"run_fingerprint": first["fingerprint"], "unfinished": 0}))
    calls.clear()
    with pytest.raises(ConfigError, match="already holds this run, complete.*--restart"):
        evaluate()
    assert not calls and not partial.exists()
    assert evaluate(configs=[("full", None), ("quest", 64)])["batches"] == 2 and calls
    partial.unlink()
    calls.clear()
    assert evaluate(restart=True)["fingerprint"] == first["fingerprint"] and len(calls) == 2
    partial.unlink()
    result.write_text(json.dumps({"run_fingerprint": first["fingerprint"], "unfinished": 2}))
    calls.clear()
    evaluate()  # the result holds an unfinished run: it runs
    assert len(calls) == 2


def test_a_stopped_run_scores_what_it_finished_and_the_same_call_finishes(monkeypatch,
                                                                             tmp_path):
    """``stop`` (--time-limit) ends a run between batches: the unfinished items have no
    score, each row's score is the finished items' mean, and the same call with the saved
    batches runs only the rest, ending as an uninterrupted run."""
    class Tok:
        def encode(self, text, bos=False):
            return [0]

    items = [ec.Item([1] * 4, [2], (str(i),), {"group": i // 2}) for i in range(6)]
    calls = []

    def run_batch(model, tok, batch, configs, m, modes, options, tick):
        calls.append(len(batch))
        return {"standard": {("full", None): [x.outputs[0] if x.outputs[0] != "1" else "?"
                                              for x in batch]}}

    monkeypatch.setattr(ec, "run_batch", run_batch)
    path = tmp_path / "needle.partial.jsonl"

    def evaluate(stop, tag=None):
        return ec.evaluate_items(None, Tok(), items, [("full", None)], 8,
                                 lambda a, it, capped=None: float(a == it.outputs[0]), batch_size=2,
                                 progress=False, partial=path, stop=stop, tag=tag)

    cut = evaluate(lambda: len(calls) == 1, tag={"commit": "aaaa"})  # stops after a batch
    row = cut["modes"]["standard"]["rows"][0]
    assert calls == [2] and cut["unfinished"] == 4
    assert row["scores"] == [1.0, 0.0, None, None, None, None]
    assert row["score"] == 0.5 and row["items_run"] == 2 and "item_errors" not in row
    assert accuracy_table([row], [128]).splitlines()[2] == "| full | 50.0 [9.5, 90.5] (2/6) |"
    none = evaluate(lambda: True)["modes"]["standard"]["rows"][0]  # nothing more ran
    assert none["score"] == 0.5 and calls == [2]
    assert cut["item_tags"] == [{"commit": "aaaa"}] * 2 + [None] * 4
    calls.clear()
    rest = evaluate(None, tag={"commit": "bbbb"})  # resumed at another commit: each item says
    assert calls == [2, 2] and rest["unfinished"] == 0 and rest["batches_resumed"] == 1
    assert rest["item_tags"] == [{"commit": "aaaa"}] * 2 + [{"commit": "bbbb"}] * 4
    row = rest["modes"]["standard"]["rows"][0]
    assert row["scores"] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0] and "items_run" not in row


def test_worker_processes_give_the_answers_of_one_process(smollm2_model, tok, hay, tmp_path):
    """``--workers 2``: batches run in two spawned processes, each loading the model as the
    script did (``resume_options``: checkpoint, device, dtype, threads shared), and end with
    the answers of one process at the same threads per process."""
    import argparse
    from functools import partial

    import torch

    items = build_items(tok, hay, [200], [0.3, 0.9], 2, seed=1)  # two batches (needles)
    configs = configurations(["full", "rocketkv"], [64])
    args = argparse.Namespace(out=str(tmp_path), time_limit=None, workers=2, threads=2,
                              checkpoint=str(shared_file(SMOLLM2_GGUF)), tokenizer=None)
    opts = ec.resume_options(args, "needle", smollm2_model, torch.device("cpu"))
    assert opts["workers"] == 2 and opts["load_worker"].args[0]["threads"] == 1
    assert opts["load_worker"].args[0]["dtype"] == "float32"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = evaluate_items(smollm2_model, tok, items, configs, 6, lambda a, it, capped=None: 0.0,
                             modes=["standard", "question_agnostic"], progress=False)
    finally:
        torch.set_num_threads(threads)
    two = evaluate_items(None, tok, items, configs, 6, lambda a, it, capped=None: 0.0,
                         modes=["standard", "question_agnostic"], progress=False,
                         workers=opts["workers"], load_worker=opts["load_worker"])
    assert one["workers"] == 1 and two["workers"] == 2 and two["batches"] == 2
    assert two["modes"] == one["modes"]
    bad = dict(opts["load_worker"].args[0], checkpoint="/nonexistent.gguf")
    with pytest.raises(Exception, match="nonexistent"):  # a worker that cannot load: raised
        evaluate_items(None, tok, items, configs, 6, lambda a, it, capped=None: 0.0, progress=False,
                       workers=2, load_worker=partial(ec._load_worker, bad))


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    """A parent killed by SIGKILL (no cleanup runs) does not leave its worker processes
    running batches: each exits within a few ORPHAN_CHECK_S of the parent's death."""
    import os
    import signal
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import functools, multiprocessing, os, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import rocketkv.evals.harness as ec\n"
        "if __name__ == '__main__':\n"
        "    ctx = multiprocessing.get_context('spawn')\n"
        "    pool = ctx.Pool(1, initializer=ec._worker_start,\n"
        "                    initargs=(functools.partial(tuple, (None, None)), None,\n"
        "                              os.getpid()))\n"
        "    print(pool.apply(os.getpid), flush=True)\n"
        "    time.sleep(600)\n")
    parent = subprocess.Popen(["python", str(script)], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    os.kill(worker, 0)  # alive
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(worker, signal.SIGKILL)
    pytest.fail("the worker outlived its parent by 15 s")
