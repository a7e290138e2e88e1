"""Predict the peak device memory of a run without a GPU: the model on the meta device.

    python scripts/predict_memory.py       # llama-3.1-8b bf16, 128K: full vs rocketkv at 256
    python scripts/predict_memory.py --config mistral-7b-v0.2 --context 32704 \\
        --methods full snapkv_pp --budgets 256 1024 --json out.json

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

import sys
import time
import weakref
from pathlib import Path
from typing import Any

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import DTYPE_NAMES, OneLineParser, add_config_option, deprecated_alias


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_config_option(p)
    p.add_argument("--methods", nargs="+", default=["full", "rocketkv"])
    p.add_argument("--budgets", nargs="+", type=int, default=[256])
    p.add_argument("--context", nargs="+", type=int, default=[131072 - 64], metavar="N")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16")
    p.add_argument("--tp", nargs="+", type=int, default=[1], metavar="N",
                   help="tensor-parallel ranks (tp.py): the figures are per rank, and the table "
                        "says whether they fit on N H100s")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    deprecated_alias(p, "--new-tokens", "--max-new-tokens")
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from rocketkv import tp
from rocketkv.cli.common import DTYPES, command_line, rows_exit_status, write_json
from rocketkv.compression import build_caches, check_methods
from rocketkv.engine.measure import weight_bytes
from rocketkv.evals.harness import configurations
from rocketkv.model import CONFIGS, ConfigError, ModelArgs, Transformer

GB = 1e9


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


H100_BYTES = 78 * 2**30  # what an H100 80GB leaves a program (the GPU machine's 78 GiB)


def summary(rows: list[dict]) -> str:
    """The rows as a Markdown table; with tensor-parallel rows (``world_size`` > 1) the
    figures are per rank, with a column saying whether that fits on H100s."""
    tp_rows = any(r.get("world_size", 1) > 1 for r in rows)
    head = ["method", "budget", "context", "weights GB", "KV cache GB", "prefill act. GB",
            "peak prefill GB", "peak decode GB", "peak total GB", "saving vs full"]
    if tp_rows:
        head[1:1] = ["ranks"]
        head.append("fits on H100s (78 GiB each)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full = {(r["context"], r["batch_size"], r.get("world_size", 1)): r for r in rows
            if r["method"] == "full" and "error" not in r}
    for r in rows:
        ranks = [str(r.get("world_size", 1))] if tp_rows else []
        if "error" in r:
            lines.append("| " + " | ".join([r["method"], *ranks, str(r["budget"]),
                                            str(r["context"]), f"error: {r['error']}"])
                         + " |" * (len(head) - 3 - len(ranks)))
            continue
        pk = r["peak_memory_bytes"]
        base = full.get((r["context"], r["batch_size"], r.get("world_size", 1)))
        saving = f"{100 * (1 - pk['total'] / base['peak_memory_bytes']['total']):.1f}%" \
            if base and r is not base else "-"
        cells = [r["method"], *ranks, str(r["budget"] or "-"), str(r["context"]),
                 f"{r['weight_bytes'] / GB:.2f}", f"{r['kv_cache_bytes'] / GB:.2f}",
                 f"{r['prefill_activation_peak_bytes'] / GB:.2f}", f"{pk['prefill'] / GB:.2f}",
                 f"{pk['decode'] / GB:.2f}", f"{pk['total'] / GB:.2f}", saving]
        if tp_rows:
            n = r.get("world_size", 1)
            cells.append(f"yes, {n}" if pk["total"] <= H100_BYTES else f"no ({n})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv), argv)


def run(a, argv=None) -> int:
    """Predict as the parsed arguments ``a`` say; the exit status."""
    if a.config not in CONFIGS:  # (the parser, built before torch, lists none)
        print(f"error: --config: unknown model shape {a.config!r} (choose from "
              f"{', '.join(CONFIGS)})", file=sys.stderr)
        return 2
    try:
        check_methods(a.methods)
        for name in ("budgets", "context"):
            if min(getattr(a, name)) <= 0:
                raise ConfigError(f"--{name} must be positive")
        if a.max_new_tokens <= 0 or a.batch_size <= 0:
            raise ConfigError("--max-new-tokens and --batch-size must be positive")
        if a.json and not Path(a.json).resolve().parent.is_dir():
            raise ConfigError(f"--json: directory {Path(a.json).resolve().parent} does not exist")
        args = ModelArgs.from_name(a.config)
        for n in a.tp:
            if n <= 0:
                raise ConfigError("--tp must be positive")
            tp.check_world(args, n)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for world in a.tp:
        for context in a.context:
            for method, budget in configurations(a.methods, a.budgets):
                try:
                    rows.append(predict(args, method, budget, context, a.max_new_tokens,
                                        a.batch_size, DTYPES[a.dtype], world=world))
                except ConfigError as e:
                    rows.append({"device": "meta", "predicted": True, "model": args.name,
                                 "method": method, "budget": budget, "context": context,
                                 "batch_size": a.batch_size, "world_size": world,
                                 "error": str(e)})
    command = command_line("predict_memory.py", argv)
    for r in rows:
        r["command"] = command
    print(summary(rows))
    print("predicted on the meta device (tensor storage only), not measured on a GPU")
    if a.json:
        write_json(a.json, rows)
        print(f"wrote {a.json}")
    return rows_exit_status(rows)


if __name__ == "__main__":
    sys.exit(run(ARGS))
