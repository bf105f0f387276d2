"""Key sources and fingerprint choices beyond the recipes: every bad body a client can send,
optional keys, body limits, and rules chosen by virtual host, through real Envoy."""

from __future__ import annotations

import json
import uuid
from typing import Iterator

import pytest

import harness
import helpers

JSON = {"content-type": "application/json"}
FORM = {"content-type": "application/x-www-form-urlencoded"}


def rules() -> list[dict]:
    return [
        helpers.rule("required-json", prefixes=["/rj"], key={"sources": [{"json": "/order/id"}]}, max_request_bytes=256),
        helpers.rule("optional-json", prefixes=["/oj"], key={"required": False, "sources": [{"json": "/id"}]}, max_request_bytes=256),
        helpers.rule("optional-header", prefixes=["/oh"], key={"required": False}, max_request_bytes=64),
        helpers.rule("header-no-body", prefixes=["/hn"], key={"header": "x-delivery"}, fingerprint="none", max_request_bytes=64),
        helpers.rule("composite", prefixes=["/co"], key={"sources": [{"header": "x-tenant"}, {"query": "ref"}, {"json": "/n"}]}),
        helpers.rule(
            "form-key",
            prefixes=["/fk"],
            key={"sources": [{"form": "trade_no"}]},
            fingerprint={"fields": [{"form": "trade_no"}, {"form": "total_amount"}]},
        ),
        helpers.rule("query-key", prefixes=["/qk"], key={"sources": [{"query": "order_no"}]}),
        # Last: where the virtual host is unknown (the native build on Envoy 1.39) it takes
        # every POST no rule before it takes, answering 503.
        helpers.rule("by-vhost", match={"virtual_hosts": ["partners"]}),
    ]


