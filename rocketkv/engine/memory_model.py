"""Predict the peak device memory of a run without a GPU: the model on the meta device.
``scripts/predict_memory.py`` prints these figures (``evals/memory_prediction.py`` runs
``predict`` per configuration).

Meta tensors carry shapes and dtypes but no data, so the real model code (``Transformer.prefill``
and one eager decode step) runs at full size in seconds on any machine. ``AllocationTracker``
watches every tensor the code creates (a ``TorchFunctionMode``), keeps the bytes of the storages
alive at each moment and reports their peak. The prediction for a phase is

    resident (weights, RoPE table, every cache buffer) + peak of the phase's live activations.

What it models and what it does not:

* SDPA calls are counted as their output only, as the fused kernels on CUDA (flash,
  memory-efficient) run without materializing scores; everything else is counted as written.
* It counts tensor storage, like ``torch.cuda.max_memory_allocated`` does: not the CUDA
  context, cuBLAS workspaces, allocator rounding and fragmentation, nor what a compiled
  decode step (Inductor's buffer planning, CUDA-graph pools) allocates differently from the
  eager step counted here.
* It is a prediction for planning and for catching regressions (a whole-prompt tensor, a
  T x T mask) on machines without a GPU, never a measurement: rows say ``"predicted": true``
  and ``device: "meta"``; measured figures come from ``scripts/bench.py`` on the GPU.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from rocketkv import tp
from rocketkv.compression import build_caches
from rocketkv.engine.measure import weight_bytes
from rocketkv.model import ModelArgs, Transformer


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class AllocationTracker(TorchFunctionMode):
    """Live and peak bytes of the tensor storages created while the mode is active.

    Every tensor a torch function returns is tracked by its storage (views share their base's
    storage and count once); a storage is freed when the last tracked tensor on it is garbage
    collected (weak-reference finalizers, which CPython runs as soon as the last reference
    goes). Storages in ``resident`` (ids from ``storage_ids``) are never counted.
    ``F.scaled_dot_product_attention`` is replaced by an empty output of the right shape:
    a fused kernel's footprint.

    Attributes:
        live: bytes alive now; peak: the most bytes alive at once since ``reset_peak``.
    """

    def __init__(self, resident: set[int] = frozenset()):
        super().__init__()
        self.resident = set(resident)
        self.refs: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.nbytes.pop(key)

    def _track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self.resident:
            return
        if key not in self.refs:
            self.refs[key] = 0
            self.nbytes[key] = t.untyped_storage().nbytes()
            self.live += self.nbytes[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, v = args[0], args[2]
            out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        else:
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def storage_ids(tensors) -> dict[int, int]:
    """{storage id: bytes} of ``tensors`` (shared storages once)."""
    return {_storage_key(t): t.untyped_storage().nbytes() for t in tensors}


@torch.no_grad()
def predict(args: ModelArgs, method: str, budget: int | None, context: int, new_tokens: int,
            batch_size: int = 1, dtype: torch.dtype = torch.bfloat16,
            options: dict[str, Any] | None = None, world: int = 1) -> dict[str, Any]:
    """Predicted peak bytes of prefill, of one decode step and of the whole run.

    Builds ``args`` on the meta device with ``method``'s caches for a prompt of ``context``
    tokens and ``new_tokens`` new ones, runs ``Transformer.prefill`` and one eager decode
    step under ``AllocationTracker``, and returns a row with ``peak_memory_bytes``
    {prefill, decode, total}, ``resident_bytes``, ``weight_bytes``, ``kv_cache_bytes`` and the
    activation peaks (bytes). With ``world`` > 1 the figures are one rank's under tensor
    parallelism over ``world`` ranks (``tp.local_args``: its share of the weights and KV
    heads, the replicated embedding and classifier; every rank holds the same). Raises
    ``ConfigError`` as ``build_caches`` and ``tp.check_world`` do.
    """
    tp.check_world(args, world)
    with torch.device("meta"):
        model = Transformer(tp.local_args(args, world))
    model = tp.attach(model.to(dtype).eval(), 0, world, args, reduce=False)
    caches = build_caches(method, args, batch_size=batch_size, prompt_len=context,
                          max_new_tokens=new_tokens, budget=budget, dtype=dtype, device="meta",
                          shard=(0, world), **(options or {}))
    model.setup_caches(caches, context + new_tokens)
    # weights, RoPE table, cache buffers, and tensors caches hold outside their buffers (the
    # gptfast_dense baseline's shared max_seq x max_seq mask)
    held = [v for c in model.caches for v in vars(c).values() if isinstance(v, torch.Tensor)]
    resident = storage_ids(list(model.parameters()) + list(model.buffers()) + held)
    resident_bytes = sum(resident.values())
    tokens = torch.zeros(batch_size, context, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    with AllocationTracker(set(resident)) as tracker:
        logits = model.prefill(tokens)
        prefill_act = tracker.peak
        del logits
        tracker.reset_peak()
        step = model(tokens[:, :1], torch.tensor([context], device="meta"))
        decode_act = tracker.peak
        del step
    prefill, decode = resident_bytes + prefill_act, resident_bytes + decode_act
    return {
        "device": "meta", "predicted": True, "torch_version": torch.__version__,
        "model": args.name, "dtype": str(dtype).removeprefix("torch."), "method": method,
        "budget": budget, "context": context, "batch_size": batch_size,
        "new_tokens": new_tokens, "world_size": world,
        "peak_memory_bytes": {"prefill": prefill, "decode": decode,
                              "total": max(prefill, decode)},
        "resident_bytes": resident_bytes,
        "weight_bytes": weight_bytes(model),
        "kv_cache_bytes": sum(c.allocated_bytes() for c in model.caches),
        "prefill_activation_peak_bytes": prefill_act,
        "decode_activation_peak_bytes": decode_act,
        "method_params": model.caches[-1].method_params(),
        "seconds": time.perf_counter() - t0,
    }
