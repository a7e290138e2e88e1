"""Generate text with a compressed KV cache, and measure its speed and memory.

    python generate.py --checkpoint model.gguf --chat --method rocketkv --budget 256 --prompt FILE
    python generate.py --checkpoint random:llama-3.1-8b --context 32768 --max-new-tokens 64

The same command as ``rocketkv generate`` (installed); ``--help`` lists every flag. The command
line is ``rocketkv/cli/generate.py``, the decode loop ``rocketkv/engine/generate.py``, the model
``rocketkv/model.py``.
"""


from rocketkv.cli.generate_flags import build_parser

if __name__ == "__main__":  # --help and usage errors before torch loads
    ARGS = build_parser().parse_args()

from rocketkv.cli.generate import entry  # noqa: E402

if __name__ == "__main__":
    entry(ARGS)
