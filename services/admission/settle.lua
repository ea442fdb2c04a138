-- A request's reservation (RedisKeys.reservation): the tokens its charge took, and what
-- has happened to the request since. Its value is the tokens, then a state letter:
--   'N'   charged; no copy of the request sent yet
--   'Nd'  a copy was sent for dispatch: it will run, only its completion settles it
--   'Nr'  refunded (refused before any copy was sent); kept, so that a copy sent or
--         completed later is still charged what it uses
-- Every write keeps the key's TTL. Every key of a call is in one tenant's slot.
--
-- ARGV[1] 'sent':   KEYS are reservations of requests the broker took for dispatch:
--                   'N' becomes 'Nd'; anything else is left. Returns how many changed.
-- ARGV[1] 'refund': KEYS[1]: 'N' becomes 'Nr' and N is returned, to be given back;
--                   anything else: false (a copy was sent, or it is settled).
-- ARGV[1] 'take':   KEYS[1], for a completion: deleted, and returned as it was (the
--                   caller corrects by actual − N, or by actual after a refund), or
--                   false when there is none.
local mode = ARGV[1]

if mode == 'sent' then
  local n = 0
  for i = 1, #KEYS do
    local v = redis.call('GET', KEYS[i])
    if v and string.find(v, '^[0-9.e+-]+$') then
      redis.call('APPEND', KEYS[i], 'd')
      n = n + 1
    end
  end
  return n
end

local v = redis.call('GET', KEYS[1])
if not v then
  return false
end
if mode == 'refund' then
  if not string.find(v, '^[0-9.e+-]+$') then
    return false
  end
  redis.call('APPEND', KEYS[1], 'r')
  return v
end
if mode == 'take' then
  redis.call('DEL', KEYS[1])
  return v
end
return redis.error_reply('unknown mode ' .. tostring(mode))
