"""Stalled ranks compare notes: the collective guard's answer to a divergence that deadlocks between guard points.

The guard points (``guard.py``) stop ranks whose phases differ before their data collectives pair. A
divergence *inside* a phase -- a rank issuing a collective of its own, or calling ``backward`` twice --
can instead leave one rank waiting at the next guard point (on the guard's group) while another waits in
the extra data collective (on a data group) for it: neither collective can complete. Left alone, that is
the watchdog's ``comm_timeout_s`` (10 minutes by default).

So the watchdog's thread, once a collective has been pending for ``GRACE_S``, publishes this rank's
record in the rendezvous store (what it waits for, every group's count and recent collectives with their
running CRCs) and reads the records other stalled ranks published. Two records prove a divergence when
  * one rank waits at a guard point, having issued n collectives on a group, while a member of that group
    waits in that group's collective number n or later: a collective the first rank will never issue, or
  * two members' running CRCs differ at a collective index both remember: they paired different ones.
Every stalled rank reaches the verdict from the same records, prints it as ``CollectiveMismatch`` and
exits; a rank whose collective fails because a peer left finds the verdict in the store (``comm.py``).
A slow rank publishes nothing (it is not waiting), so slowness alone is never a verdict; a record is
deleted when its collective completes -- a guard point's by the training thread before it moves on.
The notes are the pending collective's engine's: its guard's record, under its guard's key in the store.
"""

from __future__ import annotations

import json
from typing import Any

from zerotune.distributed.guard import CollectiveGuard, group_lines

SPREAD_S = 2.0
"""How long a rank that reached a verdict stays up before exiting: every other stalled rank's watchdog ticks
(once a second) in that time and reads the verdict, even when this rank hosts the store."""
GRACE_S = 5.0
"""How long a collective waits before its rank publishes its record: far above a healthy skew between
ranks at a phase boundary, far below the watchdog's timeout."""
VERDICT_KEY = "verdict"


class StallNotes:
    """This rank's published record (at most one at a time) and the verdict logic."""

    def __init__(self) -> None:
        self.published: int | None = None  # the watchdog token of the collective our record describes
        self._guard: CollectiveGuard | None = None  # whose store holds it

    def tick(self, token: int | None, entry: Any, waited: float) -> str | None:
        """Called by the watchdog thread every tick with the oldest pending collective (``token`` None when
        nothing is pending; ``entry.guard``: its engine's guard); returns a verdict message, or None."""
        if self.published is not None and self.published != token:
            self.withdraw(self.published)
        guard: CollectiveGuard | None = entry.guard if entry is not None else None
        if guard is None or guard.store is None or token is None or waited < GRACE_S:
            return None
        store = guard.store
        if self.published is None:
            store.set(f"stall/{guard.rank}", json.dumps(_record(guard, token, entry)))
            self.published, self._guard = token, guard
        if store.check([VERDICT_KEY]):
            return store.get(VERDICT_KEY).decode()
        verdict = _verdict(_record(guard, token, entry), _stalled_peers(guard, store))
        if verdict is not None:
            store.set(VERDICT_KEY, verdict)
        return verdict

    def withdraw(self, token: int) -> None:
        """The collective ``token`` completed: our record no longer holds (the training thread calls this for a
        guard point before it moves on, so no peer reads a stale one)."""
        guard = self._guard
        if self.published == token and guard is not None and guard.store is not None:
            self.published = self._guard = None
            try:
                guard.store.delete_key(f"stall/{guard.rank}")
            except Exception:  # noqa: BLE001 - the store left with its host rank: nobody reads the record now
                pass


def published_verdict(guard: CollectiveGuard) -> str | None:
    """The verdict stalled ranks reached in ``guard``'s notes, if any (a rank whose collective failed asks before
    reporting)."""
    store = guard.store
    try:
        return store.get(VERDICT_KEY).decode() if store is not None and store.check([VERDICT_KEY]) else None
    except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
        return None


def _record(guard: CollectiveGuard, token: int, entry: Any) -> dict:
    return {"rank": guard.rank, "token": token, "op": entry.op, "site": entry.site, "phase": entry.phase,
            "pending": list(entry.record) if entry.record else None, "groups": guard.snapshot()}


def _stalled_peers(guard: CollectiveGuard, store: Any) -> list[dict]:
    peers = sorted({rank for _, _, _, ranks in guard.snapshot().values() for rank in ranks} - {guard.rank})
    records = []
    for rank in peers:
        key = f"stall/{rank}"
        if store.check([key]):
            try:
                records.append(json.loads(store.get(key)))
            except Exception:  # noqa: BLE001 - withdrawn between check and get
                continue
    return records


def _waiting(record: dict) -> str:
    if record["phase"] is not None:
        return f"rank {record['rank']} waits at the collective guard before {record['phase']}"
    where = f" (its collective #{record['pending'][1]} on {record['pending'][0]})" if record["pending"] else ""
    return f"rank {record['rank']} waits in {record['op']} issued at {record['site']}{where}"


def _verdict(mine: dict, peers: list[dict]) -> str | None:
    for peer in peers:
        for name in set(mine["groups"]) & set(peer["groups"]):
            if _diverged(name, mine, peer):
                lines = ["ranks issued different collectives; stopping every rank (they would wait for each other "
                         "until comm_timeout_s):", f"  {_waiting(mine)}", f"  {_waiting(peer)}"]
                lines += group_lines(name, {r["rank"]: (r["groups"][name][0], r["groups"][name][2])
                                            for r in (mine, peer)})
                return "\n".join(lines)
    return None


def _diverged(name: str, a: dict, b: dict) -> bool:
    for at_point, other in ((a, b), (b, a)):
        pending = other["pending"]
        if at_point["phase"] is not None and pending is not None and pending[0] == name \
                and pending[1] >= at_point["groups"][name][0]:
            return True
    crcs_a = {index: crc for index, crc, _ in a["groups"][name][2]}
    crcs_b = {index: crc for index, crc, _ in b["groups"][name][2]}
    common = set(crcs_a) & set(crcs_b)
    return bool(common) and crcs_a[max(common)] != crcs_b[max(common)]
