"""Compression methods: one file per method, each registered in ``compression.registry``.

Importing this package registers every method, in the order below (``--help`` lists them so).
Each file opens with its paper, section and how the token budget turns into the method's
parameters; ``docs/methods.md`` has the table of them all and ``docs/adding_a_method.md`` says
how to add one.

The token budget ``t`` means one thing for every method (RocketKV paper Sec. 3.5): key+value
pairs read per decode step, per layer, per KV-head group, approximation traffic included. A
budget of at least T + m (prompt plus new tokens) means nothing needs compressing: the run uses
the full cache and the parameters say so. A budget for which no valid setting exists raises
``ConfigError`` naming the smallest valid budget. Parameters follow the tokens in the cache at
each decode step (``decode_horizon``), never the number of tokens asked for.
"""

# ruff: noqa: I001  (the imports register the methods: their order is the --help order)
from rocketkv.compression.registry import (
    METHODS,
    BudgetError,
    Method,
    Option,
    add_method_options,
    build_caches,
    check_budget,
    check_method,
    check_methods,
    check_options,
    check_setting,
    decode_horizon,
    derive,
    given_options,
    help_epilog,
    methods_table,
    needs_attention_sums,
    options_for,
    plan,
    plan_checked,
    smallest_budget,
)
from rocketkv.compression import full  # noqa: F401
from rocketkv.compression import gptfast_dense  # noqa: F401
from rocketkv.compression import exact_topk  # noqa: F401
from rocketkv.compression import snapkv  # noqa: F401
from rocketkv.compression import snapkv_pp  # noqa: F401
from rocketkv.compression import quest  # noqa: F401
from rocketkv.compression import sparq  # noqa: F401
from rocketkv.compression import hybrid  # noqa: F401
from rocketkv.compression import rocketkv  # noqa: F401
from rocketkv.compression import streamingllm  # noqa: F401
from rocketkv.compression import h2o  # noqa: F401
from rocketkv.compression import duoattention  # noqa: F401
from rocketkv.compression import keydiff  # noqa: F401
from rocketkv.compression import omnikv  # noqa: F401

__all__ = ["METHODS", "BudgetError", "Method", "Option", "add_method_options", "build_caches",
           "check_budget", "check_method", "check_methods", "check_options", "check_setting",
           "decode_horizon",
           "derive", "given_options", "help_epilog", "methods_table", "needs_attention_sums",
           "options_for", "plan", "plan_checked", "smallest_budget"]
