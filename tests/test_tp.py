"""Tensor parallelism (tp.py) on CPU with gloo: ranks launched by torchrun give one process's
greedy tokens for every method, split its KV bytes, refuse world sizes that do not divide the
heads, and end in bounded time when a rank dies."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rocketkv import tp
from rocketkv.cli import generate as generate_cli
from rocketkv.cli.quantize import quantize_checkpoint
from rocketkv.compression import METHODS
from rocketkv.compression.duoattention import DuoAttentionParams
from rocketkv.formats.checkpoint import load_model, random_model, save_native
from rocketkv.model import ConfigError, ModelArgs

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "tp_run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ROCKETKV_TP_TIMEOUT": "60"}


def torchrun(n: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={n}", *args], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def single(stories_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "one.json"
    r = subprocess.run([sys.executable, str(RUN), str(stories_dir), str(out)],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_gives_one_process_tokens(world, single, stories_dir, tmp_path):
    """stories260K (8 query heads, 4 KV heads) in float32 on 2 and 4 ranks: every method's
    greedy tokens equal the single process's, on every rank; the ranks' KV bytes add up to
    the single process's (apart from the few scalars each rank keeps, and gptfast_dense's
    mask, which every rank holds whole); a method's error is the same error."""
    out = tmp_path / "tp.json"
    r = torchrun(world, str(RUN), str(stories_dir), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["world_size"] == world and single["world_size"] == 1
    assert got["prompt_tokens"] > 256  # long enough for the budget to compress
    compressed = 0
    for method, want in single["results"].items():
        res = got["results"][method]
        if "error" in want:
            assert res.get("error") == want["error"], method
            continue
        assert res["tokens"] == want["tokens"], method
        assert res["same_tokens_on_every_rank"], method
        compressed += want["compressed"]
        extra = res["kv_bytes"] - want["kv_bytes"]
        extra_read = res["kv_read"] - want["kv_read"]
        if method == "gptfast_dense":  # its (T + m)^2 bool mask is replicated, and read
            n = got["prompt_tokens"] + len(want["tokens"])
            assert extra == extra_read == (world - 1) * n * n
        else:
            # each rank's few scalars (slot offsets; OmniKV's shared selection)
            assert 0 <= extra <= (world - 1) * 0.004 * want["kv_bytes"], (method, extra)
            assert abs(extra_read) <= (world - 1) * 0.004 * want["kv_read"], method
    assert compressed >= 6  # rocketkv, snapkv_pp, streamingllm, h2o, duoattention, keydiff


def test_a_world_size_that_does_not_split_the_heads_is_refused(stories_dir):
    r = torchrun(3, "generate.py", "--checkpoint", str(stories_dir), "-p", "Once upon a time",
                 "--max-new-tokens", "4")
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: 3 ranks cannot split 8 query heads, 4 KV heads and an MLP of 172 "
                     "evenly; world sizes that work: 1, 2, 4"]  # once: rank 0 says it
    assert not re.search(r'generate(_cli)?\.py", line', r.stderr)  # no traceback of ours
    # (torchrun prints one of its own when a rank exits non-zero)


@pytest.mark.parametrize("rank,says", [("0", True), ("2", False)])
def test_a_rank_stopped_while_joining_the_group_speaks_only_as_rank_0(
        stories_dir, monkeypatch, capsys, rank, says):
    """torchrun SIGTERMs the other ranks once one exits; a rank still joining the process
    group (the race behind the refused-world-size test's rare extra line) prints the interrupt
    line only if torchrun made it rank 0, and exits 143 either way."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", rank)

    def sigterm_while_joining(device_type):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not delivered")

    monkeypatch.setattr(tp, "init", sigterm_while_joining)
    code = generate_cli.main(["--checkpoint", str(stories_dir), "-p", "Once upon a time",
                          "--max-new-tokens", "4"])
    assert code == 143
    err = capsys.readouterr().err
    assert ("error: interrupted before any token was generated" in err) == says


@pytest.mark.parametrize("rank", ["0", "2"])
def test_a_rank_other_than_0_that_refuses_the_run_waits_for_torchrun(
        stories_dir, monkeypatch, capsys, rank):
    """Every rank refuses 3 ranks for stories260K; rank 0 prints the line and returns at once,
    another rank prints nothing and waits (so that it cannot end rank 0 before it speaks)
    until torchrun's SIGTERM, then returns 2 as well."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(tp, "init", lambda device_type: (int(rank), 3))
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    start = time.monotonic()
    if rank != "0":
        timer.start()
    try:
        code = generate_cli.main(["--checkpoint", str(stories_dir), "-p", "Once upon a time",
                              "--max-new-tokens", "4"])
    finally:
        timer.cancel()
    elapsed = time.monotonic() - start
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert code == 2
    if rank == "0":
        assert err == ["error: 3 ranks cannot split 8 query heads, 4 KV heads and an MLP of 172 "
                       "evenly; world sizes that work: 1, 2, 4"] and elapsed < 10
    else:
        assert err == [] and 1.0 <= elapsed < tp.RANK0_WAIT_S
    # without the signal the wait is bounded
    monkeypatch.setattr(tp, "RANK0_WAIT_S", 0.2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(tp, "init", lambda device_type: (1, 3))
    start = time.monotonic()
    assert generate_cli.main(["--checkpoint", str(stories_dir), "-p", "Once upon a time"]) == 2
    assert 0.2 <= time.monotonic() - start < 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_dies_ends_the_others_in_bounded_time(stories_dir):
    """Two ranks started by hand; rank 1 is killed while decoding: rank 0 ends within the
    collective timeout with one error line, no traceback, status 1."""
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "2", "ROCKETKV_TP_TIMEOUT": "30"}
    cmd = [sys.executable, "generate.py", "--checkpoint", str(stories_dir), "-p",
           "Once upon a time", "--max-new-tokens", "480", "--ignore-eos", "--no-stream"]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    time.sleep(4)
    procs[1].send_signal(signal.SIGKILL)
    start = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert time.monotonic() - start < 50
    assert procs[0].returncode in (1, 2), err[-2000:]
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and ("collective" in errors[0] or "process group" in errors[0])


