"""kernels/tuning.py: the launch settings measured per GPU (kernels/tuned/*.json)."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from rocketkv import kernels
from rocketkv.kernels import tuning

KEY = "swiglu/int4/M=1/K=4096/n=14336"
KNOBS = {"TARGET_PROGRAMS": 128, "MAX_BLOCK_N": 16, "K_BLOCK": 512, "NUM_WARPS": 8}


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A fake "NVIDIA H100" whose tables are read from ``tmp_path``."""
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tuning, "_tables", {})
    monkeypatch.setattr(tuning, "_names", {})
    monkeypatch.setattr(tuning, "_applied", set())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    return torch.device("cuda")


def write(path, gpu_name, launches=None, constants=None):
    data = {"device": gpu_name}
    if launches is not None:
        data["launches"] = [{"key": k, "config": c, "us": 1.0} for k, c in launches.items()]
    if constants is not None:
        data["constants"] = constants
    path.write_text(json.dumps(data))


def test_tables_merge_for_the_gpu_they_name(gpu, tmp_path):
    """Files naming the GPU merge in name order (a later value over an earlier one, per
    launch and per constant); another GPU's file and CPU devices get nothing."""
    write(tmp_path / "a.json", "NVIDIA H100", {KEY: dict(KNOBS, NUM_WARPS=2)},
          {"sparse": {"SPLIT_PAGES": 1024, "PREFIX_WARPS": 4}})
    write(tmp_path / "b.json", "NVIDIA H100", {KEY: KNOBS}, {"sparse": {"SPLIT_PAGES": 4096}})
    write(tmp_path / "c.json", "NVIDIA H200", {KEY: dict(KNOBS, K_BLOCK=64)},
          {"dense": {"NUM_WARPS": 2}})
    t = tuning.table(gpu)
    assert t.launches == {KEY: KNOBS}
    assert t.constants == {"sparse": {"SPLIT_PAGES": 4096, "PREFIX_WARPS": 4}}
    empty = tuning.table(torch.device("cpu"))
    assert empty.launches == {} and empty.constants == {}
    # what a bench row records of them
    assert tuning.describe(gpu) == {"files": ["a.json", "b.json"], "launches": 1,
                                    "constants": {"sparse": {"SPLIT_PAGES": 4096,
                                                             "PREFIX_WARPS": 4}},
                                    "dense_faster": False}  # no reference times
    assert tuning.describe(torch.device("cpu")) is None


def test_constants_are_set_once_a_process(gpu, tmp_path):
    """``apply_constants`` sets the modules' constants the first time the kernels meet the
    GPU, then never again (a benchmark's own settings stay); nothing off CUDA."""
    write(tmp_path / "a.json", "NVIDIA H100",
          constants={"sparse": {"SPLIT_PAGES": 4096}, "dense": {"TARGET_PROGRAMS": 256}})
    sparse = SimpleNamespace(SPLIT_PAGES=2048)
    dense = SimpleNamespace(TARGET_PROGRAMS=512)
    tuning.apply_constants(torch.device("cpu"), {"sparse": sparse, "dense": dense})
    assert (sparse.SPLIT_PAGES, dense.TARGET_PROGRAMS) == (2048, 512)
    tuning.apply_constants(gpu, {"sparse": sparse, "dense": dense})
    assert (sparse.SPLIT_PAGES, dense.TARGET_PROGRAMS) == (4096, 256)
    sparse.SPLIT_PAGES = 1024  # set afterwards, e.g. by bench_step --knob
    tuning.apply_constants(gpu, {"sparse": sparse, "dense": dense})
    assert sparse.SPLIT_PAGES == 1024


def test_the_kernels_apply_the_constants_when_they_first_run_on_a_gpu(gpu, monkeypatch):
    """``kernels.in_use`` (and ``enabled``) on a CUDA device hands the kernel modules to
    ``apply_constants``; on CPU it does not."""
    if kernels.ops() is None:
        pytest.skip(f"triton: {kernels.missing()}")
    seen = []
    monkeypatch.setattr(tuning, "apply_constants",
                        lambda device, modules: seen.append((device.type, sorted(modules))))
    previous = kernels.set_mode("auto")
    try:
        assert kernels.in_use(gpu) and not kernels.in_use(torch.device("cpu"))
        assert not kernels.enabled(torch.empty(1, 1, 1, 64))  # auto: not on CPU
    finally:
        kernels.set_mode(previous)
    assert seen == [("cuda", ["dense", "sparse"])]


