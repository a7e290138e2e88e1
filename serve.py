"""Serve a model over an OpenAI-compatible HTTP API.

    python serve.py --checkpoint model.gguf [--host 127.0.0.1] [--port 8000]
                    [--method rocketkv --budget 256] [--max-new-tokens 256] [--max-batch 8]

The same command as ``rocketkv serve`` (installed); ``--help`` lists every flag. The command
line is ``rocketkv/cli/serve.py``, the app ``rocketkv/serve/app.py``. Up to ``--max-batch``
requests decode together (continuous batching).
"""


from rocketkv.cli.serve_flags import build_parser

if __name__ == "__main__":  # --help and usage errors before torch loads
    ARGS = build_parser().parse_args()

from rocketkv.cli.serve import entry  # noqa: E402

if __name__ == "__main__":
    entry(ARGS)
