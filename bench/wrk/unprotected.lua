-- wrk script: a request no rule covers, the same every time, without a body.
--
--   wrk ... -s bench/wrk/unprotected.lua <url> -- <method> <path> ['name: value' ...]
--
-- `make bench` sends `GET /catalog/items/42` and a bodiless `POST /search`, each with the
-- browser-like headers of bench/setups.py (BROWSER_HEADERS): what most of a mesh's traffic
-- looks like to a filter that protects a few write routes.

function init(args)
   method = args[1] or "GET"
   path = args[2] or "/"
   local headers = {}
   for i = 3, #args do
      local name, value = string.match(args[i], "^([^:]+):%s*(.*)$")
      headers[name] = value
   end
   -- Built once: every request is the same bytes.
   req = wrk.format(method, path, headers, nil)
end

function request()
   return req
end
