"""scripts/predict_memory.py: the allocation tracker and the predicted prefill footprint."""

import json

import pytest
import torch
import torch.nn.functional as F

from rocketkv.engine.memory_model import AllocationTracker, predict
from rocketkv.model import ModelArgs
from scripts.predict_memory import main


def test_tracker_counts_live_storages_once():
    resident = torch.zeros(1000)
    with AllocationTracker({resident.untyped_storage()._cdata}) as tr:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:20]  # same storage: nothing new
        a.add_(1)  # in place: nothing new
        b = a * 2  # 4000 more
        resident[:5] + 0  # 20 bytes, freed at once; the resident view itself is not counted
        assert (tr.live, tr.peak) == (8000, 8020)
        del a, b  # the view keeps a's storage alive
        assert tr.live == 4000
        del view
        assert tr.live == 0
        c = torch.empty(3000)
        assert tr.peak == 12000
        del c
        tr.reset_peak()
        out = F.scaled_dot_product_attention(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 5, 4),
                                             torch.ones(1, 2, 5, 6))
        assert out.shape == (1, 2, 3, 6)
        # inputs (96 + 160 + 240 bytes) and the output (144): no (3 x 5) score matrix
        assert (tr.live, tr.peak) == (144, 96 + 160 + 240 + 144)


ARGS = ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, intermediate_size=512,
                 vocab_size=1000, max_seq_len=1 << 17, name="tiny-long")


WIDE = ModelArgs(dim=1024, n_layers=2, n_heads=8, n_kv_heads=2, intermediate_size=2048,
                 vocab_size=1000, max_seq_len=1 << 17, name="wide")


@pytest.mark.parametrize("method,budget", [("full", None), ("rocketkv", 256)])
def test_prefill_holds_only_hidden_states_and_one_layer_of_kv_per_prompt_token(method, budget):
    """Per extra prompt token, prefill's peak grows by the hidden state (bf16) plus, for an
    evicting cache, one layer's uncompressed K and V: no whole-prompt queries, attention
    output or scores (the previous prefill grew by 5120 and 9092 bytes per token here)."""
    small = predict(WIDE, method, budget, 16384, 16)["prefill_activation_peak_bytes"]
    large = predict(WIDE, method, budget, 32768, 16)["prefill_activation_peak_bytes"]
    hidden = 2 * WIDE.dim
    layer_kv = 2 * 2 * WIDE.n_kv_heads * WIDE.head_dim
    assert (large - small) / 16384 == hidden + (layer_kv if method == "rocketkv" else 0)


def test_full_cache_is_written_in_place_and_resident_bytes_add_up():
    r = predict(ARGS, "full", None, 8192, 16, dtype=torch.bfloat16)
    kv = 2 * ARGS.n_layers * ARGS.n_kv_heads * (8192 + 16) * ARGS.head_dim * 2
    assert r["kv_cache_bytes"] == kv
    rope = ARGS.max_seq_len * ARGS.head_dim // 2 * 2 * 4  # the table covers the whole context
    assert r["resident_bytes"] == r["weight_bytes"] + kv + rope
    # the full cache takes the prompt's K/V straight into its storage; an evicting cache
    # needs one layer's uncompressed K/V beside it
    evicting = predict(ARGS, "snapkv_pp", 1024, 8192, 16, dtype=torch.bfloat16)
    layer_kv = 2 * 8192 * ARGS.n_kv_heads * ARGS.head_dim * 2
    assert evicting["prefill_activation_peak_bytes"] - r["prefill_activation_peak_bytes"] \
        >= layer_kv
    # the dense baseline's shared (max_seq x max_seq) bool mask is resident too
    dense = predict(ARGS, "gptfast_dense", None, 8192, 16, dtype=torch.bfloat16)
    assert dense["resident_bytes"] - r["resident_bytes"] == (8192 + 16) ** 2
    assert r["peak_memory_bytes"]["total"] == max(r["peak_memory_bytes"]["prefill"],
                                                  r["peak_memory_bytes"]["decode"])


def test_cli_writes_rows(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--config", "stories260K", "--context", "400", "--methods", "full",
                 "rocketkv", "snapkv", "--budgets", "64", "--max-new-tokens", "8",
                 "--json", str(out)]) == 1  # a requested row (snapkv at 64) failed
    rows = json.loads(out.read_text())  # the rest are written all the same
    assert [r["method"] for r in rows] == ["full", "rocketkv", "snapkv"]
    assert all(r["predicted"] and r["device"] == "meta" for r in rows)
    assert "smallest valid budget" in rows[2]["error"]
    printed = capsys.readouterr()
    assert "not measured on a GPU" in printed.out and "1 of 3 configurations failed" in printed.err
    assert main(["--model", "stories260K", "--methods", "magic"]) == 2  # the old spelling
    assert "note: --model is deprecated; use --config" in capsys.readouterr().err
