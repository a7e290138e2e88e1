"""One-file Llama/Mistral/Qwen2 transformer for decoding with a pluggable KV cache.

The model knows nothing about KV-cache compression: every attention layer computes q, k, v,
rotates q and k at the tokens' true positions, and hands them to its cache object
(``cache.KVCache``), which stores what it wants and returns the attention output.

Two entry points:

* ``Transformer.prefill(tokens)`` runs the whole prompt layer by layer (all prompt tokens through
  layer 0, then layer 1, ...), so a cache may compress one layer's KV before the next layer runs.
  Projections, attention and the MLP run in token chunks, so beyond the hidden states and one
  layer's K/V only chunk-sized activations exist at 128K tokens, and logits are computed for
  the last position only.
* ``Transformer.forward(tokens, input_pos)`` is the single-token decode step; its shapes never
  depend on data, so it compiles once (``torch.compile(fullgraph=True)``, CUDA graphs on GPU).
  This file is its one path: the fused kernels replace it from outside (``kernels/fuse.py``).

RoPE uses Meta's layout (adjacent pairs rotate together); Hugging Face checkpoints, which use the
rotate-half layout, are permuted on load (``checkpoint.py``). Qwen2 is Llama with q, k and v
biases (``ModelArgs.qkv_bias``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from rocketkv.errors import ConfigError
from rocketkv.flags import model_name  # re-exported: ``from model import ConfigError`` works


@dataclass
class ModelArgs:
    """Shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2); sizes in
    features, lengths in tokens. Raises ConfigError for a shape the model cannot take."""

    dim: int = 4096  # hidden size
    n_layers: int = 32  # transformer blocks
    n_heads: int = 32  # query heads
    n_kv_heads: int | None = None  # key/value heads (None: n_heads, MHA; fewer: GQA)
    head_dim: int | None = None  # per-head size (None: dim // n_heads)
    intermediate_size: int = 11008  # SwiGLU hidden size
    vocab_size: int = 32000
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    # None, or {"type": "llama3" | "linear" | "freq_factors", ...} with its parameters
    # ("factor"; llama3 adds "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"; freq_factors has "factors", one divisor per
    # frequency, as llama.cpp's rope_freqs tensor): ``rope_inv_freq``
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 4096  # context length (max_position_embeddings)
    tie_word_embeddings: bool = False  # the classifier shares the token embedding matrix
    # Mistral's sliding-window attention span (or Qwen2's, where its config enables it); None:
    # full attention. The engine attends to the whole context, which equals sliding-window
    # attention only while a run's sequence fits in the window: longer runs are refused
    # (``Transformer.setup_caches``)
    sliding_window: int | None = None
    qkv_bias: bool = False  # q, k and v add a bias (Qwen2); wo and the MLP never do
    name: str = "custom"  # the config's name, for reports

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
                    "vocab_size", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: {key} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model config: n_heads={self.n_heads} is not a multiple of "
                              f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type")
            if kind not in ("llama3", "linear", "freq_factors"):
                raise ConfigError(f"model config: unsupported rope_scaling type {kind!r} "
                                  "(supported: llama3, linear, freq_factors)")
            if kind == "freq_factors" and len(self.rope_scaling["factors"]) != self.head_dim // 2:
                raise ConfigError(f"model config: {len(self.rope_scaling['factors'])} RoPE "
                                  f"frequency factors for head_dim {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the query group)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_name(cls, name: str) -> ModelArgs:
        """The named config ``name`` (a key of ``CONFIGS``, or an old spelling of one:
        ``flags.MODEL_ALIASES``); raises ConfigError otherwise."""
        name = model_name(name)
        if name not in CONFIGS:
            raise ConfigError(f"unknown model config {name!r}; known: {', '.join(CONFIGS)}")
        return cls(name=name, **CONFIGS[name])


LLAMA31_ROPE = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Values from each model's config.json (see ../shared/REFERENCE_NOTES.md). Exact keys only.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                         vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE,
                         max_seq_len=131072, norm_eps=1e-5),
    "llama-3.1-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_size=28672,
                          vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE,
                          max_seq_len=131072, norm_eps=1e-5),
    "llama-3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                       vocab_size=128256, rope_theta=500000.0, max_seq_len=8192, norm_eps=1e-5),
    "llama-2-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
                       vocab_size=32000, rope_theta=10000.0, max_seq_len=4096, norm_eps=1e-5),
    "mistral-7b-v0.2": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            intermediate_size=14336, vocab_size=32000, rope_theta=1e6,
                            max_seq_len=32768, norm_eps=1e-5),
    "longchat-7b-v1.5-32k": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                                 intermediate_size=11008, vocab_size=32000, rope_theta=10000.0,
                                 rope_scaling={"type": "linear", "factor": 8.0},
                                 max_seq_len=32768, norm_eps=1e-5),
    # SmolLM2-135M-Instruct (the header of its GGUF in ../shared/data agrees)
    "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                         vocab_size=49152, rope_theta=100000.0, max_seq_len=8192, norm_eps=1e-5,
                         tie_word_embeddings=True),
    "stories260K": dict(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, intermediate_size=172,
                        vocab_size=512, rope_theta=10000.0, max_seq_len=512, norm_eps=1e-5,
                        tie_word_embeddings=True),
    # Qwen2.5 Instruct (sliding window off in every config.json)
    "qwen2.5-0.5b": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, intermediate_size=4864,
                         vocab_size=151936, rope_theta=1e6, max_seq_len=32768, norm_eps=1e-6,
                         tie_word_embeddings=True, qkv_bias=True),
    "qwen2.5-1.5b": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_size=8960,
                         vocab_size=151936, rope_theta=1e6, max_seq_len=32768, norm_eps=1e-6,
                         tie_word_embeddings=True, qkv_bias=True),
    "qwen2.5-3b": dict(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, intermediate_size=11008,
                       vocab_size=151936, rope_theta=1e6, max_seq_len=32768, norm_eps=1e-6,
                       tie_word_embeddings=True, qkv_bias=True),
    "qwen2.5-7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_size=18944,
                       vocab_size=152064, rope_theta=1e6, max_seq_len=32768, norm_eps=1e-6,
                       qkv_bias=True),
}


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Per-pair inverse frequencies, float32 ``(head_dim // 2,)``, with the config's scaling.

    Llama 3.1 scaling (Meta's Llama 3.1 release): wavelengths below
    ``original / high_freq_factor`` keep their frequency, those above ``original /
    low_freq_factor`` are divided by ``factor``, and the band between interpolates with
    ``smooth = (original / wavelength - low) / (high - low)``. Linear scaling divides every
    frequency by ``factor`` (position interpolation, as LongChat uses). ``freq_factors``
    divides each frequency by its own factor (llama.cpp's ``rope_freqs`` tensor: how GGUF
    files carry Llama 3.1 scaling).
    """
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["type"] == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    factor = scaling["factor"]
    if scaling["type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(is_medium, interpolated, scaled)


def precompute_rope(args: ModelArgs, seq_len: int, device=None) -> Tensor:
    """Cos/sin table, float32 ``(seq_len, head_dim // 2, 2)`` for positions ``0..seq_len-1``."""
    inv_freq = rope_inv_freq(args).to(device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate adjacent pairs of ``x`` (B, T, n, head_dim) by ``rope`` (T, head_dim // 2, 2)."""
    xp = x.float().reshape(*x.shape[:-1], x.shape[-1] // 2, 2)  # (B, T, n, D/2, 2)
    cos, sin = rope[:, None, :, 0], rope[:, None, :, 1]  # (T, 1, D/2)
    out = torch.stack([xp[..., 0] * cos - xp[..., 1] * sin,
                       xp[..., 1] * cos + xp[..., 0] * sin], dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``weight * x / sqrt(mean(x^2) + eps)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # accumulate in fp32 whatever the model dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``, the gate ``w1`` and up ``w3`` projections fused
    into one matmul: ``w13`` holds w1's rows then w3's (``checkpoint.fuse_gate_up``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)

    def prefill(self, x: Tensor) -> Tensor:
        """``forward`` for prefill chunks, (B, T, dim) -> (B, T, dim): the gate activated and
        multiplied in place in the gate/up projection's output, so besides that (B, T, 2 x
        intermediate) tensor no other intermediate-sized one exists (``forward`` makes two
        more; the decode step keeps ``forward``, whose form the fused kernels check)."""
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate, inplace=True).mul_(up))


class Attention(nn.Module):
    """Grouped-query attention. K/V stay at KV-head granularity; the cache does the attending."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k and v in one matmul (fewer kernels in the decode step); rows: q (H * D), then
        # k (H_kv * D), then v (H_kv * D)
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_dim, bias=False)
        # Qwen2's q/k/v biases, one per row of wqkv: a parameter of its own rather than
        # wqkv.bias, so that quantize.py's int8/int4 layers replace wqkv and the bias stays float
        self.register_parameter("wqkv_bias", nn.Parameter(torch.zeros(qkv_dim))
                                if args.qkv_bias else None)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.kv_cache = None  # a kv_cache.KVCache, set by Transformer.setup_caches

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor) -> Tensor:
        """Decode step: normed hidden states ``x`` (B, 1, dim) at ``input_pos`` (1,) ->
        (B, 1, dim). q, k, v are projected and rotated; the cache stores k, v and attends
        (``KVCache.decode``); the output projection follows."""
        q, k, v = self.qkv(x, rope)
        return self.out(self.kv_cache.decode(q, k, v, input_pos))

    def qkv(self, x: Tensor, rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project and rotate. ``x`` (B, T, dim) -> q (B, H, T, D), k and v (B, H_kv, T, D)."""
        B, T, _ = x.shape
        D = self.head_dim
        qkv = self.wqkv(x)  # (B, T, (H + 2 H_kv) D)
        if self.wqkv_bias is not None:
            qkv = qkv + self.wqkv_bias
        q, k, v = qkv.split([self.n_heads * D, self.n_kv_heads * D, self.n_kv_heads * D], dim=-1)
        q = apply_rope(q.view(B, T, self.n_heads, D), rope)  # (B, T, H, D)
        k = apply_rope(k.view(B, T, self.n_kv_heads, D), rope)  # (B, T, H_kv, D)
        v = v.view(B, T, self.n_kv_heads, D)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def q_proj(self, x: Tensor, rope: Tensor) -> Tensor:
        """Queries only (prefill): ``x`` (B, T, dim) -> q (B, H, T, D), rotated."""
        B, T, _ = x.shape
        q = self.project(x, 0, self.n_heads * self.head_dim)  # the q rows
        q = q.view(B, T, self.n_heads, self.head_dim)
        return apply_rope(q, rope).transpose(1, 2)

    def kv_proj(self, x: Tensor, rope: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (rotated) and values only (prefill): ``x`` (B, T, dim) -> (B, H_kv, T, D)."""
        B, T, _ = x.shape
        D = self.head_dim
        kv = self.project(x, self.n_heads * D, self.wqkv.out_features)  # the k and v rows
        k, v = kv.view(B, T, 2 * self.n_kv_heads, D).split(self.n_kv_heads, dim=2)
        return apply_rope(k, rope).transpose(1, 2), v.transpose(1, 2)

    def project(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of the q/k/v projection, bias included, computing only those
        (quantized layers, ``quantized.py``, offer ``forward_rows``): ``x`` (B, T, dim) ->
        (B, T, stop - start)."""
        w = self.wqkv
        y = F.linear(x, w.weight[start:stop]) if isinstance(w, nn.Linear) else \
            w.forward_rows(x, start, stop)
        return y if self.wqkv_bias is None else y + self.wqkv_bias[start:stop]

    def out(self, y: Tensor) -> Tensor:
        """Output projection. ``y`` (B, H, T, D) -> (B, T, dim)."""
        B, _, T, _ = y.shape
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor) -> Tensor:
        """Decode step. ``x`` (B, 1, dim), ``rope`` (1, D/2, 2), ``input_pos`` (1,) int64."""
        h = x + self.attention(self.attention_norm(x), rope, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))

    def prefill(self, x: Tensor, rope: Tensor, chunk_size: int,
                mlp_rows: int | None = None) -> Tensor:
        """Whole prompt through this block; updates and returns ``x`` (B, T, dim) in place.

        The prompt is processed in prefill blocks of ``cache.prefill_block`` tokens (None: the
        whole prompt is one block, as the SnapKV family and every method that evicts after
        prefill need; KeyDiff sets ``--block-size``). For each block, two passes over token
        chunks of ``chunk_size``: (1) keys and values of every token of the block (written
        straight into the cache's storage where it offers it), then the cache stores them (and
        may evict) given the block's last ``obs_window`` queries; (2) per chunk, its queries
        attend (``prefill_attention``: to the block's keys up to the chunk's end, and to
        whatever the cache kept of earlier blocks), and the output projection, residuals and
        MLP update the chunk of ``x`` in place. Chunk i's queries depend only on chunk i of
        ``x``, which pass 2 has not changed yet. Besides ``x`` and one block's K/V, only
        chunk-sized activations exist; the MLP runs ``mlp_rows`` tokens at a time (None:
        ``chunk_size``).
        """
        B, T, _ = x.shape
        mlp_rows = mlp_rows or chunk_size
        attn = self.attention
        cache = attn.kv_cache
        block = cache.prefill_block or T
        for b in range(0, T, block):
            e_b = min(b + block, T)
            bufs = cache.prompt_buffers(b, e_b)
            if bufs is None:
                bufs = (x.new_empty(B, attn.n_kv_heads, e_b - b, attn.head_dim),
                        x.new_empty(B, attn.n_kv_heads, e_b - b, attn.head_dim))
            k, v = bufs
            for s in range(b, e_b, chunk_size):
                e = min(s + chunk_size, e_b)
                k[:, :, s - b:e - b], v[:, :, s - b:e - b] = attn.kv_proj(
                    self.attention_norm(x[:, s:e]), rope[s:e])
            w = min(cache.obs_window, e_b - b)
            q_obs = attn.q_proj(self.attention_norm(x[:, e_b - w:e_b]), rope[e_b - w:e_b])
            cache.store_prompt(k, v, q_obs, b)  # the cache may compress here
            del q_obs
            for s in range(b, e_b, chunk_size):
                e = min(s + chunk_size, e_b)
                q = attn.q_proj(self.attention_norm(x[:, s:e]), rope[s:e])
                y = cache.prefill_attention(q, k[:, :, :e - b], v[:, :, :e - b], s)
                x[:, s:e] += attn.out(y)
                del y
                for r in range(s, e, mlp_rows):  # the MLP's (rows, 2 x intermediate) output
                    # is the largest activation: at most mlp_rows tokens of it at once
                    f = min(r + mlp_rows, e)
                    x[:, r:f] += self.feed_forward.prefill(self.ffn_norm(x[:, r:f]))
            del k, v, bufs
        return x

    def append(self, x: Tensor, rope: Tensor, start: int) -> Tensor:
        """A later prompt chunk ``x`` (B, Tc, dim) at positions ``start ..``: its queries attend
        to what the cache holds plus the chunk causally (``KVCache.append``)."""
        q, k, v = self.attention.qkv(self.attention_norm(x), rope)
        h = x + self.attention.out(self.attention.kv_cache.append(q, k, v, start))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama/Mistral/Qwen2 decoder. Call ``setup_caches`` before ``prefill``/``forward``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.prefill_chunk_size = 4096  # tokens per projection/attention chunk in prefill
        self.prefill_mlp_rows = 2048  # tokens per MLP call in prefill: its (rows, 2 x
        # intermediate) output is the largest activation (Qwen2.5-0.5B, float32: 80 MB at
        # 2048 rows, 160 MB at 4096); 2048 rows cost 0-5% of the MLP's time against 4096,
        # 1024 rows 10-15% (2-core CPU)
        self.quantization: dict | None = None  # set by quantize.py's loaders
        self.register_buffer("rope", torch.empty(0, args.head_dim // 2, 2), persistent=False)

    def setup_caches(self, caches: list[nn.Module], max_seq_len: int) -> None:
        """Attach one cache per layer; build the RoPE table (once, for the whole context)."""
        if len(caches) != self.args.n_layers:
            raise ValueError(f"need {self.args.n_layers} caches, got {len(caches)}")
        if max_seq_len > self.args.max_seq_len:
            raise ConfigError(f"{max_seq_len} tokens exceed the model's context "
                              f"({self.args.max_seq_len} tokens)")
        window = self.args.sliding_window
        if window is not None and max_seq_len > window:
            raise ConfigError(f"this run needs {max_seq_len} tokens, more than the model's "
                              f"sliding-window attention span ({window} tokens), which this "
                              f"engine does not implement; runs up to {window} tokens (prompt "
                              "+ new tokens) are exact")
        for layer, cache in zip(self.layers, caches):
            layer.attention.kv_cache = cache
        if self.rope.shape[0] < self.args.max_seq_len:  # once, for the whole context: the
            # decode step's shapes then never depend on the run's length
            self.rope = precompute_rope(self.args, self.args.max_seq_len, self.device)

    @property
    def device(self) -> torch.device:
        """The device of the model's tensors (its final norm's, which every load keeps in
        float: the token embedding may be a GGUF's blocks, ``quantized.GGUFEmbedding``)."""
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype: that of the hidden states, the KV cache and the logits."""
        return self.norm.weight.dtype

    @property
    def caches(self) -> list[nn.Module]:
        return [layer.attention.kv_cache for layer in self.layers]

    def forward(self, tokens: Tensor, input_pos: Tensor, block=None) -> Tensor:
        """Decode step: ``tokens`` (B, 1) int64 at position ``input_pos`` (1,) int64 on the
        model's device. Returns logits (B, vocab) in the model dtype. ``block``: called as
        ``block(layer, x, rope, input_pos)`` instead of ``layer(x, rope, input_pos)`` (the
        CPU's per-layer compiled step, ``step.LayerCompiledStep``); None: each layer itself."""
        rope = self.rope[input_pos]  # (1, D/2, 2)
        x = self.tok_embeddings(tokens)  # (B, 1, dim)
        for layer in self.layers:
            x = layer(x, rope, input_pos) if block is None else block(layer, x, rope, input_pos)
        return self.output(self.norm(x))[:, -1]

    @torch.no_grad()
    def prefill(self, tokens: Tensor, start: int = 0, on_layer=None) -> Tensor:
        """Prompt ``tokens`` (B, T) int64 at positions ``start .. start + T - 1``, layer by layer.

        ``start == 0``: the prompt (each cache sees the whole layer's K/V and may compress).
        ``start > 0``: a later chunk of a conversation whose first ``start`` tokens are cached
        already; its queries attend to the cache as the method left it (``KVCache.append``),
        computed in one block of T tokens. ``on_layer(i)`` is called after layer i (progress).
        Returns logits of the last position only, (B, vocab) in the model dtype.
        """
        T = tokens.shape[1]
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        rope = self.rope[start:start + T]
        for i, layer in enumerate(self.layers):
            x = (layer.prefill(x, rope, self.prefill_chunk_size, self.prefill_mlp_rows)
                 if start == 0
                 else layer.append(x, rope, start))
            if on_layer is not None:
                on_layer(i)
        return self.output(self.norm(x[:, -1:]))[:, -1]

