"""DeepSpeed's public names, mapped onto zerotune (see ``paths.py`` for the table).

``zerotune.install_deepspeed_alias()`` makes ``import deepspeed`` resolve here; ``zerotune run
--as-deepspeed`` does it in every rank before the script starts; ``zerotune deepspeed-alias install``
writes a ``.pth`` hook (``alias_hook.py``, ``persistent.py``) that does it in every process of the
environment at its first ``import deepspeed``. ``import zerotune`` itself puts one finder on
``sys.meta_path`` (``alias.ZerotuneDeepSpeedPathsFinder``: ``zerotune.<deepspeed path>``, e.g.
``zerotune.runtime.pipe.engine``, for a script whose imports were renamed) and attaches the constructor
spellings and engine names of ``spellings.py``; it never installs the ``deepspeed`` alias.

Nothing in zerotune's core imports this package -- only the front doors do, ``zerotune/__init__.py`` and the
CLI (tests/test_import_graph.py): it gives zerotune's own objects the names DeepSpeed code uses.
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
