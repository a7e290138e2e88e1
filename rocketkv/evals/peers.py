"""The engines a user would pick instead of ours, measured in the same benchmark run.

``transformers``: Hugging Face ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` for a model with q/k/v
biases) at the same shape as our model (a config built from its ``ModelArgs``), random
weights, decoding the way the transformers documentation recommends for fast decoding:
``generate(..., cache_implementation="static")``, which on CUDA compiles the forward pass
(``torch.compile``, CUDA graphs) by itself once the static cache is used. Greedy, no stop
token, the same prompt length, new tokens and timing window as ``scripts/bench.py``'s rows of
our engine: per-step times between consecutive decode steps (CUDA events, or the synchronized
wall clock on CPU, recorded by a logits processor, i.e. once per step of ``generate``'s
loop), when compiling the first ``WARMUP_STEPS`` (compilation and graph capture) left out of
the median and reported as ``compile_s``; peak memory per phase by ``measure.MemoryMeter``.
Prompts past ``CHUNK_FROM`` tokens prefill in chunks (``generate``'s ``prefill_chunk_size``,
``prefill_chunk``): in one forward, its static cache's prefill builds a dense mask of prompt x
cache slots (17 GB at 128K in bool) beside 17 GB of cache and the MLP's activations, more than
an 80 GB GPU holds; the decode steps timed are the same either way.
transformers is imported only when such a row runs (it is a test requirement here and
installed on the GPU machine).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rocketkv.engine.generate import WARMUP_STEPS
from rocketkv.engine.measure import (
    MemoryMeter,
    StepTimer,
    device_name,
    float_weight_bytes,
    percentile,
)
from rocketkv.model import ConfigError, ModelArgs

PEERS = ("transformers",)
CHUNK_FROM = 32768  # longer prompts prefill in chunks of at most PREFILL_CHUNK tokens
PREFILL_CHUNK = 8192


def prefill_chunk(context: int) -> int | None:
    """The peer's prefill chunk for a ``context``-token prompt: None (one forward) up to
    ``CHUNK_FROM`` tokens; past it the largest divisor of ``context`` of at most
    ``PREFILL_CHUNK`` (equal chunks: one compiled shape), or ``PREFILL_CHUNK`` itself where
    that divisor is under an eighth of it."""
    if context <= CHUNK_FROM:
        return None
    best = max(d for d in range(1, PREFILL_CHUNK + 1) if context % d == 0)
    return best if best >= PREFILL_CHUNK // 8 else PREFILL_CHUNK


def hf_config(args: ModelArgs, dtype: torch.dtype):
    """A transformers config of the model ``args`` describes (Llama, or Qwen2 with biases).

    Raises:
        ConfigError: a RoPE scaling transformers' Llama has no equivalent for here.
    """
    import transformers

    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        kind = args.rope_scaling["type"]
        if kind == "freq_factors":
            raise ConfigError("transformers peer: per-frequency RoPE factors (a GGUF's "
                              "rope_freqs) have no transformers config")
        rope = {**{k: v for k, v in args.rope_scaling.items() if k != "type"},
                "rope_type": kind, "rope_theta": args.rope_theta}
    common = dict(hidden_size=args.dim, intermediate_size=args.intermediate_size,
                  num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                  num_key_value_heads=args.n_kv_heads, vocab_size=args.vocab_size,
                  rms_norm_eps=args.norm_eps, max_position_embeddings=args.max_seq_len,
                  tie_word_embeddings=args.tie_word_embeddings, rope_parameters=rope,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if args.qkv_bias:
        cfg = transformers.Qwen2Config(**common, use_sliding_window=False)
    else:
        cfg = transformers.LlamaConfig(**common, head_dim=args.head_dim, attention_bias=False,
                                       mlp_bias=False)
    cfg.dtype = dtype
    return cfg


def hf_model(args: ModelArgs, device: torch.device, dtype: torch.dtype):
    """Random-weight transformers model of ``args``'s shape on ``device`` in ``dtype``,
    initialized there (never a float32 copy of the weights)."""
    import transformers

    cfg = hf_config(args, dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def static_cache_bytes(args: ModelArgs, batch: int, slots: int, dtype: torch.dtype) -> int:
    """Bytes of transformers' ``StaticCache`` for ``slots`` tokens: K and V of every layer."""
    return 2 * args.n_layers * batch * args.n_kv_heads * slots * args.head_dim * dtype.itemsize


