//! The Lua scripts that decide a record's transitions inside Redis, each one atomic step on
//! the one key it touches.
//!
//! Records are packed strings (`packed.rs`). A record an earlier store wrote is a hash
//! (fields `state`, `fingerprint`, `owner`, `record`, `expires_at_ms`, `written_at_ms`, its
//! instants on Redis's clock); every script still decides on it as that store did, so an
//! upgrade loses nothing recorded and the hashes leave as they expire. A claim is not a
//! script at all while the key is free or a string (`SET NX PX GET`); `LEGACY_CLAIM_LUA` is
//! sent only when that finds a hash.
//!
//! The scripts implement `idempotency_protocol::decision` (`claim`, `complete`, `release`,
//! `renew`), which the other backends and the filter's local table call directly. A change
//! to one side must be made to the other; `tests/contract.rs` runs the same cases against
//! every backend, and against records in the older layout.

/// The packed layout in Lua: read it (None for anything else), and write it. Prepended to
/// every script that reads or writes a packed record.
const PACKED_LUA: &str = r"
local function ms(n) return string.format('%d', n) end
local function read_packed(v)
  if string.sub(v, 1, 2) == 't1' then
    if string.len(v) < 46 then return nil end
    local function instant(at)
      local n = 0
      for i = at, at + 5 do n = n * 256 + string.byte(v, i) end
      return ms(n)
    end
    local hex = string.gsub(string.sub(v, 3, 34), '.',
      function(c) return string.format('%02x', string.byte(c)) end)
    return {'T', hex, '', instant(35), instant(41), record_at = 47}
  end
  if string.sub(v, 1, 3) ~= 'i1\n' then return nil end
  local f, pos = {}, 4
  for i = 1, 5 do
    local e = string.find(v, '\n', pos, true)
    if not e then return nil end
    f[i] = string.sub(v, pos, e - 1)
    pos = e + 1
  end
  f.record_at = pos
  return f
end
local function packed(state, fingerprint, owner, expires_at, written_at, record)
  return 'i1\n' .. state .. '\n' .. fingerprint .. '\n' .. owner .. '\n' .. expires_at ..
    '\n' .. written_at .. '\n' .. record
end
local function tombstoned(fingerprint, expires_at, written_at, tombstone)
  local function instant(n)
    local b = {}
    for i = 6, 1, -1 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
    return table.concat(b)
  end
  local bytes = string.gsub(fingerprint, '..',
    function(h) return string.char(tonumber(h, 16)) end)
  return 't1' .. bytes .. instant(expires_at) .. instant(written_at) .. tombstone
end
local k = KEYS[1]
local kind = redis.call('TYPE', k)['ok']
local value, current = nil, nil
if kind == 'string' then
  value = redis.call('GET', k)
  current = read_packed(value)
  if not current then return redis.error_reply('idempotency: unreadable record at ' .. k) end
end
-- A completed record, kept `ttl` ms (until `expires_at`). With `tomb`, it is kept that much
-- longer as `tombstone` (the `t1` layout) and the whole response is KEYS[2], kept `ttl`.
local function keep_completed(fingerprint, expires_at, written_at, ttl, tomb, record, tombstone)
  if tomb > 0 then
    redis.call('SET', k, tombstoned(fingerprint, expires_at + tomb, written_at, tombstone),
      'PX', ttl + tomb)
    redis.call('SET', KEYS[2], record, 'PX', ttl)
  else
    redis.call('SET', k, packed('C', fingerprint, '', ms(expires_at), ms(written_at), record),
      'PX', ttl)
  end
end
";

