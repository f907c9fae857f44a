"""``smartexit jetson check`` (``make jetson-check``, on the device): versions against the supported table.

The supported range is what SmartExit's Jetson path is written against (NOTES.md, "Jetson AGX Orin"):
JetPack 6.1 / 6.2 (L4T r36.4.x), CUDA 12.6, TensorRT 10.3, cuDNN 9.3, Python 3.10 (JetPack's own; the
Triton python-backend stub links it), Triton's JetPack tarball 2.49 (the 2.52 igpu tarball needs glibc
2.36, Ubuntu 22.04 has 2.35). Each component gets a status:

- ``ok``: inside the range; ``too_old``: below it; ``missing``: not installed;
- ``untested``: newer than the range (JetPack 7: CUDA 13, TensorRT 10.16) or the version is unreadable;
- ``info``: reported, not judged (power mode, clocks, swap).

Verdict: ``supported`` (exit 0), ``untested`` (exit 0, warnings), ``unsupported`` (a required component
missing or too old: exit 1, with what to install). Not a Jetson: exit 2.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from edge.core import device
from edge.core.artifacts import atomic_write_json
from edge.jetson import commands
from edge.jetson.facts import NV_TEGRA_RELEASE, MEMINFO, PACKAGE_PATTERNS, DeviceFacts, collect
from edge.jetson.steps import Runner, Step, require_jetson

DEFAULT_TRITON_HOME = "/opt/tritonserver"
CHECK_JSON = Path("jetson") / "device" / "check.json"
JETPACK_INSTALL = "sudo apt update && sudo apt install nvidia-jetpack"


@dataclass(frozen=True)
class Requirement:
    """One row of the supported table: ``minimum <= version < below`` (None: presence only)."""

    component: str
    minimum: str | None
    below: str | None
    install: str
    required: bool = True


SUPPORTED: tuple[Requirement, ...] = (
    Requirement("l4t", "36.4.0", "37", "flash JetPack 6.1 or 6.2 (L4T r36.4.x) with NVIDIA SDK Manager"),
    Requirement("cuda", "12.6", "13", f"{JETPACK_INSTALL} (CUDA 12.6)"),
    Requirement("tensorrt", "10.3", "11", f"{JETPACK_INSTALL} (TensorRT 10.3)"),
    Requirement("cudnn", "9.3", "10", f"{JETPACK_INSTALL} (cuDNN 9.3)"),
    Requirement("trtexec", None, None, f"sudo apt install libnvinfer-bin (part of nvidia-jetpack): "
                                       f"{commands.TRTEXEC}"),
    Requirement("triton", "2.49", "2.52", "the Jetson tarball of Triton 2.49.0 (GitHub release, 'Jetson JetPack "
                                          "Support') extracted to /opt/tritonserver, or triton_home=DIR "
                                          "(2.52+ igpu tarballs need glibc 2.36; JetPack 6 has 2.35)"),
    Requirement("python", "3.10", "3.11", "make the venv with JetPack's Python: python3.10 -m venv .venv"),
    Requirement("jtop", None, None, "sudo pip3 install -U jetson-stats, then reboot (the power meter of "
                                    "`smartexit bench energy meter=jtop`)", required=False),
    Requirement("torch_cuda", None, None, "JetPack's PyTorch wheel in the venv (NVIDIA, 'Installing PyTorch for "
                                          "Jetson Platform'; PyPI's aarch64 torch has no CUDA): the torch_static "
                                          "backend that serves before `make jetson-engines`", required=False),
)


@dataclass(frozen=True)
class Row:
    component: str
    found: str  # what the device has, as printed
    supported: str  # the range
    status: str  # ok | too_old | missing | untested | low | info
    install: str = ""


def version_tuple(v: str) -> tuple[int, ...]:
    """'10.3.0.30' -> (10, 3, 0, 30); stops at the first part that is not a number."""
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def judge(version: str | None, req: Requirement) -> str:
    """ok / too_old / untested / missing for one version against one requirement."""
    if version is None:
        return "missing"
    if req.minimum is None:
        return "ok"
    v = version_tuple(version)
    if not v:
        return "untested"
    if v < version_tuple(req.minimum):
        return "too_old"
    if req.below is not None and v >= version_tuple(req.below):
        return "untested"
    return "ok"


def _range(req: Requirement) -> str:
    if req.minimum is None:
        return "installed"
    return f">= {req.minimum}" + (f", < {req.below}" if req.below else "")


def evaluate(facts: DeviceFacts, min_available_mib: int = 2048) -> list[Row]:
    """The rows of the report: each requirement, then memory, power mode and clocks (pure)."""
    found = {"l4t": facts.l4t, "cuda": facts.stack.cuda, "tensorrt": facts.stack.tensorrt,
             "cudnn": facts.stack.cudnn, "trtexec": commands.TRTEXEC if facts.trtexec else None,
             "triton": facts.triton if facts.triton_present else None, "python": facts.python,
             "jtop": "jtop.service" if facts.jtop_service else None,
             "torch_cuda": f"torch {facts.torch} with CUDA" if facts.torch and facts.torch_cuda else None}
    rows = []
    for req in SUPPORTED:
        v = found[req.component]
        status = judge(v, req)
        if req.component == "triton" and facts.triton_present and facts.triton is None:
            v, status = f"{facts.triton_home} (no TRITON_VERSION file)", "untested"
        shown = v or "-"
        if req.component == "l4t" and v:
            shown = f"{v} (JetPack {facts.jetpack or 'unknown'})"
        if not req.required and status == "missing":
            status = "info"
        rows.append(Row(req.component, shown, _range(req), status, req.install if status != "ok" else ""))
    if facts.memory is not None:
        m = facts.memory
        avail = m.available_kib // 1024
        rows.append(Row("memory", f"{avail} MiB available of {m.total_kib // 1024} MiB",
                        f">= {min_available_mib} MiB available", "ok" if avail >= min_available_mib else "low",
                        "" if avail >= min_available_mib else "stop other services (or lower serving limits)"))
        rows.append(Row("swap", f"{m.swap_free_kib // 1024} MiB free of {m.swap_total_kib // 1024} MiB", "-", "info"))
    else:
        rows.append(Row("memory", "-", f">= {min_available_mib} MiB available", "untested",
                        facts.errors.get("memory", "")))
    pm = facts.power_mode
    rows.append(Row("power_mode", f"{pm.name} (id {pm.id})" if pm else "-", "-", "info",
                    "" if pm else f"nvpmodel -q failed: {facts.errors.get('power_mode', '')}"))
    c = facts.clocks
    if c is not None and c.gpu is not None:
        shown = (f"GPU {c.gpu.current_hz // 1_000_000}/{c.gpu.max_hz // 1_000_000} MHz, CPUs online {c.online_cpus}, "
                 f"{'locked at maximum' if c.locked else 'not locked'}")
        rows.append(Row("clocks", shown, "-", "info", "" if c.locked else "sudo jetson_clocks before benchmarks "
                        "(steady clocks; bench results record the state)"))
    else:
        rows.append(Row("clocks", "-", "-", "info", f"needs root: sudo jetson_clocks --show "
                        f"({facts.errors.get('clocks', 'not read')})"))
    return rows


def verdict(rows: list[Row]) -> str:
    """supported / untested / unsupported (module docstring)."""
    required = {r.component for r in SUPPORTED if r.required}
    if any(r.component in required and r.status in ("missing", "too_old") for r in rows):
        return "unsupported"
    if any(r.status in ("untested", "low") for r in rows):
        return "untested"
    return "supported"


def render(facts: DeviceFacts, rows: list[Row]) -> str:
    """The report as printed: a table, the verdict, and what to install."""
    head = f"SmartExit device check: {facts.model or 'unknown model'} (root {facts.root})"
    widths = [max(len(getattr(r, k)) for r in rows + [Row('component', 'found', 'supported', 'status')])
              for k in ("component", "found", "supported", "status")]
    lines = [head, ""]
    for r in [Row("component", "found", "supported", "status"), *rows]:
        lines.append("  ".join(getattr(r, k).ljust(w) for k, w in
                               zip(("component", "found", "supported", "status"), widths)).rstrip())
    v = verdict(rows)
    lines += ["", f"verdict: {v}"]
    todo = [r for r in rows if r.install]
    if todo:
        lines += ["", "to do:"] + [f"  - {r.component} ({r.status}): {r.install}" for r in todo]
    return "\n".join(lines)


@dataclass
class CheckConfig:
    """``smartexit jetson check``: the device's versions against :data:`SUPPORTED`."""

    root: str = "/"  # the device's file system root (a fixture tree in the tests)
    run_dir: str = "artifacts/demo"  # where save=true writes jetson/device/check.json
    triton_home: str | None = None  # default: $TRITON_HOME, else /opt/tritonserver
    min_available_mib: int = 2048
    save: bool = False
    dry_run: bool = False


