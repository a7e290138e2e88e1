"""Loaders and the convert/download scripts."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, STORIES_BIN, TOK512, shared_file

from checkpoint import hf_to_meta_rope_rows, load_model, meta_to_hf_rope_rows
from scripts.convert_llama2c import read_llama2c


def test_rope_row_permutation_round_trip():
    w = torch.randn(4 * 8, 5)
    assert torch.equal(meta_to_hf_rope_rows(hf_to_meta_rope_rows(w, 4), 4), w)
    # Meta pairs (0, 1) of head 0 come from HF rows 0 and 4 (first and second halves)
    assert torch.equal(hf_to_meta_rope_rows(w, 4)[:2], w[[0, 4]])


def test_llama2c_reader_matches_the_file_layout():
    path = shared_file(STORIES_BIN)
    args, sd = read_llama2c(path)
    raw = torch.frombuffer(bytearray(path.read_bytes()[28:]), dtype=torch.float32)
    V, D = args.vocab_size, args.dim
    assert torch.equal(sd["tok_embeddings.weight"].flatten(), raw[:V * D])
    # attention_norm of layer 0 follows the embedding
    assert torch.equal(sd["layers.0.attention_norm.weight"], raw[V * D:V * D + D])
    assert args.tie_word_embeddings and args.n_kv_heads == 4


def test_llama2c_reader_rejects_truncated_file(tmp_path):
    from model import ConfigError

    bad = tmp_path / "bad.bin"
    bad.write_bytes(shared_file(STORIES_BIN).read_bytes()[:5000])
    with pytest.raises(ConfigError, match="header implies"):
        read_llama2c(bad)


def test_convert_hf_checkpoint_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.model").write_bytes(shared_file(TOK512).read_bytes())
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_hf_checkpoint.py"),
                        "--checkpoint", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert {f.name for f in (tmp_path / "ours").iterdir()} == {
        "model_args.json", "model.safetensors", "tokenizer.model"}
    a = load_model(str(tmp_path / "hf"), "cpu", torch.float32)
    b = load_model(str(tmp_path / "ours"), "cpu", torch.float32)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    # the converted directory runs through the CLI
    p = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--checkpoint",
                        str(tmp_path / "ours"), "--prompt", "-", "--max-new-tokens", "3"],
                       input="Hello", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_download_offline_fails_clearly(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "download.py"), "--repo-id",
                        "meta-llama/Llama-3.1-8B-Instruct", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1
    assert "Traceback" not in p.stderr
