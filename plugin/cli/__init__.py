"""The ``llamaflash`` command line (cli; its entry point is :func:`llamaflash.cli.cli.main`): bench and
plan (cli_budget), run and chat (run_chat), serve, demo, and registry model names (models_by_name)."""
