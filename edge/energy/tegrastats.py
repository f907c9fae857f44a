"""tegrastats: a pure parser of one line, the integral of a logged window, and :class:`TegrastatsMeter`.

One tegrastats line (Jetson Linux Developer Guide, "tegrastats Utility")::

    [MM-DD-YYYY hh:mm:ss] RAM u/tMB (lfb ..) [SWAP ..] CPU [..] [EMC_FREQ ..] GR3D_FREQ p%[@..] ..
    name@t.tC .. RAIL cur_mW/mean_mW ..

Formats handled: JetPack 5 (upper-case sensors, ``-256C`` for an offline sensor, ``NC`` channels),
JetPack 6 (lower-case sensors, ``tboard``/``tdiode``; ``VDD_CPU_CV`` may read 0 or negative, kept as
read: the INA3221 offset near zero current, which clamping would bias upwards), lines with or
without the timestamp, and JetPack 7's three values (power ``cur/mean/max``, temperature
``cur/max``). JetPack 4 rails without units (``POM_5V_IN 920/920``, milliwatts per the L4T 32
guide) are parsed but flagged: :func:`edge.energy.rails.select_rails` refuses their layout.

Power figures: the first is instantaneous; the second is the running mean since tegrastats started
(each line's mean of all its readings so far), NOT an average over the sampling interval, so a meter
must integrate the first figure over time, never the second.
"""
from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Callable, Iterable, Sequence

from edge.core.device import spawn, stop_process
from edge.core.errors import SmartExitError
from edge.energy.meter import PowerMeter, PowerSample, SensorUnavailable, trapezoid_joules
from edge.energy.rails import UNCONNECTED, RailSelection, hottest_c, select_rails

OFFLINE_C = -256.0  # what JetPack 5 prints for a powered-off thermal zone (jtop uses the same sentinel)

_NUM = r"-?\d+(?:\.\d+)?"
_TEMP = re.compile(rf"([A-Za-z][A-Za-z0-9_]*)@({_NUM})C(?:/({_NUM})C)?")
_POWER = re.compile(r"(-?\d+)mW/(-?\d+)mW(?:/(-?\d+)mW)?")
_POWER_LEGACY = re.compile(r"(-?\d+)/(-?\d+)")
_RAIL_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
_RAM = re.compile(r"(\d+)/(\d+)MB")
_GR3D = re.compile(r"(\d+)%(?:@.*)?")
_DATE = re.compile(r"\d{2}-\d{2}-\d{4}")
_TIME = re.compile(r"\d{2}:\d{2}:\d{2}")


class TegrastatsParseError(ValueError):
    """A line this parser does not understand; the message quotes the part at fault."""


class LineFormat(str, Enum):
    TWO_VALUE = "cur/mean"  # JetPack 5 and 6: mW
    THREE_VALUE = "cur/mean/max"  # JetPack 7: mW
    LEGACY_NO_UNITS = "legacy"  # JetPack 4: no unit suffix


@dataclass(frozen=True)
class RailPower:
    now_w: float  # instantaneous
    mean_w: float  # running mean since tegrastats started (not a window average)
    max_w: float | None = None  # JetPack 7's third figure (None before)


@dataclass(frozen=True)
class TegrastatsRecord:
    timestamp: datetime | None  # the line's own time, 1 s resolution; None where the line has none
    ram_used_mb: int
    ram_total_mb: int
    rails: dict[str, RailPower]  # NC channels left out
    temperatures_c: dict[str, float]  # online sensors, names as printed (JP5 "CPU", JP6 "cpu")
    offline_sensors: tuple[str, ...]  # sensors printed as -256C
    gpu_util_pct: float | None  # GR3D_FREQ's percentage; None where the line has none (Thor: "@[..]")
    format: LineFormat

    def watts(self) -> dict[str, float]:
        """Each rail's instantaneous watts."""
        return {name: r.now_w for name, r in self.rails.items()}


