"""The ``llamaflash`` command line (cli; its entry point is :func:`llamaflash.cli.cli.main`): convert,
inspect, verify and tune (cli_sidecar), run, chat, serve and models (cli_run; the work in run_chat and serve),
bench and plan (cli_budget), env (env_cmd), demo, and registry model names (models_by_name)."""