@torch.no_grad()
def run_transformers(args: ModelArgs, batch: int, context: int, new_tokens: int, *,
                     device: torch.device, dtype: torch.dtype, seed: int = 0,
                     compile: bool = True) -> dict[str, Any]:
    """One benchmark row of transformers at ``args``'s shape: ``batch`` random prompts of
    ``context`` tokens, ``new_tokens`` greedy tokens with a static cache.

    Returns the figures ``scripts/bench.py`` records for our rows (decode_ms_median/p10/p90,
    tokens_per_s, prefill_s, compile_s, peak_memory_bytes per phase, kv_cache_bytes,
    kv_bytes_per_step: the static cache's attention reads its whole buffer every step) plus
    ``transformers_version`` and ``compiled`` (whether generate compiled the forward).

    Raises:
        ConfigError: fewer new tokens than the warm-up steps plus one timed step.
    """
    import transformers

    warm = WARMUP_STEPS if compile else 0  # as our engine: warm-up only when compiling
    if new_tokens < warm + 2:
        raise ConfigError(f"transformers peer: --new-tokens must be at least {warm + 2} "
                          "(warm-up steps, then timed ones)")
    model = hf_model(args, device, dtype)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, args.vocab_size, (batch, context), generator=gen).to(device)
    meter, timer = MemoryMeter(device), StepTimer(device)
    marks: list[Any] = []
    phase: dict[str, Any] = {}

    def on_step(input_ids, scores):  # called once per generated token, after its forward
        if not marks:  # the prefill's token: its phase ends here
            phase["prefill_s"] = time.perf_counter() - phase["start"]
            phase["prefill_peak"] = meter.peak()
            meter.reset()
        marks.append(timer.start())
        return scores

    processor = transformers.LogitsProcessorList([on_step])
    chunk = prefill_chunk(context)
    if not hasattr(transformers.GenerationConfig(), "prefill_chunk_size"):
        chunk = None  # a transformers without chunked prefill: one forward (it may not fit)
    gen_kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      cache_implementation="static", logits_processor=processor,
                      pad_token_id=0, disable_compile=not compile)
    if chunk is not None:
        gen_kwargs["prefill_chunk_size"] = chunk
    meter.reset()
    phase["start"] = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **gen_kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    decode_peak = meter.peak()
    if out.shape[1] != context + new_tokens:
        raise ConfigError(f"transformers peer: generated {out.shape[1] - context} of "
                          f"{new_tokens} tokens")
    timer.marks = [(a, b) for a, b in zip(marks, marks[1:])]
    steps = timer.ms()  # between consecutive tokens: one decode step each
    timed = steps[warm:]
    compiled = hasattr(model, "_compiled_call")  # generate compiled the forward
    kv = static_cache_bytes(args, batch, context + new_tokens, dtype)
    weights = float_weight_bytes(args, dtype)
    emb = args.vocab_size * args.dim * dtype.itemsize
    median = percentile(timed, 50)
    del model, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "device": device_name(device), "transformers_version": transformers.__version__,
        "dtype": str(dtype).removeprefix("torch."), "weights": "float",
        "decode_ms_median": median, "decode_ms_p10": percentile(timed, 10),
        "decode_ms_p90": percentile(timed, 90), "tokens_per_s": batch * 1e3 / median,
        "prefill_s": phase["prefill_s"], "compile_s": sum(steps[:warm]) / 1e3,
        "peak_memory_bytes": {"prefill": phase["prefill_peak"], "decode": decode_peak,
                              "total": max(phase["prefill_peak"], decode_peak)},
        "peak_memory_kind": meter.kind, "kv_cache_bytes": kv, "kv_bytes_per_step": kv,
        "kv_ideal_bytes_per_step": kv, "weight_bytes": weights,
        "weight_bytes_per_step": weights - (0 if args.tie_word_embeddings else emb),
        "method_params": {"cache": "transformers StaticCache", "max_cache_len":
                          context + new_tokens, "attn_implementation": "sdpa",
                          "prefill_chunk_size": chunk,
                          # chunks prefill through the compiled forward: its compile for the
                          # chunk's shape is inside prefill_s, not compile_s
                          "prefill_compiled": chunk is not None and compiled},
        "compiled": compiled, "fused_kernels": False, "dense_kernels": False, "warmup_steps": warm,
        "decode_steps": len(timed),
    }