def test_world_sizes_and_shapes():
    args = ModelArgs.from_name("llama-3.1-70b")
    assert tp.valid_world_sizes(args) == [1, 2, 4, 8]
    with pytest.raises(ConfigError, match="world sizes that work: 1, 2, 4, 8"):
        tp.check_world(args, 16)
    loc = tp.local_args(args, 4)
    assert (loc.n_heads, loc.n_kv_heads, loc.intermediate_size, loc.head_dim, loc.dim) == \
        (16, 2, 7168, 128, 8192)


def test_sharded_weights_are_the_slices_of_the_whole(tmp_path):
    """Rank r of 2: the q, k, v rows of its heads (biases too), wo's columns of its query
    heads, w13's rows of its half of the gate and of the up projection and w2's columns of its
    half of the MLP; int8 rows keep their scales."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=96,
                     vocab_size=50, max_seq_len=64, qkv_bias=True, name="t")
    save_native(tmp_path / "float", args, random_model(args, "cpu", torch.float32,
                                                         seed=1).state_dict())
    quantize_checkpoint(str(tmp_path / "float"), "int8", None, tmp_path / "int8",
                        progress=False)
    for mode in ("float", "int8"):
        whole = load_model(str(tmp_path / mode), "cpu", torch.float32)
        for rank in range(2):
            part = load_model(str(tmp_path / mode), "cpu", torch.float32, shard=(rank, 2))
            a, b = whole.layers[0].attention, part.layers[0].attention
            D = 16
            rows = list(range(rank * 2 * D, (rank + 1) * 2 * D)) + \
                list(range(64 + rank * D, 64 + (rank + 1) * D)) + \
                list(range(96 + rank * D, 96 + (rank + 1) * D))
            assert torch.equal(b.wqkv.weight, a.wqkv.weight[rows])
            assert torch.equal(b.wqkv_bias, a.wqkv_bias[rows])
            assert torch.equal(b.wo.weight, a.wo.weight[:, rank * 32:(rank + 1) * 32])
            f, g = whole.layers[0].feed_forward, part.layers[0].feed_forward
            mlp = list(range(rank * 48, (rank + 1) * 48))
            assert torch.equal(g.w13.weight, f.w13.weight[mlp + [96 + i for i in mlp]])
            assert torch.equal(g.w2.weight, f.w2.weight[:, rank * 48:(rank + 1) * 48])
            if mode == "int8":
                assert torch.equal(b.wqkv.scales, a.wqkv.scales[rows])
                assert torch.equal(g.w2.scales, f.w2.scales)
            assert (part.args.n_heads, part.args.n_kv_heads) == (2, 1)
            assert b.n_heads == 2 and part.tp["args"].n_heads == 4


def test_duoattention_keeps_each_ranks_own_retrieval_heads():
    """Retrieval heads are chosen over every KV head, then each rank keeps its own,
    renumbered from 0 (stories260K cannot reach DuoAttention's retrieval budgets, above 640
    tokens, so this is checked on the parameters)."""
    duo = METHODS["duoattention"]
    args = ModelArgs.from_name("llama-3.1-8b")  # 8 KV heads
    params = DuoAttentionParams(budget=1024, compression_ratio=8.0, sink=128, recent=512,
                                retrieval_heads=5, needs_pattern=True,
                                heads=[[0, 3, 4, 7], [], [5]])
    assert duo.shard_params(params, 0, 2, args).heads == [[0, 3], [], []]
    assert duo.shard_params(params, 1, 2, args).heads == [[0, 3], [], [1]]
    assert duo.shard_params(params, 3, 4, args).heads == [[1], [], []]
    assert params.heads == [[0, 3, 4, 7], [], [5]]  # the whole model's, unchanged


def test_every_checkpoint_form_loads_a_ranks_share(tmp_path):
    """``load_model(shard=(r, 2))`` of a float, an int8 and an int4 (groups of 32)
    checkpoint, and of random weights, holds rank r's share: each column-parallel layer gives
    the rank's rows of the whole layer's output, the row-parallel layers' outputs over the
    ranks' input slices add up to the whole layer's, and random weights are the slices of the
    whole model's."""
    args = ModelArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=256,
                     vocab_size=64, max_seq_len=64, qkv_bias=True, name="t")
    whole = random_model(args, "cpu", torch.float32, seed=3)
    save_native(tmp_path / "f", args, whole.state_dict())
    quantize_checkpoint(str(tmp_path / "f"), "int8", None, tmp_path / "q8", progress=False)
    quantize_checkpoint(str(tmp_path / "f"), "int4", 32, tmp_path / "q4", progress=False)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    D = 32
    qkv = [list(range(r * 64, (r + 1) * 64)) + list(range(128 + r * D, 128 + (r + 1) * D)) +
           list(range(192 + r * D, 192 + (r + 1) * D)) for r in range(2)]
    for form in ("f", "q8", "q4"):
        full = load_model(str(tmp_path / form), "cpu", torch.float32).layers[0]
        parts = [load_model(str(tmp_path / form), "cpu", torch.float32, shard=(r, 2))
                 for r in range(2)]
        assert all(p.tp["world_size"] == 2 and p.args.n_kv_heads == 1 for p in parts)
        layers = [p.layers[0] for p in parts]
        for layer in layers:  # the all-reduce hooks need a process group: off here
            layer.attention.wo._forward_hooks.clear()
            layer.feed_forward.w2._forward_hooks.clear()
        a, f = full.attention, full.feed_forward
        for r, layer in enumerate(layers):
            got = layer.attention.wqkv(x[:, :128]) + layer.attention.wqkv_bias
            want = (a.wqkv(x[:, :128]) + a.wqkv_bias)[:, qkv[r]]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            mlp = list(range(r * 128, (r + 1) * 128))
            torch.testing.assert_close(layer.feed_forward.w13(x[:, :128]),
                                       f.w13(x[:, :128])[:, mlp + [256 + i for i in mlp]])
        wo = sum(layer.attention.wo(x[:, r * 64:(r + 1) * 64]) for r, layer in enumerate(layers))
        w2 = sum(layer.feed_forward.w2(x[:, r * 128:(r + 1) * 128])
                 for r, layer in enumerate(layers))
        for got, want in ((wo, a.wo(x[:, :128])), (w2, f.w2(x))):
            # the quantized kernels round their bf16 output: a sum of two roundings
            tol = 1e-5 if form == "f" else 1e-2 * float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=0, atol=tol)
    sd = whole.state_dict()
    for r in range(2):
        part = random_model(args, "cpu", torch.float32, seed=3, shard=(r, 2))
        for name, t in part.state_dict().items():
            assert torch.equal(t, tp.shard_tensor(name, sd[name], args, r, 2)), name


def test_the_compiled_decode_step_traces_the_collectives(stories_dir, tmp_path):
    """``--compile`` under torchrun: the all-reduces inside the compiled step (functional
    collectives; gloo on CPU), the same tokens as one eager process."""
    text = tmp_path / "p.txt"
    text.write_text("Once upon a time there was a little girl named Lily. She loved to play")
    common = ["--checkpoint", str(stories_dir), "--prompt", str(text), "--max-new-tokens", "10",
              "--method", "rocketkv", "--budget", "32"]
    one = subprocess.run([sys.executable, "generate.py", *common, "--json",
                          str(tmp_path / "one.json")], capture_output=True, text=True, env=ENV,
                         cwd=ROOT, timeout=240)
    assert one.returncode == 0, one.stderr[-2000:]
    r = torchrun(2, "generate.py", *common, "--compile", "--json", str(tmp_path / "two.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert b["compiled"] and b["world_size"] == 2 and not a["compiled"]
    assert a["token_ids"] == b["token_ids"]
