"""DuoAttention's retrieval-head identification for any model: one gate per KV head, learned.
The library behind ``scripts/duo_identify.py`` (its command line).

The optimization of the DuoAttention paper (Xiao et al. 2025, Sec. 3.2): every KV head (layer
i, head j) gets a gate alpha_ij in [0, 1] (initial 1), and the attention output of each of its
query heads is the mix ``alpha * full_attention + (1 - alpha) * streaming_attention``, the
streaming attention seeing only the first ``sink`` and the last ``recent`` positions (causal).
The model's weights are frozen; only the gates train, with Adam, on

    L = L_distill + lambda * mean_ij |alpha_ij|,
    L_distill = mean over the last l positions j and the hidden dims of (H_full[j] - H_mixed[j])^2

with H the final hidden states (after the final norm) of the model with full attention
everywhere and of the gated model, l the answer's tokens, lambda = ``--reg-weight`` (0.05).
Both terms are means, so lambda does not depend on the model's width or head count: with sums
(the paper's formula read literally) the distillation term is width x l times larger and, on
SmolLM2, 80 steps left every gate above 0.94 (``results/duo_identify/sum_loss_first_run``).
After each step the gates are clipped to [0, 1]. A head whose streaming attention changes the
answer's hidden states (one that retrieves from the middle of the context) keeps its gate up;
the L1 term pulls the others down. The paper runs 2000 steps at lr 0.02; the defaults here (80
steps, lr 0.05) let a CPU run move a gate all the way within its steps.

Data: synthetic passkey retrieval (the paper's "multiple passkey" set): a haystack of ``--text``
(default TinyStories text, not the Paul Graham essays the accuracy harness evaluates on) cut to
a length drawn from ``--context``, ``--passkeys`` sentences "The pass key {i} is {digits}.
Remember it." at random depths in [0.05, 0.95], then "What are the pass keys? The pass keys
are" and the answer, the keys in order. Deterministic under ``--seed``.

Output in ``--out``: ``full_attention_heads.tsv`` (one row per layer, one tab-separated gate per
KV head: the format of DuoAttention's released patterns, read by ``--duo-patterns``) and
``config.json`` (the settings, the command line, the loss history and the time taken).
It runs on CUDA where one exists, else on CPU (``--device``): the paper trains at up
to 128K tokens on 8 GPUs; a CPU run uses short contexts, a bounded number of steps, and a
correspondingly small streaming window.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rocketkv.cli.common import check_positive, resolve_device
from rocketkv.evals.prompts import read_texts, text_files
from rocketkv.formats.checkpoint import load_model, resolve_checkpoint
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError, Transformer, precompute_rope


def streaming_mask(T: int, sink: int, recent: int, device=None) -> Tensor:
    """(T, T) bool: query i sees key j iff j <= i and (j < sink or j > i - recent)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j <= i) & ((j < sink) | (j > i - recent))


def gated_forward(model: Transformer, tokens: Tensor, gates: Tensor | None, sink: int,
                  recent: int) -> Tensor:
    """Final hidden states (B, T, dim), after the final norm, of ``tokens`` (B, T) at positions
    0..T-1 with every attention layer mixing full and streaming attention per KV head.

    Args:
        gates: (n_layers, n_kv_heads) in [0, 1] (1: full attention), or None: full attention
            everywhere (the distillation target). Gradients flow to ``gates`` only when the
            model's weights are frozen by the caller.
    """
    B, T = tokens.shape
    a = model.args
    G = a.n_heads // a.n_kv_heads
    rope = model.rope[:T]
    mask = None if gates is None else streaming_mask(T, sink, recent, tokens.device)
    x = model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers):
        attn = layer.attention
        q, k, v = attn.qkv(layer.attention_norm(x), rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)
        if gates is not None:
            ys = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=G > 1)
            g = gates[i].repeat_interleave(G).view(1, a.n_heads, 1, 1).to(y.dtype)
            y = g * y + (1 - g) * ys
        x = x + attn.out(y)
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.norm(x)


def passkey_sample(haystack: Sequence[int], encode, length: int, n_keys: int, digits: int,
                   rng: random.Random) -> tuple[list[int], int]:
    """One multiple-passkey sequence of exactly ``length`` tokens and its answer's length.

    Args:
        haystack: token ids of the filler text (used cyclically from a random start).
        encode: str -> ids without BOS.
    Returns:
        (ids, l): the sequence and how many of its last tokens are the answer.
    Raises:
        ConfigError: the keys and the question do not fit in ``length``.
    """
    keys = ["".join(rng.choice("0123456789") for _ in range(digits)) for _ in range(n_keys)]
    needles = [encode(f" The pass key {i + 1} is {key}. Remember it.")
               for i, key in enumerate(keys)]
    question = encode(" What are the pass keys? The pass keys are")
    answer = encode(" " + ", ".join(keys) + ".")
    fill = length - sum(map(len, needles)) - len(question) - len(answer)
    if fill < n_keys:
        raise ConfigError(f"{n_keys} pass keys of {digits} digits and the question do not fit "
                          f"in {length} tokens")
    start = rng.randrange(len(haystack))
    filler = [haystack[(start + t) % len(haystack)] for t in range(fill)]
    cuts = sorted(round(fill * rng.uniform(0.05, 0.95)) for _ in range(n_keys))
    ids, prev = [], 0
    for cut, needle in zip(cuts, needles):
        ids += filler[prev:cut] + needle
        prev = cut
    ids += filler[prev:] + question + answer
    return ids, len(answer)


