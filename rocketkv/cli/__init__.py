"""The command lines: ``generate`` (``python generate.py``, ``rocketkv generate``),
``quantize`` (``python quantize.py``, ``rocketkv quantize``), and the helpers they share
(``common``). ``rocketkv/flags.py`` holds their torch-free vocabulary."""
