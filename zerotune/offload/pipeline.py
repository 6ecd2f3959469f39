"""Overlap swapping with compute: load chunk i+1 and store chunk i-1 while chunk i computes.

This is how an NVMe-offloaded optimizer steps a model whose state does not fit in memory:
the state is cut into chunks, and at any moment at most three are resident -- the one
being computed, the next one being read, and the previous one being written back -- so
resident memory stays at three chunks (``BufferPool(buffer_count=3 x tensors per chunk)``)
whatever the number of chunks.

The schedule for chunk i, step by step:

1. wait for load(i)                      -- its data must be in memory before compute
2. wait for store(i-2), then release(i-2) -- frees the buffer that load(i+1) will take
3. issue load(i+1)                       -- live now: i-1 (storing), i, i+1 (loading)
4. compute(i)                            -- overlaps the two transfers above
5. issue store(i)

On any failure every issued transfer is still waited for (an I/O thread must never write
into a buffer the caller is about to reuse) and every loaded chunk is released, then the
first error propagates.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol, Sequence, TypeVar, Union

T = TypeVar("T")


class Waitable(Protocol):
    def wait(self) -> None: ...


Pending = Union[Waitable, Iterable[Waitable], None]
"""What load and store return: a handle, several handles (one chunk can span several
tensors, e.g. a parameter and its two Adam moments), or None when they finished already."""


def wait_all(pending: Pending) -> None:
    """Wait for every handle in ``pending``; the first error is raised after all finished."""
    if pending is None:
        return
    handles = [pending] if hasattr(pending, "wait") else list(pending)
    first: BaseException | None = None
    for handle in handles:
        try:
            handle.wait()
        except BaseException as error:  # keep waiting: the others may still touch memory
            first = first or error
    if first is not None:
        raise first


def pipelined(
    chunks: Sequence[T],
    load: Callable[[T], Pending],
    compute: Callable[[T], None],
    store: Callable[[T], Pending],
    release: Callable[[T], None] | None = None,
) -> None:
    """Run ``compute`` on every chunk in order with loads and stores overlapped (see the
    module docstring for the exact schedule).

    ``load(c)`` starts bringing chunk ``c`` into memory (typically: acquire pool buffers,
    issue ``SwapStore.read``); ``store(c)`` starts writing it back; ``release(c)``, called
    once the store has finished, gives its buffers back. At most three chunks are ever
    between load and release. After a failure ``release`` is also called for chunks whose
    load or store did not complete (so buffers are never leaked); it must tolerate a chunk
    whose ``load`` raised before acquiring anything.
    """
    chunks = list(chunks)
    loads: dict[int, Pending] = {}
    stores: dict[int, Pending] = {}
    live: list[int] = []  # indices loaded (or loading) and not yet released

    def start_load(i: int) -> None:
        live.append(i)  # before load(): a load that acquires buffers then fails still gets released
        loads[i] = load(chunks[i])

    def finish_store(i: int) -> None:
        try:
            wait_all(stores.pop(i))
        finally:
            live.remove(i)
            if release is not None:
                release(chunks[i])

    try:
        if chunks:
            start_load(0)
        for i in range(len(chunks)):
            wait_all(loads.pop(i))
            if i - 2 in stores:
                finish_store(i - 2)
            if i + 1 < len(chunks):
                start_load(i + 1)
            compute(chunks[i])
            stores[i] = store(chunks[i])
        for i in sorted(stores):
            finish_store(i)
    except BaseException as error:
        _drain(chunks, loads, stores, live, release, error)
        raise


def _drain(chunks: list, loads: dict, stores: dict, live: list[int],
           release: Callable | None, error: BaseException) -> None:
    """After a failure: wait for every issued transfer and release every live chunk,
    attaching later errors to the first as notes rather than hiding it."""
    for pending in list(loads.values()) + list(stores.values()):
        try:
            wait_all(pending)
        except BaseException as later:
            error.add_note(f"also failed while draining swap I/O: {later!r}")
    loads.clear()
    stores.clear()
    for i in list(live):
        live.remove(i)
        if release is not None:
            try:
                release(chunks[i])
            except BaseException as later:
                error.add_note(f"also failed releasing chunk {i}: {later!r}")
