"""Session-wide test settings: offline HF, one thread per process, and pool cleanup.

The environment defaults are set at import time, before any worker pool (or its forkserver)
starts, because workers inherit the environment of the forkserver at the moment it starts.
"""

from __future__ import annotations

import os

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",  # 2 cores shared by up to 8 ranks: extra threads only thrash
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.harness import shutdown_pools  # noqa: E402
from tests.logs import logger_state_restored  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_pools_at_session_end():
    """Pools live for the whole session (warm-up is paid once); stop them when it ends."""
    yield
    shutdown_pools()


@pytest.fixture(autouse=True)
def _zerotune_logger_isolated():
    """Each test starts and ends with the "zerotune" logger as it found it (no leaked handlers)."""
    with logger_state_restored():
        yield


@pytest.fixture
def alias():
    """``import deepspeed`` resolves to zerotune for the test (and not after it)."""
    from zerotune.compat.alias import install_deepspeed_alias, uninstall_deepspeed_alias

    install_deepspeed_alias()
    try:
        yield
    finally:
        uninstall_deepspeed_alias()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reverse", action="store_true",
                     help="run the collected tests in reverse order (to find tests that depend on earlier ones)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse"):
        items.reverse()
