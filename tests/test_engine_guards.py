"""Two engines in one process (a GAN, RLHF's policy and reference model) each keep their own guards: the
guard-on engine records only its own collectives and stops a diverging rank with CollectiveMismatch while
the guard-off engine stays off; each engine's collectives are watched with its own comm_timeout_s; each
model's checkpointed regions follow its engine's activation_checkpointing section -- wherever its wrapped
blocks are called from, and for DeepSpeed's checkpoint(...) calls made while the engine runs."""

from __future__ import annotations

import torch

import zerotune
from tests.harness import run_distributed
from zerotune.distributed import guard_scope
from zerotune.distributed.guard import GUARD, CollectiveMismatch
from zerotune.distributed.guard_torch import guard_torch_distributed
from zerotune.distributed.watchdog import WATCHDOG
from zerotune.parallel import activation_checkpointing as ac
from zerotune.parallel import block_checkpointing as blocks


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class DeclaredBlocks(torch.nn.Module):
    """Declares its blocks (as a Hugging Face model does): ``initialize`` wraps them."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.mse_loss(self.head(x), y)


class OwnCheckpointCalls(torch.nn.Module):
    """Checkpoints its own region through DeepSpeed's global API (Megatron-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.head(zerotune.checkpointing.checkpoint(self.block, x)), y)


POLICY_A = {"cpu_checkpointing": True}
POLICY_B = {"synchronize_checkpoint_boundary": True}


def _engine(model: torch.nn.Module, **extra: object):
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}
    return zerotune.initialize(model=model, config=config)[0]


def _batch(index: int, rank: int) -> dict:
    generator = torch.Generator().manual_seed(100 * index + rank)
    return {"x": torch.randn(2, 8, generator=generator), "y": torch.randn(2, 1, generator=generator)}


def _count(engine) -> int:
    return sum(count for count, *_ in engine.guards.guard.snapshot().values())


def _two_engines(tmp: str) -> dict:
    torch.manual_seed(0)
    a = _engine(DeclaredBlocks(), collective_guard=True, comm_timeout_s=30,
                activation_checkpointing={**POLICY_A, "wrap_blocks": True})
    b = _engine(OwnCheckpointCalls(), collective_guard=False, comm_timeout_s=45, activation_checkpointing=POLICY_B)
    rank = a.global_rank
    seen: dict[str, list] = {"policies": [], "timeouts": []}
    run_checkpointed, begin = ac.run_checkpointed, WATCHDOG.begin

    def recording_run(function, args, kwargs, policy, name):
        seen["policies"].append((seen["phase"], name, policy))
        return run_checkpointed(function, args, kwargs, policy, name)

    def recording_begin(*args, timeout_s, **kwargs):
        seen["timeouts"].append((seen["phase"], timeout_s))
        return begin(*args, timeout_s=timeout_s, **kwargs)

    def micro_step(engine, name: str, index: int) -> None:
        seen["phase"] = name
        engine.backward(engine(**_batch(index, rank)))
        engine.step()

    # checkpoint() calls it in activation_checkpointing, the wrapped blocks in block_checkpointing
    ac.run_checkpointed = blocks.run_checkpointed = recording_run
    WATCHDOG.begin = recording_begin
    try:
        counts = []
        for index in range(2):  # interleaved, as a GAN's generator and discriminator steps
            micro_step(a, "a", index)
            counts.append(_count(a))
            micro_step(b, "b", index)
            counts.append(_count(a))
        with guard_torch_distributed():  # the script's own collective reports to the engine that ran last
            seen["phase"] = "raw after b"
            torch.distributed.all_reduce(torch.ones(1))
            after_b = _count(a)
            micro_step(a, "a", 2)
            before = _count(a)
            seen["phase"] = "raw after a"
            torch.distributed.all_reduce(torch.ones(1))
            after_a = _count(a) - before
        micro_step(b, "b", 3)
        seen["phase"] = "a's block called directly"  # a's wrapped blocks keep a's policy outside its methods
        a.module.blocks[0](torch.randn(2, 8, requires_grad=True))  # (the policy is taken at the forward)
        seen["phase"] = "checkpoint() outside engines"  # the engine that ran last: b
        ac.checkpoint(Block(), torch.randn(2, 8, requires_grad=True))
    finally:
        ac.run_checkpointed = blocks.run_checkpointed = run_checkpointed
        WATCHDOG.begin = begin
        seen.pop("phase", None)
    points_a = a.guards.guard.points
    try:  # rank 0 saves a's checkpoint alone: a's guard stops both ranks
        if rank == 0:
            a.save_checkpoint(tmp)
        micro_step(a, "a", 3)
        raised = None
    except CollectiveMismatch as error:
        raised = str(error)
    result = {"counts": counts, "raw_after_b": after_b - counts[-1], "raw_after_a": after_a, "raised": raised,
              "a_points": points_a, "a_active": a.guards.guard.active, "b_active": b.guards.guard.active,
              "b_points": b.guards.guard.points, "b_logs": b.guards.guard.snapshot(), "process_guard": GUARD.active,
              "timeouts": (a.guards.timeout_s, b.guards.timeout_s),
              "timeouts_seen": sorted(set(seen["timeouts"])),
              "policies": sorted({(phase, name, policy) for phase, name, policy in seen["policies"]},
                                 key=lambda entry: (entry[0], entry[1]))}
    b.destroy()
    a.destroy()
    result["closed"] = (a.guards.guard.active, a.guards.timeout_s, b.guards.timeout_s)
    return result


