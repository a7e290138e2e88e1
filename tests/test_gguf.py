"""GGUF checkpoints (checkpoint.py, scripts/convert_gguf.py) against transformers' own GGUF
reader: the real SmolLM2-135M-Instruct file, synthetic files of every type gguf can write,
llama.cpp's RoPE row order, Llama 3.1's rope_freqs, short checkpoint names, and bad files."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, SMOLLM2_GGUF, shared_file

import rocketkv
from rocketkv import quantized
from rocketkv.compression import build_caches
from rocketkv.engine.measure import weight_bytes, weight_bytes_per_step, weights_label
from rocketkv.formats import checkpoint
from rocketkv.formats.checkpoint import (
    default_gguf_weights,
    hf_config,
    hf_to_meta_rope_rows,
    load_model,
    resolve_checkpoint,
)
from rocketkv.formats.gguf_reader import open_gguf, release_pages
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError, ModelArgs, rope_inv_freq
from rocketkv.quantized import GGUFEmbedding, Int4Linear, dequantize_blocks

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType


def logits_along(model, ids: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Our logits at positions n_prompt-1 .. len-1 of ``ids`` (1, S): prefill of the first
    ``n_prompt`` tokens, then teacher-forced decode steps through the cache."""
    S = ids.shape[1]
    model.setup_caches(build_caches("full", model.args, batch_size=1, prompt_len=n_prompt,
                                    max_new_tokens=S - n_prompt + 1, budget=None,
                                    dtype=torch.float32, device="cpu"), S + 1)
    with torch.no_grad():
        out = [model.prefill(ids[:, :n_prompt])[0]]
        for t in range(n_prompt, S):
            out.append(model(ids[:, t:t + 1], torch.tensor([t]))[0])
    return torch.stack(out)


# --------------------------------------------------------------------------------------------
# The real file


def test_smollm2_config_from_gguf_metadata(smollm2_model):
    a = smollm2_model.args
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim) == (30, 576, 9, 3, 64)
    assert (a.intermediate_size, a.vocab_size, a.max_seq_len) == (1536, 49152, 8192)
    assert a.rope_theta == 100000.0 and a.rope_scaling is None
    assert a.norm_eps == pytest.approx(1e-5) and a.tie_word_embeddings


def test_smollm2_logits_match_transformers(smollm2_model, hf_smollm2):
    ids = torch.randint(0, 49152, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        greedy = hf_smollm2.generate(ids, max_new_tokens=12, do_sample=False)  # (1, 312)
        ref = hf_smollm2(greedy).logits[0, 299:]  # (13, V)
    ours = logits_along(smollm2_model, greedy, 300)
    assert ref.abs().max() > 5  # real logits, not a degenerate model
    torch.testing.assert_close(ours, ref, atol=5e-4, rtol=0)
    assert torch.equal(ours[:-1].argmax(-1), greedy[0, 300:])  # the same greedy tokens


def test_gguf_stores_qk_rows_in_meta_rope_order(smollm2_model, hf_smollm2):
    # transformers un-permutes llama.cpp's rows to HF's rotate-half order; ours keep the file's
    # order, which is Meta's adjacent-pair order: hf_to_meta of transformers' rows gives ours.
    D, H, Hkv = 64, 9, 3
    attn = hf_smollm2.model.layers[3].self_attn
    wqkv = smollm2_model.layers[3].attention.wqkv.weight
    assert torch.equal(wqkv[:H * D], hf_to_meta_rope_rows(attn.q_proj.weight, H))
    assert torch.equal(wqkv[H * D:(H + Hkv) * D], hf_to_meta_rope_rows(attn.k_proj.weight, Hkv))
    assert not torch.equal(wqkv[:H * D], attn.q_proj.weight)


# --------------------------------------------------------------------------------------------
# Synthetic files


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=10000.0, rms_norm_eps=1e-6)
    return transformers.LlamaForCausalLM(cfg).eval()


