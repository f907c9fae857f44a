"""Layer 2: the engine (continuous batching, exits, KV cache), its backends and the exit-rule protocol.
The serving path (engine, cache, rules, ONNX Runtime backend) imports no torch."""
