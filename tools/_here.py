"""This checkout's root first on ``sys.path``, so that ``python tools/X.py`` runs the engine of
the checkout the tool sits in: ``scripts/_here.py``'s reasons, for the developer tools."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)

if sys.path[:1] != [ROOT]:
    if ROOT in sys.path:
        sys.path.remove(ROOT)
    sys.path.insert(0, ROOT)