def parse_line(line: str) -> TegrastatsRecord:
    """Parse one tegrastats line.

    Raises:
        TegrastatsParseError: no RAM field, no power rail, a rail twice, rails in mixed formats, or a
            milliwatt figure outside a ``RAIL cur/mean`` pair (a field this parser would otherwise drop).
    """
    tokens = line.split()
    if not tokens:
        raise TegrastatsParseError("empty tegrastats line")
    timestamp = None
    if len(tokens) >= 2 and _DATE.fullmatch(tokens[0]) and _TIME.fullmatch(tokens[1]):
        try:
            timestamp = datetime.strptime(f"{tokens[0]} {tokens[1]}", "%m-%d-%Y %H:%M:%S")
        except ValueError as exc:
            raise TegrastatsParseError(f"bad timestamp {tokens[0]} {tokens[1]!r}: {exc}") from exc
        tokens = tokens[2:]
    ram = gpu = None
    rails: dict[str, RailPower] = {}
    formats: set[LineFormat] = set()
    temps: dict[str, float] = {}
    offline: list[str] = []
    used: set[int] = set()
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok == "RAM" and (m := _RAM.fullmatch(nxt)):
            ram = int(m.group(1)), int(m.group(2))
        elif tok == "GR3D_FREQ" and (m := _GR3D.fullmatch(nxt)):
            gpu = float(m.group(1))
        elif m := _TEMP.fullmatch(tok):
            value = float(m.group(2))
            if value == OFFLINE_C:
                offline.append(m.group(1))
            else:
                temps[m.group(1)] = value
        elif _RAIL_NAME.fullmatch(tok) and (m := _POWER.fullmatch(nxt) or _POWER_LEGACY.fullmatch(nxt)):
            used.add(i + 1)
            fmt = (LineFormat.LEGACY_NO_UNITS if "mW" not in nxt else
                   LineFormat.THREE_VALUE if m.group(3) is not None else LineFormat.TWO_VALUE)
            formats.add(fmt)
            if tok == UNCONNECTED:
                continue
            if tok in rails:
                raise TegrastatsParseError(f"rail {tok} appears twice in {line.strip()[:200]!r}")
            mx = m.group(3) if fmt is LineFormat.THREE_VALUE else None
            rails[tok] = RailPower(int(m.group(1)) / 1e3, int(m.group(2)) / 1e3,
                                   None if mx is None else int(mx) / 1e3)
        elif "mW" in tok and i not in used:
            raise TegrastatsParseError(f"unrecognised power field {tok!r} (after {tokens[i - 1]!r}) in "
                                       f"{line.strip()[:200]!r}")
    if ram is None:
        raise TegrastatsParseError(f"not a tegrastats line (no 'RAM used/totalMB'): {line.strip()[:200]!r}")
    if not rails:
        raise TegrastatsParseError(f"no power rail in tegrastats line {line.strip()[:200]!r}")
    if len(formats) > 1:
        raise TegrastatsParseError(f"rails in mixed formats {sorted(f.value for f in formats)}: "
                                   f"{line.strip()[:200]!r}")
    return TegrastatsRecord(timestamp, ram[0], ram[1], rails, temps, tuple(offline), gpu, formats.pop())


def parse_lines(lines: Iterable[str]) -> list[TegrastatsRecord]:
    """Parse every non-blank line; an error names the line number (1-based)."""
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(parse_line(line))
            except TegrastatsParseError as exc:
                raise TegrastatsParseError(f"line {n}: {exc}") from exc
    return out


def _interp(t: float, t0: float, w0: float, t1: float, w1: float) -> float:
    return w0 if t1 == t0 else w0 + (w1 - w0) * (t - t0) / (t1 - t0)


