"""What a Jetson is: L4T / JetPack, CUDA, TensorRT, cuDNN, Triton, Python, power mode, clocks, memory.

Each fact is parsed from the text the device's own tools print (formats as in the real samples under
``../shared/data/jetson_fixtures/identity/``, SOURCES.md there):

- ``/etc/nv_tegra_release``: '# R36 (release), REVISION: 4.4, ...' (:func:`edge.core.device.parse_l4t_release`);
- ``dpkg-query`` / ``dpkg -l`` lines: ``nvidia-l4t-core 36.4.7-20250918154033``, ``libnvinfer10
  10.3.0.30-1+cuda12.5``, ``libcudnn9-cuda-12 9.3.0.75-1``, ``cuda-cudart-12-6 12.6.68-1``;
- ``nvpmodel -q``: 'NV Power Mode: MODE_30W' then the mode id on its own line;
- ``jetson_clocks --show``: 'GPU MinFreq=... MaxFreq=... CurrentFreq=...', 'EMC ...', 'cpuN: ...';
- ``/proc/meminfo`` (proc(5)): 'MemAvailable:  12345 kB', 'SwapTotal: ...'.

The parsers are pure (text in, dataclass out); :func:`collect` reads the files under a root folder
(``/`` on the device, a fixture tree in the tests) and runs the commands through a runner.
"""
from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from edge.core.device import parse_l4t_release
from edge.core.errors import SmartExitError
from edge.jetson import commands

NV_TEGRA_RELEASE = Path("etc/nv_tegra_release")
DEVICE_TREE_MODEL = Path("proc/device-tree/model")
MEMINFO = Path("proc/meminfo")
JTOP_UNITS = (Path("etc/systemd/system/jtop.service"), Path("lib/systemd/system/jtop.service"))

# L4T release -> JetPack release, as the sample files name them (identity/*.txt headers; NVIDIA's L4T archive)
JETPACK_OF_L4T = {
    "35.2.1": "5.1", "35.3.1": "5.1.1", "35.4.1": "5.1.2", "35.5.0": "5.1.3", "35.6.0": "5.1.4", "35.6.1": "5.1.5",
    "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2", "36.4.4": "6.2.1", "36.4.7": "6.2.1",
    "38.4.0": "7.1", "39.2.0": "7.2",
}
# dpkg packages whose versions the check reads (patterns for dpkg-query -W)
PACKAGE_PATTERNS = ("nvidia-l4t-core", "nvidia-jetpack", "cuda-cudart-*", "libcudnn*", "libnvinfer*", "tensorrt")
# dpkg -l's first column: desired action (u i h r p), package status (n c H U F W t i), error flag (R)
_STATUS = re.compile(r"[uihrp][ncHUFWti]R?")


def is_jetson(root: str | Path = "/") -> bool:
    """A Jetson (L4T) root file system has ``/etc/nv_tegra_release``."""
    return (Path(root) / NV_TEGRA_RELEASE).is_file()


def upstream_version(deb_version: str) -> str:
    """'1:36.4.7-20250918154033' -> '36.4.7'; '10.3.0.30-1+cuda12.5' -> '10.3.0.30' (Debian policy 5.6.12:
    [epoch:]upstream[-revision]; a '+' suffix on upstream is a build tag)."""
    v = deb_version.split(":", 1)[-1]
    return v.split("-", 1)[0].split("+", 1)[0].split("~", 1)[0]