def write_gguf(path, hf_model, qtype=Q.F32, arch="llama", extra_tensors=(), untie=True,
               raw_types=None):
    """A GGUF as llama.cpp's converter writes it: llama's q/k rows permuted to Meta's order;
    qwen2's left in HF's order, with its q/k/v biases (``blk.N.attn_q.bias``...) in float32.
    ``raw_types`` {name: type}: that tensor is written as zero bytes of that type."""
    cfg, sd = hf_model.config, hf_model.state_dict()
    qwen2 = arch == "qwen2"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)

    def add(name, t):
        a = t.float().numpy()
        if name in (raw_types or {}):
            block, size = gguf.GGML_QUANT_SIZES[raw_types[name]]
            raw = np.zeros((a.shape[0], a.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_types[name])
        elif a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            data = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    rope_rows = (lambda w, n: w) if qwen2 else hf_to_meta_rope_rows
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if untie:
        add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if qwen2 else ("weight",):
            add(f"blk.{i}.attn_q.{kind}", rope_rows(sd[f"{p}self_attn.q_proj.{kind}"], H))
            add(f"blk.{i}.attn_k.{kind}", rope_rows(sd[f"{p}self_attn.k_proj.{kind}"], Hkv))
            add(f"blk.{i}.attn_v.{kind}", sd[f"{p}self_attn.v_proj.{kind}"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    for name, array, raw in extra_tensors:
        if raw is None:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, array, raw_shape=array.shape, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def last_logits(model, ids):
    return logits_along(model, ids, ids.shape[1])[0]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0,
                                   Q.Q5_1], ids=lambda q: q.name)
def test_quantization_types_match_transformers(tmp_path, tiny_hf, qtype):
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", tiny_hf, qtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_model(str(path), "cpu", torch.float32)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0, -1]
        original = tiny_hf(ids).logits[0, -1]
    got = last_logits(ours, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    if qtype == Q.F32:  # lossless: the original HF model's logits
        torch.testing.assert_close(got, original, atol=1e-5, rtol=0)
    else:  # lossy, but the same model
        assert not torch.equal(got, original)
        assert (got - original).abs().max() < 0.2 * original.abs().max()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_torch_dequantization_equals_the_gguf_package_bit_for_bit(kind):
    """quantized.dequantize_blocks (torch, vectorized) against gguf.quants.dequantize (the
    package's numpy reference) on random weights quantized by the package, odd row counts and
    a 1-D tensor included."""
    import numpy as np

    rng = np.random.default_rng(0)
    for shape in [(7, 96), (3, 32), (64,)]:
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32)
        raw = gguf.quants.quantize(x, getattr(Q, kind))
        expected = gguf.quants.dequantize(raw, getattr(Q, kind))
        got = dequantize_blocks(raw, kind)
        assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape
        assert np.array_equal(got.numpy(), expected), (kind, shape)


def test_the_gguf_reader_parses_like_the_package(tmp_path, tiny_hf):
    """gguf_reader.open_gguf (the package's reader over a plain view of the mapping) gives the
    package's own fields and tensors."""
    from rocketkv.formats.gguf_reader import open_gguf

    path = write_gguf(tmp_path / "tiny.gguf", tiny_hf, Q.Q4_1)
    ours, ref = open_gguf(path), gguf.GGUFReader(path)
    assert type(ours) is not gguf.GGUFReader and isinstance(ours, gguf.GGUFReader)
    assert list(ours.fields) == list(ref.fields)
    for name, field in ref.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.data.tobytes() == b.data.tobytes(), a.name


def test_release_pages_drops_the_mapping_from_rss_and_keeps_it_readable(tmp_path, tiny_hf):
    """After the load the file's pages leave the process's resident set (Linux: RssFile of
    /proc/self/smaps_rollup drops by about the file's size); the tensors and fields still
    read the same bytes (faulted back in from the page cache)."""
    path = write_gguf(tmp_path / "pages.gguf", tiny_hf, Q.F32,
                      extra_tensors=[("pad.weight", np.ones((1 << 20,), np.float32), None)])
    reader = open_gguf(path)
    before = [t.data.tobytes() for t in reader.tensors]  # every page touched

    def rss_file_kb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))

    touched = rss_file_kb()
    assert release_pages(reader)
    assert touched - rss_file_kb() > 3 * 1024  # 4 MiB file: most of it left the RSS
    assert [t.data.tobytes() for t in reader.tensors] == before


@pytest.mark.parametrize("qtype,gguf_weights", [(Q.F32, "float"), (Q.Q4_1, "quantized")],
                         ids=["F32-float", "Q4_1-quantized"])
