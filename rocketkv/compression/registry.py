"""The method registry: what a KV-cache method declares, and the one place that builds its caches.

A method is one ``Method`` subclass in one file of ``compression/``, registered with
``@register``; ``compression/__init__.py`` imports the files in the order ``--help`` lists
them. The registry gives every entry point the same view of the methods: the CLI flags of every
option (``add_method_options``), the options one method reads from parsed flags
(``options_for``), the ``--help`` list and the docs table (``methods_table``), and the caches of
a run (``build_caches``), which applies the rules shared by every method:

* the token budget ``t`` (RocketKV paper Sec. 3.5): key+value pairs read per decode step, per
  layer, per KV-head group, approximation traffic included; a budget of at least T + m (prompt
  plus new tokens) means nothing needs compressing, and the run uses the full cache;
* parameters follow the tokens in the cache, never the requested answer length m: ``derive``
  sees the prompt only, and a method whose parameters depend on the cache length re-derives
  them as the answer grows (``Method.at_length``, for the length rounded up to a multiple of
  ``DECODE_HORIZON`` tokens: ``decode_horizon``), so an answer's first tokens are the same
  whatever ``--max-new-tokens`` says and every step stays within the budget; every method
  attends densely while the whole cache fits the budget, which makes the full-cache shortcut
  above exact;
* a budget below what the method can honour raises ``ConfigError`` naming the smallest valid
  budget (``smallest_budget``);
* ``--skip-layers N`` leaves the first N layers uncompressed (LongChat in the paper);
* an option the method does not read is refused, naming the options it takes.

``docs/adding_a_method.md`` walks through adding one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rocketkv import tp
from rocketkv.cache import CompressedKVCache, FullKVCache, KVCache, Selector
from rocketkv.cache.base import NEVER
from rocketkv.model import ConfigError, ModelArgs


class BudgetError(ConfigError):
    """A budget the method cannot honour (the reason, without the smallest valid budget)."""


DECODE_HORIZON = 64  # tokens: decode parameters are re-derived every 64 cached tokens at most


def decode_horizon(length: int) -> int:
    """The cache length (tokens) a method derives its decode parameters for when a step's
    cache holds ``length`` tokens: ``length`` rounded up to a multiple of ``DECODE_HORIZON``.

    Parameters derived for the horizon keep the step within the budget until the cache
    outgrows it, so they change at most once every 64 decode steps, and they are a function of
    the cache length alone (not of ``--max-new-tokens``).
    """
    return -(-length // DECODE_HORIZON) * DECODE_HORIZON


@dataclass(frozen=True)
class Option:
    """One method option: a CLI flag ``--name-with-dashes`` and a key of the options dict.

    Attributes:
        name: the key (``kernel_size``); the flag is ``--kernel-size``.
        help: one line for ``--help`` (say the default and its source).
        type: argparse type (int, float, str, or a parser such as ``cli.layer_list``); None
            for a switch (``store_true``).
        choices: the allowed values, or None.
        metavar: shown in ``--help`` instead of the type.
        check: ``check(value) -> str | None``: why a given value is invalid (None: valid);
            run before any cache is built.
    """

    name: str
    help: str
    type: Callable[[str], Any] | None = int
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    check: Callable[[Any], str | None] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def add_to(self, parser: argparse._ActionsContainer) -> None:
        """Add this option's flag to ``parser`` (default None: the method's own default)."""
        if self.type is None:
            parser.add_argument(self.flag, action="store_true", help=self.help)
            return
        kw: dict[str, Any] = {"type": self.type, "help": self.help}
        if self.choices is not None:
            kw["choices"] = list(self.choices)
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        parser.add_argument(self.flag, **kw)


def positive(value: Any) -> str | None:
    """``Option.check`` for values that must be > 0."""
    return None if value > 0 else f"must be positive, got {value}"


INTERNAL = {"internal": True}  # ``field(metadata=INTERNAL)``: steers the build, not reported
OPTIONAL = {"optional": True}  # ``field(default=None, metadata=OPTIONAL)``: reported once set
_TAIL = ("traffic_tokens", "note", "degenerate", "budget_overshoot", "method", "skip_layers",
         "compressed")


@dataclass(frozen=True, kw_only=True)
class Params:
    """A budgeted method's derived parameters at one budget (``Method.derive``): a frozen
    dataclass per method whose fields are its parameters, so a cache reads ``params.k``, not a
    key of a dict. ``to_dict`` is what the reports show (``KVCache.method_params``, the JSON
    ``method_params``).

    Attributes:
        budget: the token budget t (KV pairs read per decode step, per layer, per KV group).
        compression_ratio: T / t.
        traffic_tokens: KV pairs the method reads per step per layer per KV group,
            approximation traffic included, where it says (None: not reported).
        note: a remark for the reports (None: none).
        degenerate: why the method is degenerate at this budget, by its own rule (SnapKV
            keeping fewer prompt tokens per query head than its observation window;
            DuoAttention without a retrieval head, which is StreamingLLM), or None: a result
            at such a budget is marked so and no ranking uses it.
        method, skip_layers, compressed: set by ``plan`` (the run's method name,
            ``--skip-layers`` and True); None until then.
        budget_overshoot: traffic_tokens / t where that exceeds 1 (a property; None: within).

    A subclass field with ``metadata=INTERNAL`` steers the build and is not reported; one with
    ``metadata=OPTIONAL`` is reported once set (not None). Fields left None among
    ``traffic_tokens``, ``note``, ``degenerate``, ``method``, ``skip_layers``, ``compressed``
    are left out of ``to_dict`` too.
    """

    budget: int
    compression_ratio: float
    traffic_tokens: float | None = None
    note: str | None = None
    degenerate: str | None = None
    method: str | None = None
    skip_layers: int | None = None
    compressed: bool | None = None

    @property
    def budget_overshoot(self) -> float | None:
        """traffic_tokens / budget when the traffic exceeds the budget, else None."""
        if self.traffic_tokens is None or self.traffic_tokens <= self.budget:
            return None
        return self.traffic_tokens / self.budget

    def replace(self, **changes: Any) -> Params:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The reported parameters: ``budget``, ``compression_ratio``, the method's own fields
        (not the INTERNAL ones, the OPTIONAL ones once set) in their order, then those of
        ``_TAIL`` that are set
        (``budget_overshoot`` only where the traffic exceeds the budget)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _TAIL or f.metadata.get("internal") or \
                    (value is None and f.metadata.get("optional")):
                continue
            out[f.name] = value
        for name in _TAIL:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


SKIP_LAYERS = Option("skip_layers", "leave the first N layers uncompressed (the paper: 2 for "
                     "LongChat)")


class Method:
    """One KV-cache method: its name, description, options, budget rule and caches.

    Subclasses set the class attributes and implement ``derive`` and ``build_layer`` (or
    ``build``, for a method whose layers depend on each other).

    Attributes:
        name: the ``--method`` value.
        description: one line for ``--help`` and the docs table.
        options: the ``Option``\\ s the method reads (``--skip-layers`` is added for every
            budgeted method that sets ``skip_layers``).
        budgeted: False for methods that read every cached token and take no ``--budget``.
        skip_layers: whether ``--skip-layers`` applies (True), or why not (a string).
        cache_classes: the ``KVCache`` classes the method builds (besides ``FullKVCache``
            for skipped layers and budgets covering the sequence). What they declare about
            prefill is read from them: ``needs_attention_sums`` and ``shared_prefill``, below.
        source: paper and section the budget rule comes from (docs table).
        budget_rule: how the budget t becomes the parameters (T prompt tokens, m new tokens,
            d head_dim, G query heads per KV head), one line of Markdown (docs table).
    """

    name: str = ""
    description: str = ""
    options: tuple[Option, ...] = ()
    budgeted: bool = True
    skip_layers: bool | str = True  # a string: why not (the error says it)
    cache_classes: tuple[type[KVCache], ...] = (FullKVCache,)
    source: str = ""
    budget_rule: str = ""  # how t becomes the parameters, one line of Markdown (docs table)

    @property
    def needs_attention_sums(self) -> bool:
        """A shared prefill must record the column sums of every prompt query's attention for
        this method's caches (``prefill.prefill_once``): one of ``cache_classes`` says so
        (``KVCache.needs_attention_sums``, H2O)."""
        return any(c.needs_attention_sums for c in self.cache_classes)

    @property
    def shared_prefill(self) -> bool:
        """False for a method whose caches prefill the prompt their own way (a class of
        ``cache_classes`` with ``KVCache.shared_prefill`` False: KeyDiff's blocks), so an
        evaluation does not prefill a prompt once for it (``evals.harness.run_batch``)."""
        return all(c.shared_prefill for c in self.cache_classes)

    def all_options(self) -> tuple[Option, ...]:
        """The options this method reads, ``--skip-layers`` included where it applies."""
        return self.options + ((SKIP_LAYERS,) if self.budgeted and self.skip_layers is True
                               else ())

    def derive(self, budget: int, prompt_len: int, args: ModelArgs,
               options: Mapping[str, Any]) -> Params:
        """Every parameter of the method at token budget ``budget`` for a prompt of
        ``prompt_len`` tokens, as the first decode step uses them (the paper's rule, with the
        cache's length at that step where the paper has prompt + new tokens). It never sees
        the number of tokens to generate: see ``at_length`` for how parameters follow the
        answer.

        Returns:
            the method's ``Params`` subclass: ``budget``, ``compression_ratio`` (T / t) and
            its parameters; methods that approximate scores also give ``traffic_tokens``
            (float, KV pairs read per step per layer per KV group), whose excess over t is
            ``budget_overshoot``.
        Raises:
            BudgetError: no valid setting at this budget.
            ConfigError: an option value the method cannot use.
        """
        raise NotImplementedError

    def build(self, args: ModelArgs, params: Params | None, *, batch_size: int,
              prompt_len: int, max_new_tokens: int, dtype: torch.dtype, device,
              options: Mapping[str, Any]) -> list[KVCache]:
        """One cache per layer from ``derive``'s ``params`` (None for an unbudgeted method);
        the first ``options["skip_layers"]`` layers get the full cache."""
        skip = options.get("skip_layers") or 0
        return [full_cache(i, args, batch_size, prompt_len, max_new_tokens, dtype, device,
                           "layer skipped (--skip-layers)") if i < skip else
                self.build_layer(i, args, params, batch_size=batch_size,
                                 prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                                 dtype=dtype, device=device)
                for i in range(args.n_layers)]

    def build_layer(self, layer: int, args: ModelArgs, params: Params, *,
                    batch_size: int, prompt_len: int, max_new_tokens: int,
                    dtype: torch.dtype, device) -> KVCache:
        """Layer ``layer``'s cache from ``derive``'s ``params`` (report
        ``params.to_dict()``)."""
        raise NotImplementedError

    def at_length(self, params: Params, length: int, args: ModelArgs) -> tuple[Params, int]:
        """The parameters of a decode step whose cache holds ``length`` tokens (the kept
        prompt and the answer so far, the step's own token included), from the run's
        ``params`` (``derive``'s), and the largest cache length they serve. A method whose
        traffic grows with the cache re-derives here for ``decode_horizon(length)``, keeping
        what fixes the cache's layout (a page size); the default: the parameters hold for
        every length (a fixed-size cache, or a method that reads a fixed number of tokens).
        Only ``CompressedMethod`` caches ask (``CompressedKVCache.retune_for``).
        """
        return params, NEVER

    def validate(self, params: Params, args: ModelArgs, prompt_len: int,
                 options: Mapping[str, Any]) -> Params:
        """Checks of the derived ``params`` that need more than the budget (files the method
        reads, for one); returns them, completed where the checks add parameters.
        ``prompt_len``: prompt tokens.

        Raises:
            ConfigError: what the run cannot use.
        """
        return params

    def shard_params(self, params: Params, rank: int, world: int,
                     args: ModelArgs) -> Params:
        """``params`` (derived for the whole model ``args``) as rank ``rank`` of ``world``
        uses them for its H_kv / world KV heads (``tp.py``). Budgets are per KV-head group,
        so most methods' parameters hold as they are; a method that names heads (DuoAttention)
        keeps the rank's own, renumbered from 0."""
        return params


@dataclass(frozen=True, kw_only=True)
class PromptEviction:
    """Parameters of a method that evicts prompt tokens at the end of prefill (the SnapKV
    family): mixed into its ``Params``.

    Attributes:
        window: the observation window (the prompt's last queries that vote), tokens.
        keep: prompt tokens kept per KV head (slots of the compact cache).
        evict: whether anything is evicted (False: the prompt fits; internal).
    """

    window: int
    keep: int
    evict: bool = field(metadata=INTERNAL)


class CompressedMethod(Method):
    """A method whose caches are ``cache.CompressedKVCache``: the prompt tokens an
    ``evictor`` keeps at the end of prefill (all of them without one), then a decode-time
    ``selector`` over the kept and generated tokens. Parameters that are ``PromptEviction``
    give the prompt tokens kept (``keep``) and the evictor's observation window
    (``window``)."""

    per_head_mask = False  # each query head keeps its own prompt tokens (original SnapKV)
    cache_classes = (CompressedKVCache,)

    def selector(self, params: Params) -> Selector:
        """The decode-time selection (default: dense attention over every kept token)."""
        return Selector()

    def evictor(self, params: Params) -> Callable | None:
        """``evict(q_obs, k) -> (idx, head_mask)`` (``CompressedKVCache``), or None."""
        return None

    def build_layer(self, layer: int, args: ModelArgs, params: Params, *,
                    batch_size: int, prompt_len: int, max_new_tokens: int,
                    dtype: torch.dtype, device) -> KVCache:
        evict = self.evictor(params)
        evicting = isinstance(params, PromptEviction)
        retune = None
        if type(self).at_length is not Method.at_length:
            def retune(length: int) -> tuple[Selector, int, dict[str, Any]]:
                step_params, holds = self.at_length(params, length, args)
                return self.selector(step_params), holds, step_params.to_dict()
        return CompressedKVCache(
            layer, args, batch_size, dtype, device, prompt_len=prompt_len,
            prompt_capacity=params.keep if evicting else prompt_len,
            max_new_tokens=max_new_tokens,
            selector=None if retune else self.selector(params), evict=evict,
            per_head=self.per_head_mask and evict is not None,
            obs_window=params.window if evicting else 0, params=params.to_dict(),
            retune=retune, page_size=getattr(params, "page_size", None))


def full_cache(layer: int, args: ModelArgs, batch_size: int, prompt_len: int,
               max_new_tokens: int, dtype: torch.dtype, device,
               note: str | None = None) -> FullKVCache:
    """The uncompressed cache of one layer, sized prompt + new tokens (``note``: why)."""
    return FullKVCache(layer, args, batch_size, dtype, device, prompt_len + max_new_tokens,
                       params=None if note is None else {"compressed": False, "note": note})


METHODS: dict[str, Method] = {}  # name -> method, in registration (``--help``) order


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: add one instance of ``cls`` to ``METHODS``.

    Raises:
        ValueError: a name registered twice, or an option name declared differently by two
            methods (a flag has one meaning).
    """
    method = cls()
    if not method.name or method.name in METHODS:
        raise ValueError(f"method name {method.name!r} is empty or registered twice")
    declared = {o.name: o for m in METHODS.values() for o in m.all_options()}
    for o in method.all_options():
        if o.name in declared and declared[o.name] != o:
            raise ValueError(f"option {o.flag} of {method.name} differs from the one other "
                             "methods declare: share one Option object")
    METHODS[method.name] = method
    return cls


def check_methods(names: list[str]) -> None:
    """Raises ConfigError naming every name in ``names`` that is not a registered method."""
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown methods {', '.join(unknown)}; known: {', '.join(METHODS)}")


def needs_attention_sums(methods: Iterable[str]) -> bool:
    """Whether a prefill shared by ``methods`` (names) must record the column sums of the
    prompt's attention (``prefill.prefill_once(attention_sums=...)``): some method's caches
    evict on them (``Method.needs_attention_sums``, H2O)."""
    return any(METHODS[m].needs_attention_sums for m in methods)


def check_method(method: str) -> None:
    """Raises ConfigError when ``method`` is not a registered method."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def every_option() -> dict[str, Option]:
    """Every option of every method, once each, in registration order (``--skip-layers``,
    shared by most, last)."""
    options = {o.name: o for m in METHODS.values() for o in m.options}
    return {**options, SKIP_LAYERS.name: SKIP_LAYERS}


def add_method_options(parser: argparse._ActionsContainer) -> None:
    """Every method option as a CLI flag (default None), for ``generate.py``, ``bench.py`` and
    every evaluation script; an option the chosen method does not read is refused when its
    caches are built (``check_options``)."""
    for o in every_option().values():
        o.add_to(parser)


def options_for(method: str, values: Mapping[str, Any] | argparse.Namespace) -> dict[str, Any]:
    """The options ``method`` reads, from parsed flags (a Namespace or a dict); unset ones
    (None or False) are left out, so the method's defaults apply."""
    values = vars(values) if isinstance(values, argparse.Namespace) else values
    return {o.name: values[o.name] for o in METHODS[method].all_options()
            if values.get(o.name) is not None and values.get(o.name) is not False}


def given_options(values: Mapping[str, Any] | argparse.Namespace) -> dict[str, Any]:
    """Every method option set in ``values`` (a Namespace or a dict; not None, not False)."""
    values = vars(values) if isinstance(values, argparse.Namespace) else values
    return {name: values[name] for name in every_option()
            if values.get(name) is not None and values.get(name) is not False}


def check_options(method: str, options: Mapping[str, Any]) -> None:
    """ConfigError for an option that ``method`` does not read (given: not None/False), or a
    value its ``Option.check`` rejects.

    Raises:
        ConfigError: e.g. ``--rocket-split`` with ``quest``; the message lists what the method
            takes.
    """
    m = METHODS[method]
    taken = {o.name: o for o in m.all_options()}
    for name, value in options.items():
        if value is None or value is False:
            continue
        if name == SKIP_LAYERS.name and isinstance(m.skip_layers, str):
            raise ConfigError(f"{method} takes no --skip-layers: {m.skip_layers}")
        if name not in taken:
            flags = ", ".join(o.flag for o in taken.values()) or "none"
            raise ConfigError(f"--{name.replace('_', '-')} does not apply to method {method} "
                              f"(its options: {flags})")
        option = taken[name]
        reason = option.check(value) if option.check else None
        if option.choices is not None and value not in option.choices:
            reason = f"must be one of {', '.join(map(str, option.choices))}, got {value!r}"
        if reason:
            raise ConfigError(f"{option.flag} {reason}")


def derive(method: str, budget: int, prompt_len: int, args: ModelArgs,
           options: Mapping[str, Any]) -> Params:
    """``METHODS[method].derive`` after ``check_options``: every parameter at ``budget`` (see
    ``Method.derive``).

    Raises:
        BudgetError: no valid setting at this budget.
        ConfigError: an option the method does not read, or a bad value.
    """
    check_options(method, options)
    return METHODS[method].derive(budget, prompt_len, args, options)


def smallest_budget(method: str, prompt_len: int, args: ModelArgs, options: Mapping[str, Any],
                    below: int) -> int | None:
    """The smallest budget ``derive`` accepts, or None if none below ``below`` tokens (the
    whole sequence, where the run needs no compression)."""
    for t in range(1, below):
        try:
            derive(method, t, prompt_len, args, options)
            return t
        except BudgetError:
            continue
    return None


def check_budget(method: str, budget: int | None) -> None:
    """ConfigError when ``budget`` does not suit ``method`` whatever the prompt: not positive,
    given to an unbudgeted method, or missing for a budgeted one."""
    if budget is not None and budget <= 0:
        raise ConfigError(f"--budget must be a positive number of tokens, got {budget}")
    if not METHODS[method].budgeted and budget is not None:
        raise ConfigError(f"method {method} reads every cached token and takes no --budget")
    if METHODS[method].budgeted and budget is None:
        raise ConfigError(f"method {method} needs --budget (tokens per decode step)")


def check_setting(method: str, budget: int | None, options: Mapping[str, Any]) -> None:
    """Every check of a method setting that needs neither the model nor the prompt: the
    method's name, its budget and its options (``check_method``, ``check_budget``,
    ``check_options``).

    Raises:
        ConfigError: in the command line's words (``--budget must be ...``).
    """
    check_method(method)
    check_budget(method, budget)
    check_options(method, options)


def plan(method: str, args: ModelArgs, *, prompt_len: int, max_new_tokens: int,
         budget: int | None, **options) -> Params | None:
    """Every check of a run of ``method`` that needs no weights and no memory: the parameters
    ``build_caches`` will build from, or None when the run uses the full cache (an unbudgeted
    method, or a budget of at least the whole sequence). ``generate.py`` calls it before
    loading the checkpoint, so a bad method setting is reported at once.

    Raises:
        ConfigError: unknown method; a budget that is missing, not positive, given to an
            unbudgeted method or too small (naming the smallest valid one); a bad option or
            an option the method does not read; what ``Method.validate`` rejects.
    """
    check_setting(method, budget, options)
    return plan_checked(method, args, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                        budget=budget, options=options)


def plan_checked(method: str, args: ModelArgs, *, prompt_len: int, max_new_tokens: int,
                 budget: int | None, options: Mapping[str, Any]) -> Params | None:
    """``plan`` for a setting ``check_setting`` has passed already (a ``CacheRequest``'s): the
    checks that need the model and the prompt, and the parameters.

    Raises:
        ConfigError: a budget too small for the prompt (naming the smallest valid one),
            ``--skip-layers`` outside the model, what ``Method.validate`` rejects.
    """
    m = METHODS[method]
    T, new = prompt_len, max_new_tokens
    options = {k: v for k, v in options.items() if v is not None and v is not False}
    if not m.budgeted:
        return None
    skip = options.get("skip_layers") or 0
    if not 0 <= skip <= args.n_layers:
        raise ConfigError(f"--skip-layers must lie in [0, {args.n_layers}], got {skip}")
    if budget >= T + new:
        return None
    try:
        params = m.derive(budget, T, args, options)
    except BudgetError as e:
        t_min = smallest_budget(method, T, args, options, T + new)
        hint = (f"the smallest valid budget here is {t_min}" if t_min is not None else
                f"the smallest valid budget here is {T + new} (the whole sequence, "
                "uncompressed)")
        raise ConfigError(f"{method}: budget {budget} is too small: {e}; {hint} (prompt {T} "
                          f"tokens, max_new_tokens {new})") from None
    params = params.replace(method=method, skip_layers=skip, compressed=True)
    return m.validate(params, args, T, options)


UNPLANNED = object()  # ``build_caches(planned=...)``: no plan given, plan here


def build_caches(method: str, args: ModelArgs, *, batch_size: int, prompt_len: int,
                 max_new_tokens: int, budget: int | None, dtype: torch.dtype, device,
                 shard: tuple[int, int] = (0, 1), planned: Any = UNPLANNED,
                 **options) -> list[KVCache]:
    """One cache per layer for ``method`` (after the checks of ``plan``).

    Args:
        method: a key of ``METHODS``.
        args: the whole model's config (the method's parameters are derived from it).
        shard: (rank, world size) under tensor parallelism (``tp.py``): the caches hold the
            rank's H_kv / world KV heads, with the parameters of the whole model.
        prompt_len, max_new_tokens: tokens; static buffers are sized from them.
        budget: token budget (KV pairs read per decode step per layer per KV group), or None
            for an unbudgeted method.
        options: method options (``Option.name`` -> value; None or False: unset).
        planned: what ``plan`` returned for these settings (a run planned before its weights
            loaded: ``engine.request.CachePlan``), so the method is not planned again;
            default: planned here.
    Raises:
        ConfigError: see ``plan``.
    """
    T, new = prompt_len, max_new_tokens
    params = plan(method, args, prompt_len=T, max_new_tokens=new, budget=budget, **options) \
        if planned is UNPLANNED else planned
    options = {k: v for k, v in options.items() if v is not None and v is not False}
    m = METHODS[method]
    rank, world = shard
    local = tp.local_args(args, world)
    if params is not None:
        return m.build(local, m.shard_params(params, rank, world, args), batch_size=batch_size,
                       prompt_len=T, max_new_tokens=new, dtype=dtype, device=device,
                       options=options)
    if not m.budgeted:
        return m.build(local, None, batch_size=batch_size, prompt_len=T, max_new_tokens=new,
                       dtype=dtype, device=device, options=options)
    note = f"budget {budget} >= the whole sequence ({T} prompt + {new} new tokens): no compression"
    return [full_cache(i, local, batch_size, T, new, dtype, device, note)
            for i in range(args.n_layers)]


def methods_table(detailed: bool = False) -> str:
    """The methods as a Markdown table: name, whether it takes a budget and the description;
    ``detailed`` adds how the budget becomes the parameters and the source. README.md and
    docs/methods.md hold these tables between ``<!-- methods-table -->`` markers
    (``update_docs``; a test checks them)."""
    if detailed:
        rows = ["| method | what it does | parameters from the budget t | source |",
                "|---|---|---|---|"]
        rows += [f"| `{m.name}` | {m.description} | {m.budget_rule} | {m.source} |"
                 for m in METHODS.values()]
    else:
        rows = ["| method | budget | what it does |", "|---|---|---|"]
        rows += [f"| `{m.name}` | {'t' if m.budgeted else 'none'} | {m.description} |"
                 for m in METHODS.values()]
    return "\n".join(rows)


def options_table() -> str:
    """Every method option as a Markdown table: flag, the methods that read it, its help."""
    rows = ["| option | methods | meaning (default) |", "|---|---|---|"]
    for o in every_option().values():
        users = [m.name for m in METHODS.values() if o in m.all_options()]
        users_text = "every compressed method but `omnikv`" if o is SKIP_LAYERS else \
            ", ".join(f"`{u}`" for u in users)
        value = "" if o.type is None else " " + (o.metavar or ("\\|".join(map(str, o.choices))
                                                 if o.choices else "N"))
        rows.append(f"| `{o.flag}{value}` | {users_text} | {o.help} |")
    return "\n".join(rows)


TORCH_FREE_MODULE = "rocketkv/method_tables.py"  # written by torch_free_tables()


def _literal(v: Any) -> str:
    """``v`` (None, a string or a tuple of strings) as Python source, strings double-quoted."""
    if isinstance(v, tuple):
        return "(" + ", ".join(map(_literal, v)) + ("," if len(v) == 1 else "") + ")"
    return "None" if v is None else json.dumps(v, ensure_ascii=False)


def _wrapped(text: str, indent: str, width: int = 88) -> str:
    """``text`` as implicitly concatenated string literals, one per line at ``indent``."""
    parts = textwrap.wrap(text, width, drop_whitespace=False, break_on_hyphens=False) or [""]
    return "\n".join(indent + json.dumps(x, ensure_ascii=False) for x in parts)


def torch_free_tables() -> str:
    """The source of ``rocketkv/method_tables.py``: the registry's methods (name, description)
    and every method option (name, type name, choices, metavar, help) as data, for the parsers
    built before torch loads (``flags.method_epilog``, ``flags.add_method_flags``). Written by
    ``python -m rocketkv.compression --update-docs``; a test fails while the file differs."""
    methods = "\n".join(f"    ({_literal(m.name)},\n{_wrapped(m.description, '     ')})," for m in
                        METHODS.values())
    options = "\n".join(
        f"    ({_literal(o.name)}, {_literal(None if o.type is None else o.type.__name__)}, "
        f"{_literal(o.choices)}, {_literal(o.metavar)},\n{_wrapped(o.help, '     ')}),"
        for o in every_option().values())
    head = ('"""The method registry as data, for parsers built before torch loads '
            "(``flags.py``).\n\nGenerated from ``rocketkv.compression``'s registry by "
            "``python -m rocketkv.compression\n--update-docs``: do not edit by hand "
            "(tests/test_entry_points.py fails while it differs).\n"
            '"""\n\n')
    return (head + "# (name, description), in the registry's order (--method's choices and "
            "--help's list)\n"
            f"METHOD_TABLE: tuple[tuple[str, str], ...] = (\n{methods}\n)\n\n"
            "# (name, argparse type name or None for a switch, choices, metavar, help)\n"
            "METHOD_OPTIONS: tuple[tuple[str, str | None, tuple[str, ...] | None, str | None, "
            "str], ...] = (\n"
            f"{options}\n)\n")


DOC_TABLES = {  # file (from the repository root) -> {marker: table}
    "README.md": {"methods-table": lambda: methods_table()},
    "docs/methods.md": {"methods-table": lambda: methods_table(detailed=True),
                        "options-table": options_table},
}


def render_docs(text: str, tables: Mapping[str, Callable[[], str]]) -> str:
    """``text`` with the block between ``<!-- NAME -->`` and ``<!-- /NAME -->`` replaced by
    each table.

    Raises:
        ValueError: a marker pair is missing.
    """
    for name, table in tables.items():
        start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
        if start not in text or end not in text:
            raise ValueError(f"no {start} ... {end} block")
        a, b = text.index(start) + len(start), text.index(end)
        text = text[:a] + "\n" + table() + "\n" + text[b:]
    return text


def help_epilog() -> str:
    """``--help``'s list of methods, one line each."""
    width = max(map(len, METHODS)) + 2
    return "methods:\n" + "\n".join(f"  {m.name:<{width}}{m.description}"
                                    for m in METHODS.values())

