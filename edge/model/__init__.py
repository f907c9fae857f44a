"""Layer 1: the decoder, its checkpoint format and tokenizer, exit heads, the bundled models and the
PyTorch reference generator."""
