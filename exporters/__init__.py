"""ONNX export with parity gates, TensorRT engine building, Triton model repositories (issue 4)."""