/// `decision::claim` for a record in the older layout (a hash), sent when `SET NX GET`
/// met one. ARGV: fingerprint, lease_ms, owner. Mismatch, then AlreadyClaimed (the
/// caller's own claim: its lease end, unchanged), then InFlight (retry_after_ms: the key's
/// PTTL, at least 1), then Replay. The hash may have expired since: the claim is then
/// made as a packed string, as `SET NX` would have made it (ARGV[4] is that value).
pub const LEGACY_CLAIM_LUA: &str = r"
local k = KEYS[1]
local cur = redis.call('HMGET', k, 'state', 'fingerprint', 'owner', 'expires_at_ms')
if cur[1] then
  if cur[2] ~= ARGV[1] then return {'mismatch'} end
  if cur[1] == 'in_flight' and cur[3] == ARGV[3] then
    return {'claimed', tonumber(cur[4])}
  end
  if cur[1] == 'in_flight' then
    local left = redis.call('PTTL', k)
    if left < 1 then left = 1 end
    return {'in_flight', left}
  end
  return {'completed', redis.call('HGET', k, 'record')}
end
if redis.call('SET', k, ARGV[4], 'NX', 'PX', ARGV[2]) then return {'fresh'} end
return {'raced'}
";

/// `decision::complete`. KEYS: the record, where a record with a tombstone keeps its whole
/// response. ARGV: owner, ttl_ms, record bytes, fingerprint (may be empty), now_ms,
/// tombstone_ms, the tombstone's bytes. With a tombstone, the record (the binary `t1`
/// layout, read as state `T`) holds the tombstone until its end and the whole response is a
/// second string kept `ttl_ms`. The caller's own in-flight claim → `Record`; a completed
/// record whose stored bytes equal ARGV[3], or whose tombstone is ARGV[7] → a retried
/// complete, `AlreadyRecorded`: confirm it and leave the
/// record and its expiry as they are (Lua strings are 8-bit clean, so `==` compares the raw
/// bytes); no record and a fingerprint → `RecordAfresh`; else `NotOwner`. Unlike the other
/// backends, a lapsed lease is already gone here (Redis expired it), so its owner's late
/// complete is recorded only through `RecordAfresh` (with a fingerprint) and refused
/// without one.
pub fn complete() -> String {
    format!("{PACKED_LUA}{COMPLETE_BODY}")
}

const COMPLETE_BODY: &str = r"
local ttl, now, tomb = tonumber(ARGV[2]), tonumber(ARGV[5]), tonumber(ARGV[6])
local function record_as(fingerprint)
  keep_completed(fingerprint, now + ttl, now, ttl, tomb, ARGV[3], ARGV[7])
  return 'completed'
end
if kind == 'hash' then
  local cur = redis.call('HMGET', k, 'state', 'owner', 'fingerprint', 'record')
  if cur[1] == 'in_flight' and cur[2] == ARGV[1] then return record_as(cur[3]) end
  if cur[1] == 'completed' and cur[4] == ARGV[3] then return 'completed' end
  return 'not_owner'
end
if current then
  if current[1] == 'F' and current[3] == ARGV[1] then return record_as(current[2]) end
  if current[1] == 'C' and string.sub(value, current.record_at) == ARGV[3] then
    return 'completed'
  end
  if current[1] == 'T' and (redis.call('GET', KEYS[2]) == ARGV[3]
      or string.sub(value, current.record_at) == ARGV[7]) then
    return 'completed'
  end
  return 'not_owner'
end
if kind == 'none' and ARGV[4] ~= '' then
  -- The claim's lease ran out (Redis deleted it) while the completion waited out an
  -- outage, and nobody claimed the key since: record what executed.
  return record_as(ARGV[4])
end
return 'not_owner'
";

/// `decision::release`. ARGV: owner. Only the owner's in-flight claim is removed; anything
/// else is `NotOwner`.
pub fn release() -> String {
    format!("{PACKED_LUA}{RELEASE_BODY}")
}

const RELEASE_BODY: &str = r"
local state, owner
if kind == 'hash' then
  local cur = redis.call('HMGET', k, 'state', 'owner')
  state, owner = (cur[1] == 'in_flight') and 'F' or 'C', cur[2]
elseif current then
  state, owner = current[1], current[3]
end
if state ~= 'F' or owner ~= ARGV[1] then return 'not_owner' end
redis.call('DEL', k)
return 'released'
";

