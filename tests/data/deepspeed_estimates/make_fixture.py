"""Writes estimates.json from DeepSpeed's own model-state estimators (tests/test_plan.py compares ours).

Run once with DeepSpeed installed (zerotune never imports it):

    python -m venv /tmp/dsv && /tmp/dsv/bin/pip install torch==2.13.0 deepspeed==0.19.8
    /tmp/dsv/bin/python tests/data/deepspeed_estimates/make_fixture.py
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import deepspeed
import torch
from deepspeed.runtime.zero import stage3, stage_1_and_2

CASES = [  # (total params, largest layer params, gpus per node, nodes, additional_buffer_factor)
    (7_500_000_000, 262_144_000, 8, 8, 1.5), (3_000_000_000, 32_000_000, 8, 1, 1.5),
    (125_000_000, 38_597_376, 1, 1, 1.5), (70_553_706_496, 1_050_673_152, 8, 4, 1.2), (13_000_000_000, 325_000_000, 4, 2, 2.0),
]


def printed(function, *args, **kwargs) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        function(*args, **kwargs)
    return out.getvalue()



def main() -> None:
    cases = []
    for total, largest, gpus, nodes, factor in CASES:
        case = {"total": total, "largest": largest, "gpus_per_node": gpus, "nodes": nodes, "factor": factor,
                "zero2": {str(off): stage_1_and_2.estimate_zero2_model_states_mem_needs(
                    total, gpus, nodes, cpu_offload=off, additional_buffer_factor=factor) for off in (True, False)},
                "zero3": [[off, off_params, init, *stage3.estimate_zero3_model_states_mem_needs(
                    total, largest, gpus, nodes, cpu_offload=off, cpu_offload_params=off_params, zero_init=init,
                    additional_buffer_factor=factor)] for off in (True, False) for off_params in (True, False)
                    for init in (True, False)],
                "zero2_printed": printed(stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold, total, gpus,
                                         nodes, factor),
                "zero3_printed": printed(stage3.estimate_zero3_model_states_mem_needs_all_cold, total, largest, gpus,
                                         nodes, factor)}
        cases.append(case)
    tied = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 64),
                               torch.nn.Linear(64, 1000, bias=False))
    tied[3].weight = tied[0].weight
    live = {"zero2_params": stage_1_and_2.model_to_params(tied), "zero3_params": list(stage3.model_to_params(tied)),
            "zero2_printed": printed(stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live, tied, 4, 2),
            "zero3_printed": printed(stage3.estimate_zero3_model_states_mem_needs_all_live, tied, 4, 2)}
    path = Path(__file__).with_name("estimates.json")
    path.write_text(json.dumps({"deepspeed": deepspeed.__version__, "cases": cases, "tied_model": live}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
