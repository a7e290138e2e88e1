"""Full-KV: every token cached and read at every decode step (the reference, no budget).

The cache is ``cache.FullKVCache``: a static (B, H_kv, T + m, D) buffer for K and for V, of
which a compiled decode step reads the written prefix.
"""

from __future__ import annotations

from rocketkv.compression.registry import Method, full_cache, register


@register
class FullMethod(Method):
    name = "full"
    description = "Full-KV: every token cached and read at every step (no budget)"
    budget_rule = "none: every cached token is read"
    budgeted = False
    source = "the uncompressed baseline"

    def build(self, args, params, *, batch_size, prompt_len, max_new_tokens, dtype, device,
              options):
        return [full_cache(i, args, batch_size, prompt_len, max_new_tokens, dtype, device)
                for i in range(args.n_layers)]
