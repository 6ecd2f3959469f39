"""DeepSpeed's public names, mapped onto zerotune (see ``paths.py`` for the table).

``zerotune.install_deepspeed_alias()`` makes ``import deepspeed`` resolve here; ``zerotune run
--as-deepspeed`` does it in every rank before the script starts; ``zerotune deepspeed-alias install``
writes a ``.pth`` hook (``alias_hook.py``, ``persistent.py``) that does it in every process of the
environment at its first ``import deepspeed``. Nothing in zerotune's core
imports this package (one exception: a stage-3 engine hangs ``parameter_offload.DeepSpeedZeRoOffload`` on
its optimizer, where TRL looks for it): it only gives zerotune's own objects the names DeepSpeed code uses.
"""

from zerotune.compat.alias import (
    DEEPSPEED_VERSION,
    deepspeed_alias_installed,
    install_deepspeed_alias,
    uninstall_deepspeed_alias,
)
from zerotune.compat.paths import DeepSpeedFeatureNotSupported

__all__ = ["DEEPSPEED_VERSION", "DeepSpeedFeatureNotSupported", "deepspeed_alias_installed",
           "install_deepspeed_alias", "uninstall_deepspeed_alias"]
