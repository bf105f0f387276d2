-- wrk script: POST /v1/claim to the idempotency store with a new 64-hex key per request.
--
--   wrk ... -s bench/wrk/store_claim.lua http://127.0.0.1:PORT -- <token> <nonce>
--
-- A key is 48 random hex digits chosen once per thread, then the thread number and a
-- counter (8 hex digits each): random-looking, and unique within the run.

local thread_count = 0

function setup(thread)
   thread_count = thread_count + 1
   thread:set("id", thread_count)
end

local hex = "0123456789abcdef"

function init(args)
   local token = args[1] or "bench-token"
   local nonce = tonumber(args[2]) or os.time()
   math.randomseed(nonce * 131 + id * 7919)
   local digits = {}
   for i = 1, 48 do
      local d = math.random(1, 16)
      digits[i] = hex:sub(d, d)
   end
   prefix = table.concat(digits) .. string.format("%08x", id)
   sent = 0
   headers = {
      ["Content-Type"] = "application/json",
      ["Authorization"] = "Bearer " .. token,
   }
   fingerprint = string.rep("ab", 32)
end

function request()
   sent = sent + 1
   local key = prefix .. string.format("%08x", sent)
   local body = '{"key":"' .. key .. '","fingerprint":"' .. fingerprint .. '","lease_ms":60000}'
   return wrk.format("POST", "/v1/claim", headers, body)
end
