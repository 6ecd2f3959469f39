"""gpu_check's CUDA-free part: the FLOP count behind MFU, the parity and throughput verdicts and the table.

Kept apart from the runs on the GPU (benchmarks/gpu_check.py) so that it is tested on CPU
(tests/test_gpu_check.py) and shared by the other GPU sections (benchmarks/gpu_ecosystem.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
FP32_TOLERANCE, MIXED_TOLERANCE = 1e-5, 3e-2


def flops_per_token(multiplied_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM's appendix B: 6 N for the weights plus 12 L H S for
    attention's score and value products; recomputation is not model FLOPs."""
    return 6.0 * multiplied_params + 12.0 * layers * hidden * seq_len


def mfu(tokens_per_s: float, per_token: float, peak_flops: float) -> float:
    return tokens_per_s * per_token / peak_flops


def peak_tflops_for(device_name: str, given: float | None) -> float:
    if given is not None:
        return given
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in device_name), 989.0)


def relative_difference(ours: list[float], reference: list[float]) -> float:
    """The largest |a - b| / |b| over the steps (inf when a loss is not finite or a step is missing)."""
    if len(ours) != len(reference) or not all(math.isfinite(x) for x in ours):
        return math.inf
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, reference))


@dataclass
class Row:
    section: str
    name: str
    verdict: str = ""
    figures: dict = field(default_factory=dict)


def parity_row(name: str, ours: list[float], reference: list[float], tolerance: float) -> Row:
    difference = relative_difference(ours, reference)
    return Row("parity", name, "pass" if difference <= tolerance else "FAIL",
               {"max rel. loss difference": difference, "tolerance": tolerance, "losses": ours})


def throughput_verdicts(rows: list[Row]) -> list[str]:
    """The issue's targets from the throughput rows: MFU of full fine-tuning at ZeRO 0, and ZeRO 3 / ZeRO 0."""
    by_name = {row.name: row.figures for row in rows if row.section == "throughput" and "tokens/s" in row.figures}
    lines = []
    for ckpt in ("ckpt on", "ckpt off"):
        zero0, zero3 = by_name.get(f"full, ZeRO 0, {ckpt}"), by_name.get(f"full, ZeRO 3, {ckpt}")
        if zero0:
            lines.append(f"full fine-tuning, ZeRO 0, {ckpt}: MFU {zero0['MFU']:.1%} (target >= 45%: "
                         f"{'met' if zero0['MFU'] >= 0.45 else 'NOT met'})")
        if zero0 and zero3:
            ratio = zero3["tokens/s"] / zero0["tokens/s"]
            lines.append(f"ZeRO 3 / ZeRO 0 throughput, {ckpt}: {ratio:.3f} (target >= 0.95: "
                         f"{'met' if ratio >= 0.95 else 'NOT met'})")
    return lines


def render(rows: list[Row]) -> str:
    lines = ["| section | run | verdict | figures |", "|---|---|---|---|"]
    for row in rows:
        shown = {k: v for k, v in row.figures.items() if k != "losses"}
        text = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        lines.append(f"| {row.section} | {row.name} | {row.verdict} | {text} |")
    return "\n".join(lines + [""] + throughput_verdicts(rows))
