"""``TiledLinear``: one big linear layer as ``out_splits x in_splits`` smaller ones, for ZeRO-3.

Why: ZeRO-3 gathers a communication unit's parameters whole (``stage3/wrap.py``: outside a Hugging
Face block, every module that owns parameters is a unit). A huge ``nn.Linear`` is one unit, so its
whole weight is in memory at once on every rank. Here each tile is its own ``nn.Linear`` (its own
unit), so only one tile's weight is gathered at a time, at the cost of smaller matmuls and more,
smaller collectives. Use as few tiles as the memory needs.

Math (exactly ``nn.Linear`` up to float summation order): the input's last dimension is cut at
``in_parts``, the output's at ``out_parts``; tile ``[o][i]`` holds ``W[out_parts[o]:out_parts[o+1],
in_parts[i]:in_parts[i+1]]``, and output split ``o`` is the sum over ``i`` of tile ``[o][i]`` applied to
input split ``i``. Only the last tile of each row (``i == in_splits - 1``) has a bias (the bias is
added once). Splits are as even as possible, the larger ones first.
"""

from __future__ import annotations

from typing import Any, Sequence, cast

import torch

from zerotune.zero.stage3.gathered import GatheredParameters


def uniform_boundaries(items: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries of ``items`` cut into ``parts`` runs whose sizes differ by at most one, the
    larger first: ``uniform_boundaries(10, 4) == [0, 3, 6, 8, 10]``."""
    size, extra = divmod(items, parts)
    return [part * size + min(part, extra) for part in range(parts + 1)]


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: Sequence[int] | int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """``torch.split`` along the last dimension (``partitions``: the chunks' sizes, or one size for all);
    ``contiguous_split_chunks`` copies each chunk into contiguous memory."""
    chunks = torch.split(tensor, partitions, dim=tensor.dim() - 1)  # type: ignore[arg-type]
    return tuple(chunk.contiguous() for chunk in chunks) if contiguous_split_chunks else chunks


class TiledLinear(torch.nn.Module):
    """A drop-in ``nn.Linear(in_features, out_features, bias)`` made of tiles (see the module docstring).

    ``input_is_already_split``: ``forward`` takes the ``in_splits`` input chunks (a sequence) instead of
    one tensor. ``combine_out_splits=False``: ``forward`` returns the ``out_splits`` output chunks as a list
    instead of concatenating them. ``linear_cls(in, out, bias=..., **kwargs)`` builds each tile (default
    ``nn.Linear``). ``init_linear``: a linear layer of the full size whose parameters are copied in.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type[torch.nn.Module] = torch.nn.Linear, init_linear: torch.nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        # RuntimeError as DeepSpeed's TiledLinear raises: code catching it keeps working
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"TiledLinear: in_splits must be in [1, in_features={in_features}], got {in_splits}")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"TiledLinear: out_splits must be in [1, out_features={out_features}], "
                               f"got {out_splits}")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = uniform_boundaries(in_features, in_splits)
        self.out_parts = uniform_boundaries(out_features, out_splits)
        self.linears = torch.nn.ModuleList(
            torch.nn.ModuleList(
                linear_cls(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o],
                           bias=bias and i == in_splits - 1, **kwargs)
                for i in range(in_splits))
            for o in range(out_splits))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: input_is_already_split with in_splits={self.in_splits}, "
                                 f"but forward got {len(inputs)} input chunks")
        else:
            inputs = list(self._split_global_input(input_, [self.in_parts[i + 1] - self.in_parts[i]
                                                            for i in range(self.in_splits)]))
        outputs: list[Any] = []
        for row in self._rows():
            out: Any = None
            for in_id, (tile, chunk) in enumerate(zip(row, inputs)):
                out = self._reduce_local_output(in_id, len(outputs), out, tile(chunk))
            outputs.append(out)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _rows(self) -> list[torch.nn.ModuleList]:
        """``self.linears``: row ``o`` holds the tiles of output split ``o``, one per input split."""
        return [cast(torch.nn.ModuleList, row) for row in self.linears]

    def _split_global_input(self, input: torch.Tensor, split_sizes: list[int]) -> Sequence[Any]:
        """The input's chunks along its last dimension (override for other input types)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Add tile ``[out_id][in_id]``'s result into its output split's running sum (override for other types)."""
        del in_id, out_id
        # the first term is cloned: a tile's output may be a view, and later additions must not write into it
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """The output splits joined along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy a full-size linear layer's ``weight`` (and ``bias``) into the tiles.

        Under ZeRO-3 this is collective: each tile is gathered, data-parallel rank 0's copy is what every rank
        keeps (``GatheredParameters(modifier_rank=0)``), and a partitioned ``other`` is gathered to be read.
        """
        weight, bias = getattr(other, "weight", None), getattr(other, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"TiledLinear.copy_params_from: {type(other).__name__} has no weight tensor")
        with GatheredParameters([p for p in (weight, bias) if p is not None]):
            if tuple(weight.shape) != (self.out_features, self.in_features):
                raise ValueError(f"TiledLinear.copy_params_from: weight of shape {tuple(weight.shape)}, expected "
                                 f"({self.out_features}, {self.in_features})")
            if self.use_bias != (bias is not None) or (bias is not None and tuple(bias.shape) != (self.out_features,)):
                raise ValueError(f"TiledLinear.copy_params_from: bias {None if bias is None else tuple(bias.shape)}, "
                                 f"expected {(self.out_features,) if self.use_bias else None}")
            for o, row in enumerate(self._rows()):
                rows = slice(self.out_parts[o], self.out_parts[o + 1])
                for i, tile in enumerate(row):
                    cols = slice(self.in_parts[i], self.in_parts[i + 1])
                    tile_weight, tile_bias = cast(torch.Tensor, tile.weight), getattr(tile, "bias", None)
                    with GatheredParameters([p for p in (tile_weight, tile_bias) if p is not None], modifier_rank=0):
                        tile_weight.copy_(weight[rows, cols])
                        if tile_bias is not None:
                            tile_bias.copy_(cast(torch.Tensor, bias)[rows])  # (use_bias: checked above)


class TiledLinearReturnBias(TiledLinear):
    """``TiledLinear`` over tiles that return ``(output, bias)`` without adding the bias (Megatron-LM's linear
    layers defer it to fuse it with the next kernel): returns ``(output, bias)`` too, the bias concatenated
    from the tiles that have one (None when none has)."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise TypeError(f"TiledLinearReturnBias: tile [{out_id}][{in_id}] must return (output, bias), got "
                            f"{type(new_out).__name__}")
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, new_out[0])
        return tensor, new_out[1] if new_out[1] is not None else old_bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([out for out, _ in outputs])
        biases = [bias for _, bias in outputs if bias is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None
