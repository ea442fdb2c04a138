-- seawall quota buckets: services/admission/bucket.py's model, run atomically in Redis.
--
-- KEYS[i]  one hash per (tenant, dimension): fields tokens, burst, ts (all in one key)
-- ARGV[1]  'take'   all keys pay their cost, or none does (outcome admit/degrade/reject)
--          'adjust' apply a signed correction to every key (outcome 'adjusted')
-- ARGV[2]  TTL margin in milliseconds
-- then five per key: cost (or delta), capacity, rate, burst_capacity, burst_rate
--
-- Returns {outcome, TIME seconds, TIME microseconds, then per key tokens, burst, ts},
-- numbers as %.17g strings so that Python reads back the exact doubles stored here.
-- The arithmetic mirrors bucket.py operation for operation; change both together.
-- Redis >= 5 replicates a script's effects, so TIME (non-deterministic) is safe here.

local mode = ARGV[1]
local margin = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000

local function fmt(x)
  return string.format('%.17g', x)
end

local buckets = {}
for i = 1, #KEYS do
  local a = 2 + (i - 1) * 5
  local b = {
    cost = tonumber(ARGV[a + 1]),
    cap = tonumber(ARGV[a + 2]),
    rate = tonumber(ARGV[a + 3]),
    bcap = tonumber(ARGV[a + 4]),
    brate = tonumber(ARGV[a + 5]),
  }
  local h = redis.call('HMGET', KEYS[i], 'tokens', 'ts', 'burst')
  local tokens, ts, burst = tonumber(h[1]), tonumber(h[2]), tonumber(h[3])
  if tokens == nil or ts == nil or burst == nil then
    -- missing (or expired, which the TTL makes the same thing): a full bucket
    b.tokens, b.ts, b.burst = b.cap, now, b.bcap
  else
    local elapsed = math.max(0, now - ts)
    b.tokens = math.min(b.cap, tokens + elapsed * b.rate)
    b.ts = math.max(ts, now)
    b.burst = math.min(b.bcap, burst + elapsed * b.brate)
  end
  buckets[i] = b
end

local outcome
if mode == 'take' then
  outcome = 'admit'
  for _, b in ipairs(buckets) do
    if b.cost <= b.tokens then
      -- pays from the baseline
    elseif b.cost <= b.tokens + b.burst then
      if outcome == 'admit' then outcome = 'degrade' end
    else
      outcome = 'reject'
    end
  end
  if outcome ~= 'reject' then
    for _, b in ipairs(buckets) do
      if b.cost <= b.tokens then
        b.tokens = b.tokens - b.cost
      else
        b.burst = b.burst - (b.cost - b.tokens)
        b.tokens = 0
      end
    end
  end
elseif mode == 'adjust' then
  outcome = 'adjusted'
  for _, b in ipairs(buckets) do
    local delta = b.cost
    if delta <= 0 then
      local credit = -delta
      local room = b.cap - b.tokens
      if credit <= room then
        b.tokens = b.tokens + credit
      else
        b.tokens = b.cap
        b.burst = math.min(b.bcap, b.burst + (credit - room))
      end
    elseif delta <= b.tokens then
      b.tokens = b.tokens - delta
    else
      b.burst = math.max(0, b.burst - (delta - b.tokens))
      b.tokens = 0
    end
  end
else
  return redis.error_reply('unknown mode')
end

local reply = {outcome, clock[1], clock[2]}
for i, b in ipairs(buckets) do
  local tokens, ts, burst = fmt(b.tokens), fmt(b.ts), fmt(b.burst)
  redis.call('HSET', KEYS[i], 'tokens', tokens, 'ts', ts, 'burst', burst)
  local full_after = (b.cap - b.tokens) / b.rate
  if b.bcap > 0 then
    full_after = math.max(full_after, (b.bcap - b.burst) / b.brate)
  end
  redis.call('PEXPIRE', KEYS[i], string.format('%d', math.ceil(full_after * 1000) + margin))
  reply[#reply + 1] = tokens
  reply[#reply + 1] = ts
  reply[#reply + 1] = burst
end
return reply
