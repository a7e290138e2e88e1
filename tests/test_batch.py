"""Continuous batching (``rocketkv/engine/batch.py``, ``Engine.submit``): requests with different
prompts, methods and budgets decoded together give each the greedy answer it gets alone
(``generate``), whenever they join; a prefill runs between the batch's steps; a request that
fails or is withdrawn leaves the others alone."""

import threading

import pytest
import torch

import rocketkv
from rocketkv.compression import METHODS
from rocketkv.engine import checks
from rocketkv.engine.batch import BatchDecoder, Batcher, KVCapacityError, kv_bytes
from rocketkv.engine.generate import generate
from rocketkv.engine.request import CacheRequest
from rocketkv.engine.step import Sampling
from rocketkv.model import ConfigError

# every method but the gpt-fast baseline (the full cache's twin), each with a budget below
# its prompt, so each evicts or selects; prompts of different lengths
CONFIGS = [("full", None, {}), ("exact_topk", 48, {}), ("snapkv", 96, {}),
           ("snapkv_pp", 64, {}), ("quest", 64, {}), ("sparq", 64, {}), ("hybrid", 64, {}),
           ("rocketkv", 64, {}), ("streamingllm", 48, {}), ("h2o", 64, {}),
           ("keydiff", 64, {}), ("omnikv", 64, {}), ("duoattention", 64, {})]
NEW = 14


def _runs(model, configs=CONFIGS, seed=0, new=NEW, sampling=None):
    sampling = sampling or Sampling()
    g = torch.Generator().manual_seed(seed)
    runs = []
    for i, (method, budget, options) in enumerate(configs):
        T = 120 + 23 * i
        ids = torch.randint(3, model.args.vocab_size, (T,), generator=g).tolist()
        runs.append(checks.plan_run(model.args, ids, CacheRequest(method, budget, options),
                                    sampling, max_new_tokens=new + i % 3, stop_ids=(),
                                    compile=False, device=model.device))
    return runs


def _alone(model, run):
    return generate(model, [run.ids], run.plan, max_new_tokens=run.max_new_tokens,
                    stop_ids=run.stop_ids, sampling=run.sampling).token_ids[0]


def test_the_config_list_covers_every_method():
    assert {c[0] for c in CONFIGS} | {"gptfast_dense"} == set(METHODS)


def test_requests_joining_at_different_steps_answer_as_alone(stories_model):
    """Thirteen methods, thirteen prompt lengths, joining zero to two steps apart: each
    request's greedy tokens are its single run's."""
    model = stories_model
    runs = _runs(model)
    expected = [_alone(model, r) for r in runs]
    dec = BatchDecoder(model, max_batch=len(runs))
    slots = []
    for i, run in enumerate(runs):
        slots.append(dec.admit(run))
        for _ in range(i % 3):
            dec.step()
    while dec.running:
        dec.step()
    for (method, _, _), slot, want in zip(CONFIGS, slots, expected):
        assert slot.error is None, method
        assert slot.result.token_ids[0] == want, method
        assert slot.result.method == method
    # the steps were shared: fewer steps than tokens decoded
    assert dec.steps < dec.step_tokens
    assert max(max(s.result.batch_sizes) for s in slots) >= 6


def test_a_prefill_runs_between_decode_steps(stories_model):
    """A request admitted while two decode: the batch steps after every ``prefill_layers``
    layers of its prefill, and every answer is still its single run's."""
    model = stories_model
    runs = _runs(model, CONFIGS[:3])
    expected = [_alone(model, r) for r in runs]
    dec = BatchDecoder(model, max_batch=3, prefill_layers=1)
    a, b = dec.admit(runs[0]), dec.admit(runs[1])
    before = dec.steps
    c = dec.admit(runs[2])
    assert dec.steps - before == model.args.n_layers - 1  # one step after each layer but the last
    while dec.running:
        dec.step()
    assert [s.result.token_ids[0] for s in (a, b, c)] == expected


def test_a_sampled_request_draws_the_same_whatever_its_companions(stories_model):
    model = stories_model
    sampled = _runs(model, CONFIGS[:1], seed=1, sampling=Sampling(0.9, top_p=0.95, seed=7))[0]

    def answer(companions):
        dec = BatchDecoder(model, max_batch=4)
        slot = dec.admit(sampled)
        for run in companions:
            dec.admit(run)
        while dec.running:
            dec.step()
        return slot.result.token_ids[0]

    alone = answer([])
    assert answer(_runs(model, CONFIGS[3:6], seed=2)) == alone
    assert len(alone) == sampled.max_new_tokens


def test_a_request_whose_callback_raises_ends_alone(stories_model):
    model = stories_model
    runs = _runs(model, CONFIGS[:3])
    expected = [_alone(model, r) for r in runs]

    def boom(tokens):
        if tokens.shape[1] == 3:
            raise RuntimeError("client gone")

    dec = BatchDecoder(model, max_batch=3)
    a = dec.admit(runs[0])
    b = dec.admit(runs[1], on_token=boom)
    c = dec.admit(runs[2])
    while dec.running:
        dec.step()
    assert isinstance(b.error, RuntimeError) and b.result is None and b.caches == []
    assert a.result.token_ids[0] == expected[0] and c.result.token_ids[0] == expected[2]


