"""Every method on one checkpoint and prompt, in one process or as one rank of ``torchrun``
(``tp.py``): rank 0 writes {"world_size", "results": {method: greedy token ids, KV bytes of
every rank, or the error}} as JSON. ``tests/test_tp.py`` runs it both ways.

    python tests/tp_run.py CHECKPOINT OUT.json
    torchrun --standalone --nproc-per-node 2 tests/tp_run.py CHECKPOINT OUT.json
"""

import json
import sys

import torch

from rocketkv import tp
from rocketkv.compression import METHODS
from rocketkv.engine.generate import CacheRequest, generate
from rocketkv.formats.checkpoint import load_model
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError

BUDGET, NEW_TOKENS = 64, 12
TEXT = ("Once upon a time there was a little girl named Lily. She loved to play outside in the "
        "park with her friends. One day she saw a big red ball under a tree. ") * 6
OPTIONS = {"omnikv": {"filter_layers": [1]}, "keydiff": {"block_size": 64}}  # omnikv: 3, 4 sparse
BUDGETS = {"omnikv": 8}  # few enough picks that a rank's own heads would choose others


def main(ckpt: str, out: str) -> int:
    torch.set_num_threads(1)
    rank, world = tp.init("cpu")
    model = load_model(ckpt, "cpu", torch.float32, shard=(rank, world))
    ids = load_tokenizer(ckpt).encode(TEXT)
    results = {}
    for name, m in METHODS.items():
        try:
            budget = BUDGETS.get(name, BUDGET) if m.budgeted else None
            r = generate(model, [ids], CacheRequest(name, budget, options=OPTIONS.get(name)),
                         max_new_tokens=NEW_TOKENS)
            results[name] = {"tokens": r["token_ids"][0], "kv_bytes": r["kv_cache_bytes"],
                             "kv_read": r["kv_bytes_per_step"], "compressed":
                             r["kv_cache_bytes"] < r["full_kv_bytes"]}
        except ConfigError as e:
            results[name] = {"error": str(e)}
    shares = tp.gather(results)
    if rank == 0:
        for name, res in results.items():
            if "error" not in res:
                res["kv_bytes"] = sum(s[name]["kv_bytes"] for s in shares)
                res["kv_read"] = sum(s[name]["kv_read"] for s in shares)
                res["same_tokens_on_every_rank"] = all(s[name]["tokens"] == res["tokens"]
                                                       for s in shares)
        with open(out, "w") as f:
            json.dump({"world_size": world, "prompt_tokens": len(ids), "results": results}, f)
    tp.shutdown()
    return 0


if __name__ == "__main__":
    tp.exit_now(main(*sys.argv[1:]))  # gloo's threads can abort the interpreter's teardown
