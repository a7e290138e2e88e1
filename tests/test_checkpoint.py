"""Loaders and the convert/download scripts."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, STORIES_BIN, TOK512, shared_file
from safetensors.torch import load_file, save_file

from rocketkv.cli.quantize import quantize_checkpoint
from rocketkv.formats.checkpoint import (
    fuse_gate_up,
    hf_to_meta_rope_rows,
    load_model,
    meta_to_hf_rope_rows,
    random_model,
    save_native,
)
from rocketkv.model import ConfigError, ModelArgs
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


def _split_gate_up(directory):
    """Rewrite a converted or quantized checkpoint in the layout written before the MLP's
    gate and up projections were fused: ``feed_forward.w1``/``w3`` tensors (and linears)."""
    sd = load_file(directory / "model.safetensors")
    for name in [n for n in sd if ".feed_forward.w13." in n]:
        t = sd.pop(name)
        gate, up = t.chunk(2, dim=1 if name.endswith("int4_scales_and_zeros") else 0)
        sd[name.replace("w13", "w1")], sd[name.replace("w13", "w3")] = gate, up
    save_file({n: t.contiguous() for n, t in sd.items()}, directory / "model.safetensors")
    config = directory / "quantization.json"
    if config.is_file():
        q = json.loads(config.read_text())
        for name in [n for n in q["linears"] if n.endswith("feed_forward.w13")]:
            mode = q["linears"].pop(name)
            q["linears"][name[:-3] + "w1"] = q["linears"][name[:-3] + "w3"] = mode
        config.write_text(json.dumps(q))
    return sd


def test_checkpoints_with_separate_gate_and_up_load_fused(tmp_path):
    """Float, int8 and int4 checkpoints that store w1 and w3 apart (HF, GGUF, older converted
    and quantized files) load into model.py's w13 = [w1; w3]: every parameter equal to the
    fused files'; a lone half, or halves in two modes, is refused in one line."""
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                     vocab_size=40, max_seq_len=32, name="t")
    model = random_model(args, "cpu", torch.float32, seed=2)
    save_native(tmp_path / "f", args, model.state_dict())
    quantize_checkpoint(str(tmp_path / "f"), "int8", None, tmp_path / "q8", progress=False)
    quantize_checkpoint(str(tmp_path / "f"), "int4", 32, tmp_path / "q4", progress=False)
    for form in ("f", "q8", "q4"):
        fused = load_model(str(tmp_path / form), "cpu", torch.float32)
        split = _split_gate_up(tmp_path / form)
        assert "layers.1.feed_forward.w3." + ("weight" if form == "f" else
                                              "int8_weight" if form == "q8" else
                                              "int4_weight") in split
        old = load_model(str(tmp_path / form), "cpu", torch.float32)
        for a, b in zip(fused.state_dict().items(), old.state_dict().items()):
            assert a[0] == b[0] and torch.equal(a[1], b[1]), (form, a[0])
    gate = model.layers[0].feed_forward.w13.weight[:96]
    with pytest.raises(ConfigError, match="lacks tensor 'layers.0.feed_forward.w3.weight'"):
        fuse_gate_up({"layers.0.feed_forward.w1.weight": gate}, 1)
    pair = {"layers.0.feed_forward.w1.weight": gate, "layers.0.feed_forward.w3.weight": gate}
    mixed = {"linears": {"layers.0.feed_forward.w1": "int8", "layers.0.feed_forward.w3": "int4"}}
    with pytest.raises(ConfigError, match="quantized differently"):
        fuse_gate_up(pair, 1, mixed)
