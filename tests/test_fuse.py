"""``kernels.fuse``: the fused decode step applied to a model from outside, refused for a model
whose norm, MLP, attention or RoPE is not ``model.py``'s, so that an edited model runs exactly
as written (in Triton's interpreter on CPU, kernels forced, at tiny shapes)."""

import ast
import importlib
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from rocketkv import kernels
from rocketkv import model as llama
from rocketkv.compression import build_caches
from rocketkv.engine.generate import CacheRequest, generate
from rocketkv.kernels import fuse as fusing
from rocketkv.kernels.fuse import FusedTransformer, FusedTransformerBlock, fuse, refusals
from rocketkv.model import FeedForward, ModelArgs, Transformer, TransformerBlock

ROOT = Path(__file__).resolve().parents[1]
OPS = kernels.ops()
needs_kernels = pytest.mark.skipif(
    OPS is None or (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="the kernels on CPU tensors need triton's interpreter")
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48,
                 vocab_size=40, max_seq_len=64)  # head dim 16: the kernels' smallest


class ScaledMLP(FeedForward):
    """A researcher's edit of the MLP: GELU for SiLU, the output doubled."""

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return 2 * self.w2(F.gelu(gate) * up)


def random_model(edit_mlp=False):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    if edit_mlp:
        for layer in model.layers:
            edited = ScaledMLP(ARGS)
            edited.load_state_dict(layer.feed_forward.state_dict())
            layer.feed_forward = edited
    return model.eval()


@pytest.fixture
def forced(monkeypatch):
    previous, dense = kernels.set_mode("force"), kernels.set_dense(True)
    monkeypatch.setattr(importlib.import_module("rocketkv.kernels.dense"), "TARGET_PROGRAMS", 8)
    yield
    kernels.set_mode(previous)
    kernels.set_dense(dense)


