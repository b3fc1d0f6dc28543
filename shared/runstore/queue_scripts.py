"""The Lua scripts of the work queue (`shared.runstore.queues`): each state change of a task is one of
these, run atomically by Redis. Key and argument order are given above each."""

# KEYS: tasks pending pending:policy [record]; ARGV: policy_eval_prefix, number of record fields,
# the record's field/value pairs, then (id, task bytes) pairs. Each task is queued unless its id is
# (1 or 0 for each, in order) into its pool's list (by its id); the record is written in the same
# step: a producer's cursor moves exactly when its tasks are queued.
SUBMIT = """
local prefix, fields = ARGV[1], tonumber(ARGV[2])
local out = {}
for i = 3 + 2 * fields, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HSETNX', KEYS[1], id, ARGV[i + 1]) == 1 then
    if string.sub(id, 1, #prefix) == prefix then
      redis.call('LPUSH', KEYS[3], id)
    else
      redis.call('LPUSH', KEYS[2], id)
    end
    table.insert(out, 1)
  else
    table.insert(out, 0)
  end
end
if fields > 0 then
  redis.call('HSET', KEYS[4], unpack(ARGV, 3, 2 + 2 * fields))
end
return out
"""

# KEYS: pending leases owners tasks attempts completed dead dead_counts; ARGV: now_ms lease_ms
# replica count maxlen. A pending id without a task record is dead-lettered with the reason:
# `duplicate` when the task was completed already (a second copy of its id), else `no_record`.
LEASE = """
local out = {}
for i = 1, tonumber(ARGV[4]) do
  local id = redis.call('RPOP', KEYS[1])
  if not id then break end
  local task = redis.call('HGET', KEYS[4], id)
  if task then
    redis.call('ZADD', KEYS[2], tonumber(ARGV[1]) + tonumber(ARGV[2]), id)
    redis.call('HSET', KEYS[3], id, ARGV[3])
    table.insert(out, id)
    table.insert(out, task)
    table.insert(out, redis.call('HGET', KEYS[5], id) or '0')
  else
    local stamp = redis.call('HGET', KEYS[6], id)
    local code, reason = 'no_record', 'a pending task id without a task record'
    if stamp then
      code, reason = 'duplicate', 'pending again after the lease ' .. stamp .. ' completed it'
    end
    redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[5], '*', 'task_id', id, 'code', code, 'reason', reason,
      'task', '', 'replica', ARGV[3])
    redis.call('HINCRBY', KEYS[8], code, 1)
  end
end
return out
"""

# KEYS: leases owners; ARGV: now_ms lease_ms replica id...
EXTEND = """
local kept = 0
for i = 4, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[3] then
    redis.call('ZADD', KEYS[1], 'XX', tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[i])
    kept = kept + 1
  end
end
return kept
"""

# KEYS: leases owners tasks attempts completed rollouts evals errors; ARGV: replica, then for each
# task: id, stream ('r': rollouts, 'e': evals), N, r1 ... rN. Each task on its own: published and its
# lease ended only while the replica owns the lease (N for it), else nothing (-1 for it). Each entry
# carries the lease stamp (`replica|attempt` of the lease being completed) and n, the number of
# rollouts published together.
COMPLETE = """
local replica = ARGV[1]
local out = {}
local i = 2
while i <= #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 2])
  local stream = ARGV[i + 1] == 'e' and KEYS[7] or KEYS[6]
  local first = i + 3
  i = first + n
  if redis.call('HGET', KEYS[2], id) ~= replica then
    table.insert(out, -1)
  else
    local stamp = replica .. '|' .. (redis.call('HGET', KEYS[4], id) or '0')
    for j = first, first + n - 1 do
      redis.call('XADD', stream, '*', 'task', id, 'lease', stamp, 'n', tostring(n), 'r', ARGV[j])
    end
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[4], id)
    redis.call('HDEL', KEYS[8], id)
    redis.call('HSET', KEYS[5], id, stamp)
    table.insert(out, n)
  end
end
return out
"""

