"""``format_resolved``: the table ``zerotune check`` prints."""

from __future__ import annotations

from .pydantic_errors import show_value
from .schema import ZeroTuneConfig
from .tree import iter_leaves


def format_resolved(cfg: ZeroTuneConfig) -> str:
    """One row per leaf: dotted key, value, and where the value came from; then the config's notes
    (legacy keys mapped to their modern form, keys that have no effect here and why)."""
    rows = [("key", "value", "source")]
    for path, value in iter_leaves(cfg):
        source = cfg.provenance.get(path, "default")
        if isinstance(value, str) and value == "auto":
            source = "auto (unresolved)"
        rows.append((path, show_value(value, limit=40), source))
    key_width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [f"{k:<{key_width}}  {v:<{value_width}}  {s}".rstrip() for k, v, s in rows]
    lines.insert(1, f"{'-' * key_width}  {'-' * value_width}  {'-' * 6}")
    if cfg.notes:  # legacy keys rewritten, accepted keys that change nothing: said, never silently dropped
        lines += ["", "notes:"] + [f"  {path}: {message}" for path, message in cfg.notes]
    return "\n".join(lines)