def parse_dpkg(text: str) -> dict[str, str]:
    """Installed package -> version from ``dpkg -l`` or ``dpkg-query -W`` output.

    Accepts ``ii  name  version  arch  description`` (only 'ii' / 'hi': installed), ``name version`` and
    ``name<TAB>version``; a ``:arm64`` suffix on the name is dropped. Header and other lines are ignored.
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2 or line.startswith(("Desired=", "|", "+++", "#", "===")):
            continue
        if len(fields) >= 3 and _STATUS.fullmatch(fields[0]):
            if fields[0][1] != "i":  # not installed (removed with its config files kept: 'rc', ...)
                continue
            name, version = fields[1], fields[2]
        else:
            name, version = fields[0], fields[1]
        out[name.split(":", 1)[0]] = version
    return out


@dataclass(frozen=True)
class Stack:
    """Versions of the JetPack software stack from the installed packages (None: not installed)."""

    l4t_core: str | None = None
    jetpack: str | None = None
    cuda: str | None = None
    cudnn: str | None = None
    tensorrt: str | None = None


def stack_versions(packages: dict[str, str]) -> Stack:
    """Pick the stack's versions out of ``parse_dpkg``'s table.

    CUDA from the runtime package ``cuda-cudart-<major>-<minor>`` (the toolkit meta-package has its own
    numbering: 12.6.11 beside runtime 12.6.68); cuDNN from ``libcudnn<N>[-cuda-<M>]``; TensorRT from
    ``libnvinfer<N>`` or ``tensorrt`` (on JetPack 6 tagged '+cuda12.5' though CUDA is 12.6: the tag is
    dropped); JetPack from ``nvidia-jetpack`` where that meta-package is installed.
    """
    def first(pattern: str) -> str | None:
        for name in sorted(packages):
            if re.fullmatch(pattern, name):
                return upstream_version(packages[name])
        return None

    return Stack(l4t_core=first(r"nvidia-l4t-core"), jetpack=first(r"nvidia-jetpack"),
                 cuda=first(r"cuda-cudart-\d+-\d+") or first(r"cuda-nvcc-\d+-\d+"),
                 cudnn=first(r"libcudnn\d+(-cuda-\d+)?"),
                 tensorrt=first(r"libnvinfer\d+") or first(r"tensorrt"))


@dataclass(frozen=True)
class PowerMode:
    name: str
    id: int | None


def parse_nvpmodel_query(text: str) -> PowerMode:
    """``nvpmodel -q``: 'NV Power Mode: MODE_30W' and the id on the next line (warnings such as 'NVPM WARN:
    fan mode is not set!' may come first); also jetson_release's 'NV Power Mode[0]: 15W'.

    Raises:
        SmartExitError: no power-mode line.
    """
    lines = [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines):
        m = re.match(r"NV Power Mode(?:\[(\d+)\])?:\s*(\S+)", line)
        if not m:
            continue
        mode_id = int(m.group(1)) if m.group(1) else None
        if mode_id is None and i + 1 < len(lines) and lines[i + 1].isdigit():
            mode_id = int(lines[i + 1])
        return PowerMode(m.group(2), mode_id)
    raise SmartExitError(f"unrecognised nvpmodel -q output: {text[:80]!r}")


@dataclass(frozen=True)
class Clock:
    min_hz: int
    max_hz: int
    current_hz: int

    @property
    def at_max(self) -> bool:
        return self.current_hz >= self.max_hz


@dataclass(frozen=True)
class Clocks:
    """``jetson_clocks --show``: machine, CPUs online, per-CPU / GPU / EMC clocks, power mode."""

    machine: str | None
    online_cpus: str | None
    cpus: dict[str, Clock]  # cpu0.. in kHz, as printed
    gpu: Clock | None  # Hz
    emc: Clock | None  # Hz
    power_mode: str | None

    @property
    def locked(self) -> bool:
        """Every CPU, the GPU and the memory clock at their maximum (what ``sudo jetson_clocks`` sets)."""
        parts = [*self.cpus.values(), *(c for c in (self.gpu, self.emc) if c is not None)]
        return bool(parts) and all(c.at_max for c in parts)


def _clock(line: str) -> Clock | None:
    vals = dict(re.findall(r"(MinFreq|MaxFreq|CurrentFreq)=(\d+)", line))
    if len(vals) < 3:
        return None
    return Clock(int(vals["MinFreq"]), int(vals["MaxFreq"]), int(vals["CurrentFreq"]))


def parse_jetson_clocks(text: str) -> Clocks:
    """Parse ``jetson_clocks --show`` (JetPack 5 and 6 print the same fields)."""
    machine = online = mode = None
    cpus: dict[str, Clock] = {}
    gpu = emc = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := re.search(r"Machine:\s*(.+)$", line):
            machine = m.group(1).strip()
        elif m := re.match(r"Online CPUs:\s*(\S+)", line):
            online = m.group(1)
        elif m := re.match(r"(cpu\d+):\s*Online=1", line):
            if (c := _clock(line)) is not None:
                cpus[m.group(1)] = c
        elif line.startswith("GPU "):
            gpu = _clock(line)
        elif line.startswith("EMC "):
            emc = _clock(line)
        elif m := re.match(r"NV Power Mode:\s*(\S+)", line):
            mode = m.group(1)
    return Clocks(machine, online, cpus, gpu, emc, mode)


@dataclass(frozen=True)
class Memory:
    total_kib: int
    available_kib: int
    swap_total_kib: int
    swap_free_kib: int


def parse_meminfo(text: str) -> Memory:
    """``/proc/meminfo`` (proc(5): 'Name:   value kB').

    Raises:
        SmartExitError: MemTotal or MemAvailable missing.
    """
    vals = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+):\s+(\d+)", text, re.MULTILINE)}
    if "MemTotal" not in vals or "MemAvailable" not in vals:
        raise SmartExitError("unrecognised /proc/meminfo: no MemTotal / MemAvailable")
    return Memory(vals["MemTotal"], vals["MemAvailable"], vals.get("SwapTotal", 0), vals.get("SwapFree", 0))


def triton_version(triton_home: str | Path) -> tuple[bool, str | None]:
    """(present, version) of a Triton release tree: ``bin/tritonserver``, and the ``TRITON_VERSION`` file
    Triton's build writes into its install tree (check on device: the Jetson tarball carries it)."""
    home = Path(triton_home)
    present = (home / "bin" / "tritonserver").is_file()
    vfile = home / "TRITON_VERSION"
    if not (present and vfile.is_file()):
        return present, None
    return present, vfile.read_text().strip() or None


@dataclass
class DeviceFacts:
    """Everything :mod:`edge.jetson.check` judges; ``errors`` says why a fact is missing."""

    root: str
    jetson: bool
    model: str | None = None
    l4t: str | None = None
    jetpack: str | None = None
    stack: Stack = field(default_factory=Stack)
    trtexec: bool = False
    triton_home: str | None = None
    triton_present: bool = False
    triton: str | None = None
    python: str = ""
    power_mode: PowerMode | None = None
    clocks: Clocks | None = None
    memory: Memory | None = None
    jtop_service: bool = False
    torch: str | None = None  # the venv's torch version, None: not importable
    torch_cuda: bool = False  # and whether it sees CUDA (JetPack's wheel does; PyPI's aarch64 wheel does not)
    errors: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ToolRunner = Callable[[list[str]], Any]  # argv -> CompletedProcess-like (returncode, stdout, stderr)


def _run_text(run: ToolRunner, argv: list[str], ok: tuple[int, ...] = (0,)) -> str:
    """stdout of ``argv``; a missing binary (run_command's SmartExitError) or an exit code outside ``ok``
    raises SmartExitError."""
    res = run(argv)
    if res.returncode not in ok:
        raise SmartExitError(f"`{' '.join(argv)}` exited {res.returncode}: {(res.stderr or res.stdout).strip()[-200:]}")
    return res.stdout


def jetpack_of(l4t: str | None, stack: Stack) -> str | None:
    """JetPack release: the ``nvidia-jetpack`` package where installed, else the L4T table."""
    return stack.jetpack or (JETPACK_OF_L4T.get(l4t) if l4t else None)


def collect(root: str | Path, run: ToolRunner, triton_home: str | Path,
            python: tuple[int, int, int] | None = None) -> DeviceFacts:
    """Read the device's files under ``root`` and run its tools through ``run`` (argv -> result).

    Never raises for a missing fact: its reason goes to ``errors``.
    """
    root = Path(root)
    py = python or tuple(sys.version_info[:3])
    facts = DeviceFacts(root=str(root), jetson=is_jetson(root), triton_home=str(triton_home),
                        python=".".join(map(str, py)))
    model = root / DEVICE_TREE_MODEL
    if model.is_file():
        facts.model = model.read_bytes().rstrip(b"\0").decode(errors="replace").strip()
    admindir = None if root == Path("/") else root / "var/lib/dpkg"
    try:  # dpkg-query exits 1 when a pattern matches nothing; what it printed is still right
        facts.stack = stack_versions(parse_dpkg(_run_text(
            run, commands.dpkg_versions_argv(PACKAGE_PATTERNS, admindir), ok=(0, 1))))
    except SmartExitError as exc:
        facts.errors["packages"] = str(exc)
    rel = root / NV_TEGRA_RELEASE
    if rel.is_file():
        try:
            r = parse_l4t_release(rel.read_text())
            facts.l4t = r.version if r.revision.count(".") >= 1 else f"{r.version}.0"
        except SmartExitError as exc:
            facts.errors["l4t"] = str(exc)
    if facts.l4t is None and facts.stack.l4t_core:
        facts.l4t = facts.stack.l4t_core  # jetson-stats does the same when the release file is missing
    facts.jetpack = jetpack_of(facts.l4t, facts.stack)
    facts.trtexec = (root / commands.TRTEXEC.lstrip("/")).is_file()
    facts.triton_present, facts.triton = triton_version(triton_home)
    for key, argv, parse in (("power_mode", commands.nvpmodel_query_argv(), parse_nvpmodel_query),
                             ("clocks", commands.jetson_clocks_show_argv(), parse_jetson_clocks)):
        try:
            setattr(facts, key, parse(_run_text(run, argv)))
        except SmartExitError as exc:
            facts.errors[key] = str(exc)
    mem = root / MEMINFO
    try:
        facts.memory = parse_meminfo(mem.read_text())
    except (OSError, SmartExitError) as exc:
        facts.errors["memory"] = f"{mem}: {exc}"
    facts.jtop_service = any((root / p).is_file() for p in JTOP_UNITS)
    try:
        facts.torch, facts.torch_cuda = parse_torch_probe(_run_text(run, commands.torch_probe_argv(sys.executable)))
    except SmartExitError as exc:
        facts.errors["torch"] = str(exc)
    return facts


def parse_torch_probe(text: str) -> tuple[str, bool]:
    """``torch 2.5.0a0+872d972e41.nv24.08 cuda True`` (commands.TORCH_PROBE's line) -> (version, sees CUDA).

    Raises:
        SmartExitError: not that line (torch failed to import: its error is the text).
    """
    parts = text.strip().splitlines()[-1].split() if text.strip() else []
    if len(parts) != 4 or parts[0] != "torch" or parts[2] != "cuda" or parts[3] not in ("True", "False"):
        raise SmartExitError(f"torch probe: unexpected output {text.strip()[-200:]!r}")
    return parts[1], parts[3] == "True"
