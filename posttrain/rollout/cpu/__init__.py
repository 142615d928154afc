"""CPU decode accelerators for the native engine: the fused Llama-family decoder and what feeds it."""
