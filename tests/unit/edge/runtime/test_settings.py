"""One owner per setting (STYLE 17, edge/runtime/settings.py): each setting's default is defined once, in
the settings module, and nowhere else in the product; the false-exit bound has one spelling, ``epsilon``;
nothing falls back to a number of its own. The source checks read the files themselves (tokens, not
text), so a second default or an ``eps`` creeping back fails here."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from edge.core.errors import ConfigError
from edge.runtime import settings
from edge.runtime.settings import EPSILON, PREFILL_BUDGET, PREFILL_BUDGETS, SLA_TTFT_MS, FloatSetting, IntSetting

ROOT = Path(__file__).parents[4]
PACKAGES = ("edge", "calibration", "exporters", "scheduler")
SETTINGS = ROOT / "edge" / "runtime" / "settings.py"
# every name under which a setting's value is kept somewhere (config fields, parameters, policy bounds)
NAMES = ("epsilon", "eps", "prefill_budget", "max_running", "max_seqs", "sla_ttft_ms", "sla_tpot_ms",
         "default_sla_ttft_ms", "default_sla_tpot_ms", "capacity_budget", "min_budget", "max_budget")
# ``name: <annotation> = <number>``: a dataclass field's or a parameter's own default
OWN_DEFAULT = re.compile(rf"\b({'|'.join(NAMES)})\s*:\s*[^=,()\n]+?=\s*-?\d")
# a reader's fallback number: ``stats.get("sla_ttft_ms") or 1000.0``, ``.get("epsilon", 0.01)``, ``... else 0.01``
_ANY = "|".join(NAMES)
FALLBACK = re.compile(rf"""["']({_ANY})["']\s*\)\s*or\s*-?\d"""  # stats.get("x") or 1000.0
                      rf"""|\.get\(\s*["']({_ANY})["']\s*,\s*-?\d"""  # .get("x", 0.01)
                      rf"""|\b({_ANY})\s+(?:if\s+\w+\s+is\s+not\s+None\s+)?else\s+-?\d""")  # x if x is not None else 0.01
# where the false-exit bound is handled (the model's RMSNorm eps, a numerical constant, lives elsewhere)
EPSILON_CODE = ("calibration", "edge/runtime", "edge/pipeline", "scheduler", "exporters/triton.py",
                "exporters/tensorrt.py")
# lines of edge/pipeline/bench (owned elsewhere) still spelling it the old way: (file, line text); each is
# in the report of the change that made this test, to be renamed by the bench's owner
KNOWN: set[tuple[str, str]] = set()


def _sources(*roots: str) -> list[Path]:
    out = []
    for r in roots:
        p = ROOT / r
        out += [p] if p.suffix == ".py" else sorted(p.rglob("*.py"))
    return [p for p in out if "__pycache__" not in p.parts]


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _known(p: Path, line: str) -> bool:
    return any(_rel(p) == f and text in line for f, text in KNOWN)


def test_no_default_of_a_setting_outside_the_settings_module():
    """A field or parameter named after a setting takes its default from edge/runtime/settings.py (or
    has none), and no reader falls back to a number."""
    found = []
    for p in _sources(*PACKAGES):
        if p == SETTINGS:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if (OWN_DEFAULT.search(code) or FALLBACK.search(code)) and not _known(p, line):
                found.append(f"{_rel(p)}:{n}: {line.strip()}")
    assert not found, "defaults defined outside edge/runtime/settings.py:\n" + "\n".join(found)


