"""``deepspeed.utils.numa``: the core-list syntax parses as DeepSpeed's does; core binding is refused by name."""

from __future__ import annotations

import pytest

from zerotune.compat.alias import install_deepspeed_alias
from zerotune.compat.paths import DeepSpeedFeatureNotSupported


def test_core_lists_parse_and_bad_ones_name_the_list() -> None:
    install_deepspeed_alias()
    from deepspeed.utils.numa import get_numactl_cmd, parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    assert parse_range_list("5") == [5]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "a-3", "1-2-3"):
        with pytest.raises(ValueError, match="Bad range"):
            parse_range_list(bad)
    with pytest.raises(DeepSpeedFeatureNotSupported, match="binding ranks to cores"):
        get_numactl_cmd("0-3", 2, 0)