def test_load_model_frees_the_parsed_reader(tmp_path, tiny_hf, qtype, gguf_weights):
    """Once the weights are built the reader's parsed fields are freed (Qwen2.5-0.5B: about
    220 MiB of the run's memory): nothing keeps the reader the load used, a later open_gguf
    parses the file anew, and the model still computes the HF model's logits (F32: its float
    tensors may view the file's mapping, which must outlive the reader)."""
    import gc
    import weakref

    path = write_gguf(tmp_path / f"forget-{qtype.name}.gguf", tiny_hf, qtype)
    used = weakref.ref(open_gguf(path))  # the reader load_model gets from the cache
    m = load_model(str(path), "cpu", torch.float32, gguf_weights=gguf_weights)
    gc.collect()
    assert used() is None
    again = open_gguf(path)
    assert again is open_gguf(path) and again.fields["general.architecture"].contents() == "llama"
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        original = tiny_hf(ids).logits[0, -1]
    got = last_logits(m, ids)
    if qtype == Q.F32:
        torch.testing.assert_close(got, original, atol=1e-5, rtol=0)
    else:  # 4-bit weights: the same model, not the same logits
        assert (got - original).abs().max() < 0.2 * original.abs().max()


def test_tied_classifier_when_the_file_has_no_output_weight(tmp_path, tiny_hf):
    path = write_gguf(tmp_path / "tied.gguf", tiny_hf, untie=False)
    m = load_model(str(path), "cpu", torch.float32)
    assert m.args.tie_word_embeddings and m.output.weight is m.tok_embeddings.weight


def test_rope_freqs_tensor_is_llama31_scaling(tmp_path, tiny_hf):
    # llama.cpp carries Llama 3.1's RoPE scaling as one divisor per frequency (rope_freqs);
    # the reference frequencies come from transformers' own llama3 RoPE initialization
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                   max_position_embeddings=128, rope_theta=10000.0,
                                   rope_scaling=scaling)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    factors = (plain / ref).numpy().astype(np.float32)
    assert not np.allclose(factors, 1.0)
    path = write_gguf(tmp_path / "llama31.gguf", tiny_hf,
                      extra_tensors=[("rope_freqs.weight", factors, None)])
    args = load_model(str(path), "cpu", torch.float32).args
    assert args.rope_scaling["type"] == "freq_factors"
    torch.testing.assert_close(rope_inv_freq(args), ref.float(), rtol=1e-6, atol=0)
    # config.json cannot hold factors: the real Llama 3.1 ones map back to llama3 parameters
    real = ModelArgs.from_name("llama-3.1-8b")
    as_factors = ModelArgs(**{**real.to_dict(), "rope_scaling": {
        "type": "freq_factors",
        "factors": (rope_inv_freq(ModelArgs(**{**real.to_dict(), "rope_scaling": None}))
                    / rope_inv_freq(real)).tolist()}})
    assert hf_config(as_factors, torch.bfloat16)["rope_scaling"]["rope_type"] == "llama3"
    with pytest.raises(ConfigError, match="not Llama 3.1"):
        hf_config(args, torch.float32)  # original context 32: not Llama 3.1's factors


def test_other_architecture_is_refused(tmp_path, tiny_hf):
    path = write_gguf(tmp_path / "phi3.gguf", tiny_hf, arch="phi3")
    with pytest.raises(ConfigError, match="unsupported architecture in GGUF: 'phi3'"):
        load_model(str(path), "cpu", torch.float32)


def test_unsupported_quantization_type_is_named(tmp_path, tiny_hf):
    path = write_gguf(tmp_path / "q81.gguf", tiny_hf,
                      raw_types={"blk.1.ffn_up.weight": Q.Q8_1})
    with pytest.raises(ConfigError, match="quantization type Q8_1"):
        load_model(str(path), "cpu", torch.float32)


