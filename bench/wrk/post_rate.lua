-- post.lua at a fixed rate (open loop, as far as the connections allow):
--
--   wrk ... -s bench/wrk/post_rate.lua <url> -- unique <nonce> <body> <requests/s per thread> [path]
--
-- Each thread keeps a schedule of send times, one every 1/rate s from its first request, and
-- wrk's delay() holds each request until its slot; a slot missed (every connection busy)
-- is sent at once, so the thread catches up rather than slowing down. wrk times each
-- request from when it is written, so the latencies are those of requests sent on schedule
-- as long as few are late: how many were sent more than 2 ms after their slot, and the
-- largest lag, are printed at the end ("bench-counts: late=N max_lag_us=N").
-- wrk delays in whole milliseconds: a request goes out within half a millisecond of its slot.

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "post.lua")

local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } bench_rate_timespec;
int clock_gettime(int clk_id, bench_rate_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local ts = ffi.new("bench_rate_timespec")

local function now_ms()
   ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
   return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

local base_init = init

function init(args)
   base_init({args[1], args[2], args[3], args[5]})
   local rate = tonumber(args[4]) or 0
   if rate <= 0 then
      error("post_rate.lua: requests/s per thread must be a positive number")
   end
   interval_ms = 1000 / rate
   next_ms = nil
   late = 0
   max_lag_us = 0
end

function delay()
   local now = now_ms()
   if next_ms == nil then
      next_ms = now
   end
   local wait = next_ms - now
   next_ms = next_ms + interval_ms
   if wait < 0 then
      if wait < -2 then
         late = late + 1
      end
      local lag = math.floor(-wait * 1000)
      if lag > max_lag_us then
         max_lag_us = lag
      end
      return 0
   end
   return math.floor(wait + 0.5)
end

function done(summary, latency, requests)
   local total_late, worst = 0, 0
   for _, thread in ipairs(threads) do
      total_late = total_late + (thread:get("late") or 0)
      worst = math.max(worst, thread:get("max_lag_us") or 0)
   end
   io.write(string.format("bench-counts: late=%d max_lag_us=%d\n", total_late, worst))
end