/// `decision::renew`. ARGV: owner, lease_ms, now_ms. Only the owner's in-flight claim is
/// renewed (a lapsed one is gone already, as for complete and release). Its Redis expiry
/// becomes the later of what is left of it (`PTTL`) and a full lease from now, decided on
/// Redis's clock alone, so a store replica whose clock runs behind another's never shortens
/// a lease. Answers {'renewed', lease end} (unchanged when the lease left is the longer) or
/// {'not_owner'}.
pub fn renew() -> String {
    format!("{PACKED_LUA}{RENEW_BODY}")
}

const RENEW_BODY: &str = r"
local lease, now = tonumber(ARGV[2]), tonumber(ARGV[3])
local held
if kind == 'hash' then
  local cur = redis.call('HMGET', k, 'state', 'owner', 'expires_at_ms')
  if cur[1] ~= 'in_flight' or cur[2] ~= ARGV[1] then return {'not_owner'} end
  held = tonumber(cur[3])
elseif not current or current[1] ~= 'F' or current[3] ~= ARGV[1] then
  return {'not_owner'}
else
  held = tonumber(current[4])
end
if redis.call('PTTL', k) >= lease then return {'renewed', held or (now + lease)} end
if kind == 'hash' then
  redis.call('HSET', k, 'expires_at_ms', ms(now + lease))
  redis.call('PEXPIRE', k, lease)
else
  redis.call('SET', k, packed('F', current[2], current[3], ms(now + lease), current[5], ''),
    'PX', lease)
end
return {'renewed', now + lease}
";

/// `Storage::settle`. KEYS as for `complete`. ARGV: the current record's bytes, the
/// replacement's ('' with 'remove'), its ttl_ms ('0': keep the current expiry), now_ms,
/// 'replace' or 'remove', tombstone_ms, the replacement's tombstone. Only a completed record
/// holding exactly ARGV[1] is settled; anything else is 'not_found'. The replacement is kept
/// as `complete` keeps a record, its tombstone included.
pub fn settle() -> String {
    format!("{PACKED_LUA}{SETTLE_BODY}")
}

const SETTLE_BODY: &str = r"
local ttl, now, tomb = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6])
local fingerprint, expires_at
if kind == 'hash' then
  local cur = redis.call('HMGET', k, 'state', 'fingerprint', 'record')
  if cur[1] ~= 'completed' or cur[3] ~= ARGV[1] then return 'not_found' end
  fingerprint = cur[2]
elseif current and current[1] == 'C' and string.sub(value, current.record_at) == ARGV[1] then
  fingerprint, expires_at = current[2], tonumber(current[4])
else
  return 'not_found'
end
if ARGV[5] == 'remove' then
  redis.call('DEL', k)
  return 'removed'
end
if ttl == 0 then
  local left = redis.call('PTTL', k)
  if left < 1 then return 'not_found' end
  ttl = left
  expires_at = expires_at or (now + left)
else
  expires_at = now + ttl
end
keep_completed(fingerprint, expires_at, now, ttl, tomb, ARGV[2], ARGV[7])
return 'replaced'
";

/// A lookup, or with ARGV[1] = 'purge' a lookup and delete in one step (so a purge answers
/// exactly what it removed). A packed record comes back as {'packed', value}; a hash as its
/// fields in `parse_view`'s order, then Redis's clock (the clock its instants are on).
pub const RECORD_LUA: &str = r"
local k = KEYS[1]
local kind = redis.call('TYPE', k)['ok']
if kind == 'string' then
  local v = redis.call('GET', k)
  local w = redis.call('GET', KEYS[2])
  if ARGV[1] == 'purge' then redis.call('DEL', k, KEYS[2]) end
  return {'packed', v, w}
end
local v = redis.call('HMGET', k, 'state', 'fingerprint', 'expires_at_ms', 'record',
  'owner', 'written_at_ms')
if not v[1] then return false end
local t = redis.call('TIME')
v[7] = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
if ARGV[1] == 'purge' then redis.call('DEL', k) end
return v
";
