"""Which Jetson power rails make a total, by the rail names a board reports (tegrastats, jtop).

Jetson modules carry INA3221 monitors whose channels are named in the device tree (Linux
``tegra234-p3701.dtsi`` for AGX Orin: ``VDD_GPU_SOC``, ``VDD_CPU_CV``, ``VIN_SYS_5V0`` on the monitor
at 0x40, ``VDDQ_VDD2_1V8AO`` on the one at 0x41). Two layouts of the Orin family are known here:

* **module input** (Orin NX, Orin Nano): ``VDD_IN`` is the module's whole input (NVIDIA Jetson
  Linux Developer Guide, Platform Power and Performance, Orin NX series); the other rails
  (``VDD_CPU_GPU_CV``, ``VDD_SOC``) are parts of it, so the total is ``VDD_IN`` alone. Xavier NX
  reports the same three names, and its ``VDD_IN`` is its module input too.
* **AGX Orin**: no channel measures the module input. The total is the sum of the three named
  rails ``VDD_GPU_SOC + VDD_CPU_CV + VIN_SYS_5V0``. ``VDDQ_VDD2_1V8AO`` (a DRAM rail, listed by
  JetPack 5 and 6.0 tegrastats, not by R36.4) is reported but not added, so totals from different
  JetPacks stay comparable; ``NC`` channels are unconnected. The sum is of named rails, not a
  board-input reading: carrier-board parts (fan, USB, NVMe) and losses upstream of these rails are
  not in it.

Any other set of names (AGX Thor, AGX Xavier, JetPack 4 ``POM_*``) is refused with the names found:
summing rails of an unknown layout could count a rail twice or miss the input.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping

MODULE_INPUT = "VDD_IN"
MODULE_INPUT_PARTS = frozenset({"VDD_CPU_GPU_CV", "VDD_SOC"})
AGX_ORIN_SUMMED = ("VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0")
AGX_ORIN_NOT_SUMMED = frozenset({"VDDQ_VDD2_1V8AO"})
UNCONNECTED = "NC"


class RailLayout(str, Enum):
    MODULE_INPUT = "module_input"  # VDD_IN present: the total is that one rail
    AGX_ORIN_SUM = "agx_orin_sum"  # no input rail: the sum of three named rails
    EXPLICIT = "explicit"  # the caller named the rails to sum


@dataclass(frozen=True)
class RailSelection:
    """The rails a total sums and why."""

    layout: RailLayout
    rails: tuple[str, ...]
    reason: str

    def total_watts(self, rails: Mapping[str, float]) -> float:
        """The sum of the selected rails' watts.

        Raises:
            ValueError: a selected rail is missing from ``rails``.
        """
        missing = [r for r in self.rails if r not in rails]
        if missing:
            raise ValueError(f"rails {missing} missing from a reading with rails {sorted(rails)}")
        return float(sum(rails[r] for r in self.rails))


def select_rails(names: Iterable[str], explicit: Iterable[str] | None = None) -> RailSelection:
    """The rails to sum for a board reporting rails ``names`` (``NC`` channels ignored).

    Args:
        names: the rail names of one reading.
        explicit: rails to sum instead of the board rule (each must be in ``names``).

    Raises:
        ValueError: an explicit rail that is not reported, or a layout that is not known (the message
            names the rails found and the known layouts).
    """
    found = {n for n in names if n != UNCONNECTED}
    if explicit is not None:
        chosen = tuple(explicit)
        missing = [r for r in chosen if r not in found]
        if not chosen or missing:
            raise ValueError(f"rails to sum {list(chosen)}: {missing or 'none given'} not among the reported "
                             f"rails {sorted(found)}")
        return RailSelection(RailLayout.EXPLICIT, chosen, f"sum of the rails asked for: {' + '.join(chosen)}")
    if MODULE_INPUT in found and found - {MODULE_INPUT} <= MODULE_INPUT_PARTS:
        return RailSelection(RailLayout.MODULE_INPUT, (MODULE_INPUT,),
                             "VDD_IN, the module input rail (Orin NX / Orin Nano layout); the other rails "
                             "are parts of it and not added")
    if set(AGX_ORIN_SUMMED) <= found and found - set(AGX_ORIN_SUMMED) <= AGX_ORIN_NOT_SUMMED:
        return RailSelection(RailLayout.AGX_ORIN_SUM, AGX_ORIN_SUMMED,
                             "sum of named rails VDD_GPU_SOC + VDD_CPU_CV + VIN_SYS_5V0 (AGX Orin has no "
                             "board-input rail: this is not the board's input power)")
    raise ValueError(
        f"unknown Jetson rail layout {sorted(found)}: known are VDD_IN with {sorted(MODULE_INPUT_PARTS)} "
        f"(Orin NX / Nano) and {list(AGX_ORIN_SUMMED)} (AGX Orin); name the rails to sum explicitly (rails=...)")


def hottest_c(temperatures: Mapping[str, float]) -> float | None:
    """The device temperature to report: ``tj`` (the junction maximum Jetson thermal zones expose)
    where present, else the hottest sensor; None without any."""
    for name, value in temperatures.items():
        if name.lower() == "tj":
            return value
    return max(temperatures.values(), default=None)
