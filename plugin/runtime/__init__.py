"""What runs inside a process serving a model: :class:`~llamaflash.runtime.llama.Llama` (public as
``llamaflash.Llama``) and its lifecycle, its keyword arguments (llama_settings), what it tells the user
while loading (notices), its load stages (llama_load) and the plan they share with `llamaflash env`
(model_plan), the native engine's configuration (engine), flash offload (offload), an MoE model's
expert engine (expert_runtime), the ``flash_stats()`` report (flash_stats), speculative
decoding and its draft lengths (speculative, draft_control), and the native flash reader (flash_io)."""
