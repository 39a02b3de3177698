"""Lua scripts of the slot state machine, one atomic call per transition.

NOTE [ Slot states ]
Every slot is in exactly one place: the ``empty`` list, the ``full`` set, or the ``lease`` list of the one
process that is writing or reading it. Writers move ``empty -> lease -> full``; readers ``full -> lease ->
empty`` (evict_on_read) or ``-> full`` again. A dead process's lease is reclaimed: a writer's slots go back to
``empty`` (their rows may be torn), a reader's back to ``full`` (it never delivered them) unless evict() marked
them.

Why these types: readers need uniformly random full slots, which only ``SPOP`` on a set gives; writers may fill
any empty slot, so ``empty`` is a list (``LPOP``/``RPUSH`` cost a fraction of a set's random pop per slot). A
lease is a list in the order the slots were handed out, so a process reports what it finished as "the first
``n`` of my lease, starting with slot ``s``" instead of sending the ids back: the hot path never packs or
unpacks a slot id in Lua. Slot ids come back to the client as one comma-separated string, parsed by numpy.

A call that finds its lease head is not ``s`` commits nothing: that is what makes a retried call (redis-py
retries after a lost reply) harmless, since the first execution already moved slot ``s`` out of the lease and
no other slot of the same call can bring it back to the head. Each cycle then hands back what the lease still
holds before topping it up, so a retry returns the same slots instead of leaking them. (One exception: with
evict_on_read=False a reader's returned batch goes back to ``full``, a new batch may start with the same slot, and
a retry then returns that batch and hands out another whole one; no slot is lost or read twice.) Every script checks the
generation (``ARGV[1]`` against ``KEYS[1]``): after a Redis restart or a new node session, a stale process gets
``GIGASHUFFLE_STALE`` instead of touching slots it no longer owns.
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
local function unpack_slots(s)
  local out = {}
  for i = 1, #s, 4 do out[#out + 1] = struct.unpack('<i4', s, i) end
  return out
end
-- Variadic commands in slices: Lua's unpack() is limited by the C stack.
local function each_slice(cmd, key, t)
  local n = 0
  for i = 1, #t, 4000 do n = n + redis.call(cmd, key, unpack(t, i, math.min(i + 3999, #t))) end
  return n
end
-- The members of t that are in set key, removed from it.
local function take_members(key, t)
  local kept = {}
  for i = 1, #t, 4000 do
    local slice = {unpack(t, i, math.min(i + 3999, #t))}
    local there = redis.call('SMISMEMBER', key, unpack(slice))
    for j = 1, #slice do if there[j] == 1 then kept[#kept + 1] = slice[j] end end
  end
  if #kept > 0 then each_slice('SREM', key, kept) end
  return kept
end
"""

SEED = (
    _PRELUDE
    + """
-- KEYS: gen, meta, empty
-- ARGV: gen, slots, owner, then meta field/value pairs
-- Publishes the buffer once per session: the first writer with a chunk wins; returns 1 if it won (also when a
-- retry finds its own earlier win), 0 if not.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
if redis.call('EXISTS', KEYS[2]) == 1 then
  if redis.call('HGET', KEYS[2], 'owner') == ARGV[3] then return 1 end
  return 0
end
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
local slots = tonumber(ARGV[2])
for first = 0, slots - 1, 4000 do
  local ids = {}
  for s = first, math.min(first + 3999, slots - 1) do ids[#ids + 1] = s end
  redis.call('RPUSH', KEYS[3], unpack(ids))
end
return 1
"""
)

WRITER_CYCLE = (
    _PRELUDE
    + """
-- KEYS: gen, empty, full, lease, counters
-- ARGV: gen, how many slots at the head of the lease were written, the first of them, empty slots wanted
-- Publishes the written slots, then returns the lease topped up to the wanted count from empty.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
local written = tonumber(ARGV[2])
if written > 0 and redis.call('LINDEX', KEYS[4], 0) == ARGV[3] then
  local done = redis.call('LPOP', KEYS[4], written)
  each_slice('SADD', KEYS[3], done)
  redis.call('HINCRBY', KEYS[5], 'written', #done)
end
local want = tonumber(ARGV[4])
local held = redis.call('LLEN', KEYS[4])
if held < want then
  local got = redis.call('LPOP', KEYS[2], want - held)
  if got then each_slice('RPUSH', KEYS[4], got) end
end
return table.concat(redis.call('LRANGE', KEYS[4], 0, -1), ',')
"""
)

