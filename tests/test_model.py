"""model.py against Hugging Face transformers (the independent reference)."""

import pytest
import torch

from rocketkv.compression import build_caches
from rocketkv.formats.checkpoint import args_from_hf_config, load_model
from rocketkv.model import CONFIGS, ConfigError, ModelArgs, rope_inv_freq

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# (name, config class, kwargs): GQA and MHA, llama3 and linear scaling, tied and untied
CASES = [
    ("llama_gqa_llama3_rope", "LlamaConfig",
     dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
          rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    ("llama_mha_linear_tied", "LlamaConfig",
     dict(num_attention_heads=4, num_key_value_heads=4,
          rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True)),
    ("llama_gqa_default_rope_tied", "LlamaConfig",
     dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),
    ("mistral_gqa", "MistralConfig",
     dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6, sliding_window=None,
          tie_word_embeddings=False)),
]


def make_hf_model(tmp_path, cls_name, kwargs, seed=0, **save_kwargs):
    torch.manual_seed(seed)
    cfg_cls = getattr(transformers, cls_name)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    cfg = cfg_cls(**{**dict(vocab_size=97, hidden_size=64, intermediate_size=112,
                            num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5),
                     **kwargs})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # norms away from 1 and biases (Qwen2's q/k/v) away from 0, so
        for name, p in model.named_parameters():  # their weights matter
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(tmp_path, safe_serialization=True, **save_kwargs)
    return model


