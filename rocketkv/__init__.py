"""rocketkv: a decode engine for long-context LLM inference with KV-cache compression.

    import rocketkv
    engine = rocketkv.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    print(engine.generate("What is a KV cache?", method="rocketkv", budget=256).text)

The API (``load``, ``Engine``, ``Document``, ``Result``, ``ConfigError``) lives in
``rocketkv/api.py`` and is imported on first use, so that importing a light module of the
package (``rocketkv.flags``, the command lines' ``--help``) does not load torch.

The package's layers, lowest first; a module imports only from its own layer or a lower one
(``tests/test_imports.py`` checks it):

* ``errors``, ``flags``, ``method_tables``, ``data``: the error type, the torch-free vocabulary
  of the command lines (the method tables generated from the registry) and where the data lives.
* ``model``: the transformer, in one file.
* ``kernels``: the Triton kernels and ``fuse(model)``.
* ``quantized``, ``tp``: functions applied to a model (quantized linears, tensor parallelism).
* ``cache``: the KV-cache interface, the full cache, attention and the selection machinery.
* ``compression``: one file per method, and the registry.
* ``formats``: checkpoints, GGUF files, tokenizers and chat templates.
* ``engine``: the decode step, prefill, the decode loop, sessions, documents, measurement,
  the report, the kernels' self-check.
* ``api``: the library's front (this package's names).
* ``cli``: the command lines (``generate``, ``quantize``).
* ``evals``: the accuracy and benchmark harness.
"""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.2.0"

# OpenMP threads that sleep when idle instead of spinning: on a machine other processes load,
# torch's default spin slows the CPU decode step and prefill (measured:
# results/cpu/wait-policy.md). Read once, when torch's OpenMP runtime starts, so it is set
# before torch is imported. A value of the user's own (OMP_WAIT_POLICY, GOMP_SPINCOUNT) wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

_API = ("ConfigError", "Document", "Engine", "Result", "load")
__all__ = [*_API, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        from rocketkv import api

        return getattr(api, name)
    raise AttributeError(f"module 'rocketkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
