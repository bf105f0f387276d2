"""The soak's verdict, from the ledger, the fault log and the upstream's execution counts.

Every answer must be one the docs allow for that request at that moment; every key must
end with a final answer; replays of a key must be byte-identical to each other and to the
answer that was recorded; and a key may execute more than once only on a path
docs/guarantees.md names ("What can still run twice"), each extra execution backed by an
attempt in the ledger that lost its claim that way:

| cause | the attempt that lost its claim, and the evidence |
| --- | --- |
| `lease_takeover` | the upstream ran it for longer than the lease while its store was out (its renewals could not land), and another attempt came once the lease had passed while it still ran |
| `released_status` | the upstream ran it and answered a released status itself (5xx but its gateway errors, 408, 429, ...; not Envoy's 504 after the route timeout) |
| `in_flight_at_envoy_restart` | it reached its Envoy, which was stopped before it answered; another attempt came after the lease |
| `fail_open_outage` | the `fail_open` rule ran it on the local claim alone while its store was out (it is itself the extra execution, or the one the store later lets run again) |
| `completion_queued_in_store_outage` | it completed (or left an unknown outcome) while its store was out; another attempt came after the lease and within 2.2 s (+2 s) of the store's return, before the queued completion could land |
| `completion_lost_in_envoy_restart` | it completed (or left an unknown outcome) through an Envoy restarted within 2 s after (or with the store out until then); another attempt came after the restart and the lease |

An unknown outcome (docs/guarantees.md "Unknown outcomes": Envoy's 504 after the route timeout,
or a client that hung up after sending the whole request) explains no extra execution: the key
stays taken until its TTL and every retry gets `409 outcome-unknown`, which is then an allowed
answer and a final one. A key that executed more than the evidence above explains after one of
its attempts left an unknown outcome, or that executed at all after it was answered
`409 outcome-unknown` (but on a `fail_open` local claim, or where the store may never have got
the record), fails as `RERUN_AFTER_UNKNOWN`. The tally counts the unknown outcomes
(`unknown_outcomes`).

Replays of one key must be the same response, but for the two cases the docs name: under
`fail_open` each Envoy may replay the answer it ran itself, and after a lease takeover through
another Envoy the late first attempt's Envoy may replay its own response within a second of
its end (until the store refuses that completion). Both are counted.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ledger import (
    CUT_MID_RESPONSE,
    ENVOY_RESTART,
    UPSTREAM_PAUSE,
    Attempt,
    Fault,
    KeyRecord,
)
from topology import (
    LEASE_SECONDS,
    MAX_RESPONSE_BYTES,
    RELEASED_STATUSES,
    ROUTE_TIMEOUT_SECONDS,
)

# After a store is back on its port, a claim may still fail within one claim timeout (2 s)
# while the worker's stream reopens; one more second for a busy machine.
STORE_RECOVERY_SECONDS = 3.0
# An Envoy that is stopping may still close connections it accepted just before.
ENVOY_RESTART_MARGIN = 1.0
# Clock slack between the client's view of an attempt and the filter's.
SLACK = 0.5
# A lease takeover (docs/guarantees.md "What can still run twice"): after a takeover through
# another Envoy, the late first attempt's Envoy replays its own response until the store has
# refused its completion (one store round trip; a second allows for a busy machine).
SUPERSEDED_WINDOW = 1.0
# docs/guarantees.md "What can still run twice", a store outage longer than two thirds of a lease:
# a waiting completion lands within about 2.2 s of the store's return.
COMPLETION_LANDS_SECONDS = 2.2 + 2.0
REFUSED_BY_ENVOY = {"oversized_over_buffer": 413}  # Envoy's own answer, before the filter's
UNEXPLAINED = "unexplained duplicate execution"
RERUN_AFTER_UNKNOWN = "executed again after an unknown outcome"
# The causes under which an execution after a 409 outcome-unknown is still named in the docs: the
# write ran on a fail_open local claim, or the store may never have got the unknown outcome.
RERUN_AFTER_ANSWER_CAUSES = {"fail_open_outage", "completion_queued_in_store_outage",
                             "completion_lost_in_envoy_restart"}
# How surely each cause's evidence shows an execution that lost its claim (0: seen).
CERTAINTY = {
    "released_status": 0,
    "fail_open_outage": 0,
    "lease_takeover": 1,
    "in_flight_at_envoy_restart": 2,
    "completion_queued_in_store_outage": 2,
    "completion_lost_in_envoy_restart": 3,
}


@dataclass
class KeyVerdict:
    record: KeyRecord
    executions: int
    causes: list[tuple[str, Attempt, str]] = field(default_factory=list)  # the extra executions
    problems: list[tuple[str, str]] = field(default_factory=list)  # (category, detail)

    def fail(self, category: str, detail: str) -> None:
        self.problems.append((category, detail))


class Audit:
    def __init__(self, records: list[KeyRecord], executions: dict[str, int], faults: list[Fault],
                 envoys: list[str]) -> None:
        self.records = records
        self.envoys = envoys
        self.executions = executions
        self.faults = faults
        self.answer_classes: collections.Counter[str] = collections.Counter()
        self.divergent_fail_open = 0  # keys whose Envoys replay their own fail_open execution
        # keys whose late first attempt's Envoy replayed its own response in the moment before
        # the store refused that completion
        self.superseded_window_replays = 0
        self.verdicts: list[KeyVerdict] = [self._judge_key(r) for r in records]

    # -- fault windows -----------------------------------------------------

    def store_outage(self, store: str, since: float, until: float,
                     after: float = STORE_RECOVERY_SECONDS) -> Fault | None:
        return next((f for f in self.faults if f.takes_store(store)
                     and f.overlaps(since, until, after=after)), None)

    def upstream_paused(self, since: float, until: float) -> float:
        """Seconds of [since, until] during which the upstream process was stopped."""
        return sum(max(0.0, min(until, f.end) - max(since, f.start)) for f in self.faults
                   if f.kind == UPSTREAM_PAUSE and f.end is not None)

    def envoy_restart(self, attempt: Attempt) -> Fault | None:
        return next((f for f in self.faults if f.kind == ENVOY_RESTART and f.target == attempt.envoy
                     and f.overlaps(attempt.sent, attempt.ended, after=ENVOY_RESTART_MARGIN)), None)

    # -- one answer --------------------------------------------------------

    def judge_answer(self, record: KeyRecord, a: Attempt) -> tuple[str, str | None]:
        """(the answer's class for the tally, what is wrong with it or None)."""
        refused = record.refused_by_design
        if not a.answered:
            if a.cut is not None:
                return "hung up on purpose", None
            if self.envoy_restart(a):
                return "no answer: Envoy restarting", None
            return "no answer", f"no answer outside an Envoy restart ({a.error})"
        if a.replayed:
            if refused or a.kind == "key_reused":
                return "replay", "a request the filter must refuse got a replay"
            return "replay", None
        if a.problem is not None:
            label = f"{a.status} {a.problem}"
            if refused:
                if a.problem in record.expected_problems and 400 <= a.status < 500:
                    return label, None
                return label, f"expected 4xx {'/'.join(record.expected_problems)}"
            if a.status == 409 and a.problem == "request-in-flight":
                return label, None
            if a.outcome_unknown:
                if any(b is not a and b.sent <= a.sent and self._may_have_left_unknown(b)
                       for b in record.attempts):
                    return label, None
                return label, "outcome-unknown, but no earlier attempt of the key could have left one"
            # docs/wait-mode.md "Waiting for the first request": a held duplicate whose first
            # request was released (failed, or its lease lapsed) gets a retry-able 503.
            if a.status == 503 and a.problem == "first-attempt-released" and record.rule.waits:
                return label, None
            if a.status == 422 and a.problem == "key-reused" and a.kind == "key_reused":
                return label, None
            if a.status == 503 and a.problem == "idempotency-unavailable":
                if self.store_outage(record.rule.store, a.sent, a.ended):
                    return label + " (store fault)", None
                return label, "the filter answered 503 outside a fault of the rule's store"
            if (a.status == 503 and a.problem == "capacity-exhausted" and record.rule.fail_open
                    and self.store_outage(record.rule.store, a.sent, a.ended)):
                return label + " (store fault)", None
            return label, "an answer of the filter that this request should never get"
        if a.from_upstream:
            if refused:
                return "executed", "a request the filter must refuse reached the upstream"
            if a.kind == "key_reused":
                # docs/guarantees.md "What can still run twice", Cluster mode, fail_open: with
                # the store out, an Envoy that holds no record of the key runs the write on its
                # local claim alone, whatever its body.
                if record.rule.fail_open and self.store_outage(record.rule.store, a.sent, a.ended):
                    return "executed (fail_open, store fault)", None
                return "executed", "a reused key with another body executed"
            if not 200 <= a.status < 300 and a.demo_status != a.status:
                return f"upstream {a.status}", "the upstream failed unasked"
            return ("executed" if a.final else f"upstream {a.status} (asked)"), None
        if a.route_timeout:
            if a.delay_ms / 1000 + self.upstream_paused(a.sent, a.ended) >= ROUTE_TIMEOUT_SECONDS - SLACK:
                return "504 route timeout (asked, or upstream paused)", None
            return "504 route timeout", "Envoy timed out a request that asked for no such delay"
        if REFUSED_BY_ENVOY.get(record.kind) == a.status:
            return f"{a.status} from Envoy", None
        return f"{a.status} from Envoy", f"Envoy answered {a.status} itself"

    # -- one key -----------------------------------------------------------

    def _judge_key(self, record: KeyRecord) -> KeyVerdict:
        attempts = record.sorted_attempts()
        verdict = KeyVerdict(record, self.executions.get(record.path, 0))
        for a in attempts:
            label, wrong = self.judge_answer(record, a)
            self.answer_classes[label] += 1
            if wrong:
                verdict.fail(wrong, a.describe())
        if record.refused_by_design:
            if verdict.executions:
                verdict.fail("a request the filter must refuse executed",
                             f"{verdict.executions} execution(s)")
            return verdict
        self._check_final_answers(verdict, attempts)
        self._check_executions(verdict, attempts)
        self._check_replays(verdict, attempts)
        return verdict

    @staticmethod
    def _only_in_superseded_window(attempts: list[Attempt], whole: list[Attempt]) -> bool:
        """Replays of a late first attempt's own response after a takeover elsewhere, all
        through the Envoy that ran it and within SUPERSEDED_WINDOW of its end (a lease
        takeover, docs/guarantees.md "What can still run twice": until the store refuses that
        completion, one round trip); every later replay is the one response the store kept."""
        latest = max(whole, key=lambda a: a.sent)
        kept = latest.execution
        late = [a for a in attempts if a.executed and a.execution != kept]
        for replay in whole:
            if replay.execution == kept:
                continue
            ran = [a for a in late if a.execution == replay.execution and a.envoy == replay.envoy]
            if not any(a.ended - SLACK <= replay.sent <= a.ended + SUPERSEDED_WINDOW for a in ran):
                return False
        return True

    def _check_final_answers(self, verdict: KeyVerdict, attempts: list[Attempt]) -> None:
        """The final round asked each Envoy until it answered 2xx (or a plain 4xx)."""
        last_by_envoy: dict[str, Attempt] = {}
        for a in attempts:
            if a.kind == "final":
                last_by_envoy[a.envoy] = a
        for envoy in self.envoys:
            a = last_by_envoy.get(envoy)
            if a is None:
                verdict.fail("no final answer", f"the final round never reached this key through {envoy}")
            elif not (a.final or a.outcome_unknown):
                verdict.fail("no final answer", f"from {envoy} in the final round: {a.describe()}")

    def _check_replays(self, verdict: KeyVerdict, attempts: list[Attempt]) -> None:
        record = verdict.record
        replays = [a for a in attempts if a.replayed and a.body_complete and a.kind != "key_reused"]
        whole = [a for a in replays if not a.body_omitted]
        replayed_executions = {a.execution for a in whole}
        if len(replayed_executions) > 1 or len({(a.execution, a.body_sha256) for a in whole}) > 1:
            causes = sorted({c for c, _, _ in verdict.causes})
            # Under fail_open each Envoy ran the write on its own local claim and recorded its
            # own answer (docs/guarantees.md "What can still run twice",
            # Cluster mode, fail_open): they replay different executions.
            # After any other double execution one record must win everywhere.
            if len(replayed_executions) > 1 and "fail_open_outage" in causes:
                self.divergent_fail_open += 1
            elif "lease_takeover" in causes and self._only_in_superseded_window(attempts, whole):
                self.superseded_window_replays += 1
            else:
                verdict.fail(f"replays of one key differ (extra executions: {', '.join(causes) or 'none'})",
                             "; ".join(f"{a.envoy}@{a.sent:.1f}s x-execution={a.execution} "
                                       f"sha={a.body_sha256[:12]}" for a in whole))
        if len({a.status for a in replays}) > 1:
            verdict.fail("replays of one key differ in status", str(sorted({a.status for a in replays})))
        originals = {a.execution: a for a in attempts if a.executed and a.final and a.body_complete}
        for a in whole:
            original = originals.get(a.execution)
            if original is not None and original.body_sha256 != a.body_sha256:
                verdict.fail("a replay differs from the answer it replays", f"{original.describe()} / {a.describe()}")
                break
        for a in replays:
            if a.body_omitted and not self._body_omission_explained(record, a, attempts):
                verdict.fail("a replay without its body, and no cause for it", a.describe())
                break
            if a.body_omitted and a.body_len:
                verdict.fail("a body-omitted replay carried a body", a.describe())

    def _body_omission_explained(self, record: KeyRecord, replay: Attempt, attempts: list[Attempt]) -> bool:
        """docs/guarantees.md "When a request is cut short": recorded without the body when it is
        over max_response_bytes or the client left mid-response; docs/configuration.md "Sizing
        the local table": replayed without it when the store fails too."""
        for a in attempts:
            if a.executed and a.execution == replay.execution:
                if (a.body_bytes_asked or 0) > MAX_RESPONSE_BYTES or a.cut == CUT_MID_RESPONSE:
                    return True
        return self.store_outage(record.rule.store, replay.sent, replay.ended) is not None

    def _check_executions(self, verdict: KeyVerdict, attempts: list[Attempt]) -> None:
        seen = {a.execution for a in attempts if a.executed and a.execution}
        if seen and max(seen) > verdict.executions:
            verdict.fail("execution count mismatch", f"answers carry x-execution {max(seen)} but the "
                                                     f"upstream counted {verdict.executions}")
        if verdict.executions == 0 and any(a.final for a in attempts):
            verdict.fail("execution count mismatch", "answered 2xx but the upstream never executed it")
        extra = verdict.executions - 1
        if extra <= 0:
            return
        losses = self.claim_losses(verdict.record, attempts)
        verdict.causes = losses[:extra]
        unknown = next((a for a in attempts if a.left_outcome_unknown or a.outcome_unknown), None)
        if len(losses) < extra:
            # Unknown outcomes explain nothing: the key must have stayed taken.
            category = RERUN_AFTER_UNKNOWN if unknown is not None else UNEXPLAINED
            verdict.fail(category, f"executed {verdict.executions} times, the ledger explains "
                                   f"{len(losses)} extra execution(s): " + ", ".join(c for c, _, _ in losses)
                                   + (f"; unknown outcome first at {unknown.describe()}" if unknown else ""))
            return
        # Even where other evidence accounts for the count: once the filter answered
        # outcome-unknown, nothing sent later may run, but on the store-loss paths
        # docs/guarantees.md names.
        answered = next((a for a in attempts if a.outcome_unknown), None)
        if answered is None or {c for c, _, _ in losses} & RERUN_AFTER_ANSWER_CAUSES:
            return
        rerun = next((b for b in attempts if b.sent >= answered.ended and (b.executed or b.route_timeout)), None)
        if rerun is not None:
            verdict.fail(RERUN_AFTER_UNKNOWN, f"answered outcome-unknown at {answered.describe()}, "
                                              f"then ran {rerun.describe()}")

    # -- why a key ran again ------------------------------------------------

    def claim_losses(self, record: KeyRecord, attempts: list[Attempt]) -> list[tuple[str, Attempt, str]]:
        """Each attempt that lost its claim on a path docs/guarantees.md names, with the
        evidence."""
        lease = LEASE_SECONDS

        def came_after(t: float, a: Attempt) -> Attempt | None:
            return next((b for b in attempts if b is not a and b.sent >= t), None)

        losses: list[tuple[str, Attempt, str]] = []
        for a in attempts:
            ran = a.executed or a.route_timeout
            if a.kind == "key_reused":  # it can only have run on a fail_open local claim
                if ran and record.rule.fail_open and (f := self.store_outage(record.rule.store, a.sent, a.ended)):
                    losses.append(("fail_open_outage", a, f"another body ran on the local claim during {f.id}"))
                continue
            in_lease = next((b for b in attempts if b is not a
                             and a.sent + lease - SLACK <= b.sent <= a.ended), None)
            # A running request's lease is renewed: it can only be taken over while its
            # renewals cannot reach the store.
            outage = self.store_outage(record.rule.store, a.sent, a.ended)
            if ran and a.duration >= lease - 0.25 and in_lease and outage:
                losses.append(("lease_takeover", a, f"ran {a.duration:.1f}s past the {lease}s lease "
                                                    f"while {outage.id} kept its renewals from the store; "
                                                    f"retried at {in_lease.sent:.1f}s"))
            elif ran and a.status in RELEASED_STATUSES and not a.route_timeout and came_after(a.sent, a):
                losses.append(("released_status", a, f"answered {a.status}"))
            elif (not a.answered and a.cut is None and a.reached_envoy and (f := self.envoy_restart(a))
                  and (b := came_after(a.sent + lease - SLACK, a))):
                losses.append(("in_flight_at_envoy_restart", a, f"cut by {f.id}; retried at {b.sent:.1f}s"))
            elif (ran and record.rule.fail_open
                  and (f := self.store_outage(record.rule.store, a.sent, a.ended))
                  and came_after(a.sent, a)):
                losses.append(("fail_open_outage", a, f"ran on the local claim during {f.id}"))
            # An unknown outcome is recorded like a response, so it can be lost the same ways.
            elif ((ran and a.final) or a.left_outcome_unknown) and (why := self._completion_queued(record, a, attempts)):
                losses.append(("completion_queued_in_store_outage", a, why))
            elif ((ran and a.final) or a.left_outcome_unknown) and (why := self._completion_lost_in_restart(record, a, attempts)):
                losses.append(("completion_lost_in_envoy_restart", a, why))
        # The surest evidence first: an execution seen to be released or to run without the
        # store outweighs one that only may have lost its completion.
        return sorted(losses, key=lambda loss: (CERTAINTY[loss[0]], loss[1].sent))

    def _completion_queued(self, record: KeyRecord, a: Attempt, attempts: list[Attempt]) -> str | None:
        outage = self.store_outage(record.rule.store, a.ended - SLACK, a.ended + SLACK, after=0.0)
        if outage is None or outage.end is None:
            return None
        for b in attempts:
            if b is not a and a.sent + LEASE_SECONDS - SLACK <= b.sent <= outage.end + COMPLETION_LANDS_SECONDS:
                return f"completed at {a.ended:.1f}s during {outage.id}; retried at {b.sent:.1f}s"
        return None

    def _completion_lost_in_restart(self, record: KeyRecord, a: Attempt, attempts: list[Attempt]) -> str | None:
        """The completion was still in the Envoy's root context when it stopped: sent at most
        2 s before the stop (a live store takes it in milliseconds), or sent into a store
        outage that ended too shortly before the stop for it to land."""
        for f in self.faults:
            if f.kind != ENVOY_RESTART or f.target != a.envoy or f.end is None or a.ended > f.end + SLACK:
                continue
            just_before = a.ended >= f.start - 2.0
            outage = self.store_outage(record.rule.store, a.ended - SLACK, a.ended + SLACK, after=0.0)
            still_waiting = (outage is not None and outage.end is not None
                             and outage.end + COMPLETION_LANDS_SECONDS >= f.start)
            if not (just_before or still_waiting):
                continue
            after = max(f.start, a.sent + LEASE_SECONDS - SLACK)
            b = next((b for b in attempts if b is not a and b.sent >= after), None)
            if b is not None:
                return (f"completed at {a.ended:.1f}s, {f.id} restarted {a.envoy} at {f.start:.1f}s; "
                        f"retried at {b.sent:.1f}s")
        return None

    # -- summary -----------------------------------------------------------

    def failures(self) -> list[KeyVerdict]:
        return [v for v in self.verdicts if v.problems]

    def duplicate_causes(self) -> collections.Counter[str]:
        return collections.Counter(cause for v in self.verdicts for cause, _, _ in v.causes)

    def unexplained(self) -> list[KeyVerdict]:
        return [v for v in self.verdicts if any(c in (UNEXPLAINED, RERUN_AFTER_UNKNOWN) for c, _ in v.problems)]

    def _may_have_left_unknown(self, a: Attempt) -> bool:
        """Whether a 409 outcome-unknown can follow ``a``: it left an unknown outcome, or it got
        no answer while its Envoy restarted (the stop may still have seen it as a hang-up)."""
        return a.left_outcome_unknown or (not a.answered and a.cut is None and a.reached_envoy
                                          and self.envoy_restart(a) is not None)

    def unknown_outcomes(self) -> dict[str, int]:
        """How many unknown outcomes the soak made and the filter answered."""
        valid = [v.record for v in self.verdicts if not v.record.refused_by_design]
        attempts = [a for r in valid for a in r.attempts]
        return {
            "attempts_that_left_one": sum(1 for a in attempts if a.left_outcome_unknown),
            "of_which_route_timeouts": sum(1 for a in attempts if a.route_timeout),
            "keys_answered_outcome_unknown": sum(1 for r in valid if any(a.outcome_unknown for a in r.attempts)),
            "answers_outcome_unknown": sum(1 for a in attempts if a.outcome_unknown),
            "keys_executed_again_after_one": sum(1 for v in self.verdicts
                                                 if any(c == RERUN_AFTER_UNKNOWN for c, _ in v.problems)),
        }

    def failures_by_category(self) -> collections.Counter[str]:
        return collections.Counter(c for v in self.verdicts for c in {c for c, _ in v.problems})
