"""scripts/compare_hf.py on a tiny random Llama saved by transformers: rows, greedy tokens of the
two engines agree, bad input."""

import json

import pytest
import torch

from rocketkv.evals.compare_hf import make_row
from scripts.compare_hf import main


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    out = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def test_rows_times_and_tokens_match(tiny_llama, tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = main(["--checkpoint", str(tiny_llama), "--random", "--context", "64", "100",
               "--decode-steps", "4", "--methods", "full", "rocketkv", "--budgets", "48",
               "--threads", "1", "--json", str(out), "--no-progress"])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [(r["context"], r["method"], r["budget"]) for r in rows] == [
        (64, "full", None), (64, "rocketkv", 48), (100, "full", None), (100, "rocketkv", 48)]
    for r in rows:
        assert "error" not in r, r
        assert r["device"] == "cpu" and r["threads"] == 1 and r["dtype"] == "float32"
        assert r["torch_version"] == torch.__version__ and r["transformers_version"]
        assert r["command"].startswith("python scripts/compare_hf.py --checkpoint")
        assert len(r["ours_decode_ms"]) == len(r["hf_decode_ms"]) == 4
        for key in ("ours_prefill_s", "hf_prefill_s", "ours_decode_ms_median",
                    "hf_decode_ms_median", "hf_over_ours_prefill", "hf_over_ours_decode"):
            assert r[key] > 0, key
        assert r["hf_over_ours_decode"] == pytest.approx(
            r["hf_decode_ms_median"] / r["ours_decode_ms_median"])
        assert len(r["ours_tokens"]) == len(r["hf_tokens"]) == 7  # prefill + 2 warm-up + 4
    full = [r for r in rows if r["method"] == "full"]
    assert all(r["tokens_match"] is True and r["ours_tokens"] == r["hf_tokens"] for r in full)
    assert all(r["tokens_match"] is None for r in rows if r["method"] == "rocketkv")
    assert rows[1]["method_params"] and rows[1]["kv_cache_bytes"] < rows[0]["kv_cache_bytes"]
    table = capsys.readouterr().out
    assert "| cpu | 100 | rocketkv | 48 |" in table and "| yes |" in table
    assert all("commit" in r and "dirty" in r and r["ours_gguf_weights"] == "float"
               for r in rows)
    # ours on quantized GGUF blocks: other weights than transformers', no token verdict
    row = make_row({**rows[0], "ours_gguf_weights": "quantized"}, 64, "full", None,
                   {"prefill_s": 1.0, "decode_ms": [2.0], "tokens": [1, 2]},
                   {"prefill_s": 0.5, "decode_ms": [1.0], "tokens": [1, 3], "method_params": {},
                    "kv_cache_bytes": 0, "kv_bytes_per_step": 0}, 2)
    assert row["tokens_match"] is None and row["hf_over_ours_decode"] == 2.0


@pytest.mark.parametrize("argv, message", [
    (["--context", "300"], "exceed the model's context (256 tokens)"),
    (["--context", "250"], "exceed the model's context (256 tokens)"),  # decode steps do not fit
    (["--methods", "full", "magic"], "unknown methods magic"),
    (["--decode-steps", "0"], "--decode-steps must be positive"),
])
def test_bad_input_exits_2_with_one_line(tiny_llama, capsys, argv, message):
    assert main(["--checkpoint", str(tiny_llama), "--random", "--no-progress", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert captured.out == ""


def test_missing_checkpoint_and_prompt_file(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "nope"), "--random"]) == 2
    assert capsys.readouterr().err.startswith("error: checkpoint not found")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["--checkpoint", str(tmp_path), "--prompt-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
