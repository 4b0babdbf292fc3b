-- One tenant's rate limits and shared budget holds, and its API key's own, in one atomic step.
-- Called by policies/rate_limiter_redis.py (EVALSHA; loaded again on NOSCRIPT).
--
-- KEYS[1] requests bucket, KEYS[2] tokens bucket: hashes {level, ts_us}; a missing bucket is full.
-- KEYS[3] leases: sorted set of lease id -> expiry (ms); a lease not renewed in time frees its slot.
-- KEYS[4] cancelled: sorted set of lease id -> expiry (ms) of admissions cancelled before they ran
--   (and of adopted leases dropped before their adoption arrived).
-- KEYS[5] budget: hash {period, used}: the tokens the tenant used in its budget's month, as the
--   replicas' releases and their ledgers' totals report them.
-- KEYS[6] holds: hash of lease id -> monthly budget tokens the lease holds while it runs.
-- KEYS[7] the API key's own requests bucket, KEYS[8] its tokens bucket, KEYS[9] its budget
--   {period, used}, KEYS[10] its holds (lease id -> tokens): as KEYS[1], [2], [5], [6] for the key
--   alone (its leases are the tenant's, KEYS[3]).
-- All ten keys share the tenant's hash tag, so they live on one node.
--
-- ARGV[1] op: "admit" | "release" | "peek" | "charge" | "renew" | "cancel" | "adopt" | "drop"
-- admit/release: ARGV[2] requests capacity, ARGV[3] requests per second, ARGV[4] tokens capacity,
--   ARGV[5] tokens per second (capacity -1: no such limit), ARGV[6] tokens to charge (admit) or to
--   refund (release), ARGV[7] max concurrent (-1: none), ARGV[8] lease id, ARGV[9] lease ttl ms,
--   ARGV[10] monthly token budget (-1: none held), ARGV[11] the budget's period ("2026-11"),
--   ARGV[12] admit: the month's tokens used as the calling replica knows them (its ledger's
--   totals; the shared count never goes below them); release: the tokens the request used.
--   An admission under a budget also needs ARGV[6] tokens within budget - used - held, and holds
--   them until its release (or its lease's expiry); the release adds what it used.
--   ARGV[13] the key's requests capacity, ARGV[14] its requests per second, ARGV[15] its tokens
--   capacity, ARGV[16] its tokens per second (capacity -1: no such limit of the key's),
--   ARGV[17] the key's monthly token budget (-1: none held), ARGV[18] admit: the key's tokens
--   used this month as the calling replica's ledger knows them; release: the tokens the request
--   used. The key's buckets and budget are checked and charged with the tenant's, all or nothing.
-- renew: ARGV[2] lease ttl ms, ARGV[3..] lease ids; replies how many were still held.
-- adopt: ARGV[2] lease ttl ms, ARGV[3..] lease ids: leases a replica admitted on its local share
--   while Redis was away, still running: they take slots here (never refused, nothing charged)
--   so the other replicas see them; an id already dropped is skipped. Replies the slots held.
-- drop: ARGV[2] lease ttl ms, ARGV[3] lease id: an adopted lease ended: its slot is freed, or its
--   adoption, not arrived yet, will skip it. Replies 1 if a slot was freed.
--
-- peek: the admit arguments; charges nothing.
-- charge: the admit arguments; takes 1 request and ARGV[6] tokens as far as the buckets hold them
--   (never below empty), no lease, never refused.
-- cancel: the admit arguments of an admission whose caller stopped waiting for the reply (its
--   client timed out): if it ran, its lease and budget hold are removed and its request and ARGV[6]
--   tokens are given back (replies 1); if not, its lease id is remembered for ARGV[9] ms so that
--   it does nothing when it arrives (replies 0). A slow Redis then leaves no ghost slot or charge.
-- admit, release, peek and charge reply {admitted or released (0/1), leases held, requests level,
-- tokens level, budget used, budget held, key requests level, key tokens level, key budget used,
-- key budget held}, levels as strings ("-1": no such limit), taken before
-- the charge (admit) or after (release, charge); budget figures "-1" without a budget:
-- Python applies the same rules (rate_limits.check_limits, budgets.check_token_reservation) to
-- explain a refusal.
-- Time comes from Redis, so replicas with skewed clocks agree.

local time = redis.call('TIME')
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local now_ms = math.floor(now_us / 1000)
local op = ARGV[1]
local BUDGET_KEY_TTL_MS = 40 * 24 * 3600 * 1000  -- a month's count outlives its month

-- the leases key, and the holds of its leases, live as long as its latest lease
local function expire_leases()
  local latest = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')[2]
  if latest ~= nil then
    local ttl_ms = math.max(1, tonumber(latest) - now_ms)
    redis.call('PEXPIRE', KEYS[3], ttl_ms)
    redis.call('PEXPIRE', KEYS[6], ttl_ms)
  end
end

local function tombstone(lease_id, ttl_ms)
  redis.call('ZADD', KEYS[4], now_ms + ttl_ms, lease_id)
  local latest = redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')[2]
  redis.call('PEXPIRE', KEYS[4], math.max(1, tonumber(latest) - now_ms))
end

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now_ms)

if op == 'renew' then
  local ttl_ms, num_renewed = tonumber(ARGV[2]), 0
  for i = 3, #ARGV do
    if redis.call('ZSCORE', KEYS[3], ARGV[i]) then
      redis.call('ZADD', KEYS[3], now_ms + ttl_ms, ARGV[i])
      num_renewed = num_renewed + 1
    end
  end
  expire_leases()
  return num_renewed
end

if op == 'adopt' then
  local ttl_ms = tonumber(ARGV[2])
  for i = 3, #ARGV do
    if redis.call('ZREM', KEYS[4], ARGV[i]) == 0 then
      redis.call('ZADD', KEYS[3], 'NX', now_ms + ttl_ms, ARGV[i])
    end
  end
  expire_leases()
  return redis.call('ZCARD', KEYS[3])
end

if op == 'drop' then
  if redis.call('ZREM', KEYS[3], ARGV[3]) == 1 then
    redis.call('HDEL', KEYS[6], ARGV[3])
    return 1
  end
  tombstone(ARGV[3], tonumber(ARGV[2]))
  return 0
end

local function read(key, capacity, rate)
  if capacity < 0 then return nil end
  local state = redis.call('HMGET', key, 'level', 'ts_us')
  local level = tonumber(state[1])
  if level == nil then return capacity end
  local elapsed_s = math.max(0, now_us - tonumber(state[2])) / 1000000
  return math.min(capacity, math.min(level, capacity) + elapsed_s * rate)
end

local function write(key, capacity, rate, level)
  if rate <= 0 then return end
  redis.call('HSET', key, 'level', string.format('%.17g', level), 'ts_us', string.format('%.0f', now_us))
  -- once full again the bucket is the same as no key
  redis.call('PEXPIRE', key, math.max(1, math.ceil((capacity - level) / rate * 1000)))
end

local function show(level)
  if level == nil then return '-1' end
  return string.format('%.17g', level)
end

-- The month's tokens used (never below what the caller's ledger knows; a new month starts from
-- it) and the tokens held by running leases (holds of expired leases are dropped), in the budget
-- and holds keys of the tenant (KEYS[5], KEYS[6]) or of its key (KEYS[9], KEYS[10]).
local function budget_state(budget_key, holds_key, period, known_used)
  local state = redis.call('HMGET', budget_key, 'period', 'used')
  local used = known_used
  if state[1] == period then used = math.max(used, tonumber(state[2])) end
  if state[1] ~= period or used ~= tonumber(state[2]) then
    redis.call('HSET', budget_key, 'period', period, 'used', string.format('%.0f', used))
    redis.call('PEXPIRE', budget_key, BUDGET_KEY_TTL_MS)
  end
  local held, holds = 0, redis.call('HGETALL', holds_key)
  for i = 1, #holds, 2 do
    if redis.call('ZSCORE', KEYS[3], holds[i]) then
      held = held + tonumber(holds[i + 1])
    else
      redis.call('HDEL', holds_key, holds[i])
    end
  end
  return used, held
