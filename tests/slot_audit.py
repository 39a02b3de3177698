"""An independent, atomic count of where every slot of a node's buffer is, for tests to check stats() against.

``stats()`` reports counts; this reads the slot containers themselves in one Lua call (atomic on the server) and
checks that they partition the buffer: every slot in exactly one place, none missing, none out of range.
"""

from __future__ import annotations

from typing import Any

import redis

from gigashuffle.keys import QueueKeys

# empty and the leases are lists, full is a set (NOTE [ Slot states ] in scripts.py).
_AUDIT = """
local function members(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'set' then return redis.call('SMEMBERS', key) end
  if kind == 'list' then return redis.call('LRANGE', key, 0, -1) end
  if kind == 'none' then return {} end
  return redis.error_reply('audit: ' .. key .. ' is a ' .. kind)
end
local out = {members(KEYS[1]), members(KEYS[2]), redis.call('HKEYS', KEYS[3])}
for _, key in ipairs(redis.call('KEYS', ARGV[1])) do
  out[#out + 1] = key
  out[#out + 1] = members(key)
end
return out
"""


def audit_slots(url: str, keys: QueueKeys, shuffle_size: int, *, settled: bool = True) -> dict[str, Any]:
    """One atomic look at the slot containers: every slot must be in exactly one of empty, full and one lease.

    Sets or lists alike (a list may not hold a slot twice either). With ``settled`` every lease must also belong
    to a registered process (dead ones were reclaimed).
    """
    with redis.Redis.from_url(url, socket_timeout=10.0) as client:
        raw = client.eval(_AUDIT, 3, keys.empty, keys.full, keys.procs, keys.lease("*"))
    empty = [int(s) for s in raw[0]]
    full = [int(s) for s in raw[1]]
    procs = {p.decode() for p in raw[2]}
    prefix = keys.lease("")
    leases = {raw[i].decode().removeprefix(prefix): [int(s) for s in raw[i + 1]] for i in range(3, len(raw), 2)}
    places: dict[int, list[str]] = {}
    for name, members in [("empty", empty), ("full", full), *leases.items()]:
        for slot in members:
            places.setdefault(slot, []).append(name)
    twice = {slot: where for slot, where in places.items() if len(where) > 1}
    missing = sorted(set(range(shuffle_size)) - set(places))
    stray = sorted(set(places) - set(range(shuffle_size)))
    assert not twice and not missing and not stray, f"slot sets broken: twice={twice} missing={missing} stray={stray}"
    if settled:
        orphans = sorted(set(leases) - procs)
        assert not orphans, f"leases of processes that are not registered (never reclaimed): {orphans}"
    return {"empty": len(empty), "full": len(full), "leased": sum(len(m) for m in leases.values())}