def cli(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *argv],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("case", ["truncated", "not_gguf", "arch"])
def test_bad_gguf_files_give_one_line_and_exit_2(tmp_path, tiny_hf, case):
    path = tmp_path / "bad.gguf"
    if case == "truncated":
        path.write_bytes(shared_file(SMOLLM2_GGUF).read_bytes()[:2_000_000])
        message = "truncated or corrupt"
    elif case == "not_gguf":
        path.write_bytes(b"PK\x03\x04 not a gguf file")
        message = "directory (HF layout or converted) or a GGUF file"
    else:
        write_gguf(path, tiny_hf, arch="gpt2")
        message = "unsupported architecture"
    p = cli("--checkpoint", str(path), "--random-prompt", "8", "--max-new-tokens", "2")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr


# --------------------------------------------------------------------------------------------
# scripts/convert_gguf.py


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from scripts.convert_gguf import main as convert

    out = tmp_path_factory.mktemp("conv") / "SmolLM2-135M-Instruct"
    assert convert(["--gguf", str(shared_file(SMOLLM2_GGUF)), "--out", str(out)]) == 0
    return out


def test_convert_gguf_writes_a_directory_transformers_loads(converted, smollm2_model,
                                                            hf_smollm2):
    assert {f.name for f in converted.iterdir()} >= {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"}
    hf_dir = transformers.AutoModelForCausalLM.from_pretrained(converted,
                                                               dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf_dir(ids).logits, hf_smollm2(ids).logits, atol=1e-5,
                                   rtol=0)
    # its tokenizer files give the GGUF tokenizer's ids, chat prompt and stop tokens
    from rocketkv.formats.tokenizer import load_tokenizer

    gguf_tok, dir_tok = load_tokenizer(shared_file(SMOLLM2_GGUF)), load_tokenizer(converted)
    text = "Numbers 2024 and 7 digits: 1234567.\n  def f(x):\n\treturn x  # café 日本 🚀"
    assert dir_tok.encode(text) == gguf_tok.encode(text)
    assert dir_tok.encode_chat(text, system="Be brief.") == gguf_tok.encode_chat(
        text, system="Be brief.")
    assert dir_tok.chat_stop_ids == gguf_tok.chat_stop_ids == (2,)
    # and our loader reads the HF directory back to exactly the GGUF's weights
    ours = load_model(str(converted), "cpu", torch.float32)
    assert ours.args.to_dict() | {"name": ""} == smollm2_model.args.to_dict() | {"name": ""}
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(),
                                  smollm2_model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_convert_gguf_refuses_a_non_empty_out_and_writes_nothing(tmp_path):
    from scripts.convert_gguf import main as convert

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert convert(["--gguf", str(shared_file(SMOLLM2_GGUF)), "--out",
                    str(tmp_path / "out")]) == 2
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert convert(["--gguf", str(bad), "--out", str(tmp_path / "new")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "out"]


# --------------------------------------------------------------------------------------------
# Short names


def test_short_names_resolve_to_local_copies(tmp_path, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    monkeypatch.setattr(checkpoint, "CHECKPOINT_DIRS", (ckpts,))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match="python scripts/download.py --repo-id "
                                          "meta-llama/Llama-3.1-8B-Instruct"):
        resolve_checkpoint("llama-3.1-8b")
    # the directory scripts/download.py writes
    (ckpts / "Llama-3.1-8B-Instruct").mkdir()
    (ckpts / "Llama-3.1-8B-Instruct" / "config.json").write_text("{}")
    assert resolve_checkpoint("llama-3.1-8b") == str(ckpts / "Llama-3.1-8B-Instruct")
    assert resolve_checkpoint("llama3.1-8b") == str(ckpts / "Llama-3.1-8B-Instruct")  # old name
    # a GGUF of the repository
    (ckpts / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(shared_file(SMOLLM2_GGUF))
    assert resolve_checkpoint("smollm2-135m").endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    # the Hugging Face cache (local files only)
    snap = tmp_path / "hub" / "models--lmsys--longchat-7b-v1.5-32k" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    assert resolve_checkpoint("longchat-7b-v1.5-32k") == str(snap)
    # paths, random: and unknown names pass through
    assert resolve_checkpoint("random:llama-3.1-8b") == "random:llama-3.1-8b"
    assert resolve_checkpoint("no-such-model") == "no-such-model"


def test_cli_short_name_without_a_local_copy(tmp_path):
    p = cli("--checkpoint", "mistral-7b-v0.2", "--random-prompt", "8", cwd=tmp_path)
    if p.returncode == 0:
        pytest.skip("this machine has a local Mistral-7B copy")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1
    assert "scripts/download.py --repo-id mistralai/Mistral-7B-Instruct-v0.2" in lines[0]


# --------------------------------------------------------------------------------------------
# gguf_weights="quantized": the GGUF's blocks kept quantized (gguf_quantized.py)


def _bf16_bound(sz: torch.Tensor) -> torch.Tensor:
    """Per group, the most that rounding a scale and a zero (float32 (G, out, 2)) to bfloat16
    moves ``(q - 8) scale + zero``: 8 |scale| 2^-8 + |zero| 2^-8 (bfloat16 keeps 8
    significant bits: its unit roundoff is 2^-8), as (out, G)."""
    return ((8 * sz[..., 0].abs() + sz[..., 1].abs()) * 2.0 ** -8).T


def _q4k_blocks(rng, n_blocks: int) -> np.ndarray:
    """Random but valid Q4_K super-blocks (ggml-common.h: f16 d, f16 dmin, 12 bytes of 6-bit
    scales and minimums, 128 bytes of 4-bit values), which gguf cannot write itself."""
    d = (rng.uniform(1e-4, 1e-2, (n_blocks, 2))).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (n_blocks, 140), dtype=np.uint8)
    return np.concatenate([d, rest], axis=1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_map_to_int4_g32_exactly(kind):
    """decode_int4's ``scale q + minimum`` is the gguf package's dequantized weight bit for
    bit; the int4 layer's ``(q - 8) scale + zero`` equals it up to float32 rounding of the
    zero, and with the scales and zeros in bfloat16 (the CPU kernels' dtype) within their
    rounding bound; the layer computes x W^T with that weight."""
    from rocketkv.formats.gguf_quantized import decode_int4, int4_stored
    from rocketkv.quantized import Int4Linear, dequantize_int4

    rng = np.random.default_rng(1)
    rows, cols = 48, 512
    if kind == "Q4_K":
        raw = _q4k_blocks(rng, rows * cols // 256).reshape(rows, -1)
    else:
        x = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 1, (rows, 1)))
        raw = gguf.quants.quantize(x.astype(np.float32), getattr(Q, kind))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, getattr(Q, kind)))
    q, scale, minimum = decode_int4(raw, kind)
    assert q.dtype == torch.uint8 and tuple(q.shape) == (rows, cols) and q.max() <= 15
    got = scale.repeat_interleave(32, 1) * q.float() + minimum.repeat_interleave(32, 1)
    assert torch.equal(got, expected)
    stored = int4_stored(q, scale, minimum)
    sz = stored["int4_scales_and_zeros"]
    w32 = dequantize_int4(stored["int4_weight"], sz, 32)
    torch.testing.assert_close(w32, expected, rtol=0, atol=1e-6 * expected.abs().max().item())
    w16 = dequantize_int4(stored["int4_weight"], sz.bfloat16().float(), 32)
    bound = _bf16_bound(sz).repeat_interleave(32, 1)
    err = (w16 - expected).abs()
    assert (err <= bound * 1.001 + 1e-7).all() and err.max() > 0  # rounded, within the bound
    layer = Int4Linear(stored["int4_weight"], sz, 32, "cpu", torch.float32)
    xin = torch.randn(2, cols, generator=torch.Generator().manual_seed(0))
    ref = xin.bfloat16().float() @ w16.T
    torch.testing.assert_close(layer(xin), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())


