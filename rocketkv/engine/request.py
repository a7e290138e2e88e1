"""The KV cache a run asks for (``CacheRequest``) and the method planned for one prompt
(``CachePlan``): typed, checked when made, planned once per run.

A request is checked when it is made (the method's name, budget and options: no model needed);
``CacheRequest.plan`` adds what needs the model's config and the prompt's length (the context's
room, a budget too small for the prompt) and derives the method's parameters, once: the command
line and the Python API plan before the weights load and hand the plan to
``generate.generate``, whose caches are built from it (``compression.build_caches(planned=)``)
without planning again.

    cache = CacheRequest("rocketkv", 256)                  # ConfigError here if it is invalid
    plan = cache.plan(model.args, prompt_len=len(ids), max_new_tokens=64)
    result = generate(model, ids, plan, max_new_tokens=64)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rocketkv.compression import METHODS, check_setting, plan_checked
from rocketkv.compression.registry import Params
from rocketkv.engine.prefill import OBSERVATION_WINDOW
from rocketkv.model import ConfigError, ModelArgs


@dataclass(frozen=True)
class CacheRequest:
    """The KV cache a run asks for (``docs/methods.md``).

    Attributes:
        method: a key of ``compression.METHODS`` (default ``"full"``).
        budget: the token budget: KV pairs read per decode step, per layer, per KV-head
            group; None for an unbudgeted method.
        options: the method's options (``Option.name`` -> value; None or False: unset; None:
            none).
        reserve_tokens: cache room (tokens) kept after the run's new tokens for later turns of
            the conversation (``continue_conversation``); it sizes buffers only, never the
            method's parameters (they follow the tokens in the cache).
    Raises:
        ConfigError: when made: an unknown method, a budget that is missing, not positive or
            given to an unbudgeted method, an option the method does not read or of a bad
            value, a negative ``reserve_tokens`` (``compression.check_setting``).
    """

    method: str = "full"
    budget: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    reserve_tokens: int = 0

    def __post_init__(self) -> None:
        given = {k: v for k, v in dict(self.options or {}).items()
                 if v is not None and v is not False}
        object.__setattr__(self, "options", given)
        check_setting(self.method, self.budget, given)
        if self.reserve_tokens < 0:
            raise ConfigError(f"reserve_tokens must not be negative, got {self.reserve_tokens}")

    @property
    def budgeted(self) -> bool:
        """Whether the method reads a budget of tokens (``Method.budgeted``)."""
        return METHODS[self.method].budgeted

    def replace(self, **changes: Any) -> CacheRequest:
        return dataclasses.replace(self, **changes)

    @property
    def recording(self) -> tuple[int, bool]:
        """What a shared prefill (``prefill.prefill_once``) must record to build this
        request's caches: the queries of the last ``obs_window`` tokens (at least
        ``OBSERVATION_WINDOW``, at least the method's ``window`` option) and whether the
        attention sums (``Method.needs_attention_sums``: H2O)."""
        return (max(OBSERVATION_WINDOW, self.options.get("window") or 0),
                METHODS[self.method].needs_attention_sums)

    def room(self, args: ModelArgs, prompt_len: int) -> int:
        """Tokens the model's context leaves after a ``prompt_len``-token prompt.

        Raises:
            ConfigError: none left.
        """
        room = args.max_seq_len - prompt_len
        if room <= 0:
            raise ConfigError(f"the prompt ({prompt_len} tokens) leaves no room in the model's "
                              f"context ({args.max_seq_len} tokens)")
        return room

    def plan(self, args: ModelArgs, *, prompt_len: int, max_new_tokens: int) -> CachePlan:
        """The method planned for a ``prompt_len``-token prompt and up to ``max_new_tokens``
        new tokens (as many as the context leaves room for), plus ``reserve_tokens``: the
        caches ``generate`` builds for that run.

        Raises:
            ConfigError: the prompt leaves no room in the context, or the prompt, the new
                tokens and the reserve exceed it; a budget too small for the prompt (naming
                the smallest valid one); what the method rejects for this model.
        """
        new = min(max_new_tokens, self.room(args, prompt_len))
        if prompt_len + new + self.reserve_tokens > args.max_seq_len:
            raise ConfigError(f"prompt {prompt_len} + new tokens {new} + reserve_tokens "
                              f"{self.reserve_tokens} exceed the model's context "
                              f"({args.max_seq_len} tokens)")
        after = new + self.reserve_tokens
        params = plan_checked(self.method, args, prompt_len=prompt_len, max_new_tokens=after,
                              budget=self.budget, options=self.options)
        return CachePlan(self, args, prompt_len, after, params)


@dataclass(frozen=True)
class CachePlan:
    """A ``CacheRequest`` planned for one prompt (``CacheRequest.plan``).

    Attributes:
        request: what was asked.
        args: the model's config the plan was made for.
        prompt_len: tokens of the prompt.
        new_tokens: positions the caches hold after the prompt (the run's new tokens and the
            request's reserve).
        params: the method's parameters (``compression.Params``), or None for the full cache
            (an unbudgeted method, or a budget that covers the whole sequence).
    """

    request: CacheRequest
    args: ModelArgs = field(repr=False)
    prompt_len: int
    new_tokens: int
    params: Params | None

    @property
    def note(self) -> str | None:
        """``no compression: ...`` when a budgeted method's budget covers the whole sequence
        (the command line prints it as a note, the API warns with it), else None."""
        r = self.request
        if self.params is not None or not r.budgeted:
            return None
        new = self.new_tokens
        return (f"no compression: the budget ({r.budget}) covers all {self.prompt_len + new} "
                f"tokens (prompt {self.prompt_len} + up to {new} new); {r.method} runs with "
                "the full cache")

    def check_run(self, args: ModelArgs, prompt_len: int, new_tokens: int) -> None:
        """ConfigError unless this plan is for a ``prompt_len``-token prompt with
        ``new_tokens`` positions after it on a model of config ``args``."""
        if self.args != args:
            raise ConfigError(f"the cache plan is for another model ({self.args.name}) than "
                              f"this run's ({args.name}): plan it again")
        if (self.prompt_len, self.new_tokens) != (prompt_len, new_tokens):
            raise ConfigError(f"the cache plan is for a {self.prompt_len}-token prompt and "
                              f"{self.new_tokens} positions after it, this run has "
                              f"{prompt_len} and {new_tokens}: plan it again")
