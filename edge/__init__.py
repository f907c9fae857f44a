"""SmartExit edge runtime: the model, exits, distillation, CLI and the bundled tiny model."""
__version__ = "0.1.0"
