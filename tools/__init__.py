"""Developer-only tools: ``compile_kernels.py`` (the fused kernels' registers and
spills, compiled for a GPU without one), ``check_targets.py`` (bench rows judged against the
project's targets) and ``selection_steps.py`` (the NumPy model of the selection's threshold
search); ``python tools/X.py --help`` for each. The user's scripts are in ``scripts/``. Each
opens with ``import _here`` (``tools/_here.py``); imported as ``tools.X``, the name ``_here``
is this package's module."""

import sys

from tools import _here

sys.modules.setdefault("_here", _here)