def test_stop_tokens_and_the_limit_end_a_request(stories_model):
    model = stories_model
    run = _runs(model, CONFIGS[:1])[0]
    tokens = _alone(model, run)
    stop = checks.Run(run.ids, run.plan, run.sampling, run.max_new_tokens, (tokens[4],))
    dec = BatchDecoder(model)
    slot = dec.admit(stop)
    while dec.running:
        dec.step()
    cut = tokens[:tokens.index(tokens[4]) + 1]
    assert slot.result.token_ids[0] == cut and slot.result.stop_reason == "eos"


def test_bad_batches_are_refused(stories_model):
    with pytest.raises(ConfigError, match="--max-batch must be positive"):
        BatchDecoder(stories_model, max_batch=0)
    dec = BatchDecoder(stories_model, max_batch=1)
    run = _runs(stories_model, CONFIGS[:1])[0]
    copies = checks.Run(run.ids, run.plan, run.sampling, run.max_new_tokens, (), False,
                        False, 2)
    with pytest.raises(ConfigError, match="one sequence"):
        dec.admit(copies)
    dec.admit(run)
    with pytest.raises(ConfigError, match="the batch is full"):
        dec.admit(run)


def test_the_batcher_thread_answers_futures_and_withdraws_waiting_ones(stories_model):
    model = stories_model
    runs = _runs(model, CONFIGS[:4])
    expected = [_alone(model, r) for r in runs]
    gate = threading.Event()
    batcher = Batcher(model, max_batch=2)
    try:
        held = batcher.submit(runs[0], on_token=lambda t: gate.wait(30))
        futures = [batcher.submit(r) for r in runs[1:]]
        withdrawn = batcher.submit(runs[0])
        assert withdrawn.cancel()  # still waiting: the batch holds at most two
        gate.set()
        assert held.result(60).token_ids[0] == expected[0]
        assert [f.result(60).token_ids[0] for f in futures] == expected[1:]
    finally:
        batcher.close()
    with pytest.raises(ConfigError, match="shutting down"):
        batcher.submit(runs[0])


def test_engine_generate_batch_is_generate_per_prompt(smollm2_model):
    from conftest import SMOLLM2_GGUF, shared_file

    from rocketkv.formats.tokenizer import load_tokenizer

    engine = rocketkv.Engine(smollm2_model, load_tokenizer(str(shared_file(SMOLLM2_GGUF))))
    prompts = ["What is the capital of France?", "Name three colours.",
               "Write one sentence about the sea."]
    settings = dict(method="rocketkv", budget=32, max_new_tokens=10)
    alone = [engine.generate(p, **settings) for p in prompts]
    try:
        batched = engine.generate_batch(prompts, **settings)
        with pytest.raises(ConfigError, match="this engine is batching"):
            engine.generate(prompts[0], **settings)
        with pytest.raises(ConfigError, match="unknown method"):
            engine.submit(prompts[0], method="nope")
    finally:
        engine.close_batching()
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.text for r in batched] == [r.text for r in alone]
    assert engine.generate(prompts[0], **settings).tokens == alone[0].tokens  # closed: alone again


def test_kv_bytes_sizes_the_caches_before_they_exist(stories_model):
    model = stories_model
    runs = _runs(model, CONFIGS)
    dec = BatchDecoder(model, max_batch=len(runs))
    for run in runs:
        predicted = kv_bytes(model, run)
        slot = dec.admit(run)
        assert slot.kv_bytes == predicted > 0, run.plan.request.method
    assert dec.kv_bytes_held() == sum(kv_bytes(model, r) for r in runs)


def test_requests_wait_until_their_kv_fits_and_one_too_large_is_refused(stories_model):
    """A limit that holds the largest request but no two: they run one after another, in
    order, each as alone; a request larger than the limit is refused when submitted."""
    model = stories_model
    runs = _runs(model, CONFIGS[:3])
    expected = [_alone(model, r) for r in runs]
    sizes = sorted(kv_bytes(model, r) for r in runs)
    limit = sizes[0] + sizes[1] - 1  # no two fit together
    assert sizes[2] <= limit  # each fits alone
    batcher = Batcher(model, max_batch=3, max_kv_bytes=limit)
    try:
        futures = [batcher.submit(r) for r in runs]
        results = [f.result(60) for f in futures]
        big = _runs(model, [("full", None, {})], new=200)[0]
        with pytest.raises(KVCapacityError, match="MiB, more than"):
            batcher.submit(big)
    finally:
        batcher.close()
    assert [r.token_ids[0] for r in results] == expected
    assert all(max(r.batch_sizes) == 1 for r in results)  # never two at once
    with pytest.raises(ConfigError, match="--max-kv-mib must be positive"):
        Batcher(model, max_kv_bytes=0)


def test_a_budget_covering_the_sequence_warns_the_caller_of_submit_and_generate_batch(
        stories_model):
    engine = rocketkv.Engine(stories_model)
    ids = list(range(3, 40))
    try:
        for call in (lambda: engine.submit(ids, method="rocketkv", budget=100000,
                                           max_new_tokens=4).result(60),
                     lambda: engine.generate_batch([ids, ids], method="rocketkv",
                                                   budget=100000, max_new_tokens=4)):
            with pytest.warns(UserWarning, match="no compression") as caught:
                call()
            assert {w.filename for w in caught if "no compression" in str(w.message)} \
                == {__file__}  # points at the caller's line
    finally:
        engine.close_batching()
