"""SmartExit: early-exit LLM inference for edge devices.

Layers, each importing only those below it (contracts in pyproject.toml, checked by the tests):
``edge.pipeline`` | ``edge.jetson`` > ``scheduler.loadtest`` > ``scheduler.serving`` >
``scheduler.control`` | ``edge.training`` > ``calibration`` | ``exporters`` > ``edge.runtime`` | ``edge.energy`` >
``edge.compress`` > ``edge.model`` > ``edge.core``; and no import circles (docs/architecture.md).
"""
__version__ = "0.1.0"
