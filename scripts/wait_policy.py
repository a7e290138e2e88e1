"""How OpenMP's wait policy changes the CPU decode step when other processes load the machine:
``generate.py`` run again and again, alternating the settings, each in a fresh process.

    python scripts/wait_policy.py --repeats 3 --out results/cpu

Settings (environment variables read when torch's OpenMP runtime starts):

* ``passive``: none set, so the engine's default applies (``rocketkv/__init__.py`` sets
  ``OMP_WAIT_POLICY=PASSIVE``: an idle thread sleeps at once);
* ``libgomp default``: ``GOMP_SPINCOUNT=300000``, libgomp's own default spin before sleeping
  (what torch does when nothing is set);
* ``active``: ``OMP_WAIT_POLICY=ACTIVE`` (idle threads spin).

Per run: the median decode step (ms), the prefill (s) and the 1-minute load average before it.
``wait-policy.json`` (every run, the command, the provenance) and ``wait-policy.md`` (medians per
setting) go into ``--out``. Exit status 0, 2 on bad input (one ``error:`` line).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import OneLineParser

SETTINGS = {"passive": {}, "libgomp default": {"GOMP_SPINCOUNT": "300000"},
            "active": {"OMP_WAIT_POLICY": "ACTIVE"}}
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type, oil-based ink and a screw press.")


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None,
                   help="model (default: the SmolLM2-135M-Instruct GGUF, as generate.py)")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting, alternating (3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each run (2)")
    p.add_argument("--max-new-tokens", type=int, default=48,
                   help="tokens per run, --ignore-eos (48)")
    p.add_argument("--out", default="results/cpu", metavar="DIR",
                   help="folder of wait-policy.json and wait-policy.md (results/cpu)")
    return p


def one_run(env_extra: dict[str, str], args, path: Path) -> dict:
    """One ``generate.py`` run in a fresh process with ``env_extra`` (the wait-policy variables
    of the parent removed first); its decode median, prefill and the load before it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env_extra
    cmd = [sys.executable, str(Path(_here.ROOT) / "generate.py"), "--prompt-text", PROMPT,
           "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos", "--no-compile",
           "--threads", str(args.threads), "--json", str(path), "--no-progress"]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    load = os.getloadavg()[0]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    r = json.loads(path.read_text())
    return {"decode_ms_median": r["decode_ms_median"], "prefill_s": r["prefill_s"],
            "load_average_before": load}


def run(args, argv: Sequence[str] | None = None) -> int:
    """The runs, the summary, the two files; the exit status."""
    for flag in ("repeats", "threads", "max_new_tokens"):
        if getattr(args, flag) <= 0:
            print(f"error: --{flag.replace('_', '-')} must be positive, got "
                  f"{getattr(args, flag)}", file=sys.stderr)
            return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: --out {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, extra in SETTINGS.items():
                r = one_run(extra, args, Path(tmp) / "r.json")
                runs[name].append(r)
                print(f"{name} {i + 1}: decode {r['decode_ms_median']:.1f} ms, prefill "
                      f"{r['prefill_s']:.3f} s, load {r['load_average_before']:.2f}",
                      flush=True)
    summary = {name: {"decode_ms_median": statistics.median(r["decode_ms_median"] for r in rs),
                      "prefill_s_median": statistics.median(r["prefill_s"] for r in rs),
                      "load_average_median": statistics.median(r["load_average_before"]
                                                               for r in rs)}
               for name, rs in runs.items()}
    argv_list = list(sys.argv[1:] if argv is None else argv)
    record = {"command": " ".join(["python scripts/wait_policy.py", *argv_list]),
              "settings": {k: v or "nothing set (the engine's default: PASSIVE)"
                           for k, v in SETTINGS.items()},
              "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "runs": runs, "summary": summary,
              "provenance": provenance(args.checkpoint, ["scripts/wait_policy.py",
                                                         *argv_list])}
    (out / "wait-policy.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# OpenMP wait policy under load ({args.threads} threads, {args.repeats} runs "
             "each, alternating)", "",
             "| setting | decode step median ms | prefill median s | load average median |",
             "|---|---:|---:|---:|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['decode_ms_median']:.1f} | {s['prefill_s_median']:.3f} | "
                     f"{s['load_average_median']:.2f} |")
    (out / "wait-policy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch loads
    ARGS = build_parser().parse_args()

from rocketkv.engine.provenance import provenance  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
