"""The serving front end: an OpenAI-compatible Ray Serve application over Triton (docs/serving.md).

``api`` (the HTTP protocol, pure), ``config`` (``ServeConfig``), ``metrics`` (Prometheus),
``triton_client`` (the Triton wire protocol) and ``app`` (the Ray Serve deployments; imports ray).
Nothing is imported here, so ``scheduler.serving.api`` stays importable without Ray.
"""
