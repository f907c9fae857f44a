"""Layer 4 (below the pipeline, above calibration/ and exporters/): training the tiny model, exit heads,
LayerSkip fine-tuning, exit gates, and the model cards of what they make (the tiny model's card times
its exported graph, hence above exporters/)."""
