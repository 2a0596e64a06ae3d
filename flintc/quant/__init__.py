"""Weight formats: the NVFP4 codec (ggml super-blocks <-> the packed layout kernels read)."""