end

-- A release's tokens used count once per budget: while its hold is there.
local function count_used(budget_key, holds_key, lease_id, period, num_used)
  if redis.call('HDEL', holds_key, lease_id) == 1
      and redis.call('HGET', budget_key, 'period') == period then
    redis.call('HINCRBY', budget_key, 'used', num_used)
    redis.call('PEXPIRE', budget_key, BUDGET_KEY_TTL_MS)
  end
end

local req_cap, req_rate = tonumber(ARGV[2]), tonumber(ARGV[3])
local tok_cap, tok_rate = tonumber(ARGV[4]), tonumber(ARGV[5])
local num_tokens, max_concurrent = tonumber(ARGV[6]), tonumber(ARGV[7])
local lease_id, lease_ttl_ms = ARGV[8], tonumber(ARGV[9])
local budget, period = tonumber(ARGV[10]), ARGV[11]
local key_req_cap, key_req_rate = tonumber(ARGV[13]), tonumber(ARGV[14])
local key_tok_cap, key_tok_rate = tonumber(ARGV[15]), tonumber(ARGV[16])
local key_budget = tonumber(ARGV[17])

local req_level = read(KEYS[1], req_cap, req_rate)
local tok_level = read(KEYS[2], tok_cap, tok_rate)
local key_req_level = read(KEYS[7], key_req_cap, key_req_rate)
local key_tok_level = read(KEYS[8], key_tok_cap, key_tok_rate)

