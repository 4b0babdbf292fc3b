-- One tenant's rate limits in one atomic step: admit, release or renew.
-- Called by policies/rate_limiter_redis.py (EVALSHA; loaded again on NOSCRIPT).
--
-- KEYS[1] requests bucket, KEYS[2] tokens bucket: hashes {level, ts_us}; a missing bucket is full.
-- KEYS[3] leases: sorted set of lease id -> expiry (ms); a lease not renewed in time frees its slot.
-- KEYS[4] cancelled: sorted set of lease id -> expiry (ms) of admissions cancelled before they ran.
-- All four keys share the tenant's hash tag, so they live on one node.
--
-- ARGV[1] op: "admit" | "release" | "peek" | "charge" | "renew" | "cancel"
-- admit/release: ARGV[2] requests capacity, ARGV[3] requests per second, ARGV[4] tokens capacity,
--   ARGV[5] tokens per second (capacity -1: no such limit), ARGV[6] tokens to charge (admit) or to
--   refund (release), ARGV[7] max concurrent (-1: none), ARGV[8] lease id, ARGV[9] lease ttl ms.
-- renew: ARGV[2] lease ttl ms, ARGV[3..] lease ids; replies how many were still held.
--
-- peek: the admit arguments; charges nothing.
-- charge: the admit arguments; takes 1 request and ARGV[6] tokens as far as the buckets hold them
--   (never below empty), no lease, never refused.
-- cancel: the admit arguments of an admission whose caller stopped waiting for the reply (its
--   client timed out): if it ran, its lease is removed and its request and ARGV[6] tokens are
--   given back (replies 1); if not, its lease id is remembered for ARGV[9] ms so that it does
--   nothing when it arrives (replies 0). A slow Redis then leaves no ghost slot or charge.
-- admit, release, peek and charge reply {admitted or released (0/1), leases held, requests level, tokens
-- level}, levels as strings ("-1": no such limit), taken before the charge (admit) or after
-- (release, charge):
-- Python applies the same rules (rate_limits.check_limits) to explain a refusal.
-- Time comes from Redis, so replicas with skewed clocks agree.

local time = redis.call('TIME')
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local now_ms = math.floor(now_us / 1000)
local op = ARGV[1]

-- the leases key lives as long as its latest lease
local function expire_leases()
  local latest = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')[2]
  if latest ~= nil then
    redis.call('PEXPIRE', KEYS[3], math.max(1, tonumber(latest) - now_ms))
  end
end

if op == 'renew' then
  local ttl_ms, num_renewed = tonumber(ARGV[2]), 0
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
  for i = 3, #ARGV do
    if redis.call('ZSCORE', KEYS[3], ARGV[i]) then
      redis.call('ZADD', KEYS[3], now_ms + ttl_ms, ARGV[i])
      num_renewed = num_renewed + 1
    end
  end
  expire_leases()
  return num_renewed
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

local req_cap, req_rate = tonumber(ARGV[2]), tonumber(ARGV[3])
local tok_cap, tok_rate = tonumber(ARGV[4]), tonumber(ARGV[5])
local num_tokens, max_concurrent = tonumber(ARGV[6]), tonumber(ARGV[7])
local lease_id, lease_ttl_ms = ARGV[8], tonumber(ARGV[9])

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now_ms)
local req_level = read(KEYS[1], req_cap, req_rate)
local tok_level = read(KEYS[2], tok_cap, tok_rate)

if op == 'peek' then
  return {0, redis.call('ZCARD', KEYS[3]), show(req_level), show(tok_level)}
end

if op == 'charge' then
  if req_level ~= nil then
    req_level = req_level - math.min(1, req_level)
    write(KEYS[1], req_cap, req_rate, req_level)
  end
  if tok_level ~= nil then
    tok_level = tok_level - math.min(num_tokens, tok_level)
    write(KEYS[2], tok_cap, tok_rate, tok_level)
  end
  return {0, redis.call('ZCARD', KEYS[3]), show(req_level), show(tok_level)}
end

if op == 'release' then
  local released = redis.call('ZREM', KEYS[3], lease_id)
  if released == 1 and tok_level ~= nil and num_tokens > 0 then
    tok_level = math.min(tok_cap, tok_level + num_tokens)
    write(KEYS[2], tok_cap, tok_rate, tok_level)
  end
  return {released, redis.call('ZCARD', KEYS[3]), show(req_level), show(tok_level)}
end

if op == 'cancel' then
  if redis.call('ZREM', KEYS[3], lease_id) == 1 then
    if req_level ~= nil then write(KEYS[1], req_cap, req_rate, math.min(req_cap, req_level + 1)) end
    if tok_level ~= nil then
      tok_level = math.min(tok_cap, tok_level + num_tokens)
      write(KEYS[2], tok_cap, tok_rate, tok_level)
    end
    return {1, redis.call('ZCARD', KEYS[3]), show(req_level), show(tok_level)}
  end
  redis.call('ZADD', KEYS[4], now_ms + lease_ttl_ms, lease_id)
  local latest = redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')[2]
  redis.call('PEXPIRE', KEYS[4], math.max(1, tonumber(latest) - now_ms))
  return {0, redis.call('ZCARD', KEYS[3]), show(req_level), show(tok_level)}
end

-- admit: all or nothing (nothing at all for an admission already cancelled)
local num_leases = redis.call('ZCARD', KEYS[3])
if redis.call('ZREM', KEYS[4], lease_id) == 1 then
  return {0, num_leases, show(req_level), show(tok_level)}
end
local fits = (req_level == nil or req_level >= 1)
  and (tok_level == nil or tok_level >= num_tokens)
  and (max_concurrent < 0 or num_leases < max_concurrent)
if not fits then
  return {0, num_leases, show(req_level), show(tok_level)}
end
if req_level ~= nil then write(KEYS[1], req_cap, req_rate, req_level - 1) end
if tok_level ~= nil then write(KEYS[2], tok_cap, tok_rate, tok_level - num_tokens) end
redis.call('ZADD', KEYS[3], now_ms + lease_ttl_ms, lease_id)
expire_leases()
return {1, num_leases, show(req_level), show(tok_level)}
