"""Layer 3 (beside calibration/ and exporters/): training the tiny model, exit heads, LayerSkip
fine-tuning, exit gates, and the model cards of what they make."""
