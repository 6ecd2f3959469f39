"""Per-rank loading of safetensors weights into a partitioned model (single process, fake shards).

Each test emulates rank ``r`` of ``world`` by giving every partitioned parameter a fake
``ShardedParam`` that holds only its own flat range (laid out end to end as the real segments
do, so parameters straddle ranks and some ranks hold nothing of a parameter). The parameter's
``.data`` is the real stride-0 placeholder, so any attempt to write the whole parameter fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tests.models import make_gpt2
from zerotune.zero.partition import flat_layout
from zerotune.zero.stage3 import loading
from zerotune.zero.stage3.loading import WeightLoadingError, load_partitioned_weights, read_flat_range
from zerotune.zero.stage3.sharded_param import placeholder


class FakeSegment:
    """The segment calls the loader makes after writing: drop a stale gathered copy, tell the masters."""

    def __init__(self) -> None:
        self.released = self.notified = 0

    def release(self) -> None:
        self.released += 1

    def notify_local_changed(self) -> None:
        self.notified += 1


class FakeSharded:
    """Implements the ``ShardedParam`` API the loader uses; holds only ``[lo, hi)`` of the flat parameter."""

    def __init__(self, param: nn.Parameter, lo: int, hi: int, dtype: torch.dtype) -> None:
        self.shape, self.numel = param.shape, param.numel()
        self.segment = FakeSegment()
        self.lo, self.hi = lo, hi
        self.buffer = torch.full((hi - lo,), float("nan"), dtype=dtype) if dtype.is_floating_point else \
            torch.zeros(hi - lo, dtype=dtype)

    def local_piece(self) -> tuple[int, int, torch.Tensor]:
        return self.lo, self.hi, self.buffer


def partition(model: nn.Module, monkeypatch, rank: int, world: int, *, dtype: torch.dtype | None = None,
              only=lambda name, p: True) -> dict[str, FakeSharded]:
    """Emulate rank ``rank``: partition the selected parameters end to end over ``world`` ranks."""
    chosen = [(name, p) for name, p in model.named_parameters() if only(name, p)]
    layout = flat_layout([p.numel() for _, p in chosen], world)
    start, end = layout.owned_range(rank)
    fakes, by_id = {}, {}
    for (name, param), offset in zip(chosen, layout.offsets):
        lo, hi = max(start, offset) - offset, min(end, offset + param.numel()) - offset
        lo, hi = (lo, hi) if lo < hi else (0, 0)
        fake = FakeSharded(param, lo, hi, dtype or param.dtype)
        param.data = placeholder(param.shape, param.dtype, param.device)  # no values, writes raise
        fakes[name], by_id[id(param)] = fake, fake
    monkeypatch.setattr(loading, "sharded_param_of", lambda p: by_id.get(id(p)))
    return fakes


def stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            out.update({key: handle.get_tensor(key) for key in handle.keys()})
    return out


def saved_gpt2(directory: Path, **save_kwargs) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = make_gpt2(seed=0)
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    return model, stored_tensors(directory)


def check_rank(fakes: dict[str, FakeSharded], stored: dict[str, torch.Tensor], coverage: dict[str, torch.Tensor]):
    for name, fake in fakes.items():
        key = "transformer.wte.weight" if name == "lm_head.weight" else name
        expected = stored[key].reshape(-1)[fake.lo:fake.hi].to(fake.buffer.dtype)
        assert torch.equal(fake.buffer, expected), f"{name}: local piece [{fake.lo}, {fake.hi}) differs"
        coverage.setdefault(name, torch.zeros(stored[key].numel(), dtype=torch.int32))[fake.lo:fake.hi] += 1


# ----- read_flat_range ---------------------------------------------------------------------------


class RecordingHandle:
    """Wraps a safe_open handle; records every get_slice index so tests can check what was read."""

    def __init__(self, handle) -> None:
        self.handle, self.requests, self.whole_reads = handle, [], []

    def get_slice(self, key):
        handle = self

        class Slice:
            def get_shape(self):
                return handle.handle.get_slice(key).get_shape()

            def __getitem__(self, index):
                handle.requests.append((key, index))
                return handle.handle.get_slice(key)[index]

        return Slice()

    def get_tensor(self, key):
        self.whole_reads.append(key)
        return self.handle.get_tensor(key)

    def keys(self):
        return self.handle.keys()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


SHAPES = [(), (1,), (7,), (0,), (5, 0), (4, 6), (3, 1, 5), (2, 3, 4), (9, 2)]


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory) -> Path:
    generator = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(shape, generator=generator) for i, shape in enumerate(SHAPES)}
    tensors["ints"] = torch.arange(30, dtype=torch.int64).reshape(5, 6)
    tensors["half"] = torch.randn(6, 5, generator=generator).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("shapes") / "t.safetensors"
    save_file(tensors, str(path))
    return path


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_read_flat_range_matches_full_tensor_and_reads_only_covering_rows(shapes_file, data):
    with safe_open(str(shapes_file), framework="pt") as raw:
        key = data.draw(st.sampled_from(sorted(raw.keys())))
        full = raw.get_tensor(key)
        lo = data.draw(st.integers(0, full.numel()))
        hi = data.draw(st.integers(lo, full.numel()))
        handle = RecordingHandle(raw)
        got = read_flat_range(handle, key, lo, hi)
    assert got.dim() == 1 and got.dtype == full.dtype
    assert torch.equal(got, full.reshape(-1)[lo:hi])
    assert not handle.whole_reads
    if full.dim() >= 1 and hi > lo:
        row = math.prod(full.shape[1:])
        [(_, index)] = handle.requests
        assert index == slice(lo // row, -(-hi // row)), f"{key}[{lo}:{hi}] read rows {index}"


def test_read_flat_range_rejects_out_of_bounds(shapes_file):
    with safe_open(str(shapes_file), framework="pt") as handle:
        for lo, hi in [(-1, 2), (3, 2), (0, 25), (24, 25)]:
            with pytest.raises(WeightLoadingError, match=r"'t5'.*outside its 24 elements"):
                read_flat_range(handle, "t5", lo, hi)


# ----- load_partitioned_weights ------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_partitioned_gpt2_gets_exactly_its_ranges(tmp_path, monkeypatch, world):
    _, stored = saved_gpt2(tmp_path)
    coverage: dict[str, torch.Tensor] = {}
    for rank in range(world):
        model = make_gpt2(seed=100 + rank)
        fakes = partition(model, monkeypatch, rank, world)
        report = load_partitioned_weights(model, tmp_path)
        assert sorted(report["loaded"]) == sorted(stored) and not report["missing"] and not report["unexpected"]
        check_rank(fakes, stored, coverage)
    # Together the ranks hold every element exactly once.
    for name, counts in coverage.items():
        assert torch.all(counts == 1), f"{name}: elements held by {counts.unique().tolist()} ranks"


def test_mixed_partitioned_and_plain_params_in_sharded_index_with_cast(tmp_path, monkeypatch):
    _, stored = saved_gpt2(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2, "expected several shard files"
    coverage: dict[str, torch.Tensor] = {}
    for rank in range(3):
        model = make_gpt2(seed=7 + rank)
        fakes = partition(model, monkeypatch, rank, 3, dtype=torch.bfloat16, only=lambda name, p: p.dim() == 2)
        load_partitioned_weights(model, tmp_path)
        check_rank(fakes, stored, coverage)
        for name, param in model.named_parameters():
            if param.dim() == 1:
                assert torch.equal(param, stored[name]), name
    assert set(coverage) == {n for n, p in make_gpt2().named_parameters() if p.dim() == 2}


class WithBuffers(nn.Module):
    """Persistent buffers (incl. a 0-d int64 counter) and a non-persistent one that must be left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_buffers_and_plain_params_load_exactly(tmp_path, monkeypatch):
    torch.manual_seed(0)
    source = WithBuffers()
    source.norm.running_mean.normal_()
    source.norm.running_var.uniform_(0.5, 2.0)
    source.norm.num_batches_tracked.fill_(17)
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    torch.manual_seed(1)
    target = WithBuffers()
    target.scratch.fill_(5.0)
    fakes = partition(target, monkeypatch, 1, 2, only=lambda name, p: name == "linear.weight")
    report = load_partitioned_weights(target, tmp_path / "w.safetensors")
    assert not report["missing"] and not report["unexpected"]
    check_rank(fakes, {k: v for k, v in source.state_dict().items()}, {})
    for name, value in source.state_dict().items():
        if name != "linear.weight":
            assert torch.equal(target.state_dict()[name], value), name
    assert torch.equal(target.scratch, torch.full((3,), 5.0))


