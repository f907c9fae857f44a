"""``key=value`` strings reach string fields unchanged (PEP 604 ``str | None`` included), and a config
file that cannot be read is a ConfigError naming it, never a traceback."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

import pytest

from edge.core.configio import apply, load_yaml, parse_overrides
from edge.core.errors import ConfigError


class Level(str, enum.Enum):
    ON = "on"
    OFF = "off"


@dataclass
class Fields:  # the annotations are strings (PEP 563): get_type_hints makes ``str | None`` a types.UnionType
    text: str = "x"
    maybe_text: str | None = None
    maybe_int: int | None = None
    maybe_list: list[int] | None = None
    level: Level = Level.OFF
    section: dict = field(default_factory=dict)


LITERALS = ["def f(x): return x", "# a comment", "yes", "0x1F", "[1, 2", "~", "", "3.0", "{a: 1}", "true"]


@pytest.mark.parametrize("text", LITERALS)
def test_string_fields_take_the_value_literally(text):
    cfg = parse_overrides(Fields(), [f"text={text}", f"maybe_text={text}"])
    assert cfg.text == text and cfg.maybe_text == text


@pytest.mark.parametrize("word", ["null", "none", "None", "NULL"])
def test_optional_string_is_none_by_the_words_none_and_null(word):
    assert parse_overrides(Fields(maybe_text="k"), [f"maybe_text={word}"]).maybe_text is None


def test_optional_non_string_fields_are_parsed():
    cfg = parse_overrides(Fields(), ["maybe_int=16", "maybe_list=[1, 2]"])
    assert cfg.maybe_int == 16 and cfg.maybe_list == [1, 2]
    assert parse_overrides(Fields(maybe_int=3), ["maybe_int=0x10"]).maybe_int == 16
    for none in ("null", "None", "~", ""):
        assert parse_overrides(Fields(maybe_int=3), [f"maybe_int={none}"]).maybe_int is None
    with pytest.raises(ConfigError, match="maybe_int: expected an integer, got 'abc'"):
        parse_overrides(Fields(), ["maybe_int=abc"])
    with pytest.raises(ConfigError, match="maybe_list: expected a list"):
        parse_overrides(Fields(), ["maybe_list=5"])


def test_str_enum_and_free_form_section_keep_strings():
    assert parse_overrides(Fields(), ["level=on"]).level is Level.ON  # YAML would read `on` as true
    assert parse_overrides(Fields(), ["section.api_key=0x1F"]).section == {"api_key": "0x1F"}


def test_serve_api_key_is_taken_literally():
    from scheduler.serving.config import ServeConfig

    assert apply(ServeConfig(), {"api_key": "0x1F"}).api_key == "0x1F"
    assert apply(ServeConfig(), {"api_key": "yes"}).api_key == "yes"


def test_prompt_of_generate_is_taken_literally():
    from edge.pipeline.generate import GenerateConfig

    cfg = parse_overrides(GenerateConfig(), ["mode=full", "prompt=def f(x): return x"])
    assert cfg.prompt == "def f(x): return x"


def test_deeply_nested_override_is_a_config_error():
    with pytest.raises(ConfigError, match="maybe_list: .* nested too deeply"):
        parse_overrides(Fields(), ["maybe_list=" + "[" * 5000 + "]" * 5000])


def test_non_string_key_in_a_file_is_a_config_error(tmp_path):
    f = tmp_path / "k.yaml"
    f.write_text("1: 2\n")
    with pytest.raises(ConfigError, match="config key 1 is not a name"):
        parse_overrides(Fields(), [], f)


@pytest.mark.parametrize("content,msg", [
    (b"text: \xff\xfe\n", "is not UTF-8 text"),
    (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    (b"text: " + b"{a: " * 5000 + b"1" + b"}" * 5000, "nested too deeply"),
    (b"- 1\n", "must hold a mapping"),
])
def test_unreadable_config_files_are_config_errors(tmp_path, content, msg):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match=msg) as err:
        load_yaml(f)
    assert str(f) in str(err.value)


def test_config_path_that_is_a_folder_or_missing(tmp_path):
    with pytest.raises(ConfigError, match="is not a file \\(it is a folder\\)"):
        load_yaml(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml")


@dataclass
class Rate:
    lr: float = 0.1


def test_float_in_exponent_form_without_a_dot():
    assert parse_overrides(Rate(), ["lr=1e-3"]).lr == 1e-3  # YAML 1.1 alone reads it as a string
    with pytest.raises(ConfigError, match="lr: expected a number, got 'fast'"):
        parse_overrides(Rate(), ["lr=fast"])


@pytest.mark.parametrize("text", ["0x1F", "0o17", "yes", "on", "2026-12-06", "007", "12345"])
def test_a_yaml_files_words_are_the_text_written_for_a_text_field(tmp_path, text):
    """A YAML file's unquoted 0x1F (YAML 1.1's integer 31) used to give an api_key "31", which no client would
    send: a file's words are now the text written where a text field reads them."""
    from scheduler.serving.config import ServeConfig

    path = tmp_path / "serve.yaml"
    path.write_text(f"api_key: {text}\n")
    assert parse_overrides(ServeConfig(), [], path).api_key == text


@pytest.mark.parametrize("text, read", [("3.10", "float 3.1"), ("true", "bool True"), ("False", "bool False")])
def test_a_number_with_a_fraction_or_a_boolean_for_a_text_field_is_an_error(tmp_path, text, read):
    """Where str() would not give back what was written (3.10 -> "3.1", true -> "True"): an error naming the field
    and saying to quote the value; quoted, the file's text is the value."""
    from scheduler.serving.config import ServeConfig

    path = tmp_path / "serve.yaml"
    path.write_text(f"api_key: {text}\n")
    with pytest.raises(ConfigError, match=rf"api_key: expected text, got {re.escape(read)} .*quote the value"):
        parse_overrides(ServeConfig(), [], path)
    path.write_text(f"api_key: '{text}'\n")
    assert parse_overrides(ServeConfig(), [], path).api_key == text


def test_a_yaml_files_other_words_still_read_as_the_field_asks(tmp_path):
    """Non-text fields read the words YAML 1.1 reads (hex and octal integers, yes / on booleans)."""
    from scheduler.serving.config import ServeConfig

    path = tmp_path / "serve.yaml"
    path.write_text("port: 0x1F90\nmax_inflight: 020\nonline_finetune: no\nretry_after_s: 1.5\n")
    cfg = parse_overrides(ServeConfig(), [], path)
    assert (cfg.port, cfg.max_inflight, cfg.online_finetune, cfg.retry_after_s) == (8080, 16, False, 1.5)
