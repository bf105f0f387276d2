"""The soak's clients: bounded worker threads that each pick a scenario at random (seeded),
run it through either Envoy and file every request in the ledger.

Every loop here ends by count and by time: a worker stops at the traffic deadline or after
``MAX_ITERATIONS`` scenarios, every request has a client timeout, every wait a deadline.
Requests go to the Envoys' loopback listeners only.
"""

from __future__ import annotations

import random
import socket
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import h11
import httpx

import client
import cluster
import harness
from ledger import (
    CUT_AFTER_SEND,
    CUT_MID_REQUEST,
    CUT_MID_RESPONSE,
    Attempt,
    Clock,
    FaultLog,
    KeyRecord,
    Ledger,
)
from topology import (
    HEADER_KEY_RULES,
    KIB,
    LEASE_SECONDS,
    MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES,
    MIB,
    RELEASED_STATUSES,
    ROUTE_TIMEOUT_SECONDS,
    RULES,
    Rule,
    Topology,
    envoy_buffer_limit,
)

# Longer than the route timeout plus a store round, so only a stuck Envoy makes a client give up.
REQUEST_TIMEOUT = ROUTE_TIMEOUT_SECONDS + 7.0
MAX_ITERATIONS = 100_000  # per worker; the traffic deadline ends them long before
MAX_ATTEMPTS_PER_KEY = 40  # retries the traffic phase schedules for one key, at most
FINAL_TRIES_PER_ENVOY = 40  # the final round's tries per key and Envoy, at most
NETWORK_ERRORS = (OSError, ConnectionError, TimeoutError, h11.ProtocolError)

# How often each scenario runs, relative to the others.
SCENARIO_WEIGHTS = {
    "new_write": 30,
    "retry": 34,
    "concurrent_duplicates": 4,
    "in_flight_conflict": 3,
    "released_status": 4,
    "gave_up_status": 2,
    "reset_mid_request": 4,
    "reset_after_send": 2,
    "reset_mid_response": 3,
    "oversized_over_rule_limit": 2,
    "oversized_over_buffer": 1,
    "malformed_key": 4,
    "malformed_body": 3,
    "key_reused_with_another_body": 2,
    "lease_takeover": 1,
}
RULE_WEIGHTS = {"embedded": 30, "redis": 30, "open": 15, "bodykey": 15, "wait": 10}

# (variant, Idempotency-Key header value or None for none, problem types the filter may answer)
MALFORMED_KEYS = [
    ("empty", "", ("invalid-key",)),
    ("256_bytes", "k" * 256, ("invalid-key",)),
    ("not_ascii", b"caf\xe9-\xff", ("invalid-key",)),
    ("unterminated_quote", '"abc', ("invalid-key",)),
    ("missing", None, ("missing-key",)),
]
# Bodies of the `bodykey` rule its JSON key source cannot read (docs/recipes.md).
BODY_KEY_PROBLEMS = ("invalid-key", "missing-key")
MALFORMED_BODIES = [
    ("truncated_json", b'{"order_id": "abc'),
    ("no_key_field", b'{"sku": "book", "qty": 1}'),
    ("non_scalar_key", b'{"order_id": {"nested": 1}}'),
    ("not_json", b"order_id=abc&qty=1"),
    ("key_given_twice", b'{"order_id": "a", "order_id": "b"}'),
]


def describe_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:120]}"


def answer_waiting(sock: socket.socket) -> bool:
    """Whether Envoy has already written something back, or closed (without reading it)."""
    timeout = sock.gettimeout()
    sock.settimeout(0.0)  # with a timeout, Python would wait for data before the recv
    try:
        sock.recv(1, socket.MSG_PEEK)
        return True  # data, or b"" for a close
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # reset by Envoy
    finally:
        sock.settimeout(timeout)


