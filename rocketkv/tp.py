"""Tensor parallelism over ``torch.distributed`` (gpt-fast's scheme), methods sharded by KV head.

Launched with ``torchrun --nproc-per-node N generate.py ...`` (or ``scripts/bench.py``): each
process is one rank; NCCL on GPUs (one GPU a rank, ``LOCAL_RANK``), gloo on CPU.

* **Weights** (``shard_tensor``): the fused q/k/v projection is column-parallel (each rank keeps
  the rows of its query heads, then of its KV heads, then their values, and their biases), so
  a rank holds H / N query heads and H_kv / N KV heads whole, with their query groups; the
  output projection ``wo`` is row-parallel (its columns of those heads). The MLP's fused gate
  and up projection ``w13`` is column-parallel (a rank keeps its span of the gate's rows and
  the same span of the up projection's), ``w2`` row-parallel. The row-parallel outputs are
  summed over the ranks by a forward hook (two all-reduces per layer, functional collectives,
  so ``torch.compile`` traces them into the decode graph and CUDA graphs capture them). The
  embedding, norms and classifier are replicated, as gpt-fast keeps them: every rank
  computes the same logits and samples the same token. ``checkpoint.load_model(shard=...)``
  slices every checkpoint form before it reaches the device (``shard_state_dict``: float
  tensors; int8 rows with their scales; int4's packed rows and, for the row-parallel layers,
  whole groups of inputs with their scales and zeros; random weights drawn whole one tensor
  at a time and sliced), so a rank never holds the whole model.
* **Caches**: every rank builds its method's caches for its own KV heads (``build_caches``
  with the global config for the method's parameters, ``local_args`` for the shapes). Every
  method selects per KV head (a query group never spans ranks), so a rank compresses its
  heads exactly as one process would; the exceptions take one collective: OmniKV's token
  selection, the max over every head (``all_reduce_max``, once per filter layer and step),
  and DuoAttention's retrieval heads, chosen over all heads before each rank keeps its own.
* **Errors**: a world size that does not divide the query heads, the KV heads and the MLP
  width is refused before any weight loads, naming the sizes that work (``check_world``);
  collectives time out after ``ROCKETKV_TP_TIMEOUT`` seconds (default 120), so a rank that
  died does not hang the others.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from rocketkv.model import ConfigError, ModelArgs, Transformer
from rocketkv.quantized import output_dim

DEFAULT_TIMEOUT_S = 120


def world_size() -> int:
    """Ranks of the process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank: the process group's; before the group is joined, the ``RANK``
    ``torchrun`` gave it (a rank stopped while still joining, as ``torchrun`` ends the rest
    once one rank exits, must not speak as rank 0); 0 when not launched. ``world_size()``
    stays 1 until the group is joined, so shard nothing by this pair before ``init``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    value = os.environ.get("RANK", "0")
    return int(value) if launched() and value.isdigit() else 0


RANK0_WAIT_S = 30.0  # how long another rank that refused the run waits for torchrun to end it


def wait_for_rank_0() -> None:
    """On a rank other than 0 that refused the run (every rank runs the same checks, and only
    rank 0 prints the error line): wait up to ``RANK0_WAIT_S`` for ``torchrun`` to end this
    rank. ``torchrun`` ends every rank once one exits, so a rank that exited first could end
    rank 0 before it printed. Returns on ``KeyboardInterrupt`` (``generate``'s SIGTERM
    handler raises it) or after the wait."""
    try:
        time.sleep(RANK0_WAIT_S)
    except KeyboardInterrupt:
        pass


