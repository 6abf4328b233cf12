"""Admission reservations: how much of each decode worker the gateways have promised away.

Per decode worker, two Redis keys: ``keys.admitted(w)``, a hash request_id ->
tokens of the requests admitted to it that have not left yet, and
``keys.reserved_tokens(w)``, the sum of that hash. Only the Lua scripts below
change them, each atomically, so the sum stays exact:

    RESERVE_LUA  gateway, one call over every live decode worker: the worker with
                 the most room that can take the request gets an entry (or none); with
                 preferred workers (those holding the prompt's prefix), the first of them
                 that can take it
    RELEASE_LUA  decode worker when a request leaves it, by any path (finish,
                 abort, failure); gateway when its submission failed. Idempotent.
    clear        decode worker at start: a new incarnation holds nothing

A request's charge is what its worker reserves at admission under the worker's
capacity policy (``tandem.cluster.policies``, ``CapacityPolicy.charge_tokens``), in whole blocks; a worker can take
requests while the charges fit its pool and number at most its
``max_admitted`` (its batch and the next one, waiting in the worker). So under GUARANTEED_NO_EVICT and STATIC_BATCH the gateways
never promise more KV than the pool holds, while under MAX_UTILIZATION they
promise only prompts (+1 token) and the worker preempts when growth runs out.

Leaks: an entry whose request never reached its worker (a gateway died between
reserve and submit) is released by the worker's ``reconcile`` pass once it has
been unknown to the worker in two passes in a row.
"""

from __future__ import annotations

import redis

from tandem.cluster import keys

# KEYS: per candidate worker i (1-based): KEYS[2i-1] its admitted hash, KEYS[2i] its reserved-token counter.
# ARGV[1]: request id; per worker i: ARGV[3i-1] charge, ARGV[3i] capacity tokens, ARGV[3i+1] max requests (0: any);
# then, optionally, how many leading workers are preferred (those holding the prompt's prefix): the first of them
# that can take the request does, before the most-room rule over the others.
# Returns the 0-based index of the worker that took the request (or holds it already), or -1. Ties go to the
# earlier worker.
RESERVE_LUA = """
local n = #KEYS / 2
local preferred = tonumber(ARGV[3*n + 2] or '0')
for i = 1, n do
  if redis.call('HEXISTS', KEYS[2*i-1], ARGV[1]) == 1 then
    return i - 1
  end
end
local best, best_room = -1, -1
for i = 1, n do
  local charge, capacity, max_requests = tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1])
  local room = capacity - tonumber(redis.call('GET', KEYS[2*i]) or '0')
  local count = redis.call('HLEN', KEYS[2*i-1])
  if room >= charge and (max_requests == 0 or count < max_requests) then
    if i <= preferred then
      best = i
      break
    end
    if room > best_room then
      best, best_room = i, room
    end
  end
end
if best < 0 then
  return -1
end
redis.call('HSET', KEYS[2*best-1], ARGV[1], ARGV[3*best-1])
redis.call('INCRBY', KEYS[2*best], ARGV[3*best-1])
return best - 1
"""

# KEYS[1] admitted hash, KEYS[2] reserved-token counter; ARGV[1] request id. Returns 1 if it held an entry.
RELEASE_LUA = """
local charge = redis.call('HGET', KEYS[1], ARGV[1])
if not charge then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DECRBY', KEYS[2], charge)
return 1
"""


class Reservations:
    """The decode worker's side: release the requests that left, clear at start, reconcile leaks."""

    def __init__(self, client: redis.Redis, worker_id: str):
        self._client = client
        self._keys = [keys.admitted(worker_id), keys.reserved_tokens(worker_id)]
        self._release = client.register_script(RELEASE_LUA)
        self._suspects: set[str] = set()

    def clear(self) -> None:
        self._client.delete(*self._keys)

    def release(self, request_ids: list[str]) -> None:
        """One round trip for all of them; an id without an entry is skipped."""
        if not request_ids:
            return
        pipe = self._client.pipeline(transaction=False)
        for request_id in request_ids:
            self._release(keys=self._keys, args=[request_id], client=pipe)
        pipe.execute()

    def reconcile(self, known_ids: set[str]) -> list[str]:
        """Release entries unknown to the worker now and at the previous pass; returns their ids.

        Between two passes the worker has read its inbox many times, so a request
        reserved before the first pass and still unknown never reached it.
        """
        unknown = {raw.decode() for raw in self._client.hkeys(self._keys[0])} - known_ids
        stale = sorted(unknown & self._suspects)
        self.release(stale)
        self._suspects = unknown - set(stale)
        return stale
