"""The fused decode step, applied to a model from outside (as gpt-fast's ``tp.py`` and
``quantize.py`` change a model): ``fuse(model)`` turns each stock decoder block of ``model.py``
into a ``FusedTransformerBlock`` and the model into a ``FusedTransformer``, whose decode steps
run the dense kernels (``kernels/dense.py``) where they run and fall back to ``model.py``'s
own ``forward`` everywhere else. ``model.py`` stays the one readable path and the reference.

What ``FusedTransformerBlock.forward_fused`` computes in four launches around the cache's is
what ``model.py`` computes in ``TransformerBlock.forward``, ``RMSNorm.forward``,
``Attention.forward``/``qkv``/``out``, ``apply_rope`` and ``FeedForward.forward`` (and the
final norm and LM head of ``Transformer.forward``). A model whose code differs runs as written,
so ``fuse`` refuses:

* by class: a block, attention, MLP or norm whose type is not exactly ``model.py``'s
  (``type(m) is FeedForward``: a subclass that edits the MLP is refused), or a module with
  its own ``forward`` (or the attention's ``qkv``/``out``) set on the instance;
* by code: when the source of one of those functions, or of ``model.apply_rope`` as the
  attention calls it (a patched ``model.apply_rope`` too), differs from the code the kernels
  implement. ``STOCK_CODE`` holds a fingerprint of each (its tokens without comments,
  docstring or layout: ``code_print``), so an edit of ``model.py`` itself (the MLP's
  activation, the RoPE) switches the fused path off until the kernels are checked against the
  new code and the fingerprint updated (``tests/test_fuse.py`` fails on a stock model that
  is not fused).

A refused block or LM head keeps its class and runs as written; one ``note:`` line on stderr
per model says what is off and why (where the dense kernels would run on the model's device).
At run time a fused block still falls back to the stock ``forward`` when the dense kernels are
off for the device (``kernels.dense_in_use``), its cache does not allow them
(``dense_kernels`` attribute) or a linear is not one the kernels read (``kernel_weight``: a
bias, hooks such as tensor parallelism's all-reduce, int4 in another layout), or a part of
it carries forward hooks.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import sys
import textwrap
import tokenize
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch import Tensor

from rocketkv import kernels
from rocketkv import model as llama
from rocketkv.model import Attention, FeedForward, RMSNorm, Transformer, TransformerBlock

# code_print of each function the fused path stands for (model.py as the kernels implement it)
STOCK_CODE = {
    "RMSNorm.forward": "64f6816c2a8de436",
    "FeedForward.forward": "0a973badfd259e8d",
    "Attention.forward": "cb8c8e4faac1d026",
    "Attention.qkv": "abe3045a17c138f1",
    "Attention.out": "ca609f8c02d5e102",
    "apply_rope": "5421d59e3f44d4c5",
    "TransformerBlock.forward": "cacadb75c8a397f0",
    "Transformer.forward": "137d55738b3884e8",
}
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
         tokenize.ENDMARKER}
_prints: dict[object, str] = {}  # code object -> code_print
_noted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the note printed


def code_print(fn: Callable) -> str:
    """A fingerprint of the function ``fn``'s source (16 hex digits of a SHA-256): its tokens
    joined by spaces, without comments, blank lines, indentation or its docstring, so that a
    reflowed comment or docstring keeps it and any edit of the code changes it. The source is
    read from ``fn.__code__`` (a wrapper is not its wrapped function); a callable without
    Python source gives a string that matches no fingerprint."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return f"not a Python function: {type(fn).__name__}"
    if code not in _prints:
        try:
            src = textwrap.dedent("".join(inspect.getsourcelines(code)[0]))
            body = getattr(ast.parse(src).body[0], "body", [])  # a lambda's line has none
            doc = set()
            if body and isinstance(body[0], ast.Expr) and \
                    isinstance(body[0].value, ast.Constant) and \
                    isinstance(body[0].value.value, str):
                doc = set(range(body[0].lineno, body[0].end_lineno + 1))
            tokens = [t.string for t in tokenize.generate_tokens(io.StringIO(src).readline)
                      if t.type not in _SKIP and t.start[0] not in doc]
        except (OSError, TypeError, SyntaxError, tokenize.TokenError):
            return "source unavailable"
        _prints[code] = hashlib.sha256(" ".join(tokens).encode()).hexdigest()[:16]
    return _prints[code]


def _stock_functions() -> dict[str, Callable]:
    """The functions ``STOCK_CODE`` names, as ``model.py`` defines them now (``apply_rope``:
    the name the attention's ``qkv`` looks up, a patched module attribute included)."""
    return {"RMSNorm.forward": RMSNorm.forward, "FeedForward.forward": FeedForward.forward,
            "Attention.forward": Attention.forward, "Attention.qkv": Attention.qkv,
            "Attention.out": Attention.out,
            "apply_rope": Attention.qkv.__globals__.get("apply_rope", llama.apply_rope),
            "TransformerBlock.forward": TransformerBlock.forward,
            "Transformer.forward": Transformer.forward}