def test_partitioned_params_never_read_whole(tmp_path, monkeypatch):
    _, stored = saved_gpt2(tmp_path)
    handles: list[RecordingHandle] = []
    real_safe_open = loading.safe_open

    def recording_safe_open(*args, **kwargs):
        handles.append(RecordingHandle(real_safe_open(*args, **kwargs)))
        return handles[-1]

    monkeypatch.setattr(loading, "safe_open", recording_safe_open)
    model = make_gpt2(seed=3)
    fakes = partition(model, monkeypatch, 1, 3, only=lambda name, p: p.dim() == 2)
    load_partitioned_weights(model, tmp_path)
    whole = {key for h in handles for key in h.whole_reads}
    assert whole == {n for n, p in model.named_parameters() if p.dim() == 1}
    rows_read = {}
    for key, index in (r for h in handles for r in h.requests):
        rows_read[key] = rows_read.get(key, 0) + index.stop - index.start
    for name, fake in fakes.items():
        key = "transformer.wte.weight" if name == "lm_head.weight" else name
        row = math.prod(stored[key].shape[1:])
        covering = -(-fake.hi // row) - fake.lo // row if fake.hi > fake.lo else 0
        assert rows_read.get(key, 0) == covering, f"{key}: read {rows_read.get(key)} rows, need {covering}"
    # Rank 1 of 3 holds about a third of the partitioned elements: it must read about a third of the rows.
    all_rows = sum(stored[name].shape[0] for name in fakes if name != "lm_head.weight")
    assert sum(rows_read.values()) < 0.5 * all_rows, f"read {sum(rows_read.values())} of {all_rows} rows"


def test_tied_weight_found_under_its_other_name_and_prefix_variants(tmp_path):
    source, stored = saved_gpt2(tmp_path / "full")
    # Only lm_head.weight stored (not transformer.wte.weight): the tied pair loads from it.
    only_head = {("lm_head.weight" if k == "transformer.wte.weight" else k): v for k, v in stored.items()}
    save_file(only_head, str(tmp_path / "head.safetensors"))
    model = make_gpt2(seed=5)
    report = load_partitioned_weights(model, tmp_path / "head.safetensors")
    assert "lm_head.weight" in report["loaded"] and not report["unexpected"]
    assert torch.equal(model.transformer.wte.weight, source.transformer.wte.weight)
    assert model.lm_head.weight is model.transformer.wte.weight
    # Base-model weights (no "transformer." prefix) into the LM head model, and the reverse.
    from transformers import GPT2Model
    base = GPT2Model(source.config)
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    assert load_partitioned_weights(model, tmp_path / "base")["loaded"][0].startswith("wte")
    assert torch.equal(model.transformer.wpe.weight, base.wpe.weight)
    load_partitioned_weights(base, tmp_path / "full")
    assert torch.equal(base.h[0].attn.c_attn.weight, source.transformer.h[0].attn.c_attn.weight)


# ----- errors ------------------------------------------------------------------------------------


def test_missing_key_strict_and_lenient(tmp_path):
    _, stored = saved_gpt2(tmp_path / "full")
    stored.pop("transformer.h.1.mlp.c_fc.bias")
    stored["extra.thing"] = torch.zeros(2)
    save_file(stored, str(tmp_path / "partial.safetensors"))
    model = make_gpt2(seed=1)
    with pytest.raises(WeightLoadingError, match=r"not found.*transformer\.h\.1\.mlp\.c_fc\.bias.*strict=False"):
        load_partitioned_weights(model, tmp_path / "partial.safetensors")
    before = model.transformer.h[1].mlp.c_fc.bias.clone()
    report = load_partitioned_weights(model, tmp_path / "partial.safetensors", strict=False)
    assert report["missing"] == ["transformer.h.1.mlp.c_fc.bias"] and report["unexpected"] == ["extra.thing"]
    assert torch.equal(model.transformer.h[1].mlp.c_fc.bias, before)


@pytest.mark.parametrize("partitioned", [False, True])
def test_wrong_shape_names_key_file_and_shapes(tmp_path, monkeypatch, partitioned):
    _, stored = saved_gpt2(tmp_path / "full")
    stored["transformer.wpe.weight"] = torch.zeros(16, 32)
    file = tmp_path / "bad.safetensors"
    save_file(stored, str(file))
    model = make_gpt2(seed=1)
    if partitioned:
        partition(model, monkeypatch, 0, 2)
    with pytest.raises(WeightLoadingError) as error:
        load_partitioned_weights(model, file)
    message = str(error.value)
    assert "'transformer.wpe.weight'" in message and str(file) in message
    assert "[16, 32]" in message and "[32, 32]" in message


def test_truncated_unreadable_and_missing_files(tmp_path):
    saved_gpt2(tmp_path / "full")
    data = (tmp_path / "full" / "model.safetensors").read_bytes()
    model = make_gpt2(seed=1)
    for name, content in [("cut.safetensors", data[:-64]), ("tiny.safetensors", data[:5]),
                          ("junk.safetensors", b"not a safetensors file at all")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(WeightLoadingError, match=rf"cannot read safetensors file .*{name}"):
            load_partitioned_weights(model, tmp_path / name)
    with pytest.raises(WeightLoadingError, match=r"no weights at .*nowhere"):
        load_partitioned_weights(model, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightLoadingError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_partitioned_weights(model, tmp_path / "empty")


def test_sharded_index_with_missing_or_truncated_shard(tmp_path):
    saved_gpt2(tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    key, shard = sorted(weight_map.items())[-1]
    data = (tmp_path / shard).read_bytes()
    (tmp_path / shard).write_bytes(data[: len(data) // 2])
    model = make_gpt2(seed=1)
    with pytest.raises(WeightLoadingError, match=rf"cannot read safetensors file .*{shard}"):
        load_partitioned_weights(model, tmp_path)
    (tmp_path / shard).unlink()
    with pytest.raises(WeightLoadingError,
                       match=rf"shard .*{shard} listed in .*index\.json for key '.*' does not exist"):
        load_partitioned_weights(model, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{\"metadata\": {}}")
    with pytest.raises(WeightLoadingError, match=r"weight map of .*index\.json"):
        load_partitioned_weights(model, tmp_path)


def test_real_sharded_params_of_a_world_1_segment(tmp_path):
    """The real ``ShardedParam`` (no fakes): values land in the segment's local shard, in its dtype."""
    from zerotune.zero.stage3.segment import FlatSegment

    _, stored = saved_gpt2(tmp_path)
    model = make_gpt2(seed=9)
    blocks = list(model.transformer.h[0].parameters())
    segment = FlatSegment(blocks, group=None)
    segment.cast_(torch.bfloat16)
    load_partitioned_weights(model, tmp_path)
    names = {id(p): n for n, p in model.named_parameters()}
    expected = torch.cat([stored[names[id(p)]].reshape(-1) for p in blocks]).to(torch.bfloat16)
    assert torch.equal(segment.local[:expected.numel()], expected)
    assert torch.equal(model.transformer.wte.weight, stored["transformer.wte.weight"])