@pytest.fixture(scope="module")
def smollm2_quantized():
    return load_model(str(shared_file(SMOLLM2_GGUF)), "cpu", torch.float32,
                      gguf_weights="quantized")


def test_smollm2_quantized_weights_equal_the_gguf_dequantized_ones(smollm2_model):
    """On SmolLM2's file: every Q4_1 layer as int4 g32 within the bfloat16 rounding of its
    scales and zeros, the Q8_0 classifier as per-channel int8 within half its step (what it
    is: requantized), the embedding and norms unchanged; 90.5 MiB read per step with the int8
    classifier against 513 MiB dequantized."""
    from rocketkv.engine import measure
    from rocketkv.quantized import dequantize_int4, dequantize_int8

    path = str(shared_file(SMOLLM2_GGUF))
    args, sd, quant = checkpoint.read_checkpoint(path, dtype=torch.float32,
                                                 gguf_weights="quantized-int8-classifier")
    ref = dict(smollm2_model.named_parameters())
    assert quant["groupsize"] == 32 and quant["classifier"] == "int8"
    modes = set(quant["linears"].values())
    assert modes == {"int4", "int8"} and len(quant["linears"]) == 4 * args.n_layers + 1
    for name, mode in quant["linears"].items():
        if mode == "int4":
            w = ref[f"{name}.weight"]
            sz = sd[f"{name}.int4_scales_and_zeros"]
            got = dequantize_int4(sd[f"{name}.int4_weight"], sz.bfloat16().float(), 32)
            bound = _bf16_bound(sz).repeat_interleave(32, 1)
            assert ((got - w).abs() <= bound * 1.001 + 1e-7).all(), name
        else:
            assert name == "output"
            w = ref["tok_embeddings.weight"]
            s = sd["output.int8_scales"]
            got = dequantize_int8(sd["output.int8_weight"], s)
            assert ((got - w).abs() <= s[:, None] * 0.5001).all()
    for name in ("norm.weight", "layers.3.ffn_norm.weight"):
        assert torch.equal(sd[name], ref[name])
    # the int8 classifier is its own copy: the embedding keeps its Q8_0 blocks, rows exact
    assert quant["embedding"] == "Q8_0" and torch.equal(
        dequantize_blocks(sd["tok_embeddings.blocks"], "Q8_0"), ref["tok_embeddings.weight"])
    m8 = load_model(path, "cpu", torch.float32, gguf_weights="quantized-int8-classifier")
    assert measure.weight_bytes_per_step(smollm2_model) / 2**20 == pytest.approx(513.1, abs=0.1)
    assert measure.weight_bytes_per_step(m8) / 2**20 == pytest.approx(90.5, abs=0.1)


