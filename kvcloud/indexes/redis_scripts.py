"""Redis index scripts: the Lua that runs on the server, and how the index sends it.

Lookups are one ``EVALSHA`` on the request path: a script that walks the prompt's chain and
returns only the run of hits (``lookup_run``) or every entry (``lookup``). Registrations and
the background TTL renewals are batched scripts too (``_WRITE_BATCH`` entries a call), and a
compare-and-delete is one. A renewal rewrites only a value that still exists and has not
expired, so it can never resurrect an entry deleted or expired meanwhile. The value formats
the scripts read and write are :mod:`kvcloud.indexes.redis_layout`'s.

These scripts are multi-key, which Redis Cluster allows only within one slot, and buckets
deliberately spread over slots: with ``single_key`` (a cluster variant of the index) each
batch is one single-key script sent as ``EVAL``, and the lookup becomes a pipeline of HGETs
(:meth:`~kvcloud.indexes.redis.RedisIndex._read_entries`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis import exceptions as rexc

# A value is valid when its format byte is 1 and it is long enough to hold the fixed part;
# its expiry (unix seconds, a double) sits at byte 2. Anything else is garbage: a lookup
# returns it (the client logs it and treats it as a miss) and a registration overwrites it.
_LUA_HELPERS = """
local function live(v, now)
  if not v then return false end
  local form = string.byte(v, 1)
  if form == 2 then return #v >= 22 end
  if form ~= 1 or #v < 30 then return false end
  return struct.unpack('<d', v, 2) > now
end
local function key_at(v)
  if string.byte(v, 1) == 2 then return 22 end
  return 30
end
local function keep_bucket(k, ttl)
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
local function sweep(k, now)
  local all = redis.call('HGETALL', k)
  for j = 1, #all, 2 do
    if not live(all[j + 1], now) then redis.call('HDEL', k, all[j]) end
  end
end
"""

# The request path. KEYS[i] is the bucket of the i-th fingerprint; ARGV[1] is now, ARGV[2]
# '1' to stop at the first miss (only the hit run comes back) or '0' for every entry (false
# for a miss). The fields: when ARGV[3] is a width w > 0, ARGV[4] holds them all, w bytes
# each (one argument instead of a hundred: Redis parses and Lua copies each argument, and
# that cost as much as the walk); when it is '0', field i is ARGV[i + 3]. Never writes.
_LOOKUP_SCRIPT = """
local now = tonumber(ARGV[1])
local walk = ARGV[2] == '1'
local w = tonumber(ARGV[3])
local blob = ARGV[4]
local out = {}
for i = 1, #KEYS do
  local f
  if w > 0 then f = string.sub(blob, w * i - w + 1, w * i) else f = ARGV[i + 3] end
  local v = redis.call('HGET', KEYS[i], f)
  if v and #v >= 30 and string.byte(v, 1) == 1 and struct.unpack('<d', v, 2) <= now then
    v = false
  end
  if not v then
    if walk then break end
    v = false
  end
  out[i] = v
end
return out
"""

# SET NX per entry: KEYS[i] and ARGV[2i + 2], ARGV[2i + 3] are the bucket, field and value of
# the i-th entry; ARGV[1] now, ARGV[2] the TTL in ms, ARGV[3] '1' for field TTL (format 2
# values: HSET clears a field's TTL, so HPEXPIRE follows it). An expired or garbage value
# counts as absent. Every 32nd new field of a bucket sweeps the bucket's expired fields, so a
# bucket that keeps receiving entries cannot keep dead ones forever (with field TTL the
# server removes its own; the sweep finds value-expiry entries written before a switch).
_REGISTER_SCRIPT = (
    _LUA_HELPERS
    + """
local now, ttl, field_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == '1'
local out = {}
for i = 1, #KEYS do
  local k, f = KEYS[i], ARGV[2 * i + 2]
  if live(redis.call('HGET', k, f), now) then
    out[i] = 0
  else
    local new = redis.call('HSET', k, f, ARGV[2 * i + 3]) == 1
    if field_ttl then redis.call('HPEXPIRE', k, ttl, 'FIELDS', 1, f) end
    if new and redis.call('HLEN', k) % 32 == 0 then sweep(k, now) end
    keep_bucket(k, ttl)
    out[i] = 1
  end
end
return out
"""
)

# Sliding TTL, from the background thread: KEYS[i] and ARGV[i + 3] are a bucket and a field;
# ARGV[1] now, ARGV[2] the new expiry, ARGV[3] the TTL in ms. Only a live value is rewritten,
# and only forwards, so a late renewal never resurrects an entry deleted or expired meanwhile.
# A field-TTL value (format 2, only on servers that have HPEXPIRE) gets HPEXPIRE GT: a field
# that is gone stays gone. Returns (i, previous expiry in ms or -1 for a value that carries its
# own, value) for every entry renewed: what the index's bookkeeping moves to the new expiry
# (kvcloud.indexes.redis_stats).
_RENEW_SCRIPT = (
    _LUA_HELPERS
    + """
