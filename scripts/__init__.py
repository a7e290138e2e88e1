"""The command-line scripts; ``python scripts/X.py --help`` for each. Each opens with ``import
_here`` (``scripts/_here.py``: this checkout's root first on ``sys.path``); imported as
``scripts.X``, the name ``_here`` is this package's module."""

import sys

from scripts import _here

sys.modules.setdefault("_here", _here)
