"""DeepSpeed's flops-profiler number formats: ``1.23 GMACs``, ``866.08 M``, ``61.71 K``, ``2.5 ms``.

The profile's readers (scripts, notebooks, the DeepSpeed docs' examples) parse or compare these strings, so they
follow DeepSpeed's spelling: a value scaled to T/G/M/K (or m/u below one), rounded to two decimals, then the
unit; parameter counts write billions as ``B``.
"""

from __future__ import annotations

from typing import Optional

DEFAULT_PRECISION = 2

_MAGNITUDES = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "m": 1e-3, "u": 1e-6}


def number_to_string(num: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """``num`` scaled to its largest unit (or to ``units``) and rounded: ``number_to_string(866076672)`` is
    ``"866.08 M"``."""
    if units is None:
        units = next((unit for unit in ("T", "G", "M", "K") if num >= _MAGNITUDES[unit]), "")
        if not units and not (num >= 1 or num == 0):
            units = "m" if num >= 1e-3 else "u"
    magnitude = _MAGNITUDES.get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units=units, precision=precision)}MACs"


def flops_to_string(flops: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """A rate (floating-point operations per second): ``"1.2 TFLOPS"``."""
    return f"{number_to_string(flops, units=units, precision=precision)}FLOPS"


def bytes_to_string(b: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(b, units=units, precision=precision)}B"


def params_to_string(params_num: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """A parameter count: ``"61.71 K"``, with billions written ``B`` (``units="B"`` asks for them)."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params_num, units=units, precision=precision).replace("G", "B").strip()


def duration_to_string(duration: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """Seconds: ``"2.5 ms"``."""
    return f"{number_to_string(duration, units=units, precision=precision)}s"


__all__ = ["DEFAULT_PRECISION", "number_to_string", "macs_to_string", "flops_to_string", "bytes_to_string",
           "params_to_string", "duration_to_string"]
