"""The command line's table: every command is one module named after it, in the stages' home."""
from __future__ import annotations

import importlib

from edge.pipeline.cli import STAGES

# `smartexit jetson status` and `stop` are entry points of the serve action's module (edge/jetson/serve.py)
JETSON_SERVICE = {"jetson status": "edge.jetson.serve", "jetson stop": "edge.jetson.serve"}


def test_every_command_maps_to_the_module_named_after_it():
    wrong = {}
    for command, (module, cfg_name, entry, _) in STAGES.items():
        words = command.replace("-", "_").split()
        want = JETSON_SERVICE.get(command) or (f"edge.{'.'.join(words)}" if words[0] == "jetson"
                                                else f"edge.pipeline.{'.'.join(words)}")
        if module != want:
            wrong[command] = (module, want)
    assert not wrong, f"commands whose module is not named after them (have, want): {wrong}"


def test_every_stage_module_imports_and_names_its_config_and_entry():
    for command, (module, cfg_name, entry, _) in STAGES.items():
        mod = importlib.import_module(module)
        assert isinstance(getattr(mod, cfg_name), type), command
        assert callable(getattr(mod, entry)), command
