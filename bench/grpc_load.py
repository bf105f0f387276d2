"""Load for the bench's gRPC rows: unary calls of /shop.v1.Orders/PlaceOrder made with grpcio
(the asyncio API, one channel, `--concurrency` calls in flight) for `--seconds`, each with a
new `idempotency-key` (unique) or the same one (fixed). wrk cannot speak gRPC; this is the
library users' clients are built on. Prints one JSON line: calls, OK calls, errors by code,
calls/s, and p50/p99 latency in ms.

  python bench/grpc_load.py --target 127.0.0.1:PORT --seconds 10 --mode unique --key NONCE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

PLACE = "/shop.v1.Orders/PlaceOrder"


async def worker(stub, mode: str, key: str, n: int, message: bytes, deadline: float,
                 latencies: list[float], errors: dict[str, int]) -> None:
    sent = 0
    while time.monotonic() < deadline:
        sent += 1
        this_key = f"{key}-{n}-{sent}" if mode == "unique" else key
        started = time.perf_counter()
        try:
            await stub(message, metadata=(("idempotency-key", this_key),), timeout=5)
            latencies.append((time.perf_counter() - started) * 1000)
        except grpc.aio.AioRpcError as e:
            errors[e.code().name] = errors.get(e.code().name, 0) + 1


async def main_async(args: argparse.Namespace) -> dict:
    options = [("grpc.enable_retries", 0), ("grpc.default_authority", args.authority)]
    async with grpc.aio.insecure_channel(args.target, options=options) as channel:
        stub = channel.unary_unary(PLACE)
        latencies: list[float] = []
        errors: dict[str, int] = {}
        started = time.monotonic()
        deadline = started + args.seconds
        await asyncio.gather(*(worker(stub, args.mode, args.key, n, args.message.encode(), deadline,
                                      latencies, errors) for n in range(args.concurrency)))
        elapsed = time.monotonic() - started
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(len(latencies) * p))] if latencies else 0.0

    calls = len(latencies) + sum(errors.values())
    return {"calls": calls, "ok": len(latencies), "errors": errors, "seconds": elapsed,
            "rps": calls / elapsed if elapsed > 0 else 0.0, "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--mode", choices=("unique", "fixed"), default="unique")
    p.add_argument("--key", default="bench")
    p.add_argument("--message", default='{"sku":"book","qty":1}')
    p.add_argument("--authority", default="shop.test")
    print(json.dumps(asyncio.run(main_async(p.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
