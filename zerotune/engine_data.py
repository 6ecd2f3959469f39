"""The data loader ``initialize(training_data=...)`` returns: each data-parallel rank reads its own
share of the samples (a DistributedSampler over the dp axis), one micro-batch per item.

It is a ``torch.utils.data.DataLoader`` with two additions from DeepSpeed: ``post_process_func``
(set by ``engine.set_data_post_process_func``) is applied to every batch as
``post_process_func(batch, sampler_state)``, and the ``data_efficiency`` curriculum
(``curriculum/data_sampling.py``) steps with the batches, its difficulties in that state.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, DistributedSampler

from zerotune.curriculum.data_sampling import DataCurriculum
from zerotune.distributed.mesh import ProcessMesh


class EngineDataLoader(DataLoader):
    post_process_func: Callable[[Any, dict], Any] | None = None
    curriculum: DataCurriculum | None = None

    # torch types DataLoader.__iter__ as its own iterator class; DeepSpeed's loader is a generator over it that
    # post-processes each batch (scripts only iterate it)
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for batch in super().__iter__():
            state = self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else {}
            if self.curriculum is not None:
                state = {**state, **self.curriculum.next_batch()}
                batch = self.curriculum.apply(batch, self.post_process_func)
            if self.post_process_func is not None:
                batch = self.post_process_func(batch, state)
            yield batch


def build_dataloader(training_data: Any, mesh: ProcessMesh, micro_batch: int, collate_fn: Callable | None,
                     drop_last: bool, curriculum: DataCurriculum | None = None) -> EngineDataLoader | None:
    if training_data is None:
        return None
    sampler: DistributedSampler[int] = DistributedSampler(training_data, num_replicas=mesh.size("dp"),
                                                          rank=mesh.rank("dp"))
    loader = EngineDataLoader(training_data, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn,
                              drop_last=drop_last)
    loader.curriculum = curriculum
    return loader
