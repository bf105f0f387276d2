"""Scopes that cannot collapse, through real Envoy: every value of a repeated scope header is
part of the scope, and a rule with ``scope_required`` refuses a caller it cannot tell apart
(401) instead of putting it in the one scope every anonymous caller shares."""

from __future__ import annotations

from typing import Iterator

import pytest

import harness
from helpers import (
    REPLAYED,
    module_envoy,
    new_key,
    plugin_config,
    post,
    problem,
    rule,
    send,
    unique_path,
)

CONFIG = plugin_config(
    rule("tenant", prefixes=["/tenant"], scope_headers=["x-tenant"]),
    rule("signed-in", prefixes=["/signed-in"], scope_required=True),
    rule("anonymous-ok", prefixes=["/anonymous-ok"]),
)


@pytest.fixture(scope="module")
def scopes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[harness.Envoy, harness.Upstream]]:
    with module_envoy(tmp_path_factory.mktemp("scopes"), "envoy-scopes", CONFIG) as envoy_and_upstream:
        yield envoy_and_upstream


def send_with_tenants(envoy: harness.Envoy, path: str, key: str, *tenants: bytes):
    headers = [("idempotency-key", key.encode())] + [("x-tenant", t) for t in tenants]
    return send(envoy, path, headers=headers, body=b'{"item":"book"}')


def test_every_value_of_a_repeated_scope_header_is_part_of_the_scope(scopes) -> None:
    """Before, only the first value counted: a caller sending `x-tenant: t1` alone got the
    response recorded for a request from `t1` and `t2`."""
    envoy, upstream = scopes
    path, key = unique_path("tenant"), new_key()
    both = send_with_tenants(envoy, path, key, b"t1", b"t2")
    assert both.status_code == 201 and REPLAYED not in both.headers
    first_only = send_with_tenants(envoy, path, key, b"t1")
    assert first_only.status_code == 201 and REPLAYED not in first_only.headers
    assert first_only.content != both.content
    swapped = send_with_tenants(envoy, path, key, b"t2", b"t1")
    assert swapped.status_code == 201 and REPLAYED not in swapped.headers
    assert upstream.executions(path) == 3
    # The same values in the same order are the same caller: its retries replay.
    again = send_with_tenants(envoy, path, key, b"t1", b"t2")
    assert again.headers.get(REPLAYED) == "true" and again.content == both.content
    alone_again = send_with_tenants(envoy, path, key, b"t1")
    assert alone_again.headers.get(REPLAYED) == "true" and alone_again.content == first_only.content
    assert upstream.executions(path) == 3


def test_scope_required_refuses_an_unidentified_caller_with_401(scopes) -> None:
    envoy, upstream = scopes
    path, key = unique_path("signed-in"), new_key()
    anonymous = post(envoy, path, key=key)
    doc = problem(anonymous, 401, "missing-scope", rule="signed-in")
    assert "'authorization'" in doc["detail"]
    assert upstream.executions(path) == 0
    # The refusal claimed nothing: the same key from an identified caller executes, once.
    alice = post(envoy, path, key=key, headers={"authorization": "Bearer alice"})
    assert alice.status_code == 201 and REPLAYED not in alice.headers
    retry = post(envoy, path, key=key, headers={"authorization": "Bearer alice"})
    assert retry.headers.get(REPLAYED) == "true" and retry.content == alice.content
    assert upstream.executions(path) == 1
    stats = envoy.stats(filter=r"^wasmcustom\.idempotency\.rule\.signed-in\.")
    assert stats["wasmcustom.idempotency.rule.signed-in.missing_scope"] == 1
    assert stats["wasmcustom.idempotency.rule.signed-in.executed"] == 1


def test_without_scope_required_anonymous_callers_share_one_scope(scopes) -> None:
    """The default keeps working for callers without credentials, which is why it is not on
    by default; docs/configuration.md "Scoping by a verified caller" explains the risk this
    test shows: two anonymous callers that send the same key and body get one execution
    between them."""
    envoy, upstream = scopes
    path, key = unique_path("anonymous-ok"), new_key()
    first = post(envoy, path, key=key)
    second = post(envoy, path, key=key)
    assert first.status_code == 201 and second.headers.get(REPLAYED) == "true"
    assert upstream.executions(path) == 1
