"""Full-KV decoded the way gpt-fast (and the RocketKV release) ran it: a benchmark baseline.

The RocketKV paper's speedups are measured against this dense decode (Sec. 4.3), so the
benchmark keeps it beside our own Full-KV (``full.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rocketkv.cache import FullKVCache
from rocketkv.compression.registry import Method, register
from rocketkv.model import ModelArgs


class GptFastDenseCache(FullKVCache):
    """Full-KV the way gpt-fast (and the RocketKV release) ran it, as a benchmark baseline.

    K/V are expanded to every query head with ``repeat_interleave`` at each step, attention
    runs SDPA's math kernel over the whole static buffer, and a (max_seq x max_seq) boolean
    causal mask is materialized (counted in ``allocated_bytes``: 16 GiB at 128K). Prefill uses
    ``causal_attention`` like every other cache (the decode step is what is compared).
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_seq_len: int, causal_mask: Tensor):
        super().__init__(layer_idx, args, batch_size, dtype, device, max_seq_len,
                         params={"baseline": "gpt-fast dense decode"})
        self.causal_mask = causal_mask  # shared by every layer, as gpt-fast's model buffer

    dense_kernels = False  # the baseline keeps gpt-fast's projections (PyTorch, cuBLAS)

    def attend_stored(self, q: Tensor, input_pos: Tensor) -> Tensor:
        G = self.n_heads // self.n_kv_heads
        keys = self.k_cache.repeat_interleave(G, dim=1)  # (B, H, S, D) copies, as gpt-fast
        values = self.v_cache.repeat_interleave(G, dim=1)
        mask = self.causal_mask[input_pos][None, None]  # (1, 1, 1, S) bool
        # SDPA's math kernel, which takes the mask additively (what SDPA does with a bool mask)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, float("-inf"))
        return torch.ops.aten._scaled_dot_product_attention_math(q, keys, values,
                                                                 attn_mask=bias)[0]

    def allocated_bytes(self) -> int:
        mask = self.causal_mask.numel() if self.layer_idx == 0 else 0  # count the shared mask once
        return super().allocated_bytes() + mask


@register
class GptFastDenseMethod(Method):
    name = "gptfast_dense"
    description = ("benchmark baseline: Full-KV decoded as gpt-fast did (repeated K/V, math "
                   "SDPA, max_seq^2 mask)")
    budget_rule = "none: every cached token is read, as gpt-fast did"
    budgeted = False
    cache_classes = (GptFastDenseCache,)
    source = "gpt-fast; RocketKV Sec. 4.3"

    def build(self, args, params, *, batch_size, prompt_len, max_new_tokens, dtype, device,
              options):
        max_seq_len = prompt_len + max_new_tokens
        mask = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=device))
        return [GptFastDenseCache(i, args, batch_size, dtype, device, max_seq_len, mask)
                for i in range(args.n_layers)]
