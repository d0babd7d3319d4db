"""GGML block formats (GGUF quant types) on the host: exact unpacking, a batch-invariant GEMM, a row gather."""
