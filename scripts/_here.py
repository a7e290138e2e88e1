"""This checkout's root first on ``sys.path``, so that ``python scripts/X.py`` runs the engine of
the checkout the script sits in.

Run as a file, a script has its own directory (``scripts/``) on the path, not the repository's
root, so ``import model`` would fall through to an editable install's finder (``pip install -e
.``), which maps the modules of whichever clone was installed (and knows no module added since).
That finder sits on ``sys.meta_path`` after the path finder, so a ``sys.path`` entry wins. Every
script imports this module before any module of the engine: ``import _here  # noqa: F401``
(``scripts/__init__.py`` makes the same line work when a script is imported as
``scripts.X``)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)

if sys.path[:1] != [ROOT]:
    if ROOT in sys.path:
        sys.path.remove(ROOT)
    sys.path.insert(0, ROOT)
