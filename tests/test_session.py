"""session.py: what generate keeps between calls lives on the model, not in module state."""

import pytest
import torch

from rocketkv.engine import session
from rocketkv.engine.generate import CacheRequest, generate, release_caches
from rocketkv.formats.checkpoint import random_model
from rocketkv.model import ConfigError, ModelArgs

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=16,
                 vocab_size=64, max_seq_len=128)


def tiny(seed: int):
    torch.manual_seed(seed)
    return random_model(ARGS, "cpu", torch.float32)


def test_each_model_holds_its_own_session():
    """Two models in one process: a run on one leaves the other's conversation alone, and
    the session is the model's attribute (``model.generate_session``)."""
    a, b = tiny(0), tiny(1)
    first = generate(a, [1, 2, 3, 4], CacheRequest(reserve_tokens=8), max_new_tokens=3)
    held = session.session(a)
    assert isinstance(held, session.Session) and held is a.generate_session
    assert held.conversation.position == first["conversation"]["position"]
    generate(b, [5, 6, 7], CacheRequest(reserve_tokens=4), max_new_tokens=2)
    assert session.session(a) is held and session.session(b) is b.generate_session
    nxt = generate(a, [9, 10], max_new_tokens=2,
                   continue_conversation=True)
    assert nxt["conversation"]["start"] == first["conversation"]["position"]


def test_released_or_replaced_caches_end_the_session():
    model = tiny(0)
    generate(model, [1, 2, 3], CacheRequest(reserve_tokens=4), max_new_tokens=2)
    model.setup_caches(list(model.caches)[::-1], 16)  # other caches attached: not generate's
    assert session.session(model) is None
    generate(model, [1, 2, 3], CacheRequest(reserve_tokens=4), max_new_tokens=2)
    release_caches(model)
    assert session.session(model) is None and not hasattr(model, session.ATTRIBUTE)
    assert all(layer.attention.kv_cache is None for layer in model.layers)
    with pytest.raises(ConfigError, match="no conversation to continue"):
        generate(model, [4], max_new_tokens=1,
                 continue_conversation=True)
    with pytest.raises(ConfigError, match="no conversation to rewind"):
        session.rewind_conversation(model, 2)