local now, new, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = 1, #KEYS do
  local k, f = KEYS[i], ARGV[i + 3]
  local v = redis.call('HGET', k, f)
  if v and string.byte(v, 1) == 2 then
    local was = redis.call('HPEXPIRETIME', k, 'FIELDS', 1, f)[1]
    if redis.call('HPEXPIRE', k, ttl, 'GT', 'FIELDS', 1, f)[1] == 1 then
      keep_bucket(k, ttl)
      out[#out + 1] = i
      out[#out + 1] = was
      out[#out + 1] = v
    end
  elseif live(v, now) and struct.unpack('<d', v, 2) < new then
    redis.call('HSET', k, f, string.sub(v, 1, 1) .. struct.pack('<d', new) .. string.sub(v, 10))
    keep_bucket(k, ttl)
    out[#out + 1] = i
    out[#out + 1] = -1
    out[#out + 1] = v
  end
end
return out
"""
)

# Compare-and-delete in one atomic step: KEYS[1] the bucket, ARGV[1] now, ARGV[2] the field,
# ARGV[3] the packed object key the caller verified ('' for any). A concurrent
# re-registration to a new object is never lost. Returns 0, or (value, its field expiry in ms,
# -1 where the value carries its own) for the bookkeeping.
_DROP_SCRIPT = (
    _LUA_HELPERS
    + """
local v = redis.call('HGET', KEYS[1], ARGV[2])
if not v then return 0 end
if live(v, tonumber(ARGV[1])) then
  if ARGV[3] ~= '' and string.sub(v, key_at(v)) ~= ARGV[3] then return 0 end
elseif ARGV[3] ~= '' or (#v >= 30 and string.byte(v, 1) == 1) then
  return 0
end
local was = -1
if string.byte(v, 1) == 2 then
  local r = redis.pcall('HPEXPIRETIME', KEYS[1], 'FIELDS', 1, ARGV[2])
  if type(r) == 'table' and type(r[1]) == 'number' then was = r[1] end
end
if redis.call('HDEL', KEYS[1], ARGV[2]) == 0 then return 0 end
return {v, was}
"""
)

# Compare-and-delete of an entry in the layout before 0.13 (one msgpack string per entry).
_LEGACY_DROP_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, entry = pcall(cmsgpack.unpack, raw)
if not ok or type(entry) ~= 'table' or entry[1] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""

# Entries registered or renewed per script call: bounds how long one call keeps the
# (single-threaded) server busy.
_WRITE_BATCH = 512

SOURCES = {
    "lookup": _LOOKUP_SCRIPT,
    "register": _REGISTER_SCRIPT,
    "renew": _RENEW_SCRIPT,
    "drop": _DROP_SCRIPT,
    "legacy_drop": _LEGACY_DROP_SCRIPT,
}


class Scripts:
    """The scripts, registered on ``client`` (no round trip: loaded on first use), and the
    pipelines that run them in one round trip each, loading them again when the server has
    lost them. ``single_key``: one key per script call (Redis Cluster)."""

    def __init__(self, client: Any, single_key: bool) -> None:
        self._client = client
        self._single_key = single_key
        self._scripts = {n: client.register_script(s) for n, s in SOURCES.items()}

    @property
    def step(self) -> int:
        """Entries per script call of a batched write."""
        return 1 if self._single_key else _WRITE_BATCH

    def run(self, name: str, keys: Sequence[str], args: Sequence[Any], pipe: Any = None) -> Any:
        """Run script ``name`` now (one EVALSHA, loading it if need be) or, given ``pipe``,
        add it to that pipeline."""
        if pipe is None:
            return self._scripts[name](keys=list(keys), args=list(args))
        if self._single_key:
            # A cluster pipeline cannot load a script on the node it lands on: send the source
            # (off the request path, so its few hundred bytes do not matter).
            return pipe.execute_command("EVAL", SOURCES[name], len(keys), *keys, *args)
        # EVALSHA by hand: a pipeline given Script objects asks SCRIPT EXISTS first, which is
        # a second round trip every time; execute() loads them when the server says NOSCRIPT.
        sha = self._scripts[name].sha
        return pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)

    def execute(self, build: Callable[[Any, bool], None]) -> list[Any]:
        """Run the pipeline ``build(pipe, first)`` fills, in one round trip. If the server has
        lost the scripts (restart, SCRIPT FLUSH), load them and run it once more with
        ``first`` False: every EVALSHA failed then, but any other command in it ran."""
        for first in (True, False):
            pipe = self._client.pipeline(transaction=False)
            build(pipe, first)
            if not len(pipe):
                return []
            try:
                return pipe.execute()
            except rexc.NoScriptError:
                if not first:
                    raise
                for script in self._scripts.values():
                    script.sha = self._client.script_load(script.script)
        raise AssertionError("unreachable")

    def run_batches(
        self, name: str, keys: list[str], head: list[Any], per_key: list[list[Any]]
    ) -> list[Any]:
        """Run a per-entry script over many entries: one EVALSHA per _WRITE_BATCH entries,
        all in one pipeline (one round trip); one single-key script each on a cluster."""
        step = self.step

        def build(pipe: Any, first: bool) -> None:
            for i in range(0, len(keys), step):
                args = [*head, *(a for group in per_key[i : i + step] for a in group)]
                self.run(name, keys[i : i + step], args, pipe)

        replies = self.execute(build)
        return [r for reply in replies for r in (reply if isinstance(reply, list) else [reply])]


__all__ = ["SOURCES", "Scripts"]