def launched() -> bool:
    """Whether ``torchrun`` (or any launcher setting ``WORLD_SIZE`` > 1) started us."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device_type: str) -> tuple[int, int]:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...): NCCL for ``cuda`` (this rank's GPU is ``LOCAL_RANK``), gloo
    otherwise; collectives time out after ``ROCKETKV_TP_TIMEOUT`` seconds. Returns (rank,
    world size); (0, 1) when not launched that way.

    Raises:
        ConfigError: the backend is missing or the group cannot be formed.
    """
    if not launched():
        return 0, 1
    if dist.is_initialized():
        return rank(), world_size()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_available() or (backend == "nccl" and not dist.is_nccl_available()) or \
            (backend == "gloo" and not dist.is_gloo_available()):
        raise ConfigError(f"tensor parallelism on {device_type} needs torch.distributed's "
                          f"{backend} backend, which this torch build lacks")
    timeout = float(os.environ.get("ROCKETKV_TP_TIMEOUT", DEFAULT_TIMEOUT_S))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"cannot form the process group ({backend}): "
                          f"{str(e).splitlines()[0]}") from None
    return rank(), world_size()


def valid_world_sizes(args: ModelArgs) -> list[int]:
    """World sizes that split ``args``'s query heads, KV heads and MLP width evenly."""
    g = math.gcd(math.gcd(args.n_heads, args.n_kv_heads), args.intermediate_size)
    return [n for n in range(1, g + 1) if g % n == 0]


def check_world(args: ModelArgs, world: int) -> None:
    """Raises ConfigError, naming the sizes that work, when ``world`` ranks cannot share the
    model ``args`` by KV head."""
    if world > 1 and world not in valid_world_sizes(args):
        sizes = ", ".join(map(str, valid_world_sizes(args)))
        raise ConfigError(f"{world} ranks cannot split {args.n_heads} query heads, "
                          f"{args.n_kv_heads} KV heads and an MLP of {args.intermediate_size} "
                          f"evenly; world sizes that work: {sizes}")


def local_args(args: ModelArgs, world: int) -> ModelArgs:
    """The shapes one of ``world`` ranks holds: H / N query heads, H_kv / N KV heads, an MLP
    of width / N (the hidden size and head dim unchanged)."""
    if world == 1:
        return args
    return dataclasses.replace(args, n_heads=args.n_heads // world,
                               n_kv_heads=args.n_kv_heads // world,
                               intermediate_size=args.intermediate_size // world,
                               head_dim=args.head_dim)


def _all_reduce_output(_module: nn.Module, _inputs: Any, output: Tensor) -> Tensor:
    """Forward hook of a row-parallel layer: its partial output summed over the ranks."""
    return funcol.all_reduce(output, "sum", dist.group.WORLD)


def all_reduce_max(x: Tensor) -> Tensor:
    """``x`` maxed element-wise over the ranks (itself with one rank): OmniKV's token scores
    across every KV head. A functional collective, traced by ``torch.compile``."""
    if world_size() == 1:
        return x
    return funcol.all_reduce(x, "max", dist.group.WORLD)


def _rows(w: Tensor, spans: list[tuple[int, int]], dim: int = 0) -> Tensor:
    return torch.cat([w.narrow(dim, a, b - a) for a, b in spans], dim=dim).contiguous()


def _spans(args: ModelArgs, rank_: int, world: int) -> dict[str, Any]:
    """Rank ``rank_``'s rows of the fused q/k/v projection (its query heads, KV heads and
    their values) and its span of the MLP width."""
    loc = local_args(args, world)
    D, H, Hkv, Hl, Hkvl = args.head_dim, args.n_heads, args.n_kv_heads, loc.n_heads, \
        loc.n_kv_heads
    q = (rank_ * Hl * D, (rank_ + 1) * Hl * D)
    k = (H * D + rank_ * Hkvl * D, H * D + (rank_ + 1) * Hkvl * D)
    v = ((H + Hkv) * D + rank_ * Hkvl * D, (H + Hkv) * D + (rank_ + 1) * Hkvl * D)
    inter = (rank_ * loc.intermediate_size, (rank_ + 1) * loc.intermediate_size)
    width = args.intermediate_size  # the up projection's rows follow the gate's in w13
    return {"qkv": [q, k, v], "q": q, "mlp": inter,
            "gate_up": [inter, (width + inter[0], width + inter[1])]}