@pytest.mark.parametrize("body,message", [
    ('{"device": "NVIDIA H100", "launches": [{"key": 1}]}', "not a tuned launch table"),
    ('{"device": "NVIDIA H100", "launches": [{"key": "k", "config": {"TARGET_PROGRAMS": 64, '
     '"MAX_BLOCK_N": 16, "K_BLOCK": 48, "NUM_WARPS": 4}}]}', "k: K_BLOCK must be a power of two"),
    ('{"device": "NVIDIA H100", "constants": {"sparse": {"SPLITS": 2}}}',
     "sparse.SPLITS is not a tuned constant"),
    ('{"device": "NVIDIA H100", "constants": {"model": {"X": 2}}}', "constants of 'model'"),
    ('{"device": "NVIDIA H100", "constants": {"sparse": {"ATTEND_TOKENS": 8}}}',
     "ATTEND_TOKENS must be a power of two of at least 16"),
    ('{"device": "NVIDIA H100", "constants": {"dense": {"TARGET_PROGRAMS": 0}}}',
     "TARGET_PROGRAMS must be a positive integer"),
    ("{", "not a tuned launch table"),
])
def test_a_bad_table_is_refused_with_its_file_named(gpu, tmp_path, body, message):
    (tmp_path / "bad.json").write_text(body)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        tuning.table(gpu)
    assert str(e.value).startswith(str(tmp_path / "bad.json"))


def test_every_committed_table_is_valid():
    """Each ``kernels/tuned/*.json`` reads as a table for the GPU it names, every launch key
    one ``kernels.dense.launch_key`` could give and every constant a tuned one."""
    pattern = re.compile(r"^(plain|residual|swiglu|qkv)/(float|int8|int4)/M=(1|many)/K=\d+/"
                         r"n=\d+$")
    for path in sorted(tuning.TUNED_DIR.glob("*.json")):
        t = tuning.read_table(path, json.loads(path.read_text())["device"])
        assert t.launches or t.constants, path
        assert all(pattern.match(k) for k in t.launches), path


@pytest.mark.parametrize("ours,reference,on",
                         [(3.0, 5.0, True), (5.0, 3.0, False), (None, None, False)])
def test_the_dense_kernels_run_by_default_only_where_timed_faster(gpu, tmp_path, monkeypatch,
                                                                  ours, reference, on):
    """By default (``set_dense(None)``, ``--kernels auto``) the dense kernels run on a GPU only
    when its tables timed them, over the launches they list, faster than the reference
    (cuBLAS): on the H200 the untuned kernels were 31% slower. ``set_dense(True)``
    (``--kernels on``) runs them anyway, ``False`` (``sparse``) never; the attention
    families do not depend on it, and ``report`` says why the projections stay in PyTorch."""
    if kernels.ops() is None:
        pytest.skip(f"triton: {kernels.missing()}")
    entry = {"key": KEY, "config": KNOBS}
    if ours is not None:
        entry.update(us=ours, reference_us=reference)
    (tmp_path / "t.json").write_text(json.dumps({"device": "NVIDIA H100", "launches": [entry],
                                                 "constants": {}}))
    monkeypatch.setattr(tuning, "apply_constants", lambda device, modules: None)
    mode, dense = kernels.set_mode("auto"), kernels.set_dense(None)
    try:
        assert tuning.table(gpu).dense_faster is on
        assert kernels.dense_in_use(gpu) is on and kernels.family_on("prefix", gpu)
        got = kernels.report(gpu)["dense"]
        assert got == ("fused" if on else "pytorch (cuBLAS: not timed faster on this GPU)")
        kernels.set_dense(True)
        assert kernels.dense_in_use(gpu)
        kernels.set_dense(False)
        assert not kernels.dense_in_use(gpu) and kernels.report(gpu)["dense"] == "pytorch (off)"
        kernels.set_mode("force")  # kernel development, the interpreter: on unless told
        kernels.set_dense(None)
        assert kernels.dense_in_use(torch.device("cpu"))
    finally:
        kernels.set_mode(mode)
        kernels.set_dense(dense)