READER_CYCLE = (
    _PRELUDE
    + """
-- KEYS: gen, empty, full, lease, reading, evict, counters
-- ARGV: gen, first slot of the batch read since the last call ('' if none), batch size wanted (0: none),
--       full slots needed, evict flag
-- Returns the batch read to empty (evict_on_read) or to full (less slots evict() marked meanwhile, which go to
-- empty), then hands out bs random full slots once at least the mixing threshold is full. A batch still leased
-- from a lost reply is handed out again instead.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
if ARGV[2] ~= '' and redis.call('LINDEX', KEYS[4], 0) == ARGV[2] then
  local done = redis.call('LRANGE', KEYS[4], 0, -1)
  redis.call('DEL', KEYS[4])
  redis.call('HINCRBY', KEYS[7], 'read', #done)
  if ARGV[5] == '1' then
    each_slice('RPUSH', KEYS[2], done)
  else
    each_slice('SREM', KEYS[5], done)
    local evicted = take_members(KEYS[6], done)
    local gone = {}
    for i = 1, #evicted do gone[evicted[i]] = true end
    local back = {}
    for i = 1, #done do if not gone[done[i]] then back[#back + 1] = done[i] end end
    if #evicted > 0 then each_slice('RPUSH', KEYS[2], evicted) end
    if #back > 0 then each_slice('SADD', KEYS[3], back) end
  end
end
if redis.call('LLEN', KEYS[4]) > 0 then return table.concat(redis.call('LRANGE', KEYS[4], 0, -1), ',') end
local want = tonumber(ARGV[3])
if want == 0 or redis.call('SCARD', KEYS[3]) < tonumber(ARGV[4]) then return '' end
local got = redis.call('SPOP', KEYS[3], want)
each_slice('RPUSH', KEYS[4], got)
if ARGV[5] ~= '1' then each_slice('SADD', KEYS[5], got) end
return table.concat(got, ',')
"""
)

EVICT = (
    _PRELUDE
    + """
-- KEYS: gen, empty, full, reading, evict
-- ARGV: gen, packed slots
-- Full slots become empty now; slots being read become empty when their reader returns them. Returns how many
-- slots were evicted or scheduled for eviction.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
local wanted = unpack_slots(ARGV[2])
local now = take_members(KEYS[3], wanted)
if #now > 0 then each_slice('RPUSH', KEYS[2], now) end
local later = {}
for i = 1, #wanted, 4000 do
  local slice = {unpack(wanted, i, math.min(i + 3999, #wanted))}
  local there = redis.call('SMISMEMBER', KEYS[4], unpack(slice))
  for j = 1, #slice do if there[j] == 1 then later[#later + 1] = slice[j] end end
end
if #later > 0 then each_slice('SADD', KEYS[5], later) end
return #now + #later
"""
)

RECLAIM = (
    _PRELUDE
    + """
-- KEYS: gen, empty, full, lease, reading, procs, evict
-- ARGV: gen, process id, 'writer' or 'reader'
-- Returns a dead process's slots: a writer's to empty (rows may be torn), a reader's to full (never delivered),
-- except those evicted while it read them, which go to empty as their reader would have sent them.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
local held = redis.call('LRANGE', KEYS[4], 0, -1)
if #held > 0 then
  local evicted = take_members(KEYS[7], held)
  if ARGV[3] == 'writer' then
    each_slice('RPUSH', KEYS[2], held)
  else
    local gone = {}
    for i = 1, #evicted do gone[evicted[i]] = true end
    local back = {}
    for i = 1, #held do if not gone[held[i]] then back[#back + 1] = held[i] end end
    if #evicted > 0 then each_slice('RPUSH', KEYS[2], evicted) end
    if #back > 0 then each_slice('SADD', KEYS[3], back) end
  end
  each_slice('SREM', KEYS[5], held)
end
redis.call('DEL', KEYS[4])
redis.call('HDEL', KEYS[6], ARGV[2])
return #held
"""
)

STATS = """
-- KEYS: gen, full, empty, procs
-- ARGV: none. Returns {generation or false, full, empty, processes}.
return {redis.call('GET', KEYS[1]), redis.call('SCARD', KEYS[2]), redis.call('LLEN', KEYS[3]),
        redis.call('HLEN', KEYS[4])}
"""

JOIN = """
-- KEYS: gen, conf, my rank, the node's other ranks..., then every other key of the node (reset on a new session)
-- ARGV: token, lease ms, number of other ranks, conf JSON, a fresh generation token
-- Claims this trainer's rank. The first rank of a node session (no other rank alive) wipes what an earlier,
-- dead session left and starts a new generation (a random token, so no old process can mistake a later session
-- for its own); later ranks must agree with the session's conf.
-- Returns {'busy', holder} or {'ok', generation, conf, new_session}.
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[1] then return {'busy', holder} end
local others = tonumber(ARGV[3])
local alive = 0
for i = 4, 3 + others do alive = alive + redis.call('EXISTS', KEYS[i]) end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
if alive == 0 or redis.call('EXISTS', KEYS[1]) == 0 then
  for i = 4 + others, #KEYS do redis.call('DEL', KEYS[i]) end
  redis.call('DEL', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[5])
  redis.call('SET', KEYS[2], ARGV[4])
  return {'ok', ARGV[5], ARGV[4], 1}
end
return {'ok', redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2]) or '', 0}
"""

HEARTBEAT = """
-- KEYS: my rank, gen
-- ARGV: token, lease ms, gen
-- Extends this trainer's claim. Returns 1, or 0 when the claim or the generation is gone (Redis lost its data
-- or another trainer took the rank).
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('GET', KEYS[2]) ~= ARGV[3] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
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
