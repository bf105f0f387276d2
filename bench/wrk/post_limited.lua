-- post.lua, stopping each thread after a number of responses (the memory run):
--
--   wrk ... -s bench/wrk/post_limited.lua <url> -- unique <nonce> <body> <responses per thread> [path]
--
-- Each thread stops after its share of responses; 503 answers (table_full under load) are
-- counted per thread and the totals printed at the end.

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "post.lua")

local base_init = init

function init(args)
   base_init({args[1], args[2], args[3], args[5]})
   limit = tonumber(args[4]) or 0
   received = 0
   status_503 = 0
   stopped = false
end

function response(status, headers, body)
   received = received + 1
   if status == 503 then
      status_503 = status_503 + 1
   end
   if limit > 0 and received >= limit and not stopped then
      stopped = true
      -- wrk itself sleeps for its whole -d; bench/run.py sends it SIGINT (which ends that
      -- sleep and prints the summary) once every thread has said this.
      io.stderr:write("bench-thread-done\n")
      io.stderr:flush()
      wrk.thread:stop()
   end
end

function done(summary, latency, requests)
   local total_503 = 0
   local total = 0
   for _, thread in ipairs(threads) do
      total_503 = total_503 + (thread:get("status_503") or 0)
      total = total + (thread:get("received") or 0)
   end
   io.write(string.format("bench-counts: received=%d status_503=%d\n", total, total_503))
end