def check_steps() -> list[Step]:
    """The commands the check runs (it also reads the files under root)."""
    return [Step("installed JetPack packages (L4T core, CUDA runtime, cuDNN, TensorRT)",
                 commands.dpkg_versions_argv(PACKAGE_PATTERNS), ok=(0, 1)),
            Step("power mode", commands.nvpmodel_query_argv()),
            Step("clocks (root; sudo -n fails rather than prompt)", commands.jetson_clocks_show_argv())]


def main(cfg: CheckConfig) -> int:
    runner = Runner(cfg.dry_run)
    require_jetson(cfg.root, "check", runner)
    triton_home = cfg.triton_home or os.environ.get("TRITON_HOME") or DEFAULT_TRITON_HOME
    if cfg.dry_run:
        root = Path(cfg.root)
        runner.note(f"read {root / NV_TEGRA_RELEASE}, {root / MEMINFO}, {root / 'proc/device-tree/model'}, "
                    f"{Path(triton_home) / 'TRITON_VERSION'}")
        for step in check_steps():
            runner.run(step)
        if cfg.save:
            runner.note(f"would write {Path(cfg.run_dir) / CHECK_JSON}")
        return 0
    facts = collect(cfg.root, lambda argv: device.run_command(argv, timeout=60), triton_home)
    rows = evaluate(facts, cfg.min_available_mib)
    print(render(facts, rows))
    v = verdict(rows)
    if cfg.save:
        path = Path(cfg.run_dir) / CHECK_JSON
        atomic_write_json(path, {"verdict": v, "facts": facts.to_dict(), "rows": [asdict(r) for r in rows]})
        print(f"wrote {path}")
    return 1 if v == "unsupported" else 0