class Traffic:
    def __init__(self, topology: Topology, clock: Clock, ledger: Ledger, faults: FaultLog,
                 *, seed: int, workers: int) -> None:
        self.topology = topology
        self.clock = clock
        self.ledger = ledger
        self.faults = faults
        self.seed = seed
        self.workers = workers
        self.slow_upstream = threading.Event()  # set by the fault scheduler
        self.stop = threading.Event()
        self.until = 0.0
        self.harness_errors: list[str] = []
        self.buffer_limit = envoy_buffer_limit()
        # For the requests a scenario sends at the same time as its own (duplicates, the slow
        # first attempt of a takeover). Its tasks never wait on it, so it cannot deadlock.
        self.companions = ThreadPoolExecutor(max_workers=32, thread_name_prefix="companion")
        self._threads: list[threading.Thread] = []
        self.scenarios: dict[str, Callable[[random.Random], None]] = {
            name: getattr(self, name) for name in SCENARIO_WEIGHTS
        }

    # -- running -----------------------------------------------------------

    def start(self, until: float) -> None:
        self.until = until
        for index in range(self.workers):
            thread = threading.Thread(target=self._worker, args=(index,), name=f"worker-{index}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def join(self, deadline: float) -> list[str]:
        """Waits for the workers (each ends its scenario first) until ``deadline`` on the
        clock; the names of those still running then."""
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - self.clock.now()))
        self.companions.shutdown(wait=False, cancel_futures=True)
        return [t.name for t in self._threads if t.is_alive()]

    def _worker(self, index: int) -> None:
        rng = random.Random(self.seed * 1_000 + index)
        names = list(SCENARIO_WEIGHTS)
        weights = [SCENARIO_WEIGHTS[n] for n in names]
        for _ in range(MAX_ITERATIONS):
            if self.stop.is_set() or self.clock.now() >= self.until:
                return
            name = rng.choices(names, weights)[0]
            try:
                self.scenarios[name](rng)
            except Exception:  # noqa: BLE001 - a harness bug must not hide behind a dead thread
                self.harness_errors.append(f"{name}: {traceback.format_exc()}")
            time.sleep(rng.uniform(0.005, 0.03))

    # -- keys and requests -------------------------------------------------

    def envoys(self, rng: random.Random) -> tuple[harness.Envoy, harness.Envoy]:
        """Both Envoys, in random order: the first for the request, the other for its twin."""
        first, second = rng.sample(self.topology.envoys, 2)
        return first, second

    def new_record(self, kind: str, rule: Rule, *, body_padding: int = 0, **fields) -> KeyRecord:
        key = str(uuid.uuid4())
        path = f"{rule.prefix}orders/{uuid.uuid4().hex}"
        body = (b'{"order_id":"' + key.encode() + b'","sku":"book","qty":1,"note":"'
                + b"n" * body_padding + b'"}')
        return self.ledger.add(kind=kind, rule=rule, path=path,
                               key=None if rule.key_from_body else key, body=body, **fields)

    def pick_rule(self, rng: random.Random, rules: list[Rule] | None = None) -> Rule:
        rules = rules or list(RULES.values())
        return rng.choices(rules, [RULE_WEIGHTS[r.name] for r in rules])[0]

    def _begin(self, record: KeyRecord, envoy: harness.Envoy, kind: str,
               headers: dict[str, str]) -> Attempt:
        now = self.clock.now()
        body_bytes = headers.get("x-demo-body-bytes")
        status = headers.get("x-demo-status")
        return record.add(Attempt(
            kind=kind, envoy=envoy.name, sent=now, faults=self.faults.active_ids(now),
            delay_ms=int(headers.get("x-demo-delay-ms", 0)),
            demo_status=int(status) if status else None,
            body_bytes_asked=int(body_bytes) if body_bytes else None))

    def send(self, record: KeyRecord, envoy: harness.Envoy, kind: str, *,
             headers: dict[str, str] | None = None, body: bytes | None = None,
             timeout: float = REQUEST_TIMEOUT) -> Attempt:
        """The key's request (or ``body`` instead of its own) through ``envoy``, recorded."""
        headers = dict(headers or {})
        attempt = self._begin(record, envoy, kind, headers)
        try:
            resp = cluster.post(envoy, record.path, record.key,
                                body=record.body if body is None else body,
                                headers={"content-type": "application/json", **headers},
                                timeout=timeout)
            attempt.take_response(resp)
        except client.HTTPError as err:
            attempt.error = describe_error(err)
            attempt.reached_envoy = not isinstance(err, httpx.ConnectError)
        attempt.ended = self.clock.now()
        return attempt

    def send_and_hang_up(self, record: KeyRecord, envoy: harness.Envoy, kind: str, cut: str, *,
                         rng: random.Random, headers: dict[str, str] | None = None,
                         wait: float = 0.0, body_bytes_sent: int | None = None,
                         recv_buffer: int | None = None) -> Attempt:
        """The key's request on a socket this thread holds, then a hang-up (RST mostly, FIN
        sometimes): after ``wait`` seconds, or once the answer's head has arrived for
        ``CUT_MID_RESPONSE``. A cut is recorded only if Envoy had not answered before it."""
        headers = dict(headers or {})
        attempt = self._begin(record, envoy, kind, headers)
        try:
            with cluster.raw_post(envoy, record.path, record.key or "", body=record.body,
                                  headers=headers, recv_buffer=recv_buffer,
                                  body_bytes_sent=body_bytes_sent) as raw:
                if cut != CUT_MID_RESPONSE:
                    time.sleep(wait)
                if cut == CUT_MID_RESPONSE or answer_waiting(raw.sock):
                    head = raw.read_head(timeout=REQUEST_TIMEOUT)
                    attempt.take_head(head.status, head.headers)
                    if attempt.from_upstream and cut == CUT_MID_RESPONSE:
                        attempt.cut = cut
                    else:
                        # The filter's own answer (409, 503, ...) or one that came before
                        # the hang-up: small, read whole.
                        attempt.take_body(raw.read_body(timeout=5.0))
                else:
                    attempt.cut = cut
                if rng.random() < 0.75:
                    raw.abort()  # RST; otherwise leaving the block closes with a FIN
        except NETWORK_ERRORS as err:
            attempt.error = describe_error(err)
            attempt.reached_envoy = not isinstance(err, ConnectionRefusedError)
        attempt.ended = self.clock.now()
        return attempt

    def follow_up(self, record: KeyRecord, attempt: Attempt, rng: random.Random,
                  after: float = 1.0) -> None:
        """Retry a key that got no final answer (409 says Retry-After 1); now and then come
        back to a completed one too, so replays are checked long after, across faults."""
        if len(record.attempts) >= MAX_ATTEMPTS_PER_KEY:
            return
        if not attempt.final:
            self.ledger.retry_later(record, after + rng.uniform(0, 0.5))
        elif rng.random() < 0.25:
            self.ledger.retry_later(record, rng.uniform(3, 40))

    # -- scenarios ---------------------------------------------------------

    def new_write(self, rng: random.Random) -> None:
        """A new key. During a slow-upstream window most ask for a delay past the lease (a
        client that times out retries then: lease renewal keeps it from being taken over, but
        in a store outage) or past the route timeout (Envoy's 504 is an unknown outcome:
        retries get 409 outcome-unknown)."""
        record = self.new_record("new_write", self.pick_rule(rng))
        headers: dict[str, str] = {}
        retry_after = 1.0
        if self.slow_upstream.is_set() and rng.random() < 0.6:
            past_lease = rng.random() < 0.7
            delay = (rng.randint(LEASE_SECONDS * 1000 + 500, ROUTE_TIMEOUT_SECONDS * 1000 - 1000)
                     if past_lease else
                     rng.randint(ROUTE_TIMEOUT_SECONDS * 1000 + 500, ROUTE_TIMEOUT_SECONDS * 1000 + 2000))
            headers["x-demo-delay-ms"] = str(delay)
            # The impatient client's retry, queued before the slow answer comes back.
            self.ledger.retry_later(record, LEASE_SECONDS + rng.uniform(0.3, 1.5))
        elif rng.random() < 0.3:
            headers["x-demo-delay-ms"] = str(rng.randint(20, 300))
        if rng.random() < 0.08:
            # Larger than the small table's largest page (128 KiB), or than max_response_bytes.
            headers["x-demo-body-bytes"] = str(rng.choice([64 * KIB, 300 * KIB, MAX_RESPONSE_BYTES + 100 * KIB]))
        envoy, _ = self.envoys(rng)
        attempt = self.send(record, envoy, "new_write", headers=headers)
        self.follow_up(record, attempt, rng, retry_after)

    def retry(self, rng: random.Random) -> None:
        """A retry owed to a key, or of an earlier key (across the faults so far)."""
        record = self.ledger.due_retry() or self.ledger.pick_earlier(rng)
        if record is None:
            return self.new_write(rng)
        envoy, _ = self.envoys(rng)
        attempt = self.send(record, envoy, "retry")
        self.follow_up(record, attempt, rng)

    def concurrent_duplicates(self, rng: random.Random) -> None:
        """Six copies of one new write at once, alternating between the Envoys; each answer
        takes 300 ms upstream, so the others arrive while it runs."""
        record = self.new_record("concurrent_duplicates", self.pick_rule(rng, HEADER_KEY_RULES))
        envoys = self.envoys(rng)
        futures = [self.companions.submit(self.send, record, envoys[i % 2], "concurrent_duplicate",
                                          headers={"x-demo-delay-ms": "300"}) for i in range(6)]
        attempts = [f.result(timeout=REQUEST_TIMEOUT + 30) for f in futures]
        final = next((a for a in attempts if a.final), attempts[-1])
        self.follow_up(record, final, rng)

    def in_flight_conflict(self, rng: random.Random) -> None:
        """A slow write through one Envoy, its duplicate through the other while it runs:
        the duplicate should get 409."""
        record = self.new_record("in_flight_conflict", self.pick_rule(rng, HEADER_KEY_RULES))
        first_envoy, other = self.envoys(rng)
        first = self.companions.submit(self.send, record, first_envoy, "in_flight_first",
                                       headers={"x-demo-delay-ms": "1500"})
        time.sleep(0.4)
        self.send(record, other, "in_flight_duplicate")
        self.follow_up(record, first.result(timeout=REQUEST_TIMEOUT + 30), rng)

    def released_status(self, rng: random.Random) -> None:
        """The upstream answers a status the filter releases: the retry executes again."""
        record = self.new_record("released_status", self.pick_rule(rng))
        status = rng.choice([500, 503, 429, 408])
        envoy, _ = self.envoys(rng)
        attempt = self.send(record, envoy, "released_status", headers={"x-demo-status": str(status)})
        self.follow_up(record, attempt, rng, after=0.5)

    def gave_up_status(self, rng: random.Random) -> None:
        """The upstream answers a gateway error itself, as a proxy behind Envoy that gave up
        would: an unknown outcome, which no retry runs again."""
        record = self.new_record("gave_up_status", self.pick_rule(rng))
        status = rng.choice([502, 504])
        envoy, _ = self.envoys(rng)
        attempt = self.send(record, envoy, "gave_up_status", headers={"x-demo-status": str(status)})
        self.follow_up(record, attempt, rng, after=0.5)

    def reset_mid_request(self, rng: random.Random) -> None:
        """Headers and part of the body, then the client dies: nothing may execute, and the
        key must not stay blocked."""
        record = self.new_record("reset_mid_request", self.pick_rule(rng, HEADER_KEY_RULES),
                                 body_padding=rng.randint(1 * KIB, 32 * KIB))
        envoy, _ = self.envoys(rng)
        attempt = self.send_and_hang_up(record, envoy, "reset_mid_request", CUT_MID_REQUEST, rng=rng,
                                        wait=rng.uniform(0.05, 0.3),
                                        body_bytes_sent=rng.randint(1, len(record.body) - 1))
        self.follow_up(record, attempt, rng, after=0.3)

    def reset_after_send(self, rng: random.Random) -> None:
        """The whole request, then the client hangs up while the upstream works on it
        (docs/guarantees.md "When a request is cut short": client gone after the request went
        upstream: an unknown outcome, never run again)."""
        record = self.new_record("reset_after_send", self.pick_rule(rng, HEADER_KEY_RULES))
        envoy, _ = self.envoys(rng)
        attempt = self.send_and_hang_up(record, envoy, "reset_after_send", CUT_AFTER_SEND, rng=rng,
                                        wait=rng.uniform(0.3, 0.8), headers={"x-demo-delay-ms": "2000"})
        self.follow_up(record, attempt, rng)

    def reset_mid_response(self, rng: random.Random) -> None:
        """The client reads the head of a large answer and hangs up (a small receive buffer
        keeps the body in Envoy): recorded without the body, or whole if Envoy held it."""
        record = self.new_record("reset_mid_response", self.pick_rule(rng, HEADER_KEY_RULES))
        size = rng.choice([300 * KIB, 2 * MIB, 3 * MIB])
        envoy, _ = self.envoys(rng)
        attempt = self.send_and_hang_up(record, envoy, "reset_mid_response", CUT_MID_RESPONSE, rng=rng,
                                        headers={"x-demo-body-bytes": str(size)}, recv_buffer=4096)
        self.follow_up(record, attempt, rng, after=0.5)

    def _refused(self, rng: random.Random, kind: str, rule: Rule, variant: str,
                 problems: tuple[str, ...], *, body: bytes | None = None, body_padding: int = 0,
                 key: str | bytes | None | object = ...) -> None:
        """A request the filter must refuse with one of ``problems``, on a key of its own."""
        record = self.new_record(kind, rule, body_padding=body_padding, refused_by_design=True,
                                 expected_problems=problems, variant=variant)
        if key is not ...:
            record.key = key  # type: ignore[assignment]
        if body is not None:
            record.body = body
        envoy, _ = self.envoys(rng)
        self.send(record, envoy, kind)

    def oversized_over_rule_limit(self, rng: random.Random) -> None:
        """A body over the rule's max_request_bytes (within Envoy's buffer): 400."""
        rule = self.pick_rule(rng, HEADER_KEY_RULES)
        self._refused(rng, "oversized_over_rule_limit", rule, "over_max_request_bytes",
                      ("body-too-large",), body_padding=MAX_REQUEST_BYTES + rng.randint(1, 64 * KIB))

    def oversized_over_buffer(self, rng: random.Random) -> None:
        """A body over Envoy's buffer limit: Envoy's 413 or the filter's 400."""
        rule = self.pick_rule(rng, HEADER_KEY_RULES)
        self._refused(rng, "oversized_over_buffer", rule, "over_buffer_limit",
                      ("body-too-large",), body_padding=self.buffer_limit + rng.randint(1 * KIB, 512 * KIB))

    def malformed_key(self, rng: random.Random) -> None:
        variant, key, problems = rng.choice(MALFORMED_KEYS)
        self._refused(rng, "malformed_key", self.pick_rule(rng, HEADER_KEY_RULES), variant,
                      problems, key=key)

    def malformed_body(self, rng: random.Random) -> None:
        variant, body = rng.choice(MALFORMED_BODIES)
        self._refused(rng, "malformed_body", RULES["bodykey"], variant, BODY_KEY_PROBLEMS, body=body)

    def key_reused_with_another_body(self, rng: random.Random) -> None:
        """A completed key sent again with another body: 422, and the record stays intact."""
        record = self.ledger.pick_completed(rng, HEADER_KEY_RULES)
        if record is None:
            return self.new_write(rng)
        envoy, _ = self.envoys(rng)
        self.send(record, envoy, "key_reused", body=record.body[:-2] + b' "}')

    def lease_takeover(self, rng: random.Random) -> None:
        """A write whose upstream outlives the lease, and a retry once the lease has passed:
        a lease takeover (docs/guarantees.md "What can still run twice"), the write runs twice."""
        record = self.new_record("lease_takeover", self.pick_rule(rng, HEADER_KEY_RULES))
        first_envoy, other = self.envoys(rng)
        retry_envoy = rng.choice([first_envoy, other])
        sent = self.clock.now()
        first = self.companions.submit(self.send, record, first_envoy, "lease_takeover_first",
                                       headers={"x-demo-delay-ms": str(LEASE_SECONDS * 1000 + 1500)})
        time.sleep(max(0.0, sent + LEASE_SECONDS + 0.3 - self.clock.now()))
        deadline = self.clock.now() + 3.0
        for _ in range(15):
            retried = self.send(record, retry_envoy, "lease_takeover_retry")
            if retried.status != 409 or self.clock.now() >= deadline:
                break
            time.sleep(0.2)
        first.result(timeout=REQUEST_TIMEOUT + 30)
        # Both have answered: each Envoy must now replay one and the same record.
        for envoy in self.topology.envoys:
            self.send(record, envoy, "lease_takeover_replay")
        self.follow_up(record, retried, rng)

    # -- after the traffic -------------------------------------------------

    def settle_every_key(self, deadline: float, threads: int = 16) -> None:
        """The final round: each key the filter may protect gets a final answer through each
        Envoy (retried through 409s, 503s and released statuses until ``deadline``)."""
        records = [r for r in self.ledger.all() if not r.refused_by_design]
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="final") as pool:
            list(pool.map(lambda r: self._final_answers(r, deadline), records))

    def _final_answers(self, record: KeyRecord, deadline: float) -> None:
        last = record.sorted_attempts()[-1].envoy if record.attempts else None
        order = sorted(self.topology.envoys, key=lambda e: e.name == last)
        key_deadline = min(deadline, self.clock.now() + LEASE_SECONDS + 12)
        for envoy in order:
            for _ in range(FINAL_TRIES_PER_ENVOY):
                if self.clock.now() >= key_deadline:
                    return
                attempt = self.send(record, envoy, "final", timeout=10)
                # 409 outcome-unknown is as final as a 2xx: it stays until the TTL.
                if attempt.final or attempt.outcome_unknown or (
                        attempt.answered and 400 <= attempt.status < 500 and attempt.status != 409
                        and attempt.status not in RELEASED_STATUSES):
                    break
                time.sleep(0.5)
