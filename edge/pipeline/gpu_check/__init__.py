"""deploy/gpu_check.py's sections as library code: what the one short check on a CUDA machine measures."""
