-- post_limited.lua with responses of mixed sizes (the memory run):
--
--   wrk ... -s bench/wrk/post_mixed.lua <url> -- <nonce> <body> <responses per thread> <path> <mix>
--
-- <mix> is "<bytes>[,<every>:<bytes>]...": every request asks the demo upstream for a body of
-- <bytes> (header x-demo-body-bytes), except every <every>-th request of a thread, which asks
-- for the <bytes> paired with it; when several periods divide a request's number, the longest
-- period wins. So "1500,10:16000,100:130000,1000:1000000" sends one request in ten with a
-- 16,000-byte answer, one in a hundred with 130,000, one in a thousand with 1,000,000, and the
-- rest with 1,500: deterministic, and the same for every run. Each key is new ("unique" mode
-- of post.lua). <responses per thread> 0 means no limit (wrk's -d ends the run).

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "post_limited.lua")

local limited_init = init
local base_request = request

function init(args)
   limited_init({"unique", args[1], args[2], args[3], args[4]})
   local mix = args[5] or "0"
   default_bytes = tonumber(mix:match("^(%d+)"))
   periods = {}
   for every, bytes in mix:gmatch("(%d+):(%d+)") do
      table.insert(periods, {every = tonumber(every), bytes = tostring(bytes)})
   end
   table.sort(periods, function(a, b) return a.every < b.every end)
   default_bytes = tostring(default_bytes or 0)
   -- requests sent per size, by position in the mix (0 = the default size)
   for i = 0, #periods do
      _G["sent_size_" .. i] = 0
   end
end

function request()
   local n = sent + 1  -- post.lua's request() counts this request
   local bytes, which = default_bytes, 0
   for i, p in ipairs(periods) do
      if n % p.every == 0 then
         bytes, which = p.bytes, i
      end
   end
   headers["x-demo-body-bytes"] = bytes
   local name = "sent_size_" .. which
   _G[name] = _G[name] + 1
   return base_request()
end

local limited_done = done

function done(summary, latency, requests)
   limited_done(summary, latency, requests)
   local parts = {}
   for i = 0, 9 do
      local total, seen = 0, false
      for _, thread in ipairs(threads) do
         local v = thread:get("sent_size_" .. i)
         if v then
            total, seen = total + v, true
         end
      end
      if seen then
         table.insert(parts, string.format("sent_size_%d=%d", i, total))
      end
   end
   io.write("bench-counts: " .. table.concat(parts, " ") .. "\n")
end
