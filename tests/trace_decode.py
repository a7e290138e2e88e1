"""Trace each selecting method's decode step with the fused kernels the way the GPU compiles
it (``torch.compile(fullgraph=True)``, AOT functionalization), without a GPU and without
running it: prints, per method, the Triton kernels the graph holds, or the error; and for
whole decoder layers (``layer_full``, ``layer_hybrid``, ``layer_sparq_split``: the
projections' dense kernels around the cache's) the Triton kernels and the other compute
operators left to inductor. The ``_split`` cases run the split selection
(``kernels.sparse.selection_splits``). Triton must not be in interpreter mode
(``TRITON_INTERPRET`` unset): ``tests/test_kernels.py`` runs this in a subprocess.

    python tests/trace_decode.py
"""

import json
import sys

import test_kernels as tk
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

from rocketkv import kernels
from rocketkv.cache import FullKVCache
from rocketkv.kernels.fuse import FusedTransformerBlock
from rocketkv.model import precompute_rope

CASES = {"full": None, "hybrid": 6, "hybrid_page1": 9, "quest": 3, "sparq": 10,
         "sparq_strided": 10, "exact_topk": 12, "sparq_realloc": 10, "quest_split": 3,
         "exact_topk_split": 12, "sparq_realloc_split": 10,
         "layer_full": None, "layer_hybrid": 6, "layer_sparq_split": 10}
SPLIT_PAGES = 4  # for the ``_split`` cases (``kernels.sparse.SPLIT_PAGES``): 42 tokens (10
# pages of Quest's 4) split over 16 programs (4 for Quest)


class Traced(Exception):
    pass


VIEWS = ("view", "reshape", "unsqueeze", "squeeze", "expand", "permute", "transpose", "t.",
         "slice", "select", "alias", "_unsafe_view", "empty", "as_strided", "detach",
         "clone", "lift_fresh", "getitem")  # no kernel of their own (or inductor drops them)


def trace(name: str, k: int | None) -> list[str] | dict:
    graphs = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise Traced

        return run

    args = tk.model_args(8, 2, 32)
    if name in ("full", "layer_full"):  # the dense decode (attend_prefix)
        ker = FullKVCache(0, args, 1, torch.float32, "cpu", 64)
        q, kk, v = (torch.randn(1, h, 42, 32) for h in (8, 2, 2))
    else:
        _, ker, (q, kk, v) = tk.twin_caches(name.removeprefix("layer_"), k, args, 41, 1,
                                            torch.float32, "cpu")
    torch._dynamo.reset()
    pos = torch.tensor([41])
    if name.startswith("layer_"):  # a whole decoder layer, its projections' kernels included
        args.intermediate_size = 96
        layer = FusedTransformerBlock(args)  # as kernels.fuse.fuse makes a stock block
        layer.attention.kv_cache = ker
        x, rope = torch.randn(1, 1, args.dim), precompute_rope(args, 64)[pos]
        call, inputs = layer, (x, rope, pos)
    else:
        call, inputs = ker.decode, (q[:, :, 41:42], kk[:, :, 41:42], v[:, :, 41:42], pos)
    step = torch.compile(call, backend=aot_autograd(fw_compiler=forward_compiler),
                         fullgraph=True)
    try:
        with torch.no_grad():
            step(*inputs)
    except Traced:
        pass
    names, others = [], []
    for node in graphs[0].graph.nodes:
        if "triton_kernel_wrapper" in str(node.target):
            names.append(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__)
        elif node.op == "call_function" and not any(v in str(node.target) for v in VIEWS):
            others.append(str(node.target))
    return {"triton": names, "other": others} if name.startswith("layer_") else names


def main() -> int:
    kernels.set_mode("force")
    out = {}
    ops = kernels.ops()
    default = ops.SPLIT_PAGES
    for name, k in CASES.items():
        ops.SPLIT_PAGES = SPLIT_PAGES if name.endswith("_split") else default
        try:
            out[name] = trace(name.removesuffix("_split"), k)
        except Exception as e:  # noqa: BLE001 (a graph break or trace failure is the finding)
            out[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0]}"
        finally:
            ops.SPLIT_PAGES = default
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