def identify(model: Transformer, samples, steps: int, *, lr: float = 0.02,
             reg_weight: float = 0.05, sink: int = 32, recent: int = 64,
             progress: bool = True) -> tuple[Tensor, list[dict[str, float]]]:
    """Train one gate per KV head (module docstring) and return them with the loss history.

    Args:
        samples: callable ``step -> (ids (1, T) int64 on the model's device, l)``.
        steps: optimizer steps (one sequence each).
    Returns:
        gates (n_layers, n_kv_heads) float32 in [0, 1] on CPU, and per step {"distill",
        "reg", "mean_gate"}.
    """
    a = model.args
    for p in model.parameters():
        p.requires_grad_(False)
    device = model.device
    if model.rope.shape[0] < a.max_seq_len:
        model.rope = precompute_rope(a, a.max_seq_len, device)
    gates = torch.ones(a.n_layers, a.n_kv_heads, device=device, requires_grad=True)
    opt = torch.optim.Adam([gates], lr=lr)
    history = []
    bar = _progress(steps, progress)
    for step in range(steps):
        ids, answer = samples(step)
        with torch.no_grad():
            target = gated_forward(model, ids, None, sink, recent)[:, -answer:].float()
        mixed = gated_forward(model, ids, gates, sink, recent)[:, -answer:].float()
        distill = (mixed - target).pow(2).mean()
        reg = gates.abs().mean()
        loss = distill + reg_weight * reg
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            gates.clamp_(0.0, 1.0)
        history.append({"distill": float(distill.detach()), "reg": float(reg.detach()),
                        "mean_gate": float(gates.detach().mean())})
        if bar is not None:
            bar.set_postfix(distill=f"{float(distill.detach()):.3g}",
                            gate=f"{float(gates.detach().mean()):.3f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    return gates.detach().float().cpu(), history


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", file=sys.stderr)


def write_pattern(out: Path, gates: Tensor, config: dict[str, Any]) -> list[Path]:
    """``full_attention_heads.tsv`` (layers x KV heads) and ``config.json`` in ``out``, each
    written under a temporary name and renamed (never half-written)."""
    out.mkdir(parents=True, exist_ok=True)
    tsv = "\n".join("\t".join(f"{float(g):.6e}" for g in row) for row in gates) + "\n"
    paths = []
    for name, text in (("full_attention_heads.tsv", tsv),
                       ("config.json", json.dumps(config, indent=1) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
        paths.append(out / name)
    return paths


def check_args(args: argparse.Namespace) -> None:
    check_positive(args, "steps", "recent", "passkeys", "digits", "threads")
    lo, hi = args.context
    if not 0 < lo <= hi:
        raise ConfigError(f"--context needs 0 < MIN <= MAX, got {lo} {hi}")
    if args.sink < 0:
        raise ConfigError(f"--sink must not be negative, got {args.sink}")
    if args.sink + args.recent >= lo:
        raise ConfigError(f"the streaming window ({args.sink} + {args.recent} tokens) covers "
                          f"the shortest sequence ({lo}): nothing to tell heads apart")
    if args.lr <= 0 or args.reg_weight < 0:
        raise ConfigError("--lr must be positive and --reg-weight not negative")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")


def run(args, argv=None) -> int:
    """Identify the heads as the parsed arguments ``args`` say; the exit status."""
    t0 = time.perf_counter()
    try:
        check_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        text_files([args.text])
        device = resolve_device(args.device)
        checkpoint = resolve_checkpoint(args.checkpoint)
        model = load_model(checkpoint, device, torch.float32)
        if args.context[1] > model.args.max_seq_len:
            raise ConfigError(f"--context {args.context[1]} exceeds the model's context "
                              f"({model.args.max_seq_len} tokens)")
        tok = load_tokenizer(args.tokenizer or checkpoint)
        haystack = tok.encode(" ".join(" ".join(read_texts([args.text])).split()), bos=False)
        rng = random.Random(args.seed)
        bos = [tok.bos_id] if tok.bos_id is not None else []

        def samples(step: int):
            n = rng.randint(*args.context) - len(bos)
            ids, answer = passkey_sample(haystack, lambda s: tok.encode(s, bos=False), n,
                                         args.passkeys, args.digits, rng)
            return torch.tensor([bos + ids], device=device), answer

        gates, history = identify(model, samples, args.steps, lr=args.lr,
                                  reg_weight=args.reg_weight, sink=args.sink,
                                  recent=args.recent, progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = {"model": model.args.name, "checkpoint": args.checkpoint,
              "command": "python scripts/duo_identify.py " + shlex.join(
                  sys.argv[1:] if argv is None else list(argv)),
              "text": args.text, "steps": args.steps, "lengths": args.context,
              "sink_size": args.sink, "recent_size": args.recent, "passkeys": args.passkeys,
              "digits": args.digits, "lr": args.lr, "reg_weight": args.reg_weight,
              "seed": args.seed, "initial_value": 1.0, "supervision": "distill",
              "threshold_hint": 0.5, "retrieval_heads_above_0.5": int((gates > 0.5).sum()),
              "kv_heads": int(gates.numel()), "history": history,
              "runtime_s": time.perf_counter() - t0, "device": str(device),
              "torch_version": torch.__version__, "threads": torch.get_num_threads()}
    paths = write_pattern(Path(args.out), gates, config)
    print(f"{config['retrieval_heads_above_0.5']} of {gates.numel()} KV heads above 0.5; "
          f"mean gate {float(gates.mean()):.3f}; final distill "
          f"{history[-1]['distill']:.4g}" if history else "")
    print("wrote " + ", ".join(map(str, paths)), file=sys.stderr)
    return 0