def window_joules(records: Sequence[TegrastatsRecord], selection: RailSelection, start: datetime,
                  end: datetime) -> float:
    """Energy of a logged window by the trapezoid over the lines' own timestamps, the power at
    ``start`` and ``end`` interpolated linearly between the neighbouring lines. Timestamps have 1 s
    resolution, so each boundary is uncertain by up to a second of power: use windows of many seconds.

    Raises:
        ValueError: a record without timestamp, timestamps going back, or a window not inside the log.
    """
    stamps = [r.timestamp for r in records]
    if not stamps or any(s is None for s in stamps):
        raise ValueError("window_joules needs timestamped lines")
    ref = stamps[0]
    assert ref is not None
    if (start.tzinfo is None) != (ref.tzinfo is None) or (end.tzinfo is None) != (ref.tzinfo is None):
        raise ValueError("window and tegrastats timestamps must both be naive (local time) or both aware")
    t = [(s - ref).total_seconds() for s in stamps if s is not None]  # seconds from the first line, no DST issue
    w = [selection.total_watts(r.watts()) for r in records]
    if any(b < a for a, b in zip(t, t[1:])):
        raise ValueError("tegrastats timestamps go back")
    ts, te = (start - ref).total_seconds(), (end - ref).total_seconds()
    if not (len(t) >= 2 and t[0] <= ts <= te <= t[-1]):
        raise ValueError(f"window {start} .. {end} is not inside the log's {records[0].timestamp} .. "
                         f"{records[-1].timestamp}")
    i = max(k for k in range(len(t)) if t[k] <= ts)
    j = min(k for k in range(len(t)) if t[k] >= te)
    inner = [(t[k], w[k]) for k in range(i + 1, j) if ts < t[k] < te]
    first = (ts, _interp(ts, t[i], w[i], t[min(i + 1, len(t) - 1)], w[min(i + 1, len(t) - 1)]))
    last = (te, _interp(te, t[max(j - 1, 0)], w[max(j - 1, 0)], t[j], w[j]))
    pts = [first, *inner, last]
    return trapezoid_joules([p[0] for p in pts], [p[1] for p in pts])


def interval_ms(interval_s: float) -> int:
    """tegrastats' interval: whole milliseconds, at least 1."""
    return max(1, round(interval_s * 1000))


def tegrastats_argv(interval_s: float, logfile: Path | str, binary: str = "tegrastats") -> list[str]:
    """``tegrastats --interval <ms> --logfile <path>``."""
    return [binary, "--interval", str(interval_ms(interval_s)), "--logfile", str(logfile)]


