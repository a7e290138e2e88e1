"""An answer does not depend on how many tokens were asked for: every method's parameters follow
the tokens in its cache (``compression.decode_horizon``, ``Method.at_length``), re-derived as
the answer grows, within the budget."""

import math

import pytest
import torch
from conftest import SMOLLM2_GGUF, shared_file

from rocketkv.cache import CompressedKVCache
from rocketkv.compression import METHODS, build_caches, decode_horizon, derive
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.model import ModelArgs

RETUNED = ["quest", "sparq", "hybrid", "rocketkv"]  # parameters that follow the cache's length


@pytest.fixture(scope="module")
def readme_ids(smollm2_model):
    """The README's document question (3000 tokens of essays, one made-up fact, a question),
    through SmolLM2's chat template, as ``generate.py --chat --prompt`` encodes it."""
    from rocketkv import Engine
    from rocketkv.evals.answer_length import readme_prompt
    from rocketkv.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(str(shared_file(SMOLLM2_GGUF)))
    engine = Engine(smollm2_model, tok)
    return engine.encode(readme_prompt(tok), chat=True), tuple(tok.chat_stop_ids)


@pytest.mark.parametrize("method", list(METHODS))
def test_the_first_64_tokens_do_not_depend_on_the_room_for_5000(method, smollm2_model,
                                                                 readme_ids):
    """The README prompt (about 3,000 tokens) on SmolLM2, budget 256: 64 new tokens in caches
    sized for 64 and for 5,000 (``reserve_tokens``: what ``--max-new-tokens 5000`` allocates,
    and what the budget rule used to read as m) give the same answer, token for token.
    ``scripts/answer_length.py`` runs the 5,000-token answers themselves."""
    ids, stop = readme_ids
    budget = 256 if METHODS[method].budgeted else None
    cache = CacheRequest(method, budget)
    short = generate(smollm2_model, ids, cache, max_new_tokens=64, stop_ids=stop)
    roomy = generate(smollm2_model, ids, cache.replace(reserve_tokens=5000 - 64),
                     max_new_tokens=64, stop_ids=stop)
    assert roomy.token_ids == short.token_ids
    assert len(short.token_ids[0]) > 8  # an answer, not a stop at once


def _traffic_at(params, length, d):
    """KV pairs a step reads at cache length ``length`` with ``params`` (the rule's count for
    the pages and rows written by then, not the horizon's)."""
    if params.dense:
        return length
    if params.method == "quest":
        return math.ceil(length / params.page_size) + params.k
    if params.method == "sparq":
        return length * params.r / (2 * d) + params.k
    return math.ceil(length / params.page_size) * params.r / (2 * d) + params.k


@pytest.mark.parametrize("method", RETUNED)
@pytest.mark.parametrize("T,t", [(100, 256), (4000, 256), (3000, 100), (20000, 1024)])
def test_parameters_follow_the_cache_within_the_budget(method, T, t):
    """At every cache length from the first decode step to 6,000 tokens later the step's
    parameters (``at_length``) read at most t pairs (but for the rule's floor, one head dim or
    one token, and the released hybrid split's rounding of r); they are a function of the
    length alone,
    change only where the length passes the horizon they were derived for, keep the page size
    the cache was laid out with, and are dense exactly while the cache fits the budget."""
    args = ModelArgs(dim=512, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                     vocab_size=10, max_seq_len=65536)
    m = METHODS[method]
    base = derive(method, t, T, args, {}).replace(method=method)
    kept = getattr(base, "keep", T) if method == "rocketkv" else T
    page = getattr(base, "page_size", None)
    held, holds = None, 0
    for n in range(kept + 1, kept + 6000):
        p, until = m.at_length(base, n, args)
        assert until >= n
        assert p.dense == (n <= t)
        if held is not None and n <= holds:
            assert p == held  # unchanged within the horizon
        held, holds = p, until
        if page is not None:
            assert p.page_size == page
        if not p.dense:
            assert until == decode_horizon(n)
            # the step reads no more than the rule counts for the horizon ...
            assert _traffic_at(p, n, args.head_dim) <= p.traffic_tokens + 1e-9
            # ... which is within t, but for the rule's floor (one dim, one token) and the
            # released hybrid split's rounding of r (one dim fewer would fit)
            floor = (method in ("sparq", "hybrid", "rocketkv") and p.r == 1) or \
                (method == "quest" and p.k == 1)
            rounding = method in ("hybrid", "rocketkv") and \
                _traffic_at(p.replace(r=p.r - 1), decode_horizon(n), args.head_dim) <= t
            assert p.traffic_tokens <= t or floor or rounding, (n, p)


