-- seawall quota buckets: services/admission/policy/bucket.py's model, run atomically in Redis.
--
-- One call decides one or more charges (a batch of requests in one round trip), each
-- on its own buckets, in order, all on the same server clock.
--
-- ARGV[1]  'take'   charges: every bucket of a charge pays its cost, or none does
--          'adjust' apply a signed correction to every bucket (outcome 'adjusted')
-- ARGV[2]  TTL margin in milliseconds
-- ARGV[3]  the figures, numbers separated by spaces (F below; one argument: as a dozen
--          per charge, the client's encoding of each cost more than the charge):
--          L, the number of distinct limits; then 4 per limit: capacity, rate,
--          burst_capacity, burst_rate (a tier's limits travel once per call, not once
--          per request);
--          then per charge: nkeys, split, marker TTL, reservation TTL, then two per
--          bucket: cost (or delta) and the index (1-based) of its limit
--   nkeys           how many of KEYS are this charge's (they follow the previous
--                   charge's): one hash per bucket (fields tokens, burst, ts), then,
--                   with a marker, the request's idempotency marker, then, with a
--                   reservation, the request's reservation key
--   split           take: how many of the first buckets are the region's (0: no
--                   region); the rest are the tenant's. Each group has its own outcome
--                   (admit, degrade, reject); if either rejects, nothing is spent, so a
--                   refused tenant charges no region and a refused region no tenant.
--   marker TTL      take: in milliseconds (0: no marker). A marker that exists means
--                   this request was charged before: its outcomes are returned again
--                   (replayed) and nothing is spent or written.
--   reservation TTL take: in milliseconds (0: none). When the charge is made, the
--                   tokens charged to the tenant (its last bucket's cost) are written
--                   there, for the completion's correction, if they are more than 0.
--
-- Returns one reply per charge: {tenant outcome, TIME seconds, TIME microseconds,
-- region outcome (or ''), replayed (0 or 1), then per bucket tokens, ts, burst},
-- numbers as %.17g strings so that Python reads back the exact doubles stored here.
-- The arithmetic mirrors bucket.py operation for operation; change both together.
-- Redis >= 5 replicates a script's effects, so TIME (non-deterministic) is safe here.

local mode = ARGV[1]
if mode ~= 'take' and mode ~= 'adjust' then
  return redis.error_reply('unknown mode')
end
local margin = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000

local function fmt(x)
  return string.format('%.17g', x)
end

local F = {}
for figure in string.gmatch(ARGV[3], '%S+') do
  F[#F + 1] = figure
end

local limits = {}
local nlimits = tonumber(F[1])
for j = 1, nlimits do
  local a = 1 + (j - 1) * 4
  limits[j] = {tonumber(F[a + 1]), tonumber(F[a + 2]),
               tonumber(F[a + 3]), tonumber(F[a + 4])}
end

-- The reply of a charge: its head, then each bucket's state (as written, where it was:
-- formatting each figure once, not twice: 20.3 -> 17.8 µs a charge in Redis).
local function states(reply, buckets)
  for i = 1, #buckets do
    local b = buckets[i]
    local written = b.written
    if written then
      reply[#reply + 1] = written[1]
      reply[#reply + 1] = written[2]
      reply[#reply + 1] = written[3]
    else
      reply[#reply + 1] = fmt(b.tokens)
      reply[#reply + 1] = fmt(b.ts)
      reply[#reply + 1] = fmt(b.burst)
    end
  end
  return reply
end

-- The outcome of buckets[first .. last] paying their costs.
local function fits(buckets, first, last)
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

-- One charge: KEYS[k0 + 1 .. k0 + nkeys], its figures from F[a0 + 1].
local function charge(k0, a0, nkeys, split, marker_ttl, reservation_ttl)
  local nbuckets = nkeys
  local reservation = nil
  if mode == 'take' and reservation_ttl > 0 then
    reservation = KEYS[k0 + nbuckets]
    nbuckets = nbuckets - 1
  end
  local marker = nil
  if mode == 'take' and marker_ttl > 0 then
    marker = KEYS[k0 + nbuckets]
    nbuckets = nbuckets - 1
  end

  local buckets = {}
  for i = 1, nbuckets do
    local lim = limits[tonumber(F[a0 + 2 * i])]
    local b = {
      key = KEYS[k0 + i],
      cost = tonumber(F[a0 + 2 * i - 1]),
      cap = lim[1],
      rate = lim[2],
      bcap = lim[3],
      brate = lim[4],
    }
    local h = redis.call('HMGET', b.key, 'tokens', 'ts', 'burst')
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

  local tenant_outcome, region_outcome = 'adjusted', ''
  if mode == 'take' then
    if marker then
      local seen = redis.call('GET', marker)
      if seen then
        local comma = string.find(seen, ',', 1, true)
        return states({string.sub(seen, 1, comma - 1), clock[1], clock[2],
                       string.sub(seen, comma + 1), 1}, buckets)
      end
    end
    if split > 0 then
      region_outcome = fits(buckets, 1, split)
    end
    tenant_outcome = fits(buckets, split + 1, nbuckets)
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
  else
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
  end

  for i = 1, nbuckets do
    local b = buckets[i]
    local written = {fmt(b.tokens), fmt(b.ts), fmt(b.burst)}
    b.written = written
    redis.call('HSET', b.key, 'tokens', written[1], 'ts', written[2], 'burst', written[3])
    local full_after = (b.cap - b.tokens) / b.rate
    if b.bcap > 0 then
      full_after = math.max(full_after, (b.bcap - b.burst) / b.brate)
    end
    redis.call('PEXPIRE', b.key, string.format('%d', math.ceil(full_after * 1000) + margin))
  end
  return states({tenant_outcome, clock[1], clock[2], region_outcome, 0}, buckets)
end

local replies = {}
local k0, a, nargs = 0, 1 + nlimits * 4, #F
while a < nargs do
  local nkeys, split = tonumber(F[a + 1]), tonumber(F[a + 2])
  local marker_ttl, reservation_ttl = tonumber(F[a + 3]), tonumber(F[a + 4])
  local nbuckets = nkeys
  if mode == 'take' and marker_ttl > 0 then nbuckets = nbuckets - 1 end
  if mode == 'take' and reservation_ttl > 0 then nbuckets = nbuckets - 1 end
  replies[#replies + 1] = charge(k0, a + 4, nkeys, split, marker_ttl, reservation_ttl)
  k0 = k0 + nkeys
  a = a + 4 + 2 * nbuckets
end
return replies
