"""Compile every fused kernel (kernels/sparse.py, kernels/dense.py) for a GPU architecture
without a GPU.

    python tools/compile_kernels.py                  # sm_90 (H100/H200), llama-3.1-8b, bf16
    python tools/compile_kernels.py --arch 100 --json /tmp/regs.json
    python tools/compile_kernels.py --config qwen2.5-0.5b --dtype float32
    python tools/compile_kernels.py --runs rocketkv,dense --no-table  # some runs only

Triton's front end and the ``ptxas`` its wheel bundles turn each kernel, at the configurations
the engine launches for a model's shape (``--checkpoint``, a named config: its head dim and
query group, padded to powers of two and the group to at least 16; its projections at batch 1
and 16, with q/k/v biases where the model has them) and cache dtype (``--dtype``: 16-bit data
meets the tensor cores' 16-bit dots, float32 the "ieee" ones), into GPU
code, and ``ptxas -v`` reports registers and spills per thread. This catches what Triton's
interpreter (the CPU tests) does not check: code that only the GPU compiler rejects, and
register spills. It says nothing about speed.

Two lists are compiled. The table (``configurations``, ``dense_configurations``) names each
kernel's constexpr variants, its other integers left generic. The runs (``--runs``, all by
default) are the launches themselves: the engine's own decode-step code (a method's cache
``decode``, and the dense path's ``qkv_store``, ``attend_stored`` and projections) runs on
the ``meta`` device at the model's shape with a recorder in place of each kernel launch, so
every argument is what a GPU run passes (RocketKV @256's 740 and 1171 pages: page lists of
1024 and 2048 registers; k above 512; Quest's split selection; SparQ's reallocation; batch 1,
16 and 64: ``BLOCK_M`` 64), and each is specialised as Triton specialises it when it
launches: an integer equal to 1 becomes a constant, a multiple of 16 (and a pointer at a
multiple of 16 bytes) is marked divisible by 16 (``triton``'s own ``native_specialize_impl``).
Code compiled without those marks is not the code a GPU runs.

Exit status 1 when a kernel fails to compile,
2 when triton or its ptxas is missing or ``TRITON_INTERPRET`` is set (the kernels are then
interpreted, not compiled).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: tools/_here.py)
import torch
from torch import Tensor

from rocketkv import kernels
from rocketkv.cli.common import OneLineParser, write_json
from rocketkv.compression import build_caches
from rocketkv.flags import DTYPE_NAMES, add_config_option
from rocketkv.model import CONFIGS, ModelArgs

DTYPES = {"bfloat16": ("*bf16", "native"), "float16": ("*fp16", "native"),  # pointers, tl.dot
          "float32": ("*fp32", "ieee")}  # (cli.DTYPES: what --dtype accepts)


def configurations(sparse, args: ModelArgs, dtype: str) -> list[tuple]:
    """(kernel, pointer dtypes, constexprs, num_warps) for every launch shape the engine uses
    on a cache of ``dtype`` at the shape of ``args`` (``kernels.sparse``'s blocks: ``D_BLOCK``
    the head dim's power of two, ``G_BLOCK`` the query group's, at least 16)."""
    S = sparse
    T, dot = DTYPES[dtype]
    D, G = S._pow2(args.head_dim), max(16, S._pow2(args.n_heads // args.n_kv_heads))
    out = []
    for aux in (kernels.AUX_SUMMARY, kernels.AUX_DIM_MAJOR):
        out.append((S._write_token_kernel, dict(k_cache=T, v_cache=T, aux=T,
                                                k_new=T, v_new=T, slot_ptr="*i64"),
                    {"AUX": aux, "D_BLOCK": D}, 4))
    for mode, two in ((S.MODE_SOFTMAX, True), (S.MODE_SOFTMAX, False), (S.MODE_BOUND, True),
                      (S.MODE_BOUND, False)):
        out.append((S._paged_select_kernel, dict(q_ptr=T, rows_ptr=T, last_ptr="*i64",
                                                 off_ptr="*i64", scores_ptr="*fp32",
                                                 pages_ptr="*i32", take_ptr="*i32"),
                    {"MODE": mode, "TWO_BOUNDS": two, "HAS_OFFSET": True, "DOT": dot,
                     "G_BLOCK": G, "D_BLOCK": D, "BLOCK": S.SCORE_BLOCK,
                     "PR": 0 if two else S.SELECT_REGISTER_PAGES, "SEL": S.SELECT_BLOCK},
                    S.NUM_WARPS))
    for splits, page in ((1, 5), (1, 1), (4, 23), (1, 1024)):
        chunk = min(S._pow2(page), S.ATTEND_TOKENS)
        out.append((S._attend_pages_kernel, dict(q_ptr=T, k_cache=T, v_cache=T,
                                                 pages_ptr="*i32", take_ptr="*i32",
                                                 o_ptr="*fp32", lse_ptr="*fp32", out_ptr=T,
                                                 scale="fp32"),
                    {"SPLITS": splits, "DOT": dot, "G_BLOCK": G, "D_BLOCK": D,
                     "CHUNK": chunk, "PAGES_BLOCK": S.ATTEND_TOKENS // chunk}, S.NUM_WARPS))
    for mode, two, page, realloc in ((S.MODE_SOFTMAX, True, 16, False),
                                     (S.MODE_SOFTMAX, False, 1, False),
                                     (S.MODE_BOUND, True, 16, False),
                                     (S.MODE_BOUND, False, 1, False),
                                     (S.MODE_SOFTMAX, False, 1, True)):  # SparQ reallocating
        chunk, pages_block = S._attend_blocks(page)
        out.append((S._select_attend_kernel,
                    dict(q_ptr=T, rows_ptr=T, k_cache=T, v_cache=T,
                         last_ptr="*i64", off_ptr="*i64", scores_ptr="*fp32",
                         pages_ptr="*i32", take_ptr="*i32", out_ptr=T, vm_ptr="*fp32",
                         scale="fp32"),
                    {"MODE": mode, "TWO_BOUNDS": two, "HAS_OFFSET": True, "REALLOC": realloc,
                     "DOT_S": dot,
                     "DOT_A": dot, "G_BLOCK": G, "D_BLOCK": D, "BLOCK": S.SCORE_BLOCK,
                     "PR": S.SELECT_REGISTER_PAGES if two else 0, "SEL": S.SELECT_BLOCK,
                     "CHUNK": chunk, "PAGES_BLOCK": pages_block}, S.NUM_WARPS))
    for splits in (1, 64):
        out.append((S._attend_prefix_kernel, dict(q_ptr=T, k_cache=T, v_cache=T,
                                                  last_ptr="*i64", off_ptr="*i64", o_ptr="*fp32",
                                                  lse_ptr="*fp32", out_ptr=T, scale="fp32"),
                    {"SPLITS": splits, "HAS_OFFSET": splits == 1, "DOT": dot,
                     "G_BLOCK": G, "D_BLOCK": D, "TOK": S.ATTEND_TOKENS}, S.PREFIX_WARPS))
    out.append((S._merge_splits_kernel, dict(o_ptr="*fp32", lse_ptr="*fp32", out_ptr=T),
                {"SPLITS": 64, "G_BLOCK": G, "D_BLOCK": D}, 4))
    # the split selection: hybrid's pages (4 splits at 128K), SparQ's and Exact-TopK's tokens
    # (16 at 32K, 64 at 128K; Exact-TopK stores its logits in pass 1 and reads them in pass 2)
    sel_ptrs = dict(q_ptr=T, rows_ptr=T, last_ptr="*i64", off_ptr="*i64", ml_ptr="*fp32",
                    logits_ptr="*fp32")
    for splits, two, store in ((4, True, False), (64, False, False), (16, False, True)):
        out.append((S._split_lse_kernel, sel_ptrs,
                    {"SPLITS": splits, "TWO_BOUNDS": two, "HAS_OFFSET": True, "STORE": store,
                     "DOT": dot, "G_BLOCK": G, "D_BLOCK": D, "BLOCK": S.SCORE_BLOCK},
                    S.NUM_WARPS))
    for mode, splits, two, load in ((S.MODE_SOFTMAX, 4, True, False),
                                    (S.MODE_SOFTMAX, 64, False, False),
                                    (S.MODE_SOFTMAX, 16, False, True), (S.MODE_BOUND, 64, False,
                                                                        False)):
        out.append((S._split_choose_kernel,
                    dict(sel_ptrs, scores_ptr="*fp32", cand_pages="*i32", cand_take="*i32"),
                    {"MODE": mode, "SPLITS": splits, "TWO_BOUNDS": two, "HAS_OFFSET": True,
                     "LOAD": load, "DOT": dot, "G_BLOCK": G, "D_BLOCK": D,
                     "BLOCK": S.SCORE_BLOCK, "PR": S.SPLIT_PAGES}, S.NUM_WARPS))
    for attend, page, realloc in ((True, 23, False), (True, 1, False), (False, 1, False),
                                  (True, 1, True)):
        chunk, pages_block = S._attend_blocks(page)
        out.append((S._split_merge_kernel,
                    dict(q_ptr=T, k_cache=T, v_cache=T, last_ptr="*i64",
                         off_ptr="*i64", scores_ptr="*fp32", cand_pages="*i32",
                         cand_take="*i32", pages_ptr="*i32", take_ptr="*i32", out_ptr=T,
                         ml_ptr="*fp32", vm_ptr="*fp32", scale="fp32"),
                    {"SPLITS": 16, "HAS_OFFSET": True, "ATTEND": attend, "REALLOC": realloc,
                     "DOT": dot, "G_BLOCK": G,
                     "D_BLOCK": D, "BLOCK": S.SCORE_BLOCK, "CR": S.SELECT_CANDIDATES,
                     "CHUNK": chunk, "PAGES_BLOCK": pages_block}, S.NUM_WARPS))
    return out


def dense_configurations(dense, args: ModelArgs, dtype: str) -> list[tuple]:
    """The dense kernels' launches at the shape of ``args`` (``launch_config``'s blocks) in
    ``dtype``, one batch row (the GEMV) and 16 (``tl.dot``): q/k/v with each auxiliary-key
    format (with the model's biases), the output and down projections with the residual,
    gate/up with SwiGLU, the LM head after the norm; then int8 and int4 (group 128, the stored
    nibbles that ``quantized.int4_layout`` keeps where these kernels run, in any dtype)
    weights at q/k/v and gate/up, batch 1 and 16."""
    E = dense
    T, dot = DTYPES[dtype]
    D, dim, inter, vocab = args.head_dim, args.dim, args.intermediate_size, args.vocab_size
    qkv, bias = (args.n_heads + 2 * args.n_kv_heads) * D, args.qkv_bias
    pointers = {name: T for name in ("x_ptr", "w_ptr", "out_ptr", "norm_ptr", "bias_ptr",
                                     "res_ptr", "kc_ptr", "vc_ptr", "aux_ptr")}
    pointers.update(rope_ptr="*fp32", pos_ptr="*i64", off_ptr="*i64", eps="fp32", sz_ptr=T)
    launches = [(E.EPI_QKV, dim, qkv, True, aux) for aux in (kernels.AUX_NONE,
                                                             kernels.AUX_SUMMARY,
                                                             kernels.AUX_DIM_MAJOR)]
    launches += [(E.EPI_RESIDUAL, args.n_heads * D, dim, False, 0),
                 (E.EPI_SWIGLU, dim, inter, True, 0), (E.EPI_RESIDUAL, inter, dim, False, 0),
                 (E.EPI_PLAIN, dim, vocab, True, 0)]
    out = []
    for M in (1, 16):
        for epi, K, n, norm, aux in launches:
            if M > 1 and aux:  # one format stands for the rest at batch 16
                continue
            bm, bn, bk, _ = E.launch_config(epi, M, K, n, D)
            out.append((E._linear_kernel, pointers,
                        {"NORM": norm, "BIAS": bias and epi == E.EPI_QKV, "EPI": epi,
                         "AUX": aux, "HAS_OFFSET": aux > 0, "QUANT": E.QUANT_NONE,
                         "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "DOT": dot}, E.NUM_WARPS))
    for quant, w in ((E.QUANT_INT8, "*i8"), (E.QUANT_INT4, "*u8")):
        for M in (1, 16):
            for epi, K, n, aux in ((E.EPI_QKV, dim, qkv, kernels.AUX_SUMMARY),
                                   (E.EPI_SWIGLU, dim, inter, 0)):
                bm, bn, bk, _ = E.launch_config(epi, M, K, n, D)
                if quant == E.QUANT_INT4:
                    bk = min(bk, 128)
                out.append((E._linear_kernel, dict(pointers, w_ptr=w),
                            {"NORM": True, "BIAS": bias and epi == E.EPI_QKV, "EPI": epi,
                             "AUX": aux, "HAS_OFFSET": aux > 0, "QUANT": quant, "BLOCK_M": bm,
                             "BLOCK_N": bn, "BLOCK_K": bk, "DOT": dot}, E.NUM_WARPS))
    return out


NEW_TOKENS = 64  # the decode steps of the runs' caches (scripts/bench.py's --new-tokens)
RUNS = {  # name -> decode steps (method, budget, prompt tokens, options) whose launches compile
    "full": [("full", None, 32768, {}), ("full", None, 131008, {})],
    "rocketkv": [("rocketkv", 256, 32768, {}), ("rocketkv", 256, 131008, {})],  # 740, 1171
    "rocketkv-2048": [("rocketkv", 2048, 32768, {})],  # k 1024: paged_select, attend_pages
    "hybrid": [("hybrid", 256, 32768, {}), ("hybrid", 256, 131008, {})],
    "quest": [("quest", 256, 32768, {}), ("quest", 256, 131008, {"page_size": 16}),
              ("quest", 2048, 32768, {})],  # one program; split; k 1024
    "sparq": [("sparq", 256, 32768, {}), ("sparq", 256, 131008, {}),
              ("sparq", 256, 1984, {"sparq_reallocate": True}),
              ("sparq", 256, 32768, {"sparq_reallocate": True})],
    "exact_topk": [("exact_topk", 256, 32768, {}), ("exact_topk", 256, 131008, {})],
    "dense": [],  # the projections alone: float, int8 and int4 weights at batch 1, 16, 64
}
DENSE_BATCHES = (1, 16, 64)


class _Recorder:
    """Stands for ``wrap(kernel)``: ``[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, launches: list, label: str):
        self.launches, self.label = launches, label

    def __call__(self, kernel):
        def launch(*args, **kwargs):
            self.launches.append((self.label, kernel, args, kwargs))

        return type("Launch", (), {"__getitem__": lambda _, grid: launch})()


def record(sparse, dense, label: str, step) -> list[tuple]:
    """(label, kernel, args, kwargs) of every kernel launch of ``step()``, run with the kernels
    forced and each launch recorded instead of run (the tensors may live on ``meta``)."""
    launches: list[tuple] = []
    saved = sparse.wrap, dense.wrap
    sparse.wrap = dense.wrap = _Recorder(launches, label)
    mode = kernels.set_mode("force")
    try:
        with torch.no_grad():
            step()
    finally:
        sparse.wrap, dense.wrap = saved
        kernels.set_mode(mode)
    return launches


def _dense_step(args: ModelArgs, dtype: torch.dtype, batch: int, cache, pos: Tensor,
                weights: str) -> None:
    """The dense path's decode step of one layer and the LM head on ``meta`` tensors:
    ``qkv_store`` into ``cache``'s token store, its ``attend_stored``, the output projection
    with the residual, gate/up with SwiGLU, down with the residual, the LM head after the
    norm; ``weights`` "float", "int8" or "int4" (group 128)."""
    dev = torch.device("meta")
    D, dim, H = args.head_dim, args.dim, args.n_heads

    def weight(n: int, k: int) -> tuple[Tensor, Tensor | None, int]:
        if weights == "int8":
            return (torch.empty(n, k, dtype=torch.int8, device=dev),
                    torch.empty(n, dtype=dtype, device=dev), 0)
        if weights == "int4":
            return (torch.empty(n, k // 2, dtype=torch.uint8, device=dev),
                    torch.empty(k // 128, n, 2, dtype=dtype, device=dev), 128)
        return torch.empty(n, k, dtype=dtype, device=dev), None, 0

    def act(n: int) -> Tensor:
        return torch.empty(batch, 1, n, dtype=dtype, device=dev)

    gain = torch.empty(dim, dtype=dtype, device=dev)
    qkv = (H + 2 * args.n_kv_heads) * D
    w, sc, g = weight(qkv, dim)
    bias = torch.empty(qkv, dtype=dtype, device=dev) if args.qkv_bias else None
    rope = torch.empty(1, D // 2, 2, dtype=torch.float32, device=dev)
    store = cache.token_store(pos)
    q = kernels.qkv_store(act(dim), gain, 1e-5, w, bias, rope, tuple(store), H, scales=sc,
                          groupsize=g)
    y = cache.attend_stored(q, pos)
    w, sc, g = weight(dim, H * D)
    h = kernels.linear(y.reshape(batch, 1, H * D), w, residual=act(dim), scales=sc,
                       groupsize=g)
    w, sc, g = weight(2 * args.intermediate_size, dim)
    m = kernels.linear(h, w, gain, 1e-5, swiglu=True, scales=sc, groupsize=g)
    w, sc, g = weight(dim, args.intermediate_size)
    h = kernels.linear(m, w, residual=h, scales=sc, groupsize=g)
    if weights == "float":  # the LM head keeps the model's dtype
        kernels.linear(h, torch.empty(args.vocab_size, dim, dtype=dtype, device=dev), gain,
                       1e-5)


def run_launches(sparse, dense, args: ModelArgs, dtype: str, runs: list[str]) -> list[tuple]:
    """The launches of ``runs`` (``RUNS``'s names) at the shape of ``args`` in ``dtype``: each
    method's cache ``decode`` (the token's write and the selection and attention, as
    ``--kernels sparse`` runs them) and the dense path's step over the same cache (batch 1);
    for ``dense`` a Full-KV cache at 32K and every weight format at each of
    ``DENSE_BATCHES``."""
    dt = getattr(torch, dtype)
    layer = dataclasses.replace(args, n_layers=1)
    dev = torch.device("meta")
    out = []

    def caches(method, budget, T, options, batch):
        return build_caches(method, layer, batch_size=batch, prompt_len=T,
                            max_new_tokens=NEW_TOKENS, budget=budget, dtype=dt, device=dev,
                            **options)[0]

    def tensors(batch):
        H, Hkv, D = args.n_heads, args.n_kv_heads, args.head_dim
        return (torch.empty(batch, H, 1, D, dtype=dt, device=dev),
                *(torch.empty(batch, Hkv, 1, D, dtype=dt, device=dev) for _ in range(2)))

    for name in runs:
        for method, budget, T, options in RUNS[name]:
            cache = caches(method, budget, T, options, 1)
            pos = torch.tensor([T], device=dev)
            label = f"{method}@{budget or 'all'} {T}" + "".join(f" {k}" for k in options)
            out += record(sparse, dense, label, lambda c=cache, p=pos: c.decode(*tensors(1),
                                                                                  p))
            out += record(sparse, dense, label + " dense",
                          lambda c=cache, p=pos: _dense_step(args, dt, 1, c, p, "float"))
        if name == "dense":
            for batch in DENSE_BATCHES:
                for weights in ("float", "int8", "int4"):
                    cache = caches("full", None, 32768, {}, batch)
                    pos = torch.tensor([32768], device=dev)
                    out += record(sparse, dense, f"dense {weights} batch {batch}",
                                  lambda c=cache, p=pos, b=batch, w=weights:
                                  _dense_step(args, dt, b, c, p, w))
    return out


def specialised(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, int]:
    """(signature, constexprs, attrs, num_warps) of one recorded launch, specialised as
    Triton's launcher specialises it (``native_specialize_impl``): an integer equal to 1 a
    constant, an integer that is a multiple of 16 and a pointer at a multiple of 16 bytes
    marked ``tt.divisibility`` 16 (a ``meta`` tensor's base counts as aligned, as the CUDA
    caching allocator's are: its views' storage offsets decide)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        name = p.name
        if p.is_constexpr:
            sig[name], constexprs[name] = "constexpr", kwargs[name]
            continue
        value = args[i]
        if isinstance(value, torch.Tensor):
            ty = native_specialize_impl(BaseBackend, torch.empty(1, dtype=value.dtype), False,
                                        True, True)[0]
            spec = "D" if value.storage_offset() * value.element_size() % 16 == 0 else ""
        else:
            ty, spec = native_specialize_impl(BaseBackend, value, False,
                                              not p.do_not_specialize,
                                              not p.do_not_specialize_on_alignment)
        if ty == "constexpr":
            sig[name], constexprs[name] = "constexpr", value
        else:
            sig[name] = ty
            if spec and "D" in spec:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs, kwargs.get("num_warps", 4)


def captured_configurations(sparse, dense, args: ModelArgs, dtype: str,
                            runs: list[str]) -> list[tuple]:
    """(kernel, signature, constexprs, num_warps, attrs, runs) of every distinct specialised
    launch of ``runs`` (``run_launches``), with the runs that launch it."""
    seen: dict[str, list] = {}
    for label, kernel, a, kw in run_launches(sparse, dense, args, dtype, runs):
        sig, constexprs, attrs, warps = specialised(kernel, a, kw)
        key = repr((kernel.__name__, sorted(sig.items()), sorted(constexprs.items()),
                    sorted(attrs), warps))
        if key in seen:
            seen[key][-1].append(label)
        else:
            seen[key] = [kernel, sig, constexprs, warps, attrs, [label]]
    return [tuple(v) for v in seen.values()]


def compile_one(kernel, pointers: dict, constexprs: dict, num_warps: int, attrs: dict | None = None,
                runs: list[str] | None = None, *, arch: int, ptxas: Path,
                float_args: str = "fp32") -> dict:
    """Compile one configuration (``attrs``: Triton's ``tt.divisibility`` marks by argument
    index; ``runs``: the captured runs that launch it; ``float_args``: how the float scalars
    arrive, "fp32" as Triton's launcher passes a Python float, "fp64" or "constexpr" (a
    Python float in the kernel's code) as torch.compile's Inductor passed them on the H200);
    registers and spill bytes from ``ptxas -v``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "i32" for n in kernel.arg_names}
    sig.update(pointers)
    sig.update({c: "constexpr" for c in constexprs})
    floats = [n for n, t in sig.items() if t == "fp32"]  # scalars ("*fp32" is a pointer)
    if float_args == "constexpr":  # Inductor may bake a module's float (RMSNorm's eps) in
        constexprs = {**constexprs, **{n: 0.125 for n in floats}}
    sig.update({n: "constexpr" if float_args == "constexpr" else float_args for n in floats})
    name = f"{kernel.__name__} {constexprs}"
    extra = {}
    if runs is not None:
        divisible = [kernel.arg_names[i[0]] for i in sorted(attrs or {})]
        ones = [c for c in constexprs if c not in floats and
                not kernel.params[kernel.arg_names.index(c)].is_constexpr]
        name += f" divisible by 16: {','.join(divisible) or '-'}; equal to 1: " \
                f"{','.join(ones) or '-'}"
        extra = {"runs": runs, "divisible_by_16": divisible, "equal_to_1": ones}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs,
                                            attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps})
    except Exception as e:  # noqa: BLE001 (any compiler error is the finding)
        return {"kernel": name, **extra,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    r = subprocess.run([str(ptxas), "-v", "--gpu-name", gpu, f.name, "-o", os.devnull],
                       capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores", r.stderr)
    return {"kernel": name, "num_warps": num_warps,
            "registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "shared_bytes": compiled.metadata.shared, **extra}


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90)")
    add_config_option(p, choices=[n for n in CONFIGS if ModelArgs.from_name(n).head_dim >= 16],
                      help="the model shape, a named config (default llama-3.1-8b)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16",
                   help="the model's and cache's dtype (default bfloat16)")
    p.add_argument("--runs", default="all", metavar="NAMES",
                   help=f"the captured runs whose launches compile, comma-separated, of "
                        f"{', '.join(RUNS)}; 'all' (default) or 'none'")
    p.add_argument("--no-table", action="store_true",
                   help="compile the captured runs only, not the table of variants")
    p.add_argument("--float-args", choices=["fp32", "fp64", "constexpr"], default="fp32",
                   help="how the kernels' float scalars (the attention scale, RMSNorm's "
                        "epsilon) arrive: fp32 as a direct launch passes them (default); fp64 "
                        "or constexpr as torch.compile's Inductor passes them")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    shape = ModelArgs.from_name(args.config)
    runs = list(RUNS) if args.runs == "all" else [] if args.runs == "none" else \
        [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        p.error(f"--runs: unknown run(s) {', '.join(unknown)} (known: {', '.join(RUNS)}, all, "
                f"none)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: TRITON_INTERPRET=1 is set: the kernels would be interpreted, not "
              "compiled", file=sys.stderr)
        return 2
    sparse = kernels.ops()  # imported now: TRITON_INTERPRET was checked above
    if sparse is None:
        print(f"error: {kernels.missing()}", file=sys.stderr)
        return 2
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        print(f"error: no ptxas at {ptxas}", file=sys.stderr)
        return 2
    dense = importlib.import_module("rocketkv.kernels.dense")  # imported by kernels.ops() above
    table = [] if args.no_table else configurations(sparse, shape, args.dtype) + \
        dense_configurations(dense, shape, args.dtype)
    captured = captured_configurations(sparse, dense, shape, args.dtype, runs)
    rows = [compile_one(*c, arch=args.arch, ptxas=ptxas, float_args=args.float_args)
            for c in table + captured]
    for r in rows:
        if "error" in r:
            print(f"FAIL {r['kernel']}: {r['error']}")
        else:
            print(f"ok   {r['kernel']}: {r['registers']} registers, {r['spill_bytes']} bytes "
                  f"spilled, {r['shared_bytes']} bytes shared, {r['num_warps']} warps")
    if args.json:
        write_json(args.json, rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
