"""DeepSpeed's public names, mapped onto zerotune (see ``paths.py`` for the table).

``zerotune.install_deepspeed_alias()`` makes ``import deepspeed`` resolve here; ``zerotune run
--as-deepspeed`` does it in every rank before the script starts. Nothing in zerotune's core
imports this package: it only gives zerotune's own objects the names DeepSpeed code uses.
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
