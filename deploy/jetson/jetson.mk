# Jetson AGX Orin targets, included by the top-level Makefile (walk-through: deploy/jetson/README.md).
# Each target is one `smartexit jetson <action>` (edge/jetson/); the library does the work.
#
#   on the development machine:  jetson-push DEVICE=user@host   jetson-bench DEVICE=user@host
#   on the Jetson:                jetson-check  jetson-engines  jetson-serve  jetson-status  jetson-stop
#
# DRY_RUN=1 prints every command with its real paths and arguments and touches nothing; on a machine
# that is not a Jetson an on-device target then says that a real run would stop there (exit code 2)
# and still prints what it would run. `make -n jetson-...` works anywhere.
# REMOTE_DIR: the checkout on the device (relative to the remote home, or absolute).
# API_KEY_CONFIG: a YAML file (mode 0600) with `serve: {api_key: ...}`: serve on 0.0.0.0 with the key
# required; without it the serving app binds 127.0.0.1.
# JETSON_ARGS: more key=value settings for the action (e.g. JETSON_ARGS="ssh_options=[-p,2222]").
.PHONY: jetson-check jetson-push jetson-engines jetson-serve jetson-status jetson-stop jetson-bench

DEVICE ?=
REMOTE_DIR ?= smartexit
API_KEY_CONFIG ?=
JETSON_ARGS ?=
JETSON_DRY := $(if $(filter 1 true yes,$(DRY_RUN)),dry_run=true)
# a push needs the served repository and the export; a dry run builds nothing, so it does not depend on them
JETSON_PUSH_NEEDS := $(if $(JETSON_DRY),,$(ART)/triton/smartexit/config.pbtxt $(ART)/onnx/graphs.json)

jetson-check: $(STAMP)
	$(SE) jetson check run_dir=$(ART) $(JETSON_DRY) $(JETSON_ARGS)

jetson-push: $(STAMP) $(JETSON_PUSH_NEEDS)
	$(SE) jetson push run_dir=$(ART) device=$(DEVICE) remote_dir=$(REMOTE_DIR) $(JETSON_DRY) $(JETSON_ARGS)

jetson-engines: $(STAMP)
	$(SE) jetson engines run_dir=$(ART) $(JETSON_DRY) $(JETSON_ARGS)

jetson-serve: $(STAMP)
	$(SE) jetson serve run_dir=$(ART) $(if $(API_KEY_CONFIG),api_key_config=$(API_KEY_CONFIG)) $(JETSON_DRY) $(JETSON_ARGS)

jetson-status: $(STAMP)
	$(SE) jetson status $(JETSON_DRY) $(JETSON_ARGS)

jetson-stop: $(STAMP)
	$(SE) jetson stop $(JETSON_DRY) $(JETSON_ARGS)

jetson-bench: $(STAMP)
	$(SE) jetson bench run_dir=$(ART) device=$(DEVICE) remote_dir=$(REMOTE_DIR) $(JETSON_DRY) $(JETSON_ARGS)
