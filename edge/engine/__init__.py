"""The SmartExit runtime engine: continuous batching, chunked prefill, batched hierarchical exits."""
