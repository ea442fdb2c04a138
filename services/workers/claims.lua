-- seawall work claims: which worker runs a request now, and which generation of it.
--
-- KEYS[1]  the request's hash (RedisKeys.work): state ('running' or 'done'), owner,
--          gen, lease_until (ms, server clock), attempts
-- ARGV[1]  'claim'   take the request unless it is done, or running under another
--                    worker's live lease; a new generation, above every earlier one
--                    (server microseconds, or one more than the last)
--          'renew'   extend the lease, if the caller still owns this generation
--          'done'    the terminal reply is delivered: nobody runs it again
--          'release' give the lease up (the caller stops before the end)
-- ARGV[2]  worker id
-- ARGV[3]  lease in milliseconds (claim, renew)
-- ARGV[4]  the key's TTL in milliseconds (claim, done): past the request's deadline
-- ARGV[5]  the caller's generation (renew, done, release)
--
-- claim returns {'claimed', gen, attempts} | {'busy', owner, ms left on its lease} |
-- {'done', gen}; renew returns 1 if the lease is still the caller's, else 0.

local key = KEYS[1]
local op, worker = ARGV[1], ARGV[2]
local lease_ms, ttl_ms, gen = tonumber(ARGV[3]), ARGV[4], ARGV[5]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local h = redis.call('HMGET', key, 'state', 'owner', 'gen', 'lease_until', 'attempts')
local state, owner, held_gen = h[1], h[2], h[3]
local lease_until, attempts = tonumber(h[4]) or 0, tonumber(h[5]) or 0

if op == 'claim' then
  if state == 'done' then
    return {'done', held_gen}
  end
  if state == 'running' and owner ~= worker and lease_until > now_ms then
    return {'busy', owner, lease_until - now_ms}
  end
  -- microseconds since the epoch as a decimal string (exact, unlike a Lua double
  -- once past 2^53 µs; the current count is far below it, but stay exact anyway)
  local now_us = clock[1] .. string.format('%06d', tonumber(clock[2]))
  local new_gen = now_us
  if held_gen and tonumber(held_gen) >= tonumber(now_us) then
    new_gen = string.format('%d', tonumber(held_gen) + 1)
  end
  attempts = attempts + 1
  redis.call('HSET', key, 'state', 'running', 'owner', worker, 'gen', new_gen,
             'lease_until', string.format('%d', now_ms + lease_ms), 'attempts', attempts)
  redis.call('PEXPIRE', key, ttl_ms)
  return {'claimed', new_gen, attempts}
elseif op == 'renew' then
  if state == 'running' and owner == worker and held_gen == gen then
    redis.call('HSET', key, 'lease_until', string.format('%d', now_ms + lease_ms))
    return 1
  end
  return 0
elseif op == 'done' then
  redis.call('HSET', key, 'state', 'done', 'owner', worker, 'gen', gen, 'lease_until', '0')
  redis.call('PEXPIRE', key, ttl_ms)
  return 1
elseif op == 'release' then
  if state == 'running' and owner == worker and held_gen == gen then
    redis.call('HSET', key, 'lease_until', '0')
  end
  return 1
end
return redis.error_reply('unknown op')
