"""Convert a llama2.c ``.bin`` checkpoint (legacy format) into a checkpoint directory.

    python scripts/convert_llama2c.py --checkpoint stories260K.bin \
        --tokenizer tok512.model --out DIR

Format (llama2.c ``export.py`` legacy v0): a header of 7 int32 ``dim, hidden_dim, n_layers,
n_heads, n_kv_heads, vocab_size, seq_len`` (a negative vocab_size means the classifier has its
own matrix at the end), then float32 arrays: tok_embeddings [V, D], attention_norm [L, D],
wq [L, D, D], wk [L, KVD, D], wv [L, KVD, D], wo [L, D, D], ffn_norm [L, D], w1 [L, H, D],
w2 [L, D, H], w3 [L, H, D], final norm [D], two RoPE tables [seq, head_dim / 2] (skipped), and
the classifier [V, D] when not shared. Matrices are (out, in); RoPE rotates adjacent pairs
(Meta layout), theta 10000, RMSNorm eps 1e-5.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import OneLineParser


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="llama2.c .bin file")
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model of the checkpoint")
    p.add_argument("--out", metavar="DIR", required=True, help="output checkpoint directory")
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
import torch

from rocketkv.formats.checkpoint import save_native
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError, ModelArgs

HEADER = struct.Struct("<7i")


def read_llama2c(path: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Parse a llama2.c legacy checkpoint into ``ModelArgs`` and a ``model.py`` state dict.

    Raises:
        ConfigError: unreadable file, bad header, or a size that does not match the header.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if len(data) < HEADER.size:
        raise ConfigError(f"{path} is too short for a llama2.c header")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = HEADER.unpack_from(data)
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len) <= 0 or dim % n_heads:
        raise ConfigError(f"{path}: implausible llama2.c header {HEADER.unpack_from(data)}")
    args = ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     intermediate_size=hidden, vocab_size=vocab, max_seq_len=seq_len,
                     rope_theta=10000.0, norm_eps=1e-5, tie_word_embeddings=shared,
                     name=path.stem)
    hd = dim // n_heads
    kvd = n_kv_heads * hd
    L = n_layers
    shapes = [("tok_embeddings", (vocab, dim)), ("attention_norm", (L, dim)),
              ("wq", (L, dim, dim)), ("wk", (L, kvd, dim)), ("wv", (L, kvd, dim)),
              ("wo", (L, dim, dim)), ("ffn_norm", (L, dim)), ("w1", (L, hidden, dim)),
              ("w2", (L, dim, hidden)), ("w3", (L, hidden, dim)), ("norm", (dim,)),
              ("rope_real", (seq_len, hd // 2)), ("rope_imag", (seq_len, hd // 2))]
    if not shared:
        shapes.append(("output", (vocab, dim)))
    need = sum(torch.Size(s).numel() for _, s in shapes) * 4
    if len(data) - HEADER.size != need:
        raise ConfigError(f"{path}: {len(data) - HEADER.size} bytes of weights, the header "
                          f"implies {need}")
    flat = torch.frombuffer(bytearray(data[HEADER.size:]), dtype=torch.float32)
    w, off = {}, 0
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        w[name] = flat[off:off + n].view(shape).clone()
        off += n

    sd = {"tok_embeddings.weight": w["tok_embeddings"], "norm.weight": w["norm"],
          "output.weight": w.get("output", w["tok_embeddings"])}
    for i in range(L):
        p = f"layers.{i}."
        sd[p + "attention.wqkv.weight"] = torch.cat([w["wq"][i], w["wk"][i], w["wv"][i]])
        sd[p + "attention.wo.weight"] = w["wo"][i]
        sd[p + "feed_forward.w13.weight"] = torch.cat([w["w1"][i], w["w3"][i]])
        sd[p + "feed_forward.w2.weight"] = w["w2"][i]
        sd[p + "attention_norm.weight"] = w["attention_norm"][i]
        sd[p + "ffn_norm.weight"] = w["ffn_norm"][i]
    return args, sd


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(a) -> int:
    """Convert as the parsed arguments ``a`` say; the exit status."""
    try:
        args, sd = read_llama2c(a.checkpoint)
        tok = load_tokenizer(a.tokenizer)
        if tok.vocab_size != args.vocab_size:
            raise ConfigError(f"tokenizer has {tok.vocab_size} tokens, checkpoint "
                              f"{args.vocab_size}")
        out = save_native(a.out, args, sd, [a.tokenizer])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.n_layers} layers, dim {args.dim}, vocab {args.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(run(ARGS))
