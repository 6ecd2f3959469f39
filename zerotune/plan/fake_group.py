"""A process group of any size that moves nothing, for tracing one rank of a parallel layout in-process.

torch's own ``FakeProcessGroup`` (a C++ group whose collectives complete at once without touching data)
serves as the default group while ``zerotune plan`` builds and traces a tensor-parallel model on fake
tensors: zerotune's own ``apply_autotp`` then splits the layers exactly as a real run would and the forward
issues its collectives, so the plan counts one rank's shards and activations instead of guessing them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

BACKEND = "fake"


def _create(common_options, backend_options):
    from torch._C._distributed_c10d import FakeProcessGroup

    # (torch's stub declares _create_internal(rank, world_size); it takes the backend options too)
    return FakeProcessGroup._create_internal(  # type: ignore[call-arg]
        common_options.group_rank, common_options.group_size, backend_options)


@contextmanager
def fake_world(size: int) -> Iterator[dist.ProcessGroup]:
    """The default process group, as rank 0 of ``size`` fake ranks, for the duration of the block."""
    if dist.is_initialized():
        raise RuntimeError("zerotune plan traces a parallel layout with a fake process group, but this process "
                           "already has one; run the plan outside a distributed job")
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=size)
    try:
        world = dist.group.WORLD
        assert world is not None  # (init_process_group made it)
        yield world
    finally:
        dist.destroy_process_group()
