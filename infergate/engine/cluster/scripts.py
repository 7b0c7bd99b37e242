"""The Lua scripts the shared limits run in Redis. Each reads the time from Redis (TIME),
so the replicas' clocks never matter; times are microseconds."""

from __future__ import annotations

# GCRA (the generic cell rate algorithm) for the rate, then a lease for the concurrency,
# in one round trip. A request that passes the rate but finds no free slot has used its
# token, as on the local path (tenants.py).
#   KEYS[1] the tenant's theoretical arrival time (TAT), KEYS[2] its leases (a sorted set
#   scored by expiry)
#   ARGV: interval (1/rps, 0: no rate limit), tolerance ((burst - 1) * interval),
#         slots (0: no concurrency limit), lease TTL, lease id
# Returns {1, 0} admitted, {0, wait} over the rate (wait: until a token is there),
# {2, 0} no free slot.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
if interval > 0 then
  local tat = tonumber(redis.call('GET', KEYS[1])) or now
  if tat < now then tat = now end
  local allow_at = tat - tonumber(ARGV[2])
  if now < allow_at then
    return {0, allow_at - now}
  end
  local new_tat = tat + interval
  redis.call('SET', KEYS[1], string.format('%.0f', new_tat),
             'PX', math.ceil((new_tat - now) / 1000) + 1)
end
local slots = tonumber(ARGV[3])
if slots > 0 then
  local ttl = tonumber(ARGV[4])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= slots then
    return {2, 0}
  end
  redis.call('ZADD', KEYS[2], string.format('%.0f', now + ttl), ARGV[5])
  redis.call('PEXPIRE', KEYS[2], math.ceil(ttl / 1000) * 2)
end
return {1, 0}
"""

# Renew this replica's leases (they outlive it by one TTL at most) and its heartbeat;
# returns how many replicas are alive (the divisor of the local share).
#   KEYS[1] the replicas set, KEYS[2..] the sets holding the leases
#   ARGV[1] TTL, ARGV[2] this replica's id, ARGV[3..] the lease ids, in KEYS' order
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[1])
local expiry = string.format('%.0f', now + ttl)
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', expiry, ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], math.ceil(ttl / 1000) * 2)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], expiry, ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl / 1000) * 2)
return redis.call('ZCARD', KEYS[1])
"""
