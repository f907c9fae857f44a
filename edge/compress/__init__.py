"""Compression: sensitivity-guided quantization (QAT + PTQ, INT4 weight-only), structured pruning near
exits, token-importance skipping in prefill. The ``compress`` stage (:mod:`edge.pipeline.compress`)
runs between distillation and calibration, so that calibration sees the model that is served."""
