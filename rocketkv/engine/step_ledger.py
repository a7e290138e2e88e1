"""What this machine learned about compiling the CPU decode step, so a later run of the same
shape compiles by default when it pays (``StepLedger``).

Inductor keeps what it compiles on disk (its FX graph cache); the engine points it at a
folder that survives a reboot (``persistent_inductor_cache``: ``$ROCKETKV_CACHE_DIR/inductor``,
default ``~/.cache/rocketkv/inductor``, unless ``TORCHINDUCTOR_CACHE_DIR`` is set), so a second
run of a step shape compiles in seconds instead of tens of seconds. The ledger
(``compiled-steps.json`` beside it) records, per step shape (``step_key``: the model's shapes,
weights and dtype, the method and its parameters, the cache's length, the batch, torch's
version, the CPU): the compile seconds of the first compile and of the later ones (served by the
cache), and the median decode step compiled and eager. ``generate``'s default on CPU
(``step.default_compile``: eager below ``CPU_COMPILE_MIN_STEPS`` decode steps) becomes
"compiled" for a shape whose cached compile the run's decode steps repay:
steps x (eager ms - compiled ms) > cached compile s (``worth_compiling``); a shape never
compiled, or never run eagerly, keeps the default.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

CACHE_ENV = "ROCKETKV_CACHE_DIR"
LEDGER_FILE = "compiled-steps.json"


def cache_root() -> Path:
    """``$ROCKETKV_CACHE_DIR``, else ``~/.cache/rocketkv``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rocketkv")


def persistent_inductor_cache() -> None:
    """Point Inductor's on-disk cache at ``cache_root() / "inductor"`` unless
    ``TORCHINDUCTOR_CACHE_DIR`` is set (its default, under /tmp, is lost at a reboot). Called
    before the first compile."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


def step_key(fields: dict[str, Any]) -> str:
    """A short hash of ``fields`` (JSON-serialisable, order-free): a step shape's key."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class StepLedger:
    """The ledger file (``cache_root() / LEDGER_FILE``, or ``path``): step key -> {"compiles",
    "compile_s_first", "compile_s_cached", "compiled_ms", "eager_ms"} (seconds and
    milliseconds; a field is missing until measured). A file that cannot be read counts as
    empty; one that cannot be written is left alone (the run goes on)."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_root() / LEDGER_FILE

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> dict[str, Any] | None:
        return self._load().get(key)

    def record(self, key: str, *, compiled: bool, compile_s: float | None,
               step_ms: float | None, label: str = "") -> None:
        """Add one run of step ``key``: compiled (its warm-up's ``compile_s``: the first
        compile of the shape, or a later one the on-disk cache served) or eager, and its
        median decode step ``step_ms`` (None: too few steps to time)."""
        data = self._load()
        entry = data.setdefault(key, {"compiles": 0})
        if label:
            entry["label"] = label
        if compiled:
            if compile_s is not None:
                entry["compile_s_cached" if entry["compiles"] else "compile_s_first"] = \
                    round(compile_s, 3)
                entry["compiles"] += 1
            if step_ms is not None:
                entry["compiled_ms"] = round(step_ms, 3)
        elif step_ms is not None:
            entry["eager_ms"] = round(step_ms, 3)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)  # whole or not at all
        except OSError:
            pass

    def worth_compiling(self, key: str, decode_steps: int) -> bool:
        """Whether compiling step ``key`` for ``decode_steps`` steps saves time: its cached
        compile, its compiled and its eager step all measured before, and
        ``decode_steps`` x (eager ms - compiled ms) above the cached compile's ms."""
        e = self.get(key) or {}
        if not {"compile_s_cached", "compiled_ms", "eager_ms"} <= e.keys():
            return False
        return decode_steps * (e["eager_ms"] - e["compiled_ms"]) > e["compile_s_cached"] * 1e3


def compile_note(entry: dict[str, Any] | None) -> str:
    """The line ``generate.py`` prints before a CPU run compiles its step, from the shape's
    ledger ``entry`` (None: never compiled here), so a long compile is not a silent wait."""
    if entry and "compile_s_cached" in entry:
        return (f"compiling the decode step: {entry['compile_s_cached']:.1f} s from the "
                "on-disk cache last time for this shape")
    if entry and "compile_s_first" in entry:
        return (f"compiling the decode step: {entry['compile_s_first']:.1f} s the first time "
                "for this shape; less now if the on-disk cache kept it")
    return ("compiling the decode step, per layer (the first time for this shape on this "
            f"machine: 10-30 s; later runs read it from {cache_root() / 'inductor'} unless "
            "TORCHINDUCTOR_CACHE_DIR says otherwise)")
