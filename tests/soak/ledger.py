"""What the soak saw, on one clock (seconds since the traffic began): every request it sent,
filed under its key (the ledger), and every fault it injected (the fault log). The audit
reads nothing else besides the upstream's execution counts and the processes' own stats."""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

import client
from helpers import BODY_OMITTED, PROBLEM_TYPE_BASE, REPLAYED

from topology import GAVE_UP_STATUSES, Rule


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


# --------------------------------------------------------------------------
# faults
# --------------------------------------------------------------------------

# Fault kinds and what they take away.
STORE_STOP = "store_stop"          # SIGTERM, down for a while, started again (same data)
STORE_KILL = "store_kill"          # SIGKILL, the same otherwise
STORE_PAUSE = "store_pause"        # SIGSTOP/SIGCONT: the kernel accepts, nothing answers
REDIS_RESTART = "redis_restart"    # redis-server stopped and started again (AOF keeps data)
ENVOY_RESTART = "envoy_restart"    # one Envoy stopped by PID and started on the same ports
SLOW_UPSTREAM = "slow_upstream"    # writes ask the upstream for delays past lease and timeout
UPSTREAM_PAUSE = "upstream_pause"  # SIGSTOP/SIGCONT of the upstream process
STORE_OUTAGES = {STORE_STOP, STORE_KILL, STORE_PAUSE}


@dataclass
class Fault:
    id: str
    kind: str
    target: str  # "embedded" / "redis" (a store), "envoy-a" / "envoy-b", "upstream"
    start: float
    end: float | None = None
    detail: str = ""

    def takes_store(self, store: str) -> bool:
        """Whether claims of rules on ``store`` cannot be confirmed during this fault."""
        if self.kind in STORE_OUTAGES:
            return self.target == store
        return self.kind == REDIS_RESTART and store == "redis"

    def overlaps(self, since: float, until: float, *, after: float = 0.0) -> bool:
        """Whether [since, until] meets this fault's window extended by ``after`` seconds."""
        end = self.end if self.end is not None else float("inf")
        return since <= end + after and until >= self.start


@dataclass
class FaultLog:
    clock: Clock
    faults: list[Fault] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def begin(self, kind: str, target: str, detail: str = "") -> Fault:
        fault = Fault(f"F{next(self._ids)}", kind, target, self.clock.now(), detail=detail)
        with self._lock:
            self.faults.append(fault)
        print(f"[{fault.start:7.1f}s] fault {fault.id} {kind} {target} begins {detail}", flush=True)
        return fault

    def finish(self, fault: Fault, detail: str = "") -> None:
        fault.end = self.clock.now()
        if detail:
            fault.detail = f"{fault.detail} {detail}".strip()
        print(f"[{fault.end:7.1f}s] fault {fault.id} {fault.kind} {fault.target} ends "
              f"({fault.end - fault.start:.1f}s) {detail}", flush=True)

    def active_ids(self, at: float) -> tuple[str, ...]:
        with self._lock:
            return tuple(f.id for f in self.faults if f.overlaps(at, at))

    def all(self) -> list[Fault]:
        with self._lock:
            return list(self.faults)


# --------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------

# How the client left on purpose (the "cut" of an attempt), docs/guarantees.md "When a request
# is cut short".
CUT_MID_REQUEST = "mid-request"    # headers and part of the body sent, then RST or FIN
CUT_AFTER_SEND = "after-send"      # the whole request sent, hung up before the answer's head
CUT_MID_RESPONSE = "mid-response"  # the head read, hung up during the body


