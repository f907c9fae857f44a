"""A stage's arguments: flags and key=value in any order; user errors print ``error: ...``, exit 2, write nothing."""
from __future__ import annotations

import json

import pytest

from edge.core.configio import parse_overrides
from edge.core.errors import ConfigError
from edge.pipeline.cli import _stage_args
from edge.pipeline.cli import main as cli
from edge.pipeline.generate import GenerateConfig
from edge.pipeline.report import ReportConfig, build
from edge.pipeline.report import main as report_main
from edge.pipeline.run import open_run


def test_flags_and_key_value_mix_in_any_order():
    args = ["--mode", "full", "max_new_tokens=2", "--prompt", "# x = 1", "--config=c.yaml", "--top-p=0.5",
            "threshold=0.5", "--seed", "-1"]
    config, overrides = _stage_args(args)
    assert config == "c.yaml"
    assert overrides == ["mode=full", "max_new_tokens=2", "prompt=# x = 1", "top_p=0.5", "threshold=0.5", "seed=-1"]
    cfg = parse_overrides(GenerateConfig(), overrides)
    assert (cfg.mode, cfg.prompt, cfg.max_new_tokens, cfg.top_p, cfg.seed) == ("full", "# x = 1", 2, 0.5, -1)


@pytest.mark.parametrize("args,msg", [
    (["full"], "unexpected argument 'full'"),
    (["--prompt"], "--prompt needs a value"),
    (["--config", "a", "--config=b"], "--config given twice"),
    (["=3"], "unexpected argument"),
])
def test_bad_stage_arguments(args, msg):
    with pytest.raises(ConfigError, match=msg):
        _stage_args(args)


def test_cli_mixed_order_reaches_the_config(tmp_path, capsys):
    """The flags after a key=value are read (they used to be 'unexpected argument'); the empty prompt is refused."""
    run = tmp_path / "run"
    assert cli(["generate", f"run_dir={run}", "max_new_tokens=2", "--mode", "full", "--prompt", ""]) == 2
    assert "generate.prompt is empty" in capsys.readouterr().err
    assert not run.exists()


def test_cli_help_of_a_stage(capsys):
    assert cli(["generate", "--mode", "full", "-h"]) == 0
    assert "key=value" in capsys.readouterr().out


def test_cli_config_that_is_not_readable(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"steps: \xff\n")
    assert cli(["distill", "--config", str(bad), f"run_dir={tmp_path / 'r'}"]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    assert cli(["distill", "--config", str(tmp_path), f"run_dir={tmp_path / 'r'}"]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args,msg", [
    (["threads=-2"], "generate.threads must be a whole number >= 1"),
    (["threads=0", "mode=full", "prompt=hi"], "generate.threads must be"),
    (["mode=full", "prompt=hi", "temperature=.nan"], "temperature must be a finite number >= 0"),
    (["mode=full", "prompt=hi", "temperature=.inf"], "temperature must be a finite number >= 0"),
    (["mode=full", "prompt=hi", "temperature=-1"], "temperature must be a finite number >= 0"),
    (["mode=full", "prompt=hi", "top_p=0"], "top_p must be in"),
    (["mode=full", "prompt=hi", "top_p=.nan"], "top_p must be in"),
    (["mode=full", "prompt=hi", "top_p=1.5"], "top_p must be in"),
    (["mode=full", "prompt="], "generate.prompt is empty"),
    (["prompt=hi"], "generate.prompt needs a mode"),
    (["threshold=.nan"], "threshold must be in"),
])
def test_generate_config_ranges(args, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_overrides(GenerateConfig(), args)


def test_generate_prompt_none_is_the_held_out_prompts():
    assert parse_overrides(GenerateConfig(), ["mode=full", "prompt=none"]).prompt is None


@pytest.mark.parametrize("threads", [0, -2])
def test_open_run_refuses_threads_below_one(tmp_path, threads):
    with pytest.raises(ConfigError, match=f"threads must be a whole number >= 1, got {threads}"):
        open_run(tmp_path, threads)


def test_cli_generate_bad_threads_exit_2(tmp_path, capsys):
    assert cli(["generate", f"run_dir={tmp_path / 'r'}", "prompts=1", "max_new_tokens=2", "threads=-2"]) == 2
    assert capsys.readouterr().err.startswith("error: generate.threads")
    assert not (tmp_path / "r").exists()


def test_report_needs_a_run_folder_with_a_manifest(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert cli(["report", f"run_dir={missing}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not missing.exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        report_main(ReportConfig(run_dir=str(a_file)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no manifest.json"):
        report_main(ReportConfig(run_dir=str(empty)))
    assert list(empty.iterdir()) == []


def test_report_of_a_run_with_a_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"run": "r", "stages": {}}))
    assert build(tmp_path) == {"run": "r"}