class LogTail:
    """Follows a growing text file on a thread and hands each complete line, with the time it was
    seen (``clock()``), to ``on_line``; a partial last line waits for its newline."""

    def __init__(self, path: Path, on_line: Callable[[str, float], None], clock: Callable[[], float] = time.monotonic,
                 poll_s: float = 0.01) -> None:
        self.path, self.on_line, self.clock, self.poll_s = path, on_line, clock, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tail-{path.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Read what is left, then end the thread."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self.path.exists():
            if self._stop.wait(self.poll_s):
                return
        buf = ""
        with open(self.path, encoding="utf-8", errors="replace") as f:
            while True:
                stopping = self._stop.is_set()  # read once more after the stop, then end
                chunk = f.read()
                if chunk:
                    buf += chunk
                    *lines, buf = buf.split("\n")
                    now = self.clock()
                    for line in lines:
                        if line.strip():
                            self.on_line(line, now)
                elif stopping:
                    return
                else:
                    self._stop.wait(self.poll_s)


class TegrastatsMeter(PowerMeter):
    """Power from ``tegrastats --interval <ms> --logfile <path>``, one process per window.

    ``start()`` spawns tegrastats (:func:`edge.core.device.spawn`) and waits for its first line: the
    window begins at that line's arrival. Each line is stamped with the meter clock when it is read
    from the log, parsed, and its total is the sum of the rails :func:`select_rails` chose from the
    first line (or ``rails``). ``stop()`` waits for the first line after the call, takes the power at
    the stop instant by linear interpolation, integrates by the trapezoid over the window and stops
    the process (:func:`edge.core.device.stop_process`). The constructor runs one short window, so a
    board whose rails are unknown is refused at once (:class:`SensorUnavailable`).
    """

    name = "tegrastats"

    def __init__(self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 rails: Sequence[str] | None = None, binary: str = "tegrastats", log_dir: Path | str | None = None,
                 line_timeout_s: float = 5.0, probe: bool = True) -> None:
        super().__init__(interval_s, clock)
        if shutil.which(binary) is None:
            raise SensorUnavailable(f"tegrastats: {binary!r} not found on PATH")
        self.binary, self.line_timeout_s = binary, line_timeout_s
        self._explicit = tuple(rails) if rails is not None else None
        self._selection: RailSelection | None = None
        self._own_dir = log_dir is None
        self._dir = Path(tempfile.mkdtemp(prefix="smartexit-tegrastats-")) if log_dir is None else Path(log_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._arrived = threading.Condition()
        self._samples: list[PowerSample] = []
        self._latest: PowerSample | None = None
        self._error: Exception | None = None
        self._proc = None
        self._tail: LogTail | None = None
        self._windows = 0
        self.reason = ("tegrastats: rails chosen from its first line (AGX Orin: VDD_GPU_SOC + VDD_CPU_CV + "
                       "VIN_SYS_5V0, no board-input rail; Orin NX / Nano: VDD_IN)")
        if probe:
            try:
                self.start()
                self.stop()
            except SmartExitError as exc:
                self.close()
                raise SensorUnavailable(str(exc)) from exc

    @property
    def rails(self) -> list[str]:
        return list(self._selection.rails) if self._selection else []

    def latest(self) -> PowerSample | None:
        return self._latest

    def _on_line(self, line: str, t: float) -> None:
        try:
            rec = parse_line(line)
            if rec.format is LineFormat.LEGACY_NO_UNITS:
                raise TegrastatsParseError("JetPack 4 tegrastats (rails without units) is not supported: "
                                           "the meters need JetPack 5 or later")
            if self._selection is None:
                self._selection = select_rails(rec.rails, self._explicit)
                self.reason = f"tegrastats every {interval_ms(self.interval_s)} ms: {self._selection.reason}"
            watts = rec.watts()
            sample = PowerSample(t, self._selection.total_watts(watts), watts, hottest_c(rec.temperatures_c))
        except ValueError as exc:  # a line or a layout this parser refuses: stop() raises it
            with self._arrived:
                self._error = self._error or exc
                self._arrived.notify_all()
            return
        with self._arrived:
            self._samples.append(sample)
            self._latest = sample
            self._arrived.notify_all()

    def _wait_for(self, ready: Callable[[], bool], timeout: float) -> None:
        """Wait until ``ready()``; raise at a parse error, an exited tegrastats or the timeout."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while not ready():
                if self._error is not None:
                    raise SmartExitError(f"tegrastats: {self._error}")
                if self._proc is not None and self._proc.poll() is not None:
                    raise SmartExitError(f"tegrastats exited with code {self._proc.returncode}: {self._output()}")
                if time.monotonic() > deadline:
                    raise SmartExitError(f"tegrastats wrote no line within {timeout:.1f} s: {self._output()}")
                self._arrived.wait(0.05)

    def _output(self) -> str:
        out = self._dir / "tegrastats.out"
        text = out.read_text(errors="replace").strip()[-500:] if out.exists() else ""
        return f"its output: {text!r}" if text else "no output"

    def _start(self) -> float:
        with self._arrived:
            self._samples, self._error = [], None
        self._windows += 1
        log = self._dir / f"window-{self._windows}.log"
        log.unlink(missing_ok=True)
        self._proc = spawn(tegrastats_argv(self.interval_s, log, self.binary), log_path=self._dir / "tegrastats.out")
        self._tail = LogTail(log, self._on_line, self.clock)
        self._tail.start()
        try:
            self._wait_for(lambda: bool(self._samples), self.line_timeout_s + 2 * self.interval_s)
        except SmartExitError:
            self._shutdown()
            raise
        return self._samples[0].t

    def _stop(self) -> tuple[float | None, str | None, list[PowerSample]]:
        t_stop = self.clock()
        try:
            self._wait_for(lambda: self._samples[-1].t >= t_stop, self.line_timeout_s + 2 * self.interval_s)
        finally:
            self._shutdown()
        with self._arrived:
            after = next(i for i, s in enumerate(self._samples) if s.t >= t_stop)
            samples = self._samples[:after + 1]  # the window's lines and the first after it
        inside, b = samples[:-1], samples[-1]
        if not inside:  # stop() in the same clock tick as the first line
            return 0.0, "samples", samples
        a = inside[-1]
        w_stop = a.watts + (b.watts - a.watts) * (t_stop - a.t) / (b.t - a.t) if b.t > a.t else b.watts
        joules = trapezoid_joules([s.t for s in inside] + [t_stop], [s.watts for s in inside] + [w_stop])
        return joules, "samples", samples

    def _shutdown(self) -> None:
        if self._proc is not None:
            stop_process(self._proc, timeout=5.0)
            self._proc = None
        if self._tail is not None:
            self._tail.stop()
            self._tail = None

    def close(self) -> None:
        self._shutdown()
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