def test_the_checks_catch_what_they_should():
    """The patterns above are the test: they match the definitions this change removed."""
    for line in ("    prefill_budget: int = 256  # prompt tokens per iteration", "    sla_ttft_ms: float = 500.0",
                 "    epsilon: float = 0.009", "def learn_then_test(losses, lams, eps: float = 0.009, delta=0.05):",
                 "    min_budget: int = 16", "    capacity_budget: int = 128"):
        assert OWN_DEFAULT.search(line), line
    for line in ('sla_ttft_ms=float(stats.get("sla_ttft_ms") or 1000.0),', 'eps = table.get("epsilon", 0.01)',
                 "AuditEstimate(eps=a.eps if a.eps is not None else (eps if eps is not None else 0.01),"):
        assert FALLBACK.search(line), line
    assert not OWN_DEFAULT.search("    prefill_budget: int = PREFILL_BUDGET.default")
    assert not FALLBACK.search('max_chunk=None if stats["max_chunk"] is None else int(stats["max_chunk"])')


def test_each_setting_defined_once_in_the_settings_module():
    text = SETTINGS.read_text()
    names = re.findall(r'(?:Int|Float)Setting\(\s*"(\w+)"', text)
    assert len(names) == len(set(names)) and {"epsilon", "prefill_budget", "max_running", "sla_ttft_ms",
                                              "sla_tpot_ms"} <= set(names)
    for name in ("PREFILL_BUDGETS", "MAX_RUNNING_GRID"):  # the grids: here, and assigned nowhere else
        assert len(re.findall(rf"^{name}\b.*=", text, re.M)) == 1
        others = [_rel(p) for p in _sources(*PACKAGES) if p != SETTINGS
                  and re.search(r"^\s*[A-Z_]*(BUDGETS|LIMITS)\s*=\s*\(", p.read_text(), re.M)]
        assert not others, f"a budget or limit grid defined again in {others}"


def _code_tokens(p: Path):
    """(line, token) of every name and every plain string key in ``p`` (no comments, no docstring prose)."""
    for tok in tokenize.generate_tokens(io.StringIO(p.read_text()).readline):
        if tok.type == tokenize.NAME:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING:
            # a key spelled inside an f-string or as a literal: ["eps"], .get("eps"), "eps"
            for m in re.finditer(r"""(?:\[\s*|get\(\s*|^[rbuf]*)(['"])(eps)\1""", tok.string):
                yield tok.start[0], m.group(2)


def test_the_false_exit_bound_has_one_spelling():
    """``epsilon`` everywhere the bound is handled: no identifier or key ``eps``, and the certificate's entry
    read only through ThresholdTable.epsilon."""
    found = []
    for p in _sources(*EPSILON_CODE):
        lines = p.read_text().splitlines()
        for n, word in _code_tokens(p):
            if word == "eps" and not _known(p, lines[n - 1]):
                found.append(f"{_rel(p)}:{n}: {lines[n - 1].strip()}")
        for n, line in enumerate(lines, 1):
            if (re.search(r"""certificate(\.get\(|\[)\s*['"]epsilon""", line) and _rel(p) != "calibration/table.py"
                    and not _known(p, line)):
                found.append(f"{_rel(p)}:{n}: {line.strip()} (read ThresholdTable.epsilon)")
    assert not found, "the false-exit bound spelled otherwise:\n" + "\n".join(found)


def test_bounds_are_checked_with_the_setting_named():
    assert PREFILL_BUDGET.check(64, "engine") == 64
    with pytest.raises(ConfigError, match=r"engine.prefill_budget must be an integer >= 1, got 0"):
        PREFILL_BUDGET.check(0, "engine")
    with pytest.raises(ConfigError, match=r"calibrate.epsilon must be in \(0, 1\), got 1.5"):
        EPSILON.check(1.5, "calibrate")
    with pytest.raises(ConfigError, match=r"host.default_sla_ttft_ms must be > 0, got 0"):
        SLA_TTFT_MS.check(0, "host", "default_sla_ttft_ms")
    assert EPSILON.low < EPSILON.default < EPSILON.high
    for s in vars(settings).values():  # every default passes its own bounds
        if isinstance(s, (IntSetting, FloatSetting)):
            assert s.check(s.default, "settings") == s.default
    assert list(PREFILL_BUDGETS) == sorted(PREFILL_BUDGETS) and PREFILL_BUDGET.default in PREFILL_BUDGETS
