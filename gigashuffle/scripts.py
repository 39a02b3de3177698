"""Lua scripts of the slot state machine, one atomic call per transition.

NOTE [ Slot states ]
Every slot is in exactly one place: the ``empty`` set, the ``full`` set, or the ``lease`` set of the one
process that is writing or reading it. Writers move ``empty -> lease -> full``; readers ``full -> lease ->
empty`` (evict_on_read) or ``-> full`` again. A dead process's lease is reclaimed: a writer's slots go back to
``empty`` (their rows may be torn), a reader's back to ``full`` (it never delivered them) unless evict() marked
them. Slot lists travel packed as little-endian int32 strings and are decoded with numpy on the client.

Each cycle script first hands back what the caller's lease still holds beyond what it commits: if a reply was
lost and redis-py retried the call, the retry returns the same slots instead of leaking them, so retries are
safe. (One exception: with evict_on_read=False a lost reader reply may have re-picked slots the call returned;
the retry returns those once more and tops the batch up from ``full``, so the reader gets a different but
whole batch, and no slot is lost.) Every script checks the generation (``ARGV[1]`` against ``KEYS[1]``): after
a Redis restart or a new node session, a stale process gets ``GIGASHUFFLE_STALE`` instead of touching slots it
no longer owns.
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
local function pack_slots(t)
  local parts = {}
  for i = 1, #t do parts[i] = struct.pack('<i4', tonumber(t[i])) end
  return table.concat(parts)
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
-- ARGV: gen, slots, then meta field/value pairs
-- Publishes the buffer once per session: the first writer with a chunk wins; returns 1 if it won, 0 if not.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
local slots = tonumber(ARGV[2])
for first = 0, slots - 1, 4000 do
  local ids = {}
  for s = first, math.min(first + 3999, slots - 1) do ids[#ids + 1] = s end
  redis.call('SADD', KEYS[3], unpack(ids))
end
return 1
"""
)

WRITER_CYCLE = (
    _PRELUDE
    + """
-- KEYS: gen, empty, full, lease
-- ARGV: gen, packed slots written since the last call, number of empty slots wanted
-- Publishes the written slots, then returns the caller's lease topped up to the wanted count from empty.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
local written = take_members(KEYS[4], unpack_slots(ARGV[2]))
if #written > 0 then each_slice('SADD', KEYS[3], written) end
local want = tonumber(ARGV[3])
local held = redis.call('SMEMBERS', KEYS[4])
if #held < want then
  local got = redis.call('SPOP', KEYS[2], want - #held)
  if #got > 0 then
    each_slice('SADD', KEYS[4], got)
    for i = 1, #got do held[#held + 1] = got[i] end
  end
end
return pack_slots(held)
"""
)

READER_CYCLE = (
    _PRELUDE
    + """
-- KEYS: gen, empty, full, lease, reading, evict
-- ARGV: gen, packed slots read since the last call, batch size wanted (0: none), full slots needed, evict flag
-- Returns the read slots to empty (evict_on_read) or full, then hands out a batch of random full slots once at
-- least the mixing threshold is full; a batch still leased from a lost reply is handed out again first.
local err = check_gen(KEYS[1], ARGV[1]); if err then return err end
local done = take_members(KEYS[4], unpack_slots(ARGV[2]))
if #done > 0 then
  if ARGV[5] == '1' then
    each_slice('SADD', KEYS[2], done)
  else
    each_slice('SREM', KEYS[5], done)
    local evicted = take_members(KEYS[6], done)
    local gone = {}
    for i = 1, #evicted do gone[tostring(evicted[i])] = true end
    local back = {}
    for i = 1, #done do if not gone[tostring(done[i])] then back[#back + 1] = done[i] end end
    if #evicted > 0 then each_slice('SADD', KEYS[2], evicted) end
    if #back > 0 then each_slice('SADD', KEYS[3], back) end
  end
end
local held = redis.call('SMEMBERS', KEYS[4])
local want = tonumber(ARGV[3])
if #held > 0 then
  -- A retry whose lost reply had re-picked some of the slots it returns (evict_on_read=False) has just returned
  -- those again: top the batch up from full, so that the reader still gets a whole batch.
  if #done > 0 and #held < want then
    local more = redis.call('SPOP', KEYS[3], want - #held)
    if #more > 0 then
      each_slice('SADD', KEYS[4], more)
      if ARGV[5] ~= '1' then each_slice('SADD', KEYS[5], more) end
      for i = 1, #more do held[#held + 1] = more[i] end
    end
  end
  return pack_slots(held)
end
if want == 0 or redis.call('SCARD', KEYS[3]) < tonumber(ARGV[4]) then return '' end
local got = redis.call('SPOP', KEYS[3], want)
each_slice('SADD', KEYS[4], got)
if ARGV[5] ~= '1' then each_slice('SADD', KEYS[5], got) end
return pack_slots(got)
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
if #now > 0 then each_slice('SADD', KEYS[2], now) end
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
local held = redis.call('SMEMBERS', KEYS[4])
if #held > 0 then
  local evicted = take_members(KEYS[7], held)
  if ARGV[3] == 'writer' then
    each_slice('SADD', KEYS[2], held)
  else
    local gone = {}
    for i = 1, #evicted do gone[evicted[i]] = true end
    local back = {}
    for i = 1, #held do if not gone[held[i]] then back[#back + 1] = held[i] end end
    if #evicted > 0 then each_slice('SADD', KEYS[2], evicted) end
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
return {redis.call('GET', KEYS[1]), redis.call('SCARD', KEYS[2]), redis.call('SCARD', KEYS[3]),
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
