"""The fault scheduler: runs in the main thread (so processes it starts again die with the
soak, see harness._preexec), one fault at a time from a fixed cycle, each bounded in time and
logged with its start and end on the soak's clock. Between two faults the system runs
undisturbed for ``gap`` seconds, so retries land on a healthy system too.

Before an Envoy is restarted, its counters and VM health are saved in the ``EnvoyBook``: a
new process starts them from zero.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

import harness
from cluster import wasm_vm_failures
from helpers import rule_counters
from ledger import (
    ENVOY_RESTART,
    REDIS_RESTART,
    SLOW_UPSTREAM,
    STORE_KILL,
    STORE_PAUSE,
    STORE_STOP,
    UPSTREAM_PAUSE,
    Clock,
    FaultLog,
)
from topology import RULES, Topology


@dataclass(frozen=True)
class Step:
    kind: str
    target: str
    seconds: float  # how long the thing stays away (an Envoy restart takes what it takes)


# The first six are one of each kind, so that a short run (--seconds 60) sees every kind;
# then the variants. The embedded store's outages outlast the 5 s lease on purpose.
CYCLE = [
    Step(STORE_STOP, "embedded", 6.0),
    Step(STORE_PAUSE, "redis", 3.0),
    Step(SLOW_UPSTREAM, "upstream", 8.0),
    Step(ENVOY_RESTART, "envoy-b", 0.0),
    Step(REDIS_RESTART, "redis", 2.0),
    Step(UPSTREAM_PAUSE, "upstream", 2.5),
    Step(STORE_PAUSE, "embedded", 3.0),
    Step(STORE_STOP, "redis", 4.0),
    Step(STORE_KILL, "embedded", 3.0),
    Step(ENVOY_RESTART, "envoy-a", 0.0),
]
# What an Envoy restart or a store start adds to a step, for planning only.
RESTART_ALLOWANCE = 6.0


class EnvoyBook:
    """Counters and VM health of every Envoy process the soak ran."""

    def __init__(self) -> None:
        self.retired: list[dict] = []

    @staticmethod
    def snapshot(envoy: harness.Envoy) -> dict:
        return {
            "envoy": envoy.name,
            "pid": envoy.process.pid if envoy.process else None,
            "rule_counters": {name: rule_counters(envoy, name) for name in RULES},
            "vm_failures": wasm_vm_failures(envoy),
        }

    def retire(self, envoy: harness.Envoy) -> None:
        try:
            self.retired.append(self.snapshot(envoy))
        except Exception as err:  # noqa: BLE001 - an unreadable admin is itself a finding
            self.retired.append({"envoy": envoy.name, "pid": envoy.process.pid if envoy.process else None,
                                 "error": f"stats unreadable before the restart: {err}"})

    def all(self, live: list[harness.Envoy]) -> list[dict]:
        return self.retired + [self.snapshot(e) for e in live]


@dataclass
class FaultScheduler:
    topology: Topology
    clock: Clock
    faults: FaultLog
    book: EnvoyBook
    slow_upstream: threading.Event  # Traffic's: while set, new writes ask for long delays
    _upstream_paused: bool = False

    def run(self, *, first_at: float, until: float, gap: float) -> None:
        """Injects faults from the cycle, from ``first_at`` while the next one can end before
        ``until`` (both on the clock)."""
        self._sleep_until(first_at)
        for index in range(len(CYCLE) * 100):  # bounded; ``until`` ends it long before
            step = CYCLE[index % len(CYCLE)]
            if self.clock.now() + step.seconds + RESTART_ALLOWANCE > until:
                return
            self.inject(step)
            self._sleep_until(min(until, self.clock.now() + gap))

    def inject(self, step: Step) -> None:
        fault = self.faults.begin(step.kind, step.target)
        detail = ""
        try:
            if step.kind in (STORE_STOP, STORE_KILL):
                store = self.topology.stores[step.target]
                if step.kind == STORE_KILL:
                    store.process.kill()
                else:
                    store.stop()
                time.sleep(step.seconds)
                store.start()
                detail = f"store pid now {store.process.pid}"
            elif step.kind == STORE_PAUSE:
                store = self.topology.stores[step.target]
                store.pause()
                try:
                    time.sleep(step.seconds)
                finally:
                    store.resume()
            elif step.kind == REDIS_RESTART:
                redis = self.topology.redis
                redis.stop()
                time.sleep(step.seconds)
                redis.restart()
            elif step.kind == ENVOY_RESTART:
                envoy = self.topology.envoy(step.target)
                old_pid = envoy.process.pid if envoy.process else None
                self.book.retire(envoy)
                envoy.restart()
                detail = f"pid {old_pid} -> {envoy.process.pid if envoy.process else None}"
            elif step.kind == SLOW_UPSTREAM:
                self.slow_upstream.set()
                try:
                    time.sleep(step.seconds)
                finally:
                    self.slow_upstream.clear()
            elif step.kind == UPSTREAM_PAUSE:
                self.topology.upstream.process.signal(signal.SIGSTOP)
                self._upstream_paused = True
                try:
                    time.sleep(step.seconds)
                finally:
                    self.resume_upstream()
            else:
                raise ValueError(f"unknown fault kind {step.kind}")
        finally:
            self.faults.finish(fault, detail)

    def resume_upstream(self) -> None:
        if self._upstream_paused:
            self.topology.upstream.process.signal(signal.SIGCONT)
            self._upstream_paused = False

    def undo(self) -> None:
        """Leaves nothing paused (a stopped process would only go at SIGKILL)."""
        self.slow_upstream.clear()
        self.resume_upstream()
        for store in self.topology.stores.values():
            store.resume()

    def _sleep_until(self, at: float) -> None:
        while True:
            remaining = at - self.clock.now()
            if remaining <= 0:
                return
            time.sleep(min(remaining, 0.5))