def _role(name: str, spans: dict[str, Any]) -> tuple[list | None, tuple | None]:
    """(row spans, column span) rank keeps of the tensor ``name`` of the whole model (a
    parameter, or a stored tensor of a quantized checkpoint: ``X.int8_weight``...); (None,
    None): replicated."""
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 4:
        return None, None
    module = ".".join(parts[2:4])
    if module in ("attention.wqkv", "attention.wqkv_bias"):
        return spans["qkv"], None
    if module == "feed_forward.w13":  # the gate's rows, then the up projection's
        return spans["gate_up"], None
    if module == "attention.wo":
        return None, spans["q"]
    if module == "feed_forward.w2":
        return None, spans["mlp"]
    return None, None


def shard_tensor(name: str, t: Tensor, args: ModelArgs, rank_: int, world: int,
                 groupsize: int | None = None) -> Tensor:
    """Rank ``rank_``'s share of the tensor ``name`` of the whole model ``args``: a float
    weight or bias, or a quantized layer's stored tensor (int8 weight (out, in) and per-row
    scales (out,); int4 packed weight (out, in / 2) and scales_and_zeros (in / groupsize,
    out, 2)). Replicated tensors come back as they are.

    Raises:
        ConfigError: an int4 column span that splits a group of ``groupsize`` inputs.
    """
    if world == 1:
        return t
    rows, cols = _role(name, _spans(args, rank_, world))
    leaf = name.rsplit(".", 1)[-1]
    if rows is not None:
        return _rows(t, rows, dim=output_dim(leaf))
    if cols is None or leaf == "int8_scales":  # per-row scales hold for any column slice
        return t
    a, b = cols
    if leaf == "int4_weight":  # two inputs a byte
        return t[:, a // 2:b // 2].contiguous()
    if leaf == "int4_scales_and_zeros":
        if a % groupsize or b % groupsize:
            raise ConfigError(f"{name}: a rank's {b - a} input features split the int4 "
                              f"groups of {groupsize}; use fewer ranks or int8")
        return t[a // groupsize:b // groupsize].contiguous()
    return t[:, a:b].contiguous()


def shard_state_dict(sd: dict[str, Tensor], args: ModelArgs, rank_: int, world: int,
                     groupsize: int | None = None) -> dict[str, Tensor]:
    """``shard_tensor`` of every tensor of a state dict (float, or a quantized checkpoint's
    stored tensors): what ``checkpoint.load_model(shard=...)`` materializes, so a rank reads
    only its share of a memory-mapped checkpoint onto its device."""
    check_world(args, world)
    return {n: shard_tensor(n, t, args, rank_, world, groupsize) for n, t in sd.items()}


def attach(model: Transformer, rank_: int, world: int, args: ModelArgs,
           reduce: bool = True) -> Transformer:
    """Mark ``model``, built at rank ``rank_``'s shapes (``local_args``), as that rank of the
    whole model ``args``: ``model.tp`` = (rank, world size, the global config), and the
    all-reduce hooks on ``wo`` and ``w2`` (``reduce``; False for a model on the meta device
    that only predicts memory, ``scripts/predict_memory.py --tp``)."""
    model.tp = {"rank": rank_, "world_size": world, "args": args}
    if world > 1 and reduce:
        for layer in model.layers:
            layer.attention.wo.register_forward_hook(_all_reduce_output)
            layer.feed_forward.w2.register_forward_hook(_all_reduce_output)
    return model


def failure(e: BaseException) -> str:
    """One line for a failed collective (gloo and NCCL raise RuntimeError or its subclass
    ``DistBackendError``)."""
    return (f"a collective across the ranks failed (did another rank stop, or time out after "
            f"ROCKETKV_TP_TIMEOUT?): {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def exit_now(code: int) -> None:
    """End the process with ``code`` at once, streams flushed, skipping the interpreter's
    teardown: a rank's last step under ``torchrun`` (gloo's threads can abort that teardown
    with "terminate called without an active exception", after a failed collective always)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def gather(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a list of one without a process group)."""
    if world_size() == 1:
        return [value]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, value)
    return out


def shutdown() -> None:
    """Leave the process group, if one was formed, once every rank is done with it (a rank
    that tears its connections down while another still uses them aborts at exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
