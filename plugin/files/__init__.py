"""The files llamaflash reads: GGUF headers and base models (gguf_header, gguf_model, experts), the
sidecar format and its readers and checks (sidecar_format, sidecar, sidecar_checks, expert_sidecar,
integrity), and the models and texts fetched from the package registries (assets). Nothing here loads
llama.cpp or the native extension, except the row checksums of integrity."""
