-- wrk script: POST a small JSON body to the idempotency filter's protected path.
--
--   wrk ... -s bench/wrk/post.lua <url> -- unique <nonce> <body> [path]   every request a new key
--   wrk ... -s bench/wrk/post.lua <url> -- fixed  <key>   <body> [path]   every request the same key
--
-- Unique keys are "<nonce>-<thread>-<n>", so no two requests of one run (and, with a fresh
-- nonce, of two runs) share a key. The path defaults to /orders, which envoy/envoy.yaml
-- protects; any path no rule covers passes the filter untouched.

local thread_count = 0
threads = {}

function setup(thread)
   thread_count = thread_count + 1
   thread:set("id", thread_count)
   table.insert(threads, thread)
end

function init(args)
   mode = args[1] or "unique"
   key_arg = args[2] or "bench"
   body = args[3] or '{"sku":"book","qty":1}'
   path = args[4] or "/orders"
   sent = 0
   prefix = key_arg .. "-" .. tostring(id) .. "-"
   headers = {
      ["Content-Type"] = "application/json",
      ["Idempotency-Key"] = key_arg,
   }
end

function request()
   sent = sent + 1
   if mode == "unique" then
      headers["Idempotency-Key"] = prefix .. sent
   end
   return wrk.format("POST", path, headers, body)
end
