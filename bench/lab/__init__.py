"""The benchmark lab of llamaflash (installed as ``llamaflash.bench``): stock llama.cpp and llamaflash
side by side, each run in a fresh process, under memory limits or in memory.

Not part of what a program imports to run a model: ``llamaflash bench``, ``llamaflash demo`` and
``llamaflash tune`` import it when they run, and the scripts in the repository's ``bench/`` build on it.
Its worker is the one fresh-process timing harness of all of them.

- :mod:`.memlimit`: the benchmark under a memory limit (``llamaflash bench``);
- :mod:`.cgroups`: memory and blkio cgroups (v1), one process inside a limit, how it ended;
- :mod:`.pagecache`: page-cache residency, eviction, private copies of files;
- :mod:`.benchkit`: prompt text, model resolution, machine description, the worker runner (and
  :func:`~.benchkit.timed_run`, one timed run), medians;
- :mod:`.worker`: one run in a fresh process, started by file path (never imported by a run);
- :mod:`.moe_synth`: synthetic Mixture-of-Experts GGUF models of real architectures
  (:mod:`.moe_layout` tensors and hyperparameters, :mod:`.moe_weights` random weights and routing
  shaping, :mod:`.moe_vocab` real tokenizers from the llama-cpp-python sdist, :mod:`.llama_sdist`
  its verified download, shared with the build).
"""
