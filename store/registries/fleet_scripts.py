"""The fleet registry's transitions as Redis Lua scripts (fleet_registry.py runs them): each
is atomic on the server, so a claim, its facts and its job, or a build's update and the check
that its job is still the context's, can never be seen half done."""

# The caller found no artifact in the object store, so a READY entry is stale (or its build
# ended a moment ago: the job is then a no-op, the indexer finding the artifact stored).
ENQUEUE = """
if not redis.call('set', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'BUILDING' end
redis.call('del', KEYS[1])
redis.call('hset', KEYS[1], 'state', 'BUILDING', 'job_id', ARGV[1], 'spec', ARGV[3], 'tenant', ARGV[4],
           'n_tokens', ARGV[5], 'progress', '0', 'attempts', '0', 'updated_at', ARGV[6])
redis.call('xadd', KEYS[3], '*', 'context_id', ARGV[7], 'job_id', ARGV[1], 'tokens', ARGV[8])
return 'QUEUED'
"""
# the job's own entry, still BUILDING: the only state a build may touch
OURS = """
local h = redis.call('hmget', KEYS[1], 'job_id', 'state')
if h[1] ~= ARGV[1] or h[2] ~= 'BUILDING' then return 0 end
"""
START = OURS + """
redis.call('hset', KEYS[1], 'indexer', ARGV[2], 'updated_at', ARGV[4])
redis.call('pexpire', KEYS[2], ARGV[3])
return redis.call('hincrby', KEYS[1], 'attempts', 1)
"""
PROGRESS = OURS + """
redis.call('hset', KEYS[1], 'progress', ARGV[2], 'updated_at', ARGV[4])
redis.call('pexpire', KEYS[2], ARGV[3])
return 1
"""
FINISH = OURS + """
redis.call('hset', KEYS[1], 'state', ARGV[2], 'uri', ARGV[3], 'error', ARGV[4], 'progress', ARGV[5],
           'updated_at', ARGV[6])
redis.call('del', KEYS[2])
return 1
"""
DELETE = """
local prev = redis.call('hget', KEYS[1], 'state')
redis.call('del', KEYS[1], KEYS[2], KEYS[3])
redis.call('hset', KEYS[1], 'state', 'DELETED', 'updated_at', ARGV[2])
redis.call('pexpire', KEYS[1], ARGV[1])
redis.call('publish', ARGV[3], 'deleted ' .. ARGV[4])
return prev or ''
"""
# reconcile: an artifact in the object store is READY unless deleted or being built
RECORD = """
local state = redis.call('hget', KEYS[1], 'state')
if state == 'DELETED' then return 'DELETED' end
if state == 'DAMAGED' then return 'DAMAGED' end
if state == 'READY' or (state == 'BUILDING' and redis.call('exists', KEYS[2]) == 1) then return 'KEPT' end
redis.call('del', KEYS[1])
redis.call('hset', KEYS[1], 'state', 'READY', 'uri', ARGV[1], 'tenant', ARGV[2], 'n_tokens', ARGV[3],
           'progress', '1', 'updated_at', ARGV[4])
return 'ADDED'
"""
# a stored object failed its check: DAMAGED (kept until a Put rebuilds it or a delete), unless a
# build is replacing it or it was deleted; the set lists the damaged ids for ListContexts
DAMAGE = """
local state = redis.call('hget', KEYS[1], 'state')
if state == 'DELETED' or state == 'BUILDING' then return 0 end
redis.call('hset', KEYS[1], 'state', 'DAMAGED', 'error', ARGV[1], 'updated_at', ARGV[2], 'progress', '0')
if state == false and ARGV[3] ~= '' then redis.call('hset', KEYS[1], 'tenant', ARGV[3]) end
redis.call('sadd', KEYS[2], ARGV[4])
return 1
"""
# reconcile: a build nobody holds (its claim lapsed) whose job left the stream is lost: FAILED,
# so its waiters stop and the next Put builds it again (a new job takes the claim first)
LOST = OURS + """
if redis.call('exists', KEYS[2]) == 1 then return 0 end
redis.call('hset', KEYS[1], 'state', 'FAILED', 'error', ARGV[2], 'updated_at', ARGV[3])
return 1
"""
# reconcile: a READY entry whose object is gone goes, unless it changed since it was read
DROP_READY = """
local h = redis.call('hmget', KEYS[1], 'state', 'updated_at')
if h[1] ~= 'READY' or tonumber(h[2]) ~= tonumber(ARGV[1]) then return 0 end
redis.call('del', KEYS[1], KEYS[2])
return 1
"""
# periodic upkeep (GC): due if the fleet's last run is at least ARGV[1] ms old by the server's
# clock, which every worker shares; the caller that finds it due runs it
DUE = """
local t = redis.call('time')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local last = tonumber(redis.call('get', KEYS[1]) or '0')
if now - last < tonumber(ARGV[1]) then return 0 end
redis.call('set', KEYS[1], now)
return 1
"""
# the job ids on the build stream (its entries also carry packed tokens: not sent back)
JOB_IDS = """
local out = {}
for _, e in ipairs(redis.call('xrange', KEYS[1], '-', '+')) do
  local f = e[2]
  for i = 1, #f, 2 do if f[i] == 'job_id' then out[#out + 1] = f[i + 1] end end
end
return out
"""