def add_partner_vhost(config: dict) -> None:
    """A second virtual host, `partners`, for requests with Host: partners.test."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hosts = hcm["route_config"]["virtual_hosts"]
    hosts.insert(0, {
        "name": "partners",
        "domains": ["partners.test"],
        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "demo_upstream"}}],
    })
    # A virtual host with no route for anything: Envoy's router answers 404 itself.
    hosts.insert(0, {"name": "closed", "domains": ["closed.test"], "routes": []})


@pytest.fixture(scope="module")
def sources_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[harness.Envoy, harness.Upstream]]:
    with helpers.module_envoy(tmp_path_factory.mktemp("sources"), "envoy-sources", {"rules": rules()},
                              mutate=add_partner_vhost) as envoy_and_upstream:
        yield envoy_and_upstream


@pytest.mark.parametrize(
    "content_type, body, kind, detail",
    [
        ("application/json", b"{not json", "invalid-key", "invalid JSON"),
        ("text/plain", b'{"order":{"id":"1"}}', "invalid-key", "is not JSON"),
        ("application/json", b'{"order":{}}', "missing-key", "JSON body field '/order/id'"),
        ("application/json", b'{"order":{"id":[1]}}', "invalid-key", "not a string, number or boolean"),
        ("application/json", b'{"order":{"id":null}}', "invalid-key", "not a string, number or boolean"),
        ("application/json", b'{"order":{"id":""}}', "invalid-key", "empty"),
        ("application/json", b'{"order":{"id":"x"},"pad":"' + b"p" * 300 + b'"}', "body-too-large", "256 bytes"),
    ],
)
def test_bad_bodies_get_400_naming_the_source(sources_envoy, content_type, body, kind, detail) -> None:
    envoy, upstream = sources_envoy
    path = helpers.unique_path("rj")
    resp = helpers.post(envoy, path, body=body, headers={"content-type": content_type})
    doc = helpers.problem(resp, 400, kind, rule="required-json")
    assert detail in doc["detail"], doc
    assert upstream.executions(path) == 0


@pytest.mark.parametrize(
    "body",
    [b"{not json", b'{"other":1}', b'{"id":{"a":1}}', b'{"id":"x","pad":"' + b"p" * 300 + b'"}'],
    ids=["unparseable", "missing", "not-scalar", "over-the-limit"],
)
def test_optional_body_keys_pass_through_when_absent_or_unreadable(sources_envoy, body) -> None:
    envoy, upstream = sources_envoy
    path = helpers.unique_path("oj")
    for _ in range(2):
        resp = helpers.post(envoy, path, body=body, headers=JSON)
        assert resp.status_code == 201 and not helpers.is_replay(resp)
    assert upstream.executions(path) == 2
    ok_path = helpers.unique_path("oj")
    first = helpers.post(envoy, ok_path, body=b'{"id":"o-1"}', headers=JSON)
    again = helpers.post(envoy, ok_path, body=b'{ "id" : "o-1" }', headers=JSON)
    # Whole-body fingerprint (the default): whitespace is a different payload.
    helpers.problem(again, 422, "key-reused", rule="optional-json")
    assert not helpers.is_replay(first)


def test_a_sent_optional_key_with_a_body_over_the_limit_is_refused_not_run_twice(sources_envoy) -> None:
    """An optional key sent in its header asks for protection: a body over max_request_bytes
    (64) cannot be fingerprinted, so the request is refused, not let through unprotected
    where it and each retry would run the write again. Without the key it passes."""
    envoy, upstream = sources_envoy
    path = helpers.unique_path("oh")
    body = b'{"amount":1,"pad":"' + b"p" * 100 + b'"}'
    key = str(uuid.uuid4())
    for _ in range(2):
        resp = helpers.post(envoy, path, body=body, headers={**JSON, "idempotency-key": key})
        assert "64 bytes" in helpers.problem(resp, 400, "body-too-large", rule="optional-header")["detail"]
    assert upstream.executions(path) == 0
    resp = helpers.post(envoy, path, body=body, headers=JSON)
    assert resp.status_code == 201 and not helpers.is_replay(resp)
    assert upstream.executions(path) == 1


def test_a_rule_that_needs_no_body_never_buffers_it(sources_envoy) -> None:
    """Header key and fingerprint "none": a body far over max_request_bytes (64) is not held
    for a decision, it streams to the upstream, and a redelivery with another body replays."""
    envoy, upstream = sources_envoy
    path = helpers.unique_path("hn")
    delivery = str(uuid.uuid4())
    first = helpers.post(envoy, path, body=b"a" * 100_000, headers={"x-delivery": delivery})
    again = helpers.post(envoy, path, body=b"b" * 10, headers={"x-delivery": delivery})
    assert first.status_code == 201 and json.loads(first.content)["body_bytes"] == 100_000
    assert helpers.is_replay(again) and again.content == first.content
    assert upstream.executions(path) == 1


def test_composite_key_from_header_query_and_body(sources_envoy) -> None:
    envoy, upstream = sources_envoy
    path = helpers.unique_path("co")
    send = lambda tenant, ref, n: helpers.post(  # noqa: E731
        envoy, f"{path}?ref={ref}", body=json.dumps({"n": n}), headers={"x-tenant": tenant, **JSON}
    )
    first = send("t1", "r1", 1)
    assert not helpers.is_replay(first)
    assert helpers.is_replay(send("t1", "r1", 1))
    # Change any one part and it is another key (the path with query is part of the default
    # fingerprint, so a changed ref is a new key and a new payload at once).
    assert not helpers.is_replay(send("t2", "r1", 1))
    assert not helpers.is_replay(send("t1", "r1", 2))
    assert upstream.executions(path) == 3
    resp = helpers.post(envoy, f"{path}?ref=r1", body=json.dumps({"n": 1}), headers=JSON)
    assert "header 'x-tenant'" in helpers.problem(resp, 400, "missing-key", rule="composite")["detail"]


def test_a_request_no_route_takes_gets_envoys_404_not_the_filters_answer(sources_envoy) -> None:
    """No route matched: nothing can reach the upstream, and the router answers 404. A rule
    matching by virtual host must not answer it instead (the filter cannot tell "no virtual
    host" from "a virtual host it cannot read" only when a route matched)."""
    envoy, upstream = sources_envoy
    path = helpers.unique_path("anything")
    resp = helpers.post(envoy, path, headers={"host": "closed.test"})
    if harness.native_without_route_facts():
        # Envoy 1.39 names an empty route even when none matched: the filter cannot tell, and
        # a rule matching by virtual host answers 503 (docs/envoy-versions.md).
        helpers.problem(resp, 503, "idempotency-unavailable", rule="by-vhost")
    else:
        assert resp.status_code == 404, resp.content[:300]
    assert upstream.executions(path) == 0


def test_a_rule_chosen_by_virtual_host(sources_envoy) -> None:
    envoy, upstream = sources_envoy
    path = helpers.unique_path("anything")
    resp = helpers.post(envoy, path, headers={"host": "partners.test"})
    if harness.native_without_route_facts():
        # No virtual host name from this Envoy: the rule may take either request, so neither
        # is let through unprotected.
        helpers.problem(resp, 503, "idempotency-unavailable", rule="by-vhost")
        helpers.problem(helpers.post(envoy, path), 503, "idempotency-unavailable", rule="by-vhost")
        assert upstream.executions(path) == 0
        return
    helpers.problem(resp, 400, "missing-key", rule="by-vhost")
    # The same path on the default virtual host matches no rule here and passes untouched.
    assert helpers.post(envoy, path).status_code == 201
    assert upstream.executions(path) == 1


def test_big_json_numbers_are_different_keys(sources_envoy) -> None:
    """Two 28-digit ids that a float would make equal are two writes, and each one's retry
    replays its own response."""
    envoy, upstream = sources_envoy
    path = helpers.unique_path("rj")
    bodies = [b'{"order":{"id":1234567890123456789012345678}}', b'{"order":{"id":1234567890123456789012345679}}']
    firsts = [helpers.post(envoy, path, body=body, headers=JSON) for body in bodies]
    for resp in firsts:
        assert resp.status_code == 201 and not helpers.is_replay(resp), resp.content
    assert upstream.executions(path) == 2
    for body, first in zip(bodies, firsts):
        again = helpers.post(envoy, path, body=body, headers=JSON)
        assert helpers.is_replay(again) and again.content == first.content
    assert upstream.executions(path) == 2


@pytest.mark.parametrize(
    "body, detail",
    [
        (b"trade_no=%zz&total_amount=1.00", "invalid percent-encoding ('%zz')"),
        (b"trade_no=T%4&total_amount=1.00", "invalid percent-encoding ('%4')"),
        (b"trade_no=T%ff&total_amount=1.00", "not UTF-8"),
        (b"trade_no=T1&total_amount=1.00&trade_no=T2", "appears more than once"),
        (b"trade_no=T1&trade%5Fno=T1&total_amount=1.00", "appears more than once"),
    ],
    ids=["bad-escape", "short-escape", "not-utf8", "duplicate", "duplicate-encoded-name"],
)
def test_undecodable_or_repeated_form_keys_get_400(sources_envoy, body, detail) -> None:
    """Decoded leniently, `%zz` and `%ff` were keys of their own and the first of two
    `trade_no` fields won while the upstream may read the last: now each is refused."""
    envoy, upstream = sources_envoy
    path = helpers.unique_path("fk")
    resp = helpers.post(envoy, path, body=body, headers=FORM)
    doc = helpers.problem(resp, 400, "invalid-key", rule="form-key")
    assert "form field 'trade_no'" in doc["detail"] and detail in doc["detail"], doc
    assert upstream.executions(path) == 0


def test_a_repeated_fingerprinted_form_field_counts_every_value(sources_envoy) -> None:
    envoy, upstream = sources_envoy
    path = helpers.unique_path("fk")
    trade = helpers.new_key()
    first = helpers.post(envoy, path, body=f"trade_no={trade}&total_amount=1&total_amount=2", headers=FORM)
    assert first.status_code == 201 and not helpers.is_replay(first)
    again = helpers.post(envoy, path, body=f"sign=x&trade_no={trade}&total_amount=1&total_amount=2", headers=FORM)
    assert helpers.is_replay(again)
    changed = helpers.post(envoy, path, body=f"trade_no={trade}&total_amount=1&total_amount=3", headers=FORM)
    helpers.problem(changed, 422, "key-reused", rule="form-key")
    assert upstream.executions(path) == 1


@pytest.mark.parametrize(
    "query, detail",
    [
        ("order_no=%zz", "invalid percent-encoding ('%zz')"),
        ("order_no=A%C3%28", "not UTF-8"),
        ("order_no=A1&order_no=A2", "appears more than once"),
    ],
    ids=["bad-escape", "not-utf8", "duplicate"],
)
def test_undecodable_or_repeated_query_keys_get_400(sources_envoy, query, detail) -> None:
    """The query goes out byte for byte (the client leaves `%zz` as written)."""
    envoy, upstream = sources_envoy
    path = helpers.unique_path("qk")
    resp = helpers.send(envoy, f"{path}?{query}", body=b"{}")
    doc = helpers.problem(resp, 400, "invalid-key", rule="query-key")
    assert "query parameter 'order_no'" in doc["detail"] and detail in doc["detail"], doc
    assert upstream.executions(path) == 0
    # The same key, validly encoded, is a key.
    ok = helpers.send(envoy, f"{path}?order_no=%41%2D{uuid.uuid4().hex}", body=b"{}")
    assert ok.status_code == 201 and upstream.executions(path) == 1
