"""Lua scripts of the control plane: the node session, the buffer's metadata, the stats counters and the node
barrier of a checkpoint's cut (NOTE [ Node cut ] in control/cutbarrier.py).

NOTE [ Control plane ]
Slots are not here: their state lives in the slot table beside the buffer (NOTE [ Slot table ] in
``shm/slottable.py``), so nothing Redis forgets, restores or fails over can contradict it. What Redis keeps is who is
here and what was agreed: rank claims, the session generation, the shared conf, the buffer's HMAC'd metadata, the
process registry and the node's counts, which each trainer's heartbeat records. Scripts that act for a process of
a session check its generation (``ARGV[1]`` against ``KEYS[1]``): after a new node session a stale process gets
``GIGASHUFFLE_STALE``. In the steady state each trainer sends about 1.2 commands a second and none per batch
(NOTE [ Heartbeat ] in control/session.py).
"""

from __future__ import annotations

STALE_MARK = "GIGASHUFFLE_STALE"

_PRELUDE = """
local function check_gen(key, gen)
  local current = redis.call('GET', key)
  if current ~= gen then
    return redis.error_reply('GIGASHUFFLE_STALE generation ' .. tostring(gen) .. ' is not current ('
      .. tostring(current) .. ')')
  end
  return nil
end
"""

PUBLISH_META = (
    _PRELUDE
    + """
-- KEYS: gen, meta
-- ARGV: gen, owner, then meta field/value pairs
-- Publishes the buffer once per session: the first writer with a chunk wins; returns 1 if it won (also when a
-- retry finds its own earlier win), 0 if not.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
if redis.call('EXISTS', KEYS[2]) == 1 then
  if redis.call('HGET', KEYS[2], 'owner') == ARGV[2] then return 1 end
  return 0
end
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
return 1
"""
)

PUBLISH_DUMMY = """
-- KEYS: gen, dummy
-- ARGV: gen, then field/value pairs
-- The dummy batch's row (or the mark that the designated writer has none); the first publication stands.
-- Returns 1: published; 0: an earlier publication stands; -1: the caller's session is gone (its writes must not
-- reach the new one).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 2))
return 1
"""

STATS = """
-- KEYS: gen, counters, procs
-- ARGV: none. Returns {generation or false, full, empty, in flight, processes} (counts as last flushed).
local c = redis.call('HMGET', KEYS[2], 'full', 'empty', 'in_flight')
return {redis.call('GET', KEYS[1]), tonumber(c[1]) or 0, tonumber(c[2]) or 0, tonumber(c[3]) or 0,
        redis.call('HLEN', KEYS[3])}
"""

JOIN = """
-- KEYS: gen, conf, my rank, the node's other ranks..., then every other key of the node (reset on a new session)
-- ARGV: token, lease ms, number of other ranks, conf JSON, a fresh generation '<server run_id>/<random token>'
-- Claims this trainer's rank. The first rank of a node session (no other rank alive) wipes what an earlier,
-- dead session left and starts a new generation (a random token, so no old process can mistake a later session
-- for its own); so does any rank that finds a generation made on another server (this one was restored from a
-- snapshot or is a failed-over replica: what it holds describes processes and buffers that may be gone). Later
-- ranks must agree with the session's conf.
-- Returns {'busy', holder} or {'ok', generation, conf, new_session}.
local server = string.match(ARGV[5], '^[^/]*/') or ''
local current = redis.call('GET', KEYS[1])
local foreign = current and string.sub(current, 1, #server) ~= server
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[1] and not foreign then return {'busy', holder} end
local others = tonumber(ARGV[3])
local alive = 0
for i = 4, 3 + others do alive = alive + redis.call('EXISTS', KEYS[i]) end
if foreign then
  for i = 4, 3 + others do redis.call('DEL', KEYS[i]) end
  alive = 0
end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
if alive == 0 or not current then
  for i = 4 + others, #KEYS do redis.call('DEL', KEYS[i]) end
  redis.call('DEL', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[5])
  redis.call('SET', KEYS[2], ARGV[4])
  return {'ok', ARGV[5], ARGV[4], 1}
end
return {'ok', redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2]) or '', 0}
"""

RESTORE_CLAIM = """
-- KEYS: a rank
-- ARGV: the token a heartbeat wrote, the holder value it overwrote, lease ms
-- Gives a rank's claim back to the trainer whose value a heartbeat's SET overwrote (see NOTE [ Heartbeat ] in
-- control/session.py), unless it changed again meanwhile. Returns 1 if it did.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

RELEASE_RANK = """
-- KEYS: my rank, the node's other ranks..., then every other key of the node
-- ARGV: token, number of other ranks
-- Drops this trainer's claim (if still its own); the last rank of the node deletes every key of the session.
-- Returns 1 if it deleted the session.
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
local others = tonumber(ARGV[2])
for i = 2, 1 + others do if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end end
for i = 2 + others, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""

DROP_STALE_CLAIM = """
-- KEYS: a rank
-- ARGV: the holder value seen
-- Deletes a claim whose holder is known dead, unless someone else took it meanwhile.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

CUT_ARRIVE = """
-- KEYS: the node's cut hash (of this generation), then the claim of every local rank of the node, in local-rank order
-- ARGV: my local rank, my claim token, cut number, phase (0: I gave this cut up), TTL ms, the last phase
-- Records that this trainer reached (cut, phase) of the node's checkpoint cut (NOTE [ Node cut ] in
-- control/cutbarrier.py) and returns, for every local rank that has not, {local rank, its entry or '', status}. An
-- entry '<cut> <phase> <token>' counts only while its token holds that rank's claim now: a dead trainer's, or an
-- earlier job's whose claim lapsed or was taken over, does not. A later cut counts as past the last phase of an
-- earlier one (that rank left it and began the next); before the last phase no rank can be at a later cut unless
-- the ranks numbered their checkpoints differently: such a live entry has status 1. A live entry of this cut at
-- phase 0 (that rank's state_dict() failed before it copied) has status 2: this cut cannot complete.
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
local cut, phase, last = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6])
local missing = {}
for i = 2, #KEYS do
  local entry = redis.call('HGET', KEYS[1], tostring(i - 2))
  local ok, status = false, 0
  if entry then
    local c, p, token = string.match(entry, '^(%d+) (%d+) (.*)$')
    c, p = tonumber(c), tonumber(p)
    local live = c ~= nil and redis.call('GET', KEYS[i]) == token
    ok = live and ((c > cut and phase == last) or (c == cut and p >= phase and p > 0))
    if live and c > cut and phase ~= last then status = 1 end
    if live and c == cut and p == 0 then status = 2 end
  end
  if not ok then
    missing[#missing + 1] = i - 2
    missing[#missing + 1] = entry or ''
    missing[#missing + 1] = status
  end
end
return missing
"""
