"""``python -m rocketkv COMMAND ...``: the ``rocketkv`` console command (``cli/main.py``)."""

from rocketkv.cli.main import main

main()
