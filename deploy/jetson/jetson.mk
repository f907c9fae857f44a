# Included by the top-level Makefile. Targets that only make sense on a Jetson (L4T).
.PHONY: jetson-check

# Prints L4T / JetPack and TensorRT package versions; fails with a clear message elsewhere.
jetson-check: $(STAMP)
	$(BIN)/python -c "import json; from edge.device import jetson_info; print(json.dumps(jetson_info(), indent=2))"