@pytest.mark.parametrize("method", ["quest", "sparq", "hybrid"])
def test_a_retuned_cache_attends_like_one_built_for_that_length(method):
    """Decode 400 steps after a 30-token prompt at budget 48, so the cache goes from dense to
    sparse and its parameters change again as it grows; at every step the output equals that of a
    cache built afresh, with the step's parameters (``at_length``) and page size, for the
    tokens written so far (prefilled with them, buffers just long enough), so the selector's
    state (page summaries, dim-major keys) survives every change and the longer buffers of the
    run change nothing."""
    torch.manual_seed(0)
    B, H, Hkv, D, T, t, steps = 1, 4, 2, 16, 30, 48, 400
    args = ModelArgs(dim=H * D, n_layers=1, n_heads=H, n_kv_heads=Hkv, head_dim=D,
                     intermediate_size=8, vocab_size=10, max_seq_len=1024)
    q = torch.randn(B, H, T + steps, D)
    k = torch.randn(B, Hkv, T + steps, D)
    v = torch.randn(B, Hkv, T + steps, D)
    m = METHODS[method]
    base = derive(method, t, T, args, {})
    cache = build_caches(method, args, batch_size=B, prompt_len=T, max_new_tokens=steps,
                         budget=t, dtype=torch.float32, device="cpu")[0]
    cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    changes = 0
    for pos in range(T, T + steps):
        if pos >= cache.retune_at:
            changes += cache.retune_for(pos)
        step = slice(pos, pos + 1)
        out = cache.decode(q[:, :, step], k[:, :, step], v[:, :, step], torch.tensor([pos]))
        params, _ = m.at_length(base, pos + 1, args)
        fresh = CompressedKVCache(0, args, B, torch.float32, "cpu", prompt_len=pos,
                                  prompt_capacity=pos, max_new_tokens=1,
                                  selector=m.selector(params),
                                  page_size=getattr(base, "page_size", None))
        assert fresh.selector.params() == cache.selector.params(), pos
        fresh.prefill(q[:, :, :pos], k[:, :, :pos], v[:, :, :pos])
        ref = fresh.decode(q[:, :, step], k[:, :, step], v[:, :, step], torch.tensor([pos]))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert changes >= 2  # dense -> sparse, then r (or k) as the cache grew


@pytest.mark.parametrize("method", ["sparq", "hybrid"])
def test_a_compiled_step_follows_the_parameters_without_a_compile_each(method):
    """A compiled decode step across a dense -> sparse switch and several changes of r gives
    the eager tokens and compiles a handful of times, not once per change (Dynamo treats the
    selector's integers as symbolic after the first change: ``step.DYNAMO_CONFIG``)."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                     vocab_size=64, max_seq_len=1024)
    from rocketkv.model import Transformer

    model = Transformer(args)
    prompt = torch.randint(0, args.vocab_size, (1, 30))
    cache = CacheRequest(method, 48)
    eager = generate(model, prompt, cache, max_new_tokens=400)
    r_seen = {c.selector.params().get("r") for c in model.caches}
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = generate(model, prompt, cache, max_new_tokens=400,
                        step=StepConfig(compile=True, backend=counter))
    assert compiled["token_ids"] == eager["token_ids"]
    base = derive(method, 48, 30, args, {})
    first_sparse = METHODS[method].at_length(base, 49, args)[0].r
    assert max(r_seen) < first_sparse  # r followed the cache down as it grew
    assert counter.frame_count <= 4