@dataclass
class Attempt:
    kind: str
    envoy: str
    sent: float
    faults: tuple[str, ...] = ()
    delay_ms: int = 0
    demo_status: int | None = None
    body_bytes_asked: int | None = None  # x-demo-body-bytes
    ended: float = 0.0
    status: int | None = None
    error: str | None = None
    reached_envoy: bool = True  # False: the connection was refused (an Envoy down)
    cut: str | None = None
    replayed: bool = False
    body_omitted: bool = False
    from_upstream: bool = False  # the demo upstream's x-demo-upstream header (kept on replays)
    execution: int | None = None  # x-execution: which execution produced this answer
    problem: str | None = None  # the problem type without PROBLEM_TYPE_BASE
    content_type: str = ""
    body_len: int = 0
    body_sha256: str | None = None
    body_complete: bool = False

    @property
    def duration(self) -> float:
        return self.ended - self.sent

    @property
    def answered(self) -> bool:
        return self.status is not None

    @property
    def executed(self) -> bool:
        """The upstream answered this attempt itself (not a replay): it executed."""
        return self.answered and self.from_upstream and not self.replayed

    @property
    def route_timeout(self) -> bool:
        """Envoy's own 504: the upstream outlived the route timeout (it had executed)."""
        return self.status == 504 and not self.from_upstream and self.problem is None

    @property
    def final(self) -> bool:
        """A 2xx (recorded or replayed): a retry would learn nothing new."""
        return self.status is not None and 200 <= self.status < 300

    @property
    def outcome_unknown(self) -> bool:
        """The filter's 409 ``outcome-unknown`` (docs/guarantees.md "Unknown outcomes"): an
        earlier attempt with this key may have run without a known result, and the key stays
        taken until its TTL; as final as a 2xx, a retry learns nothing new."""
        return self.status == 409 and self.problem == "outcome-unknown"

    @property
    def gave_up_upstream(self) -> bool:
        """The upstream's own answer says someone behind Envoy gave up (a 502 or 504 of its
        own): the filter records it as an unknown outcome."""
        return self.executed and self.status in GAVE_UP_STATUSES

    @property
    def left_outcome_unknown(self) -> bool:
        """This attempt may have run upstream and ended without the upstream's answer: Envoy's
        504 after the route timeout, the client hung up after sending it whole, or the
        upstream's answer says someone behind gave up. The filter records each as an unknown
        outcome (a hang-up before the router's attempt frees the key instead: then it never
        ran)."""
        return self.route_timeout or self.cut == CUT_AFTER_SEND or self.gave_up_upstream

    def take_response(self, resp: client.Response) -> None:
        self.take_head(resp.status_code, resp.headers)
        self.take_body(resp.content)

    def take_head(self, status: int, headers) -> None:
        self.status = status
        self.replayed = headers.get(REPLAYED) == "true"
        self.body_omitted = headers.get(BODY_OMITTED) == "true"
        self.from_upstream = headers.get("x-demo-upstream") == "1"
        execution = headers.get("x-execution")
        self.execution = int(execution) if execution and execution.isdigit() else None
        self.content_type = headers.get("content-type", "")

    def take_body(self, body: bytes) -> None:
        self.body_len = len(body)
        self.body_sha256 = hashlib.sha256(body).hexdigest()
        self.body_complete = True
        if self.content_type == "application/problem+json":
            try:
                kind = json.loads(body).get("type", "")
            except (ValueError, AttributeError):
                kind = "<unreadable problem>"
            self.problem = kind[len(PROBLEM_TYPE_BASE):] if kind.startswith(PROBLEM_TYPE_BASE) else kind

    def describe(self) -> str:
        what = f"{self.status}" if self.answered else f"no answer ({self.error})"
        flags = [f for f, on in (("replayed", self.replayed), ("body-omitted", self.body_omitted),
                                 ("upstream", self.from_upstream)) if on]
        details = (("x-execution", self.execution), ("problem", self.problem), ("cut", self.cut),
                   ("delay-ms", self.delay_ms), ("asked-status", self.demo_status),
                   ("asked-body", self.body_bytes_asked), ("faults", ",".join(self.faults)))
        extra = [f"{name}={value}" for name, value in details if value]
        body = f" body={self.body_len}B sha={self.body_sha256[:12]}" if self.body_sha256 else ""
        return (f"{self.sent:7.2f}s..{self.ended:7.2f}s {self.envoy} {self.kind:<24} {what} "
                f"{' '.join(flags)} {' '.join(extra)}{body}").rstrip()


@dataclass
class KeyRecord:
    """One key: its own path (so the upstream's count for the path is its executions), the
    request a retry repeats byte for byte, and every attempt made with it."""

    id: int
    kind: str  # the scenario that made it
    rule: Rule
    path: str
    key: str | bytes | None  # the Idempotency-Key header (None: not sent)
    body: bytes
    # Requests the filter must refuse (malformed, oversized): they never execute, and are
    # never retried.
    refused_by_design: bool = False
    expected_problems: tuple[str, ...] = ()
    variant: str = ""
    attempts: list[Attempt] = field(default_factory=list)

    def add(self, attempt: Attempt) -> Attempt:
        self.attempts.append(attempt)  # list.append is atomic: workers share records
        return attempt

    def sorted_attempts(self) -> list[Attempt]:
        return sorted(list(self.attempts), key=lambda a: a.sent)

    def completed(self) -> bool:
        return any(a.final for a in list(self.attempts))

    def as_dict(self) -> dict:
        key = self.key.decode("latin-1") if isinstance(self.key, bytes) else self.key
        return {"id": self.id, "kind": self.kind, "variant": self.variant, "rule": self.rule.name,
                "path": self.path, "key": key, "body_bytes": len(self.body),
                "attempts": [asdict(a) for a in self.sorted_attempts()]}


class Ledger:
    """Every key the soak made, and the retries it owes them."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.records: list[KeyRecord] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._due: list[tuple[float, int, KeyRecord]] = []  # (due time, tie-breaker, record)
        self._tie = itertools.count()

    def add(self, **fields) -> KeyRecord:
        with self._lock:
            record = KeyRecord(id=next(self._ids), **fields)
            self.records.append(record)
            return record

    def retry_later(self, record: KeyRecord, after: float) -> None:
        with self._lock:
            heapq.heappush(self._due, (self.clock.now() + after, next(self._tie), record))

    def due_retry(self) -> KeyRecord | None:
        now = self.clock.now()
        with self._lock:
            if self._due and self._due[0][0] <= now:
                return heapq.heappop(self._due)[2]
        return None

    def pick_earlier(self, rng: random.Random, recent: int = 200) -> KeyRecord | None:
        """A key made earlier and worth retrying: mostly a recent one, sometimes any."""
        with self._lock:
            candidates = [r for r in self.records[-recent:] if not r.refused_by_design]
            if rng.random() < 0.35 or not candidates:
                candidates = self.records
            if not candidates:
                return None
            record = rng.choice(candidates)
        return None if record.refused_by_design else record

    def pick_completed(self, rng: random.Random, rules: Iterable[Rule], tries: int = 20) -> KeyRecord | None:
        allowed = set(r.name for r in rules)
        with self._lock:
            pool = list(self.records[-500:])
        for _ in range(tries):
            if not pool:
                return None
            record = rng.choice(pool)
            if not record.refused_by_design and record.rule.name in allowed and record.completed():
                return record
        return None

    def all(self) -> list[KeyRecord]:
        with self._lock:
            return list(self.records)