# KEYS: leases owners errors; ARGV: id replica reason. Ends the lease now; the next sweep counts
# the attempt (and names the reason if the task runs out of attempts).
FAIL = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[3], ARGV[1], ARGV[3]) end
return 1
"""

# KEYS: leases owners attempts pending tasks dead errors dead_counts pending:policy;
# ARGV: now_ms max_attempts maxlen policy_eval_prefix (a task whose id starts with it goes back to
# the policy-eval pool's list)
REQUEUE = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local requeued, dead = 0, 0
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local owner = redis.call('HGET', KEYS[2], id) or ''
  redis.call('HDEL', KEYS[2], id)
  local attempts = redis.call('HINCRBY', KEYS[3], id, 1)
  if attempts > tonumber(ARGV[2]) then
    local task = redis.call('HGET', KEYS[5], id) or ''
    local last = redis.call('HGET', KEYS[7], id)
    local message = 'lease expired or failed ' .. attempts .. ' times (last replica ' .. owner .. ')'
    if last then message = message .. '; last error: ' .. last end
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[3], '*', 'task_id', id, 'code', 'attempts',
      'reason', message, 'task', task)
    redis.call('HINCRBY', KEYS[8], 'attempts', 1)
    redis.call('HDEL', KEYS[5], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[7], id)
    dead = dead + 1
  elseif string.sub(id, 1, #ARGV[4]) == ARGV[4] then
    redis.call('RPUSH', KEYS[9], id)
    requeued = requeued + 1
  else
    redis.call('RPUSH', KEYS[4], id)
    requeued = requeued + 1
  end
end
return {requeued, dead}
"""

# KEYS: tasks leases owners attempts errors dead dead_counts; ARGV: id replica code message maxlen.
# Only the replica holding the lease may give the task up.
DEAD_LETTER = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
local task = redis.call('HGET', KEYS[1], ARGV[1]) or ''
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*', 'task_id', ARGV[1], 'code', ARGV[3],
  'reason', ARGV[4], 'task', task, 'replica', ARGV[2])
redis.call('HINCRBY', KEYS[7], ARGV[3], 1)
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 1
"""

# KEYS: leases pending; ARGV: policy_eval prefix, eval prefix. {leased tasks of the rollouts pool,
# leased of π's pool, of the rollouts pool's: μ's eval tasks leased, μ's eval tasks pending},
# counted in one step so the pools always add up to the leases.
DEPTHS_BY_KIND = """
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local policy, eval = 0, 0
for _, id in ipairs(ids) do
  if string.sub(id, 1, #ARGV[1]) == ARGV[1] then policy = policy + 1
  elseif string.sub(id, 1, #ARGV[2]) == ARGV[2] then eval = eval + 1 end
end
local pending_eval = 0
for _, id in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if string.sub(id, 1, #ARGV[2]) == ARGV[2] then pending_eval = pending_eval + 1 end
end
return {#ids - policy, policy, eval, pending_eval}
"""

# KEYS: owners tasks attempts leases; ARGV: replica now_ms lease_ms known ids... Every task the
# owners hash gives to `replica` that it does not know it holds (a lease whose reply was lost:
# the call timed out, then Redis ran it) with a fresh deadline: (id, task, attempt) triples.
RECLAIM = """
local known = {}
for i = 4, #ARGV do known[ARGV[i]] = true end
local out = {}
local owners = redis.call('HGETALL', KEYS[1])
for i = 1, #owners, 2 do
  local id = owners[i]
  if owners[i + 1] == ARGV[1] and not known[id] then
    local task = redis.call('HGET', KEYS[2], id)
    if task then
      redis.call('ZADD', KEYS[4], tonumber(ARGV[2]) + tonumber(ARGV[3]), id)
      table.insert(out, id)
      table.insert(out, task)
      table.insert(out, redis.call('HGET', KEYS[3], id) or '0')
    end
  end
end
return out
"""

# KEYS: tasks completed; ARGV: prefix first last. The ids prefix..i for first <= i < last with neither a
# task record nor a completed stamp, counted in Redis (one call, not two commands an id).
UNKNOWN = """
local out = {}
for i = tonumber(ARGV[2]), tonumber(ARGV[3]) - 1 do
  local id = ARGV[1] .. i
  if redis.call('HEXISTS', KEYS[1], id) == 0 and redis.call('HEXISTS', KEYS[2], id) == 0 then
    table.insert(out, id)
  end
end
return out
"""