def code_changes() -> list[str]:
    """The names of ``STOCK_CODE`` whose code in ``model.py`` differs from the fingerprint."""
    return [name for name, fn in _stock_functions().items() if code_print(fn) != STOCK_CODE[name]]


def kernel_weight(layer: nn.Module) -> tuple[Tensor, Tensor | None, int] | None:
    """What the dense decode kernels read in place of ``layer`` (``kernels.dense.linear``'s
    ``weight``, ``scales``, ``groupsize``): a float ``nn.Linear``'s weight (no bias), or a
    quantized layer's (``quantized.py``'s ``kernel_weight()``: int8, int4 in its nibble
    layout); None for a layer with hooks (tensor parallelism's all-reduce) or another kind."""
    if layer._forward_hooks or layer._forward_pre_hooks:
        return None
    if type(layer) is nn.Linear:
        return (layer.weight, None, 0) if layer.bias is None and \
            layer.weight.is_floating_point() else None
    get = getattr(layer, "kernel_weight", None)
    return get() if get is not None else None


def _hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


_PARTS = (("attention", Attention, ("forward", "qkv", "out")),
          ("feed_forward", FeedForward, ("forward",)),
          ("attention_norm", RMSNorm, ("forward",)), ("ffn_norm", RMSNorm, ("forward",)))


def _stock_parts(block: nn.Module) -> bool:
    """Whether ``block``'s parts are exactly ``model.py``'s classes (the run-time check)."""
    return all(type(getattr(block, name, None)) is cls for name, cls, _ in _PARTS)


class FusedTransformerBlock(TransformerBlock):
    """A stock ``TransformerBlock`` whose decode step runs the dense kernels where they run
    (``fusable``), else ``TransformerBlock.forward``. Made by ``fuse`` (the class of the
    block is swapped; its modules, parameters and cache are the block's)."""

    def forward(self, x: Tensor, rope: Tensor, input_pos: Tensor) -> Tensor:
        """Decode step. ``x`` (B, 1, dim), ``rope`` (1, D/2, 2), ``input_pos`` (1,) int64."""
        if kernels.dense_in_use(x.device) and self.fusable():
            return self.forward_fused(x, rope, input_pos)
        return super().forward(x, rope, input_pos)

    def fusable(self) -> bool:
        """Whether ``forward_fused`` computes this layer: stock parts without hooks, linears
        the kernels read (``kernel_weight``: float or quantized, no hooks, not
        tensor-parallel) and a cache that allows it (``dense_kernels``)."""
        a, f = self.attention, self.feed_forward
        return _stock_parts(self) and getattr(a.kv_cache, "dense_kernels", False) and \
            not _hooked(a, f, self.attention_norm, self.ffn_norm) and \
            all(kernel_weight(m) is not None for m in (a.wqkv, a.wo, f.w13, f.w2))

    def forward_fused(self, x: Tensor, rope: Tensor, input_pos: Tensor) -> Tensor:
        """``forward`` in the dense kernels (``kernels/dense.py``), four launches around the
        cache's: [norm, q/k/v, RoPE, the token's write], attention, [output projection,
        residual], [norm, gate/up, SwiGLU], [down projection, residual]."""
        a, cache = self.attention, self.attention.kv_cache
        store = cache.token_store(input_pos)
        if store is None:  # the cache must see k and v: the kernel writes them to a scratch
            k = x.new_empty(x.shape[0], a.n_kv_heads, 1, a.head_dim)  # "cache" of one slot
            v = torch.empty_like(k)
            where = (k, v, torch.zeros_like(input_pos), None, *kernels.no_aux(k))
        else:
            where = store
        w, scales, group = kernel_weight(a.wqkv)
        q = kernels.qkv_store(x, self.attention_norm.weight, self.attention_norm.eps, w,
                              a.wqkv_bias, rope, where, a.n_heads, scales, group)
        if store is None:
            y = cache.decode(q, k, v, input_pos)
        else:
            y = cache.attend_stored(q, input_pos)
        w, scales, group = kernel_weight(a.wo)
        h = kernels.linear(y.transpose(1, 2).flatten(2), w, residual=x, scales=scales,
                           groupsize=group)
        w, scales, group = kernel_weight(self.feed_forward.w13)
        g = kernels.linear(h, w, self.ffn_norm.weight, self.ffn_norm.eps, swiglu=True,
                           scales=scales, groupsize=group)
        w, scales, group = kernel_weight(self.feed_forward.w2)
        return kernels.linear(g, w, residual=h, scales=scales, groupsize=group)