def test_smollm2_quantized_predicts_like_the_float_model(smollm2_model, smollm2_quantized):
    """Teacher-forced on 32 tokens of text after a 24-token prefill, through the decode
    step's int4 kernels: the int4 layers with the float classifier agree with the dequantized
    float model on every top-1 but one at most (measured on 64 tokens: 64 of 64, mean KL
    0.0003 nats, docs/quantization.md); the logits move (they are not the float model's)."""
    from rocketkv.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(str(shared_file(SMOLLM2_GGUF)))
    text = (ROOT / "README.md").read_text()
    ids = torch.tensor([tok.encode(text)[:56]])
    ref, got = (logits_along(m, ids, 24)[:32] for m in (smollm2_model, smollm2_quantized))
    assert smollm2_quantized.quantization["mode"] == "int4"
    assert smollm2_quantized.output.weight is smollm2_quantized.tok_embeddings.weight
    assert (ref.argmax(-1) == got.argmax(-1)).sum() >= 31
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert 0 < kl.mean() < 0.002


def test_smollm2_w8a8_stays_close_to_the_float_model(smollm2_model):
    """--gguf-weights quantized-w8a8: the int8 classifier runs on int8 activations (SmolLM2's
    layers are int4, which keep bfloat16 ones); teacher-forced as above, its logits are not the
    weight-only int8 classifier's, and stay near the float model's. The bound depends on the
    CPU: fbgemm's 8-bit activations with VNNI (measured on 64 tokens: 58/64 top-1, mean KL
    0.011 nats), 7-bit ones without (``quantized._reduce_range``; on an AVX2 EPYC, these 32
    tokens: 28/32, mean KL 0.038; docs/quantization.md)."""
    path = str(shared_file(SMOLLM2_GGUF))
    tok = load_tokenizer(path)
    ids = torch.tensor([tok.encode((ROOT / "README.md").read_text())[:56]])
    w8a8 = load_model(path, "cpu", torch.float32, gguf_weights="quantized-w8a8")
    assert weights_label(w8a8) == "int4-g32, classifier int8, int8 activations"
    assert w8a8.output.int8_activations and not hasattr(w8a8.layers[0].feed_forward.w13,
                                                        "int8_activations")
    w8 = load_model(path, "cpu", torch.float32, gguf_weights="quantized-int8-classifier")
    ref, got, weight_only = (logits_along(m, ids, 24)[:32] for m in (smollm2_model, w8a8, w8))
    assert (got - weight_only).abs().max() > 1e-3
    assert (ref.argmax(-1) == got.argmax(-1)).sum() >= 26
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert 0 < kl.mean() < (0.06 if quantized._reduce_range() else 0.03)


