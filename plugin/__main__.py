"""``python -m llamaflash``: the ``llamaflash`` command line."""

from llamaflash.cli import main

main()