class FusedTransformer(Transformer):
    """A stock ``Transformer`` whose decode step ends in the final norm and LM head as one
    kernel where the dense kernels run (and the head is one they read), else
    ``Transformer.forward``. Made by ``fuse``."""

    def forward(self, tokens: Tensor, input_pos: Tensor, block=None) -> Tensor:
        """Decode step: ``tokens`` (B, 1) int64 at ``input_pos`` (1,) int64 -> logits (B,
        vocab) in the model dtype; ``block`` as ``Transformer.forward`` takes it (the CPU's
        per-layer compiled step)."""
        head = None
        if kernels.dense_in_use(tokens.device) and type(self.norm) is RMSNorm and \
                not _hooked(self.norm):
            head = kernel_weight(self.output)
        if head is None:
            return super().forward(tokens, input_pos, block)
        rope = self.rope[input_pos]  # (1, D/2, 2)
        x = self.tok_embeddings(tokens)  # (B, 1, dim)
        for layer in self.layers:
            x = layer(x, rope, input_pos) if block is None else block(layer, x, rope, input_pos)
        w, scales, group = head  # norm + LM head in one kernel
        return kernels.linear(x, w, self.norm.weight, self.norm.eps, scales=scales,
                              groupsize=group)[:, -1]


def _edited(module: nn.Module, cls: type, methods: tuple[str, ...]) -> str | None:
    """Why ``module`` is not a stock ``cls`` (its type, or a method set on the instance)."""
    if type(module) is not cls:
        kind = type(module)
        return f"{kind.__module__}.{kind.__qualname__}, not model.{cls.__name__}"
    own = [m for m in methods if m in vars(module)]
    return f"its own {'/'.join(own)} on the instance" if own else None


def block_refusal(block: nn.Module) -> str | None:
    """Why ``block`` cannot become a ``FusedTransformerBlock`` (by class: the block, its
    attention, MLP or norms; see the module's docstring), or None."""
    if type(block) not in (TransformerBlock, FusedTransformerBlock):
        kind = type(block)
        return f"the block is {kind.__module__}.{kind.__qualname__}, not model.TransformerBlock"
    if "forward" in vars(block):
        return "the block has its own forward on the instance"
    for name, cls, methods in _PARTS:
        why = _edited(getattr(block, name, None), cls, methods)
        if why is not None:
            return f"{name} is {why}"
    return None


def head_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s final norm and LM head cannot become a ``FusedTransformer``'s, or None."""
    if type(model) not in (Transformer, FusedTransformer):
        kind = type(model)
        return f"the model is {kind.__module__}.{kind.__qualname__}, not model.Transformer"
    if "forward" in vars(model):
        return "the model has its own forward on the instance"
    why = _edited(model.norm, RMSNorm, ("forward",))
    return None if why is None else f"norm is {why}"


def refusals(model: nn.Module) -> list[str]:
    """What ``fuse`` leaves to ``model.py``'s code in ``model`` and why: one entry per reason
    (``"layers 0, 3: feed_forward is ..."``, ``"LM head: ..."``, or every part when the code
    of ``model.py`` differs from ``STOCK_CODE``); empty when everything is fused."""
    changed = code_changes()
    if changed:
        return [f"model.py's {', '.join(changed)} differ from the code the kernels implement "
                "(kernels/fuse.py STOCK_CODE)"]
    by_reason: dict[str, list[int]] = {}
    for i, block in enumerate(model.layers):
        why = block_refusal(block)
        if why is not None:
            by_reason.setdefault(why, []).append(i)
    out = [f"{'layer' if len(ix) == 1 else 'layers'} {', '.join(map(str, ix))}: {why}"
           for why, ix in by_reason.items()]
    why = head_refusal(model)
    return out + ([f"LM head: {why}"] if why is not None else [])


def fuse(model: Transformer) -> Transformer:
    """Turn ``model`` (``model.Transformer``, float or quantized by ``quantized.py``) into its
    fused form in place and return it: each stock block becomes a ``FusedTransformerBlock``,
    the model a ``FusedTransformer`` (the modules' classes are swapped; parameters, buffers,
    hooks and caches stay). Idempotent. Parts that are not stock (``refusals``) keep their
    code, and where the dense kernels would run on the model's device one line ``note: ...``
    on stderr says so, once per model. Raises nothing for an edited model: it runs as
    written."""
    reasons = refusals(model)
    stock_code = not code_changes()
    for block in model.layers:  # a block edited since an earlier fuse goes back to its code
        if stock_code and block_refusal(block) is None:
            block.__class__ = FusedTransformerBlock
        elif type(block) is FusedTransformerBlock:
            block.__class__ = TransformerBlock
    if stock_code and head_refusal(model) is None:
        model.__class__ = FusedTransformer
    elif type(model) is FusedTransformer:
        model.__class__ = Transformer
    device = model.device
    if reasons and _noted.get(model) != reasons and kernels.dense_in_use(device):
        _noted[model] = reasons
        print("note: the fused dense decode kernels are off for part of this model, which "
              f"runs there as written: {'; '.join(reasons)}", file=sys.stderr)
    return model


def fused_layers(model: nn.Module) -> int:
    """How many of ``model``'s blocks decode through the dense kernels now: fused blocks
    whose ``fusable()`` holds (caches attached)."""
    return sum(isinstance(b, FusedTransformerBlock) and bool(b.fusable()) for b in model.layers)