def test_cli_gguf_weights_quantized_generates_the_float_models_greedy_tokens(
        tmp_path, smollm2_model):
    """generate.py --gguf-weights quantized: its greedy tokens are the float model's greedy
    choices along them (teacher-forced), and the report names the int4 weights."""
    import json

    out = tmp_path / "run.json"
    p = cli("--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--gguf-weights", "quantized",
            "-p", "The capital of France is", "--max-new-tokens", "8", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "int4-g32, classifier float" in p.stderr
    r = json.loads(out.read_text())
    prompt, new = r["prompt_token_ids"][0], r["token_ids"][0]
    ids = torch.tensor([prompt + new])
    ref = logits_along(smollm2_model, ids, len(prompt))
    assert ref[:len(new)].argmax(-1).tolist() == new


@pytest.mark.parametrize("arch, qtype", [("llama", Q.Q4_0), ("qwen2", Q.Q4_1)])
def test_quantized_layers_are_the_float_loaders_weights(tmp_path, tiny_hf, arch, qtype):
    """A small file per architecture, layer 0's v projection stored as Q8_0 (a mixed q/k/v,
    as Q4_K_M files have): every layer's stored int4/int8 tensors dequantize to the float
    loader's weight of the same file (int4 exactly, up to float32 rounding of the zero; int8
    within half its step), qwen2's q/k rows permuted alike, the biases and norms as on the
    float path; and the model's logits stay close to the float model's."""
    from test_model import make_hf_model

    from rocketkv.quantized import dequantize_int4, dequantize_int8

    if arch == "qwen2":
        hf = make_hf_model(tmp_path / "hf", "Qwen2Config", dict(
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128))
    else:
        hf = tiny_hf
    raw = {"blk.0.attn_v.weight": Q.Q8_0}  # zero blocks: a v projection of zeros
    path = str(write_gguf(tmp_path / "m.gguf", hf, qtype, arch=arch, raw_types=raw))
    _, ref, _ = checkpoint.read_checkpoint(path, dtype=torch.float32)
    _, sd, quant = checkpoint.read_checkpoint(path, dtype=torch.float32,
                                              gguf_weights="quantized")
    assert quant["linears"]["layers.0.attention.wqkv"] == "int8"
    assert quant["linears"]["layers.1.attention.wqkv"] == "int4"
    assert "output" not in quant["linears"] and torch.equal(sd["output.weight"],
                                                            ref["output.weight"])
    # the untied embedding keeps its 4-bit blocks, which dequantize to the float rows exactly
    assert quant["embedding"] == qtype.name and "tok_embeddings.weight" not in sd
    assert torch.equal(dequantize_blocks(sd.pop("tok_embeddings.blocks"), qtype.name),
                       ref.pop("tok_embeddings.weight"))
    for name, mode in quant["linears"].items():
        w = ref.pop(f"{name}.weight")
        if mode == "int4":
            got = dequantize_int4(sd.pop(f"{name}.int4_weight"),
                                  sd.pop(f"{name}.int4_scales_and_zeros"), 32)
            torch.testing.assert_close(got, w, rtol=0, atol=1e-6)
        else:
            s = sd.pop(f"{name}.int8_scales")
            got = dequantize_int8(sd.pop(f"{name}.int8_weight"), s)
            assert ((got - w).abs() <= 0.5001 * s[:, None]).all(), name
    assert sd.keys() == ref.keys() and all(torch.equal(sd[n], ref[n]) for n in sd)
    ours, theirs = (load_model(path, "cpu", torch.float32, gguf_weights=g)
                    for g in ("quantized", "float"))
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    got, expected = (logits_along(m, ids, 8) for m in (ours, theirs))
    torch.testing.assert_close(got, expected, rtol=0, atol=0.03 * expected.abs().max().item())


@pytest.mark.parametrize("qtype, untie, gguf_weights, blocks", [
    (Q.Q5_0, True, "quantized", True),
    (Q.Q8_0, True, "quantized-int8-classifier", True),
    (Q.Q8_0, False, "quantized-int8-classifier", True),  # tied, but the classifier is int8
    (Q.Q8_0, False, "quantized", False),  # tied to the float classifier: one float matrix
    (Q.Q5_1, True, "quantized", False),  # a type dequantize_blocks lacks: float
], ids=["Q5_0", "Q8_0-int8-classifier", "Q8_0-tied-int8-classifier", "Q8_0-tied-float",
        "Q5_1"])
def test_gguf_embedding_gathers_the_float_rows_exactly(tmp_path, tiny_hf, monkeypatch, qtype,
                                                       untie, gguf_weights, blocks):
    """The quantized loads keep the token embedding as its GGUF blocks unless a float
    classifier shares it or torch cannot dequantize the type: its rows are the float load's
    bit for bit (dequantized 4 rows at a time here: 14 rows in 4 chunks), it costs its block
    bytes, and the step's weight bytes leave it out."""
    monkeypatch.setattr(GGUFEmbedding, "ROWS", 4)

    path = str(write_gguf(tmp_path / "e.gguf", tiny_hf, qtype, untie=untie))
    ours = load_model(path, "cpu", torch.float32, gguf_weights=gguf_weights)
    ref = load_model(path, "cpu", torch.float32)
    emb = ours.tok_embeddings
    assert isinstance(emb, GGUFEmbedding) is blocks
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    got = emb(ids)
    assert got.shape == (2, 7, 64) and got.dtype == torch.float32
    assert torch.equal(got, ref.tok_embeddings(ids))
    table = sum(p.numel() * p.element_size() for p in emb.parameters())
    assert table == (256 * 64 // 32 * gguf.GGML_QUANT_SIZES[qtype][1] if blocks
                     else 256 * 64 * 4)
    tied = getattr(ours.output, "weight", None) is getattr(emb, "weight", False)
    assert weight_bytes_per_step(ours) == weight_bytes(ours) - (0 if tied else table)
    assert ours.dtype == torch.float32 and ours.device.type == "cpu"


def test_cli_bad_gguf_weights_value_gives_one_line():
    p = cli("--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--gguf-weights", "int3",
            "--prompt-tokens", "8", "--max-new-tokens", "2")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "int3" in lines[0], p.stderr


def test_gguf_weights_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="--gguf-weights must be one of float, quantized"):
        load_model(str(shared_file(SMOLLM2_GGUF)), "cpu", torch.float32, gguf_weights="int4")
    with pytest.raises(ConfigError, match="applies to GGUF checkpoints only"):
        load_model("random:stories260K", "cpu", torch.float32, gguf_weights="quantized")


