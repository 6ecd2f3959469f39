"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned over the data-parallel ranks.

Split FSDP2-style into small parts, each in its own module:

* ``sharded_param``: one object per partitioned parameter, with an explicit SHARDED / UNSHARDED state;
* ``segment``: parameters laid end to end in one flat buffer sharded over the ranks (gather, release);
* ``unit``: one communication unit (e.g. a transformer block): its segments, the coalesced
  all-gather before use, the release after, the gradient reduce-scatter into the owner's slice;
* ``schedule``: the module hooks, the execution order recorded on the first step, and prefetch;
* ``wrap``: which modules become units, and partitioning a model into them;
* ``state``: the engine-facing state (masters, optimizer groups, norm, step) for stage 3;
* ``init`` / ``gathered`` / ``loading`` / ``saving``: ``zero.Init``, ``GatheredParameters``,
  per-rank safetensors loading and the consolidated 16-bit save.
"""