local function reply(flag, used, held, key_used, key_held)
  return {flag, redis.call('ZCARD', KEYS[3]), show(req_level), show(tok_level), show(used), show(held),
    show(key_req_level), show(key_tok_level), show(key_used), show(key_held)}
end

-- Take amount from a bucket (at most what it holds when capped), or give it back (negative).
local function take(key, capacity, rate, level, amount, capped)
  if level == nil then return nil end
  if capped then amount = math.min(amount, level) end
  level = math.min(capacity, level - amount)
  write(key, capacity, rate, level)
  return level
end

if op == 'peek' then
  return reply(0)
end

if op == 'charge' then
  req_level = take(KEYS[1], req_cap, req_rate, req_level, 1, true)
  tok_level = take(KEYS[2], tok_cap, tok_rate, tok_level, num_tokens, true)
  key_req_level = take(KEYS[7], key_req_cap, key_req_rate, key_req_level, 1, true)
  key_tok_level = take(KEYS[8], key_tok_cap, key_tok_rate, key_tok_level, num_tokens, true)
  return reply(0)
end

if op == 'release' then
  local released = redis.call('ZREM', KEYS[3], lease_id)
  if released == 1 and num_tokens > 0 then
    tok_level = take(KEYS[2], tok_cap, tok_rate, tok_level, -num_tokens, false)
    key_tok_level = take(KEYS[8], key_tok_cap, key_tok_rate, key_tok_level, -num_tokens, false)
  end
  count_used(KEYS[5], KEYS[6], lease_id, period, tonumber(ARGV[12]))
  count_used(KEYS[9], KEYS[10], lease_id, period, tonumber(ARGV[18]))
  return reply(released)
end

if op == 'cancel' then
  if redis.call('ZREM', KEYS[3], lease_id) == 1 then
    redis.call('HDEL', KEYS[6], lease_id)
    redis.call('HDEL', KEYS[10], lease_id)
    req_level = take(KEYS[1], req_cap, req_rate, req_level, -1, false)
    tok_level = take(KEYS[2], tok_cap, tok_rate, tok_level, -num_tokens, false)
    key_req_level = take(KEYS[7], key_req_cap, key_req_rate, key_req_level, -1, false)
    key_tok_level = take(KEYS[8], key_tok_cap, key_tok_rate, key_tok_level, -num_tokens, false)
    return reply(1)
  end
  tombstone(lease_id, lease_ttl_ms)
  return reply(0)
end

-- admit: all or nothing (nothing at all for an admission already cancelled)
local num_leases = redis.call('ZCARD', KEYS[3])
if redis.call('ZREM', KEYS[4], lease_id) == 1 then
  return reply(0)
end
local used, held, key_used, key_held
if budget >= 0 then used, held = budget_state(KEYS[5], KEYS[6], period, tonumber(ARGV[12])) end
if key_budget >= 0 then
  key_used, key_held = budget_state(KEYS[9], KEYS[10], period, tonumber(ARGV[18]))
end
local fits = (req_level == nil or req_level >= 1)
  and (tok_level == nil or tok_level >= num_tokens)
  and (key_req_level == nil or key_req_level >= 1)
  and (key_tok_level == nil or key_tok_level >= num_tokens)
  and (max_concurrent < 0 or num_leases < max_concurrent)
  and (budget < 0 or num_tokens <= budget - used - held)
  and (key_budget < 0 or num_tokens <= key_budget - key_used - key_held)
if not fits then
  return reply(0, used, held, key_used, key_held)
end
if req_level ~= nil then write(KEYS[1], req_cap, req_rate, req_level - 1) end
if tok_level ~= nil then write(KEYS[2], tok_cap, tok_rate, tok_level - num_tokens) end
if key_req_level ~= nil then write(KEYS[7], key_req_cap, key_req_rate, key_req_level - 1) end
if key_tok_level ~= nil then write(KEYS[8], key_tok_cap, key_tok_rate, key_tok_level - num_tokens) end
redis.call('ZADD', KEYS[3], now_ms + lease_ttl_ms, lease_id)
if budget >= 0 then redis.call('HSET', KEYS[6], lease_id, num_tokens) end
if key_budget >= 0 then
  -- the key's holds are cleaned against the tenant's leases (budget_state), the hash outliving
  -- them only while the key is unused
  redis.call('HSET', KEYS[10], lease_id, num_tokens)
  redis.call('PEXPIRE', KEYS[10], BUDGET_KEY_TTL_MS)
end
expire_leases()
return {1, num_leases, show(req_level), show(tok_level), show(used), show(held),
  show(key_req_level), show(key_tok_level), show(key_used), show(key_held)}
