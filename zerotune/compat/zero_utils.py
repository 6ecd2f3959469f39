"""``deepspeed.runtime.zero.utils``: ``ZeRORuntimeException``, the error DeepSpeed's engine raises for ZeRO setups
it cannot run.

DeepSpeed raises it in two places, neither of which is an error in zerotune, which therefore never raises it:
* a client optimizer other than DeepSpeedCPUAdam with ``offload_optimizer`` while ``zero_force_ds_cpu_optimizer``
  is true -- zerotune's offloaded step runs torch's kernels for any torch optimizer, its DeepSpeedCPUAdam
  included, so the key has no effect (``config/schema.py``);
* loading optimizer state saved at another data-parallel world size -- zerotune's checkpoints are keyed by
  parameter name and load at any layout (``checkpoint/logical.py``).
It is exported so that DeepSpeed code's ``except ZeRORuntimeException`` clauses keep working.
"""

from __future__ import annotations

__all__ = ["ZeRORuntimeException"]


class ZeRORuntimeException(Exception):  # noqa: N818 - DeepSpeed's name
    """A ZeRO setup DeepSpeed's engine cannot run (never raised by zerotune: see the module doc)."""
