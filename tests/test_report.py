"""The report for people (``engine/report.py``: what ``generate.py`` prints on stderr): the
method's parameters as one readable line, the kernel line only where kernels can run, and one
note when the budget covers the whole sequence (no compression)."""

import json
import re

import pytest
import torch

from rocketkv.cli import generate as generate_cli
from rocketkv.engine import report
from rocketkv.engine.generate import CacheRequest, generate
from rocketkv.engine.report import format_report

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def rocket(stories_model):
    """A rocketkv run on stories260K: a 300-token prompt, budget 64."""
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    return generate(stories_model, ids, CacheRequest("rocketkv", 64), max_new_tokens=2)


def significant_digits(number: str) -> int:
    return len(number.replace(".", "").lstrip("0"))


def test_the_method_line_is_named_and_rounded(rocket):
    params = rocket.method_params
    assert isinstance(params["c1"], float) and len(repr(params["c1"])) > 6  # raw: many digits
    line = format_report(rocket).splitlines()[0]
    assert line.startswith("method rocketkv  budget 64  (") and line.endswith(")"), line
    assert "{" not in line and "'" not in line and "params" not in line, line
    assert f"c1 {params['c1']:.3g}" in line and f"page size {params['page_size']}" in line
    assert f"kernel size {params['kernel_size']}" in line and "split sqrt" in line
    for number in re.findall(r"\d+\.\d+", line):
        assert significant_digits(number) <= 3, (number, line)
    # internal fields and booleans left out; the kept tokens have their own line
    for word in ("compressed", "skip layers", "True", "False", "prompt tokens kept",
                 "method rocketkv  budget 64  (method"):
        assert word not in line, (word, line)
    assert line.count("rocketkv") == 1
    # skip_layers once set is a parameter of the run
    skipped = dict(rocket, method_params={**params, "skip_layers": 2})
    assert "skip layers 2" in report.method_line(skipped)


def test_the_method_line_of_unbudgeted_and_uncompressed_runs(rocket):
    full = dict(rocket, method="full", budget=None, method_params={"max_seq_len": 302})
    assert report.method_line(full) == "method full"
    covered = dict(rocket, budget=100000, method_params={
        "compressed": False, "note": "budget 100000 >= the whole sequence (5 prompt + 4 new "
                                     "tokens): no compression", "max_seq_len": 9})
    assert report.method_line(covered) == ("method rocketkv  budget 100000  (no compression: "
                                           "the budget covers the whole sequence)")
    # a list (OmniKV's filter layers) and large floats stay short
    odd = dict(rocket, method="omnikv", budget=256, method_params={
        "filter_layers": [2, 8, 18], "offload": False, "traffic_tokens": 700.0,
        "compression_ratio": 1234.5678, "selector": "last"})
    assert report.method_line(odd) == ("method omnikv  budget 256  (filter layers 2,8,18, "
                                       "traffic tokens 700, compression ratio 1235, selector "
                                       "last)")


CUDA_ONLY = {"sparse": "pytorch (cuda only)", "write": "unused",
             "prefix": "pytorch (cuda only)", "dense": "pytorch (cuda only)"}


def test_the_kernel_line_only_where_kernels_can_run(rocket):
    cpu = format_report(dict(rocket, device="cpu", kernels=CUDA_ONLY))
    assert "kernels:" not in cpu and "fused kernels off" in cpu
    gpu = format_report(dict(rocket, device="NVIDIA H200", kernels=CUDA_ONLY))
    assert "kernels: sparse pytorch (cuda only)" in gpu
    # kernels forced on the CPU (Triton's interpreter: tests/test_kernel_check.py) ran there
    forced = format_report(dict(rocket, device="cpu", kernels={
        **CUDA_ONLY, "prefix": "pytorch (self-check: RuntimeError: boom)"}))
    assert "kernels: sparse pytorch (cuda only), write unused, prefix pytorch (self-check" \
        in forced


def test_cli_report_on_the_cpu(stories_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    text = "Once upon a time, there was a little girl named Lily. " * 8
    assert generate_cli.main(["--checkpoint", str(stories_dir), "-p", text, "--method",
                              "rocketkv", "--budget", "40", "--max-new-tokens", "4",
                              "--no-stream", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    r = json.loads(out.read_text())
    lines = err.splitlines()
    assert report.method_line(r) in lines and "params {" not in err
    assert not [ln for ln in lines if ln.startswith("kernels:")], err
    assert not [ln for ln in lines if ln.startswith("note:")], err
    # the JSON keeps every field as it was
    assert r["kernels"]["prefix"] == "pytorch (cuda only)"
    assert isinstance(r["method_params"]["c1"], float) and r["method_params"]["compressed"]


def test_cli_says_once_that_a_budget_covering_the_sequence_means_no_compression(
        stories_dir, tmp_path, capsys):
    assert generate_cli.main(["--checkpoint", str(stories_dir), "-p", PROMPT, "--method",
                              "rocketkv", "--budget", "100000", "--max-new-tokens", "4",
                              "--no-stream"]) == 0
    err = capsys.readouterr().err
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1, err
    assert notes[0].startswith("note: no compression: the budget (100000) covers all 9 tokens "
                               "(prompt 5 + up to 4 new)"), notes[0]
    assert err.index(notes[0]) < err.index("load (weights and tokenizer)")  # before the load
    # one document, many questions: the same note, once
    (tmp_path / "q.txt").write_text("Who?\nWhere?\n")
    assert generate_cli.main(["--checkpoint", str(stories_dir), "-p", PROMPT, "--method",
                              "snapkv", "--budget", "100000", "--max-new-tokens", "3",
                              "--questions", str(tmp_path / "q.txt"), "--no-stream"]) == 0
    err = capsys.readouterr().err
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: no compression"), err
