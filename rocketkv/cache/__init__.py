"""The KV cache: its interface and the full (uncompressed) cache (``base.py``), the attention
math every cache shares (``attention.py``) and the selection machinery of the budgeted methods
(``selection.py``); this package re-exports their names.

Every attention layer owns one ``KVCache``. The model hands it q, k, v (keys already rotated at
their true positions) and gets the attention output back; the cache decides what to store, what
to read and how to attend. Compression methods (``compression/``) are subclasses.

The interface carries what the methods need without bending:

* Prefill runs layer by layer, and within a layer in prefill blocks of ``prefill_block``
  tokens (None, the default: the whole prompt is one block). ``store_prompt(k, v, q_obs,
  start)`` sees one block's K/V and its last ``obs_window`` queries before any of the block's
  queries attends, so a cache may evict right there (SnapKV family, one block); then the model
  asks ``prefill_attention(q, k, v, start)`` for chunks of the block's queries (exact causal
  attention by default; KeyDiff attends to its already-compressed cache plus the block and
  evicts after each block). A cache may offer ``prompt_buffers`` so the model writes the
  block's K/V straight into its storage. Whole-prompt queries, attention outputs and
  (T x T) scores never exist: at 128K tokens, prefill holds the hidden states and one layer's
  K/V beside the weights and caches.
* ``decode(q, k, v, input_pos)`` gets the new token at ``input_pos``, a device tensor, so the
  step has static shapes and compiles once; a cache may evict inside it within a fixed
  capacity (H2O, StreamingLLM) or update page summaries on write (Quest, RocketKV). A cache
  whose step is "write the token, then attend" also offers ``token_store(input_pos)`` (where
  the token goes, with a selector's auxiliary keys: ``Selector.token_aux``) and
  ``attend_stored(q, input_pos)``: with the dense kernels the q/k/v projection kernel writes
  the token there and the model calls ``attend_stored`` (``TransformerBlock.forward_fused``).
* Buffers are per-cache ``register_buffer`` tensors of any shape and device: different
  capacities per KV head (DuoAttention) or CPU-resident storage (OmniKV offload) are the
  subclass's choice. Caches are built together by a method's factory (``build_caches``), so
  a later layer's cache may hold a reference to an earlier layer's state (OmniKV filter layers).
* ``allocated_bytes()`` and ``bytes_read_per_step()`` report storage and per-step traffic.

Token budget (RocketKV paper Sec. 3.5): key+value pairs read per decode step, per layer, per
KV-head group, approximation traffic included. The full cache has no budget: it reads every
cached token.
"""

# The switches and sizes of attention.py (CPU_FLASH_PREFILL, FLEX_DECODE, MASK_ELEMENTS,
# LSE_ROWS) are set on rocketkv.cache.attention itself, so they are not re-exported here.
from rocketkv.cache.attention import (  # noqa: F401
    FLEX_BLOCK,
    attend,
    attention_and_column_sums,
    attention_column_sums,
    attention_probs,
    causal_attention,
    current_prefill_memo,
    flex_prefix_attention,
    prefill_memo,
    prefix_attention,
    written_slots,
)
from rocketkv.cache.base import (  # noqa: F401
    FullKVCache,
    KVCache,
    TokenStore,
    same_view,
)
from rocketkv.cache.selection import (  # noqa: F401
    SECTOR,
    CompressedKVCache,
    Selector,
    attend_selected,
    gather_tokens,
    sector_bytes,
    strided_bytes,
    token_bytes,
)
