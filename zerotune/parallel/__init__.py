"""Model transforms that change how a model computes, not what: activation checkpointing (later: tensor,
sequence and pipeline parallelism). Import the submodules directly; nothing is re-exported here so that
importing one transform never pulls in the others."""
