"""``python -m llamaflash``: the ``llamaflash`` command line."""

from llamaflash.cli.cli import main

main()
