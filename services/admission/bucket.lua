-- seawall quota buckets: services/admission/bucket.py's model, run atomically in Redis.
--
-- KEYS     one hash per bucket (fields tokens, burst, ts, all in one key); then, with a
--          marker (ARGV[4] > 0), the request's idempotency marker; then, with a
--          reservation (ARGV[5] > 0), the request's reservation key
-- ARGV[1]  'take'   a charge: every bucket pays its cost, or none does
--          'adjust' apply a signed correction to every bucket (outcome 'adjusted')
-- ARGV[2]  TTL margin in milliseconds
-- ARGV[3]  take: how many of the first buckets are the region's (0: no region); the
--          rest are the tenant's. Each group has its own outcome (admit, degrade,
--          reject); if either rejects, nothing is spent, so a refused tenant charges
--          no region and a refused region charges no tenant.
-- ARGV[4]  take: the marker's TTL in milliseconds (0: no marker). A marker that
--          exists means this request was charged before: its outcomes are returned
--          again (replayed) and nothing is spent or written.
-- ARGV[5]  take: the reservation's TTL in milliseconds (0: none). When the charge is
--          made, the tokens charged to the tenant (its last bucket's cost) are written
--          there, for the completion's correction, if they are more than 0.
-- then five per bucket: cost (or delta), capacity, rate, burst_capacity, burst_rate
--
-- Returns {tenant outcome, TIME seconds, TIME microseconds, region outcome (or ''),
-- replayed (0 or 1), then per bucket tokens, ts, burst}, numbers as %.17g strings so
-- that Python reads back the exact doubles stored here. The arithmetic mirrors
-- bucket.py operation for operation; change both together.
-- Redis >= 5 replicates a script's effects, so TIME (non-deterministic) is safe here.

local mode = ARGV[1]
local margin = tonumber(ARGV[2])
local split = tonumber(ARGV[3])
local marker_ttl = tonumber(ARGV[4])
local reservation_ttl = tonumber(ARGV[5])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000

local function fmt(x)
  return string.format('%.17g', x)
end

local nbuckets = #KEYS
local reservation = nil
if mode == 'take' and reservation_ttl > 0 then
  reservation = KEYS[nbuckets]
  nbuckets = nbuckets - 1
end
local marker = nil
if mode == 'take' and marker_ttl > 0 then
  marker = KEYS[nbuckets]
  nbuckets = nbuckets - 1
end

local buckets = {}
for i = 1, nbuckets do
  local a = 5 + (i - 1) * 5
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

local function states(reply)
  for i = 1, nbuckets do
    local b = buckets[i]
    reply[#reply + 1] = fmt(b.tokens)
    reply[#reply + 1] = fmt(b.ts)
    reply[#reply + 1] = fmt(b.burst)
  end
  return reply
end

local function fits(first, last)
  local outcome = 'admit'
  for i = first, last do
    local b = buckets[i]
    if b.cost <= b.tokens then
      -- pays from the baseline
    elseif b.cost <= b.tokens + b.burst then
      if outcome == 'admit' then outcome = 'degrade' end
    else
      outcome = 'reject'
    end
  end
  return outcome
end

local tenant_outcome, region_outcome = 'adjusted', ''
if mode == 'take' then
  if marker then
    local seen = redis.call('GET', marker)
    if seen then
      local comma = string.find(seen, ',', 1, true)
      return states({string.sub(seen, 1, comma - 1), clock[1], clock[2],
                     string.sub(seen, comma + 1), 1})
    end
  end
  if split > 0 then
    region_outcome = fits(1, split)
  end
  tenant_outcome = fits(split + 1, nbuckets)
  if tenant_outcome ~= 'reject' and region_outcome ~= 'reject' then
    for i = 1, nbuckets do
      local b = buckets[i]
      if b.cost <= b.tokens then
        b.tokens = b.tokens - b.cost
      else
        b.burst = b.burst - (b.cost - b.tokens)
        b.tokens = 0
      end
    end
    local reserved = buckets[nbuckets].cost
    if reservation and reserved > 0 then
      redis.call('SET', reservation, fmt(reserved), 'PX', string.format('%d', reservation_ttl))
    end
  end
  if marker then
    redis.call('SET', marker, tenant_outcome .. ',' .. region_outcome,
               'PX', string.format('%d', marker_ttl))
  end
elseif mode == 'adjust' then
  for i = 1, nbuckets do
    local b = buckets[i]
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

for i = 1, nbuckets do
  local b = buckets[i]
  redis.call('HSET', KEYS[i], 'tokens', fmt(b.tokens), 'ts', fmt(b.ts), 'burst', fmt(b.burst))
  local full_after = (b.cap - b.tokens) / b.rate
  if b.bcap > 0 then
    full_after = math.max(full_after, (b.bcap - b.burst) / b.brate)
  end
  redis.call('PEXPIRE', KEYS[i], string.format('%d', math.ceil(full_after * 1000) + margin))
end
return states({tenant_outcome, clock[1], clock[2], region_outcome, 0})