@pytest.mark.parametrize("name,cls_name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_logits_match_transformers(tmp_path, name, cls_name, kwargs):
    hf = make_hf_model(tmp_path, cls_name, kwargs)
    ours = load_model(str(tmp_path), "cpu", torch.float32)
    # 80 positions: past original_max_position_embeddings (16) for the llama3 case
    ids = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits  # (2, 80, V)
    prompt_len = 30
    ours.setup_caches(build_caches("full", ours.args, batch_size=2, prompt_len=prompt_len,
                                   max_new_tokens=50, budget=None, dtype=torch.float32,
                                   device="cpu"), 80)
    with torch.no_grad():
        logits = ours.prefill(ids[:, :prompt_len])
        assert (logits - ref[:, prompt_len - 1]).abs().max() < 1e-4
        for t in range(prompt_len, 80):
            logits = ours(ids[:, t:t + 1], torch.tensor([t]))
            assert (logits - ref[:, t]).abs().max() < 1e-4, f"position {t}"


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model(tmp_path, "LlamaConfig",
                       dict(num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=False), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(str(tmp_path), "cpu", torch.float32)
    ids = torch.randint(0, 97, (1, 12))
    ours.setup_caches(build_caches("full", ours.args, batch_size=1, prompt_len=12,
                                   max_new_tokens=1, budget=None, dtype=torch.float32,
                                   device="cpu"), 13)
    with torch.no_grad():
        assert (ours.prefill(ids) - hf(ids).logits[:, -1]).abs().max() < 1e-4


def test_prefill_chunking_does_not_change_logits(tmp_path):
    make_hf_model(tmp_path, "LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2))
    ours = load_model(str(tmp_path), "cpu", torch.float32)
    ids = torch.randint(0, 97, (1, 50))
    outs = []
    for chunk, mlp_rows in ((4096, 4096), (7, 4096), (16, 5)):  # query chunks, MLP rows
        ours.prefill_chunk_size, ours.prefill_mlp_rows = chunk, mlp_rows
        ours.setup_caches(build_caches("full", ours.args, batch_size=1, prompt_len=50,
                                       max_new_tokens=1, budget=None, dtype=torch.float32,
                                       device="cpu"), 51)
        outs.append(ours.prefill(ids))
    for out in outs[1:]:
        assert (outs[0] - out).abs().max() < 1e-5


# ---- config parsing ------------------------------------------------------------------------

LLAMA31_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_from_hf_config_classic_and_rope_parameters_layouts_agree():
    classic = args_from_hf_config(LLAMA31_HF, name="llama-3.1-8b")
    v5 = dict(LLAMA31_HF)
    v5.pop("rope_theta")
    v5["rope_parameters"] = {**v5.pop("rope_scaling"), "rope_theta": 500000.0}
    assert args_from_hf_config(v5, name="llama-3.1-8b") == classic
    assert classic == ModelArgs.from_name("llama-3.1-8b")


def test_named_configs_match_reference_values():
    a = ModelArgs.from_name("mistral-7b-v0.2")
    assert (a.rope_theta, a.n_kv_heads, a.max_seq_len, a.rope_scaling) == (1e6, 8, 32768, None)
    a = ModelArgs.from_name("longchat-7b-v1.5-32k")
    assert a.rope_scaling == {"type": "linear", "factor": 8.0} and a.n_kv_heads == 32
    a = ModelArgs.from_name("stories260K")
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.intermediate_size, a.vocab_size,
            a.max_seq_len, a.tie_word_embeddings) == (64, 5, 8, 4, 172, 512, 512, True)
    assert set(CONFIGS) >= {"llama-3.1-8b", "llama-3.1-70b", "llama-3-8b", "llama-2-7b",
                            "mistral-7b-v0.2", "longchat-7b-v1.5-32k", "stories260K"}
    a = ModelArgs.from_name("smollm2-135m")
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.intermediate_size, a.vocab_size,
            a.max_seq_len, a.rope_theta) == (576, 30, 9, 3, 1536, 49152, 8192, 100000.0)
    # KV cache per token of Llama-3.1-8B: 128 KiB in bf16
    a = ModelArgs.from_name("llama-3.1-8b")
    assert 2 * a.n_layers * a.n_kv_heads * a.head_dim * 2 == 128 * 1024


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(**{k: v for k, v in LLAMA31_HF.items() if k != "architectures"})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(ModelArgs.from_name("llama-3.1-8b"))
    assert torch.allclose(ours, inv_freq.float(), rtol=1e-6)


@pytest.mark.parametrize("bad,match", [
    ({"model_type": "gpt2"}, "unsupported architecture"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive"),
    ({"attention_bias": True}, "biases"),
])
def test_from_hf_config_rejects(bad, match):
    with pytest.raises(ConfigError, match=match):
        args_from_hf_config({**LLAMA31_HF, **bad})


def test_sliding_window_is_accepted_for_runs_that_fit_in_it():
    """Mistral v0.1's 4096-token window: attention equals full attention while the whole run
    fits in it, so such runs load and longer ones are refused with the reason."""
    from rocketkv.engine.generate import generate
    from rocketkv.formats.checkpoint import random_model

    small = {**LLAMA31_HF, "model_type": "mistral", "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256,
             "rope_scaling": None, "sliding_window": 64}
    args = args_from_hf_config(small)
    assert args.sliding_window == 64
    assert args_from_hf_config({**small, "sliding_window": 256}).sliding_window is None
    model = random_model(args, "cpu", torch.float32)
    assert len(generate(model, list(range(40)), max_new_tokens=24)["token_ids"][0]) == 24
    with pytest.raises(ConfigError, match="sliding-window attention span \\(64 tokens\\)"):
        generate(model, list(range(40)), max_new_tokens=25)


def test_unknown_name_is_an_error_not_a_fuzzy_match():
    with pytest.raises(ConfigError, match="unknown model config"):
        ModelArgs.from_name("llama-3.1-8b-instruct")


def test_a_model_has_one_name_everywhere(capsys):
    """A short name of --checkpoint is the name of its shape (random:NAME, --config NAME), and
    an old spelling still resolves, with one note on stderr."""
    from rocketkv.flags import KNOWN_CHECKPOINTS, MODEL_ALIASES

    assert set(KNOWN_CHECKPOINTS) <= set(CONFIGS)
    assert {"smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b",
            "qwen2.5-7b"} <= set(CONFIGS)
    for old, new in MODEL_ALIASES.items():
        assert ModelArgs.from_name(old) == ModelArgs.from_name(new)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"note: the model name {old!r} is deprecated; use {new!r}"
                   for old, new in MODEL_ALIASES.items()]


def test_the_smollm2_config_is_the_gguf_header():
    """``random:smollm2-135m`` has the shape of the SmolLM2 GGUF (benchmarks at that shape)."""
    from conftest import SMOLLM2_GGUF, shared_file

    from rocketkv.formats.checkpoint import checkpoint_args

    gguf = checkpoint_args(str(shared_file(SMOLLM2_GGUF)))
    named = ModelArgs.from_name("smollm2-135m")
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
              "vocab_size", "rope_theta", "max_seq_len", "tie_word_embeddings", "qkv_bias"):
        assert getattr(named, f) == getattr(gguf, f), f
    assert abs(named.norm_eps - gguf.norm_eps) < 1e-9
