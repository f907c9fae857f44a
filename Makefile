# SmartExit: `make demo` runs the pipeline on the bundled tiny model; `make test` runs the tests.
# Both bootstrap .venv from requirements/lock.txt on first use (idempotent).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN ?= demo
ART := artifacts/$(RUN)
SE := $(BIN)/smartexit
DEMO_CFG := configs/demo.yaml
MODEL_FILES := $(wildcard edge/assets/tiny/*) $(wildcard edge/assets/tiny-ee/*) $(wildcard edge/assets/data/*)
SRC := $(shell find edge calibration exporters scheduler -name '*.py' 2>/dev/null)

.PHONY: demo test test-fast venv distill compress bench-compress energy compress-study calibrate export bench generate report repo serve bench-serve profile bench-scheduler bench-projection gpu-check aiperf-check train-tiny train-tiny-ee train-scheduler train-scheduler-ablation llamacpp clean help
.DEFAULT_GOAL := help

help:
	@echo "make demo        run every stage on the bundled tiny model -> $(ART)/report.md"
	@echo "make test        run the test suite (unit + integration; gpu/jetson tiers skip without hardware)"
	@echo "make test-fast   the unit tier without tests marked slow or integration: the edit loop (< 5 min on 2 cores, no servers)"
	@echo "make train-tiny  retrain the bundled tiny model (1-2 h on 2 cores, resumable)"
	@echo "make train-tiny-ee  LayerSkip-train it into bundled-ee (40 min to 2 h on 2 cores; resumable)"
	@echo "make train-scheduler  retrain the learned scheduler -> scheduler/assets/ppo (~10 min on 2 cores; needs the latency model of smartexit profile)"
	@echo "make train-scheduler-ablation  the same without the exit-depth features -> scheduler/assets/ppo_noexit (bench scheduler's ppo-noexit)"
	@echo "make serve       start tritonserver + the Ray Serve OpenAI API on 127.0.0.1:8000 (Ctrl-C stops it)"
	@echo "make bench-serve the serving load test (trace arrivals, both control policies, vs in process)"
	@echo "make profile     the engine's step time and the serving path -> the simulator's latency model (~1.5 min)"
	@echo "make bench-scheduler  the learned scheduler vs fixed budgets and heuristics, the full sweep (simulator + real stack; the demo runs a reduced form)"
	@echo "make compress-study  every compression recipe side by side (+ llama.cpp q8_0 / q4_0) -> $(ART)/bench/compress.md (~15 min)"
	@echo "make energy      energy per token (jtop / tegrastats / NVML / RAPL; CPU-seconds proxy without a sensor): full depth vs exits vs compressed"
	@echo "make bench-projection  exit decisions at Qwen2.5-0.5B / Llama-3.2-1B shapes, random local weights -> $(ART)/bench/projection.md (~20 min, ~20 GiB)"
	@echo "make gpu-check   on a CUDA GPU: torch_static's CUDA graphs, what exit checks cost, NVML joules -> $(ART)/gpu_check (< 10 min)"
	@echo "make llamacpp    build llama-cpp-python and llama-bench from source: adds llama.cpp as system (f) of make bench"
	@echo "make distill | compress | calibrate | export | bench | generate | report   one stage at a time (RUN=name picks artifacts/<name>)"
	@echo "make jetson-push DEVICE=user@host, then on the Orin: make jetson-check | jetson-engines | jetson-serve | jetson-status | jetson-stop;"
	@echo "     make jetson-bench DEVICE=user@host pulls its numbers back (DRY_RUN=1 prints every command; deploy/jetson/README.md)"

venv: $(STAMP)
$(STAMP): requirements/lock.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements/lock.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e . > $(VENV)/install.log 2>&1 \
		|| { cat $(VENV)/install.log; exit 1; }
	@touch $@

# ---- pipeline stages (real file dependencies: an edit re-runs only what is stale) ----
$(ART)/multi_exit/exits.json: $(STAMP) $(MODEL_FILES) $(DEMO_CFG) $(SRC)
	$(SE) distill --config $(DEMO_CFG) run_dir=$(ART)

# distill -> compress -> export -> calibrate: calibration runs the exported graphs that serve (a compressed
# model's integer kernels), and judges every token against those graphs at full depth
$(ART)/compressed/compress.json: $(ART)/multi_exit/exits.json configs/compress.yaml
	$(SE) compress --config configs/compress.yaml run_dir=$(ART)

$(ART)/calibration/thresholds.json: $(ART)/compressed/compress.json $(ART)/onnx/graphs.json configs/calibrate.yaml
	$(SE) calibrate --config configs/calibrate.yaml run_dir=$(ART)

$(ART)/.generate.done: $(ART)/compressed/compress.json $(ART)/calibration/thresholds.json
	$(SE) generate run_dir=$(ART)
	@touch $@

$(ART)/onnx/graphs.json: $(ART)/compressed/compress.json
	$(SE) export run_dir=$(ART)

$(ART)/bench/compress.json: $(ART)/onnx/graphs.json $(ART)/calibration/thresholds.json configs/bench_compress.yaml
	$(SE) bench compress --config configs/bench_compress.yaml run_dir=$(ART)

$(ART)/bench/energy.json: $(ART)/bench/compress.json configs/bench_energy.yaml
	$(SE) bench energy --config configs/bench_energy.yaml run_dir=$(ART)

$(ART)/bench/decode.json: $(ART)/onnx/graphs.json $(ART)/calibration/thresholds.json
	$(SE) bench decode --config configs/bench_decode.yaml run_dir=$(ART)

$(ART)/triton/smartexit/config.pbtxt: $(ART)/onnx/graphs.json $(ART)/calibration/thresholds.json exporters/triton.py
	$(SE) repo run_dir=$(ART)

$(ART)/bench/serve.json: $(ART)/triton/smartexit/config.pbtxt configs/bench_serve.yaml
	$(SE) bench serve --config configs/bench_serve.yaml run_dir=$(ART)

$(ART)/bench/audit.json: $(ART)/triton/smartexit/config.pbtxt
	$(SE) bench audit run_dir=$(ART)

# one stack start in the demo (PROFILE_ARGS=serving_starts=2: the serving path fitted across two starts, ~100 s more;
# the demo read 15:06 and 15:35 with two on a 2-core Intel VM, stop 65, docs/scheduler.md)
PROFILE_ARGS ?= serving_starts=1
$(ART)/scheduler/latency.json: $(ART)/triton/smartexit/config.pbtxt
	$(SE) profile run_dir=$(ART) $(PROFILE_ARGS)

POLICY_FILES := $(wildcard scheduler/assets/ppo/* scheduler/assets/ppo_noexit/*)
$(ART)/bench/scheduler.json: $(ART)/scheduler/latency.json configs/bench_scheduler.yaml $(POLICY_FILES)
	$(SE) bench scheduler --config configs/bench_scheduler.yaml run_dir=$(ART)

$(ART)/report.json: $(ART)/multi_exit/exits.json $(ART)/calibration/thresholds.json $(ART)/.generate.done \
		$(ART)/onnx/graphs.json $(ART)/bench/decode.json $(ART)/bench/serve.json $(ART)/bench/audit.json \
		$(ART)/bench/scheduler.json $(ART)/bench/compress.json $(ART)/bench/energy.json \
		$(wildcard $(ART)/bench/projection.json)
	$(SE) report run_dir=$(ART)

distill: $(ART)/multi_exit/exits.json
compress: $(ART)/compressed/compress.json
bench-compress: $(ART)/bench/compress.json
energy: $(ART)/bench/energy.json
compress-study: $(ART)/onnx/graphs.json $(ART)/calibration/thresholds.json
	$(SE) bench compress --config configs/compress_study.yaml run_dir=$(ART)
calibrate: $(ART)/calibration/thresholds.json
export: $(ART)/onnx/graphs.json
bench: $(ART)/bench/decode.json
generate: $(ART)/.generate.done
report: $(ART)/report.json
repo: $(ART)/triton/smartexit/config.pbtxt
bench-serve: $(ART)/bench/serve.json
profile: $(ART)/scheduler/latency.json
# the full sweep (configs/bench_scheduler_full.yaml); the demo runs the reduced form (configs/bench_scheduler.yaml)
bench-scheduler: $(ART)/scheduler/latency.json $(POLICY_FILES)
	$(SE) bench scheduler --config configs/bench_scheduler_full.yaml run_dir=$(ART)
	@test ! -f $(ART)/report.json || $(SE) report run_dir=$(ART)

# not part of demo: minutes per shape and gigabytes of graphs (configs/bench_projection.yaml)
bench-projection: $(ART)/calibration/thresholds.json
	$(SE) bench projection --config configs/bench_projection.yaml run_dir=$(ART)
	@test ! -f $(ART)/report.json || $(SE) report run_dir=$(ART)

# on a machine with a CUDA GPU: the torch_static engine's CUDA graphs, exit costs, NVML joules -> $(ART)/gpu_check
# (GPU_PYTHON: an interpreter whose torch has CUDA, if .venv's has not; GPU_CHECK_ARGS: deploy/gpu_check.py's options)
gpu-check: $(STAMP)
	OUT=$(ART)/gpu_check PYTHON=$${GPU_PYTHON:-$(BIN)/python} deploy/gpu_check.sh $(GPU_CHECK_ARGS)

# the serving stack on the run's repository until Ctrl-C (serve.host / serve.port / serve.api_key: SERVE_ARGS)
serve: $(ART)/triton/smartexit/config.pbtxt
	$(SE) serve run_dir=$(ART) $(SERVE_ARGS)

demo: $(ART)/report.json
	@echo "SmartExit demo finished; report: $(ART)/report.md ($(ART)/report.json)"

train-tiny: $(STAMP)
	$(SE) train-tiny

train-tiny-ee: $(STAMP)
	$(SE) distill --config configs/tiny_ee.yaml run_dir=runs/tiny-ee
	$(BIN)/python -m edge.training.bundle_ee make-ee runs/tiny-ee

train-scheduler: $(ART)/scheduler/latency.json
	$(SE) train-scheduler --config configs/train_scheduler.yaml run_dir=$(ART)

# the exit-depth ablation: the same training without the predicted exit depth in the observation
train-scheduler-ablation: $(ART)/scheduler/latency.json
	$(SE) train-scheduler --config configs/train_scheduler.yaml run_dir=$(ART) env.masked=[predicted_exit_depth] \
		out=scheduler/assets/ppo_noexit

# ---- load-client cross-check: NVIDIA aiperf in its own venv (it pins other versions), never in demo/test ----
AIPERF_VENV := .venv-aiperf
aiperf-check: $(ART)/triton/smartexit/config.pbtxt
	@test -x $(AIPERF_VENV)/bin/aiperf || { $(PYTHON) -m venv $(AIPERF_VENV) && $(AIPERF_VENV)/bin/pip install --quiet -r requirements/aiperf.txt; }
	$(SE) bench crosscheck run_dir=$(ART) aiperf=$(AIPERF_VENV)/bin/aiperf

# ---- llama.cpp peer of the decode benchmark (system f): built from source, never part of demo or test ----
LLAMACPP_SRC := $(VENV)/llamacpp-src
LLAMACPP_STAMP := $(VENV)/.llamacpp-installed

llamacpp: $(LLAMACPP_STAMP)
$(LLAMACPP_STAMP): requirements/llamacpp.txt $(STAMP)
	@echo "building llama-cpp-python and llama-bench from its sdist into $(VENV) (about 15-35 min on 2 cores)"
	rm -rf $(LLAMACPP_SRC) && mkdir -p $(LLAMACPP_SRC)
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: -d $(LLAMACPP_SRC) \
		"$$(grep -m1 '^llama-cpp-python==' requirements/llamacpp.txt)"
	tar -xzf $(LLAMACPP_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMACPP_SRC) --strip-components=1
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" $(BIN)/python -m pip install --quiet \
		--no-binary llama-cpp-python -c requirements/lock.txt -r requirements/llamacpp.txt \
		$(LLAMACPP_SRC)/llama_cpp_python-*.tar.gz
	$(BIN)/python -m edge.pipeline.bench.llamacpp_bench build
	$(BIN)/python -c "from edge.pipeline.bench.llamacpp import available; r = available(); print(r or 'llama.cpp peer ready'); raise SystemExit(r is not None)"
	@touch $@

# ---- tests ----
test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# the edit loop: tests/unit (CPU only, no tritonserver or Ray) minus tests marked slow; `make test` runs them all
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit -m "not slow and not integration"

clean:
	rm -rf artifacts

-include deploy/jetson/jetson.mk