def decode(model, mode, T=12, steps=2):
    """Logits (steps, 1, vocab) of greedy decode steps after a prefill of T random tokens,
    with the full cache, the kernels in ``mode``."""
    caches = build_caches("full", ARGS, batch_size=1, prompt_len=T, max_new_tokens=steps + 1,
                          budget=None, dtype=torch.float32, device="cpu")
    model.setup_caches(caches, T + steps + 1)
    tokens = torch.randint(0, ARGS.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    previous = kernels.set_mode(mode)
    try:
        with torch.no_grad():
            tok, pos, out = model.prefill(tokens).argmax(-1, keepdim=True), torch.tensor([T]), []
            for _ in range(steps):
                out.append(model(tok, pos))
                tok, pos = out[-1].argmax(-1, keepdim=True), pos + 1
    finally:
        kernels.set_mode(previous)
    return torch.stack(out)


@needs_kernels
def test_an_edited_mlp_runs_as_written_with_the_kernels_forced(forced, capsys):
    """A model whose MLP is a subclass (GELU, output doubled) is not fused: with the kernels
    forced its logits are its own PyTorch path's (the LM head and the attention still in
    kernels: within float32 rounding), far from the stock model's through the fused blocks;
    one ``note:`` line names the refused part, once however often the model is fused."""
    stock = fuse(random_model())
    assert all(type(b) is FusedTransformerBlock for b in stock.layers)
    stock_fused = decode(stock, "force")
    edited = random_model(edit_mlp=True)
    capsys.readouterr()
    fuse(edited)
    fuse(edited)  # idempotent, noted once
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "feed_forward is test_fuse.ScaledMLP" in notes[0] and \
        "layers 0, 1" in notes[0], notes
    assert all(type(b) is TransformerBlock for b in edited.layers)
    assert type(edited) is FusedTransformer  # the stock LM head is fused still
    as_written = decode(edited, "off")
    forced_run = decode(edited, "force")
    assert torch.allclose(forced_run, as_written, atol=1e-4, rtol=1e-4), \
        (forced_run - as_written).abs().max()
    assert (forced_run - stock_fused).abs().max() > 100 * (forced_run - as_written).abs().max()


@needs_kernels
def test_generate_fuses_a_stock_model_and_says_so(forced, capsys):
    """``generate`` fuses the model it is given (``dense_kernels``: fused blocks ran), with
    the PyTorch path's greedy tokens and no note; an edited MLP keeps its code (no dense
    blocks ran)."""
    model, runs = random_model(), {}
    for mode in ("off", "force"):
        kernels.set_mode(mode)
        runs[mode] = generate(model, list(range(3, 15)), CacheRequest("full"), max_new_tokens=3)
    assert type(model) is FusedTransformer and runs["force"]["dense_kernels"]
    assert runs["force"]["token_ids"] == runs["off"]["token_ids"]
    assert "note:" not in capsys.readouterr().err
    kernels.set_mode("force")
    edited = generate(random_model(edit_mlp=True), list(range(3, 15)), CacheRequest("full"),
                      max_new_tokens=3)
    assert edited["fused_kernels"] and not edited["dense_kernels"]


def test_a_stock_model_is_fused_whole():
    """``model.py`` as shipped is the code the kernels implement (``STOCK_CODE``: when this
    fails after an edit of model.py, check the kernels compute the new code, then update the
    fingerprints); every block and the model become fused, twice the same."""
    assert fusing.code_changes() == []
    model = random_model()
    assert refusals(model) == []
    assert fuse(fuse(model)) is model and type(model) is FusedTransformer
    assert all(type(b) is FusedTransformerBlock for b in model.layers)


def test_an_edit_of_model_py_itself_is_refused(monkeypatch):
    """An edit made in ``model.py`` rather than by a subclass (its MLP's or its RoPE's code)
    switches the fused path off for every part, blocks fused earlier included; comments and
    docstrings are not code."""
    model = fuse(random_model())

    def forward(self, x):  # the stock MLP with another activation
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.gelu(gate) * up)

    def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
        """Another docstring."""
        xp = x.float().reshape(*x.shape[:-1], x.shape[-1] // 2, 2)  # (B, T, n, D/2, 2)
        cos, sin = rope[:, None, :, 0], rope[:, None, :, 1]  # another comment
        out = torch.stack([xp[..., 0] * cos - xp[..., 1] * sin,
                           xp[..., 1] * cos + xp[..., 0] * sin], dim=-1)
        return out.flatten(-2).type_as(x)

    def rotate_half(x, rope):
        return x

    with monkeypatch.context() as m:
        m.setattr(FeedForward, "forward", forward)
        assert "FeedForward.forward" in refusals(model)[0]
        fuse(model)
        assert type(model) is Transformer and \
            all(type(b) is TransformerBlock for b in model.layers)
    assert fusing.code_print(apply_rope) == fusing.code_print(llama.apply_rope)
    with monkeypatch.context() as m:
        m.setattr(llama, "apply_rope", rotate_half)
        assert fusing.code_changes() == ["apply_rope"]
    assert fusing.code_changes() == []
    assert type(fuse(model)) is FusedTransformer


def test_refusals_by_class_name_the_part():
    """A subclassed block, attention or norm, a method set on an instance and a subclassed
    model each keep their code; the rest of the model is fused."""

    class MyBlock(TransformerBlock):
        pass

    class MyModel(Transformer):
        pass

    model = random_model()
    model.layers[0] = MyBlock(ARGS)
    model.layers[1].attention.qkv = lambda x, rope: None
    reasons = refusals(model)
    assert reasons[0].startswith("layer 0: the block is test_fuse.") and \
        "MyBlock, not model.TransformerBlock" in reasons[0]
    assert reasons[1] == "layer 1: attention is its own qkv on the instance"
    fuse(model)
    assert [type(b) for b in model.layers] == [MyBlock, TransformerBlock]
    assert type(model) is FusedTransformer
    other = MyModel(ARGS)
    other.layers[1].ffn_norm = type("Norm", (llama.RMSNorm,), {})(ARGS.dim, 1e-5)
    reasons = refusals(other)
    assert reasons[0].startswith("layer 1: ffn_norm is ") and reasons[1].startswith(
        "LM head: the model is test_fuse.")
    fuse(other)
    assert type(other) is MyModel and type(other.layers[0]) is FusedTransformerBlock


def test_model_py_imports_nothing_from_kernels():
    """The model is one readable path: ``model.py`` imports no module of ``kernels/``."""
    tree = ast.parse((ROOT / "rocketkv" / "model.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n == "kernels" or n.startswith("kernels.")]