def test_two_engines_in_one_process_keep_their_own_guard_watchdog_timeout_and_checkpointing_policy(tmp_path) -> None:
    results = run_distributed(_two_engines, 2, str(tmp_path), timeout=120)
    policy_a = ac.CheckpointPolicy(**POLICY_A)
    policy_b = ac.CheckpointPolicy(**POLICY_B)
    for rank, result in enumerate(results):
        # The guard-on engine records its own collectives only: a's count grows over a's steps, not over b's.
        counts = result["counts"]
        assert counts[0] > 0 and counts[1] == counts[0] and counts[3] == counts[2] > counts[1], counts
        assert result["raw_after_b"] == 0 and result["raw_after_a"] == 1, result
        assert result["a_active"] and result["a_points"] >= 3
        assert not result["b_active"] and result["b_points"] == 0 and result["b_logs"] == {}
        assert not result["process_guard"]
        # ... and stops a diverging rank, on every rank, naming each rank's phase.
        assert result["raised"] is not None, rank
        assert "rank 0 is about to run save_checkpoint" in result["raised"], result["raised"]
        assert "rank 1 is about to run backward" in result["raised"], result["raised"]
        # Each engine's collectives are watched with its own comm_timeout_s (one watchdog thread serves both).
        assert result["timeouts"] == (30.0, 45.0)
        by_phase: dict[str, set] = {}
        for phase, timeout in result["timeouts_seen"]:
            by_phase.setdefault(phase, set()).add(timeout)
        assert by_phase["a"] == {30.0} and by_phase["b"] == {45.0}, by_phase
        assert by_phase["raw after a"] == {30.0} and by_phase["raw after b"] == {45.0}, by_phase
        # Each model's checkpointed regions follow its engine's section.
        policies = {(phase, name): policy for phase, name, policy in result["policies"]}
        assert policies[("a", "blocks.0")] == policies[("a", "blocks.1")] == policy_a, policies
        assert policies[("b", "Block")] == policy_b, policies
        assert policies[("a's block called directly", "blocks.0")] == policy_a, policies
        assert policies[("checkpoint() outside engines", "Block")] == policy_b, policies
        assert len({policy for (phase, _), policy in policies.items() if phase == "a"}) == 1, policies
        # destroy() closes an engine's guards.
        assert result["closed"] == (False, None, None), result["closed"]


def test_a_direct_configure_after_the_engines_were_built_overrides_their_sections(monkeypatch) -> None:
    """DeepSpeed's module-level configure() keeps working: called after initialize it is what the engine's regions
    follow, as when one global policy held the latest of the two; before it, the engine's section wins."""
    monkeypatch.setattr(ac, "_configured_policy", None)
    monkeypatch.setattr(guard_scope, "_newest", None)
    ac.configure(None, checkpoint_in_cpu=True)
    scope = guard_scope.GuardScope(GUARD, checkpoint_policy=ac.CheckpointPolicy(profile=True))
    guard_scope.make_newest(scope)
    assert ac.configured_policy() == ac.CheckpointPolicy(profile=True) and ac.is_configured()
    assert ac.configure(None, synchronize=True) == ac.configured_policy()
    assert ac.policy_in_force(scope) == ac.CheckpointPolicy(synchronize_checkpoint_boundary=True)
