"""Trace each selecting method's decode step with the fused kernels the way the GPU compiles
it (``torch.compile(fullgraph=True)``, AOT functionalization), without a GPU and without
running it: prints, per method, the Triton kernels the graph holds, or the error. Triton must
not be in interpreter mode (``TRITON_INTERPRET`` unset): ``tests/test_kernels.py`` runs this
in a subprocess.

    python tests/trace_decode.py
"""

import json
import sys

import test_kernels as tk
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

import kernels
from kv_cache import FullKVCache

CASES = {"full": None, "hybrid": 6, "hybrid_page1": 9, "quest": 3, "sparq": 10,
         "sparq_strided": 10, "exact_topk": 12}


class Traced(Exception):
    pass


def trace(name: str, k: int) -> list[str]:
    graphs = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise Traced

        return run

    if name == "full":  # the dense decode (attend_prefix)
        ker = FullKVCache(0, tk.model_args(8, 2, 32), 1, torch.float32, "cpu", 64)
        q, kk, v = (torch.randn(1, h, 42, 32) for h in (8, 2, 2))
    else:
        _, ker, (q, kk, v) = tk.twin_caches(name, k, tk.model_args(8, 2, 32), 41, 1,
                                            torch.float32, "cpu")
    torch._dynamo.reset()
    step = torch.compile(ker.decode, backend=aot_autograd(fw_compiler=forward_compiler),
                         fullgraph=True)
    try:
        with torch.no_grad():
            step(q[:, :, 41:42], kk[:, :, 41:42], v[:, :, 41:42], torch.tensor([41]))
    except Traced:
        pass
    names = []
    for node in graphs[0].graph.nodes:
        if "triton_kernel_wrapper" in str(node.target):
            names.append(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__)
    return names


def main() -> int:
    kernels.set_mode("force")
    out = {}
    for name, k in CASES.items():
        try:
            out[name] = trace(name, k)
        except Exception as e:  # noqa: BLE001 (a graph break or trace failure is the finding)
            out[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0]}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