def test_gguf_weights_default_to_quantized_on_the_cpu_only():
    """generate.py and rocketkv.load keep a GGUF's blocks quantized on the CPU unless told,
    with an int8 classifier (weight-only: int8 activations stay opt-in), dequantize on CUDA
    (kernels not yet run on a GPU), and leave other checkpoints float."""
    from rocketkv.quantized import Int8Linear

    gguf = str(shared_file(SMOLLM2_GGUF))
    assert default_gguf_weights(None, gguf, "cpu") == "quantized-int8-classifier"
    assert default_gguf_weights(None, gguf, "cuda") == "float"
    assert default_gguf_weights(None, "random:stories260K", "cpu") == "float"
    assert default_gguf_weights("float", gguf, "cpu") == "float"
    engine = rocketkv.load(gguf, device="cpu")
    assert isinstance(engine.model.layers[0].feed_forward.w13, Int4Linear)
    assert isinstance(engine.model.output, Int8Linear) and not engine.model.output.int8_activations
    assert rocketkv.load(gguf, device="cpu", gguf_weights="float").model.quantization is None


def test_api_load_takes_gguf_weights():
    from rocketkv.quantized import Int4Linear, Int8Linear

    engine = rocketkv.load(str(shared_file(SMOLLM2_GGUF)), device="cpu",
                           gguf_weights="quantized-int8-classifier")
    assert isinstance(engine.model.layers[0].feed_forward.w13, Int4Linear)
    assert isinstance(engine.model.output, Int8Linear)
