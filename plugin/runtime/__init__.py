"""What runs inside a process serving a model: :class:`~llamaflash.runtime.llama.Llama` (public as
``llamaflash.Llama``) and its lifecycle, its keyword arguments (llama_settings), opening the native
engine (engine), the MoE expert engine (expert_runtime, moe_init), flash offload statistics (offload,
flash_stats), speculative decoding and its draft lengths (speculative, draft_control), and the native
flash reader (flash_io)."""
