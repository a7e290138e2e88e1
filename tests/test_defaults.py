"""What runs when nothing is named: generate.py and rocketkv.load() without a checkpoint take
the SmolLM2-135M-Instruct GGUF of the data directory, or say in one line how to get it."""

import os
import subprocess
import sys

from conftest import ROOT, SMOLLM2_GGUF, shared_file


def run(args, data_dir, cwd):
    env = {**os.environ, "ROCKETKV_DATA": str(data_dir), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_generate_without_a_checkpoint_runs_the_default_model(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / SMOLLM2_GGUF.name).symlink_to(shared_file(SMOLLM2_GGUF))
    p = run([str(ROOT / "generate.py"), "-p", "What is the capital of France?",
             "--max-new-tokens", "8", "--no-stream"], tmp_path, tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"checkpoint {tmp_path / 'models' / SMOLLM2_GGUF.name}" in p.stderr
    assert "Paris" in p.stdout  # the instruct model, through its chat template by default


def test_without_the_default_model_one_line_says_how_to_get_it(tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    for args in ([str(ROOT / "generate.py"), "-p", "hi"],
                 ["-c", "import rocketkv; rocketkv.load()"]):
        p = run(args, empty, tmp_path)
        assert p.returncode != 0
        last = p.stderr.strip().splitlines()[-1]
        assert "scripts/download.py --repo-id HuggingFaceTB/SmolLM2-135M-Instruct" in last
        if args[0].endswith("generate.py"):
            assert p.returncode == 2 and p.stderr.strip().startswith("error: no --checkpoint")
