"""Every recipe of docs/recipes.md, through real Envoy: the configuration users copy from
``envoy/recipes/`` is the one tested here, with the request its sender really makes. So is
the README's minimal configuration, the first one a newcomer copies.

A recipe holds when the first delivery executes, a redelivery executes nothing and gets the
recorded answer, and what the sender changes between deliveries (signatures, timestamps,
JSON key order) does not turn a redelivery into a new payment.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import urllib.parse
import uuid
from typing import Iterator

import pytest
import yaml

import harness
import helpers

RECIPES = harness.REPO_ROOT / "envoy" / "recipes"
RECIPES_PAGE = harness.REPO_ROOT / "docs" / "recipes.md"
README = harness.REPO_ROOT / "README.md"
# The key the demo upstream's signed endpoints verify with (crates/demo-upstream).
DEMO_SIGNING_KEY = b"demo-signing-key"


def recipe(name: str) -> dict:
    return json.loads((RECIPES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def recipes_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[harness.Envoy, harness.Upstream]]:
    """One Envoy whose plugin configuration holds every recipe's rules, unchanged."""
    rules = [r for path in sorted(RECIPES.glob("*.json")) for r in json.loads(path.read_text())["rules"]]
    with helpers.module_envoy(tmp_path_factory.mktemp("recipes"), "envoy-recipes", {"rules": rules}) as envoy_and_upstream:
        yield envoy_and_upstream


def test_every_recipe_file_is_shown_verbatim_in_the_recipes_page() -> None:
    page = RECIPES_PAGE.read_text()
    files = sorted(RECIPES.glob("*.json"))
    assert len(files) == 6
    for path in files:
        assert path.read_text().strip() in page, f"docs/recipes.md does not show {path.name} as it is"


def readme_minimal_configuration() -> tuple[dict, dict]:
    """The JSON plugin configuration and the Envoy filter (YAML) that the README's
    "A minimal configuration" shows."""
    section = README.read_text().split("\n## A minimal configuration\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", section, re.S | re.M)
    json_blocks = [b for lang, b in blocks if lang == "json"]
    yaml_blocks = [b for lang, b in blocks if lang == "yaml"]
    assert len(json_blocks) == 1 and len(yaml_blocks) == 1, blocks
    (http_filter,) = yaml.safe_load(yaml_blocks[0])
    return json.loads(json_blocks[0]), http_filter


def sample_http_filter() -> dict:
    """The idempotency filter of envoy/envoy.yaml's listener, as users copy it."""
    config = yaml.safe_load(harness.default_envoy_config().read_text())
    (listener,) = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == "idempotency")


def test_the_readme_minimal_configuration_is_the_sample_filter_with_one_rule() -> None:
    plugin, http_filter = readme_minimal_configuration()
    assert [r["name"] for r in plugin["rules"]] == ["orders"] and "store" not in plugin
    shown = http_filter["typed_config"]["config"]
    assert json.loads(shown["configuration"]["value"]) == plugin
    # Everything else is envoy/envoy.yaml's filter as it is: name, root and VM, failure
    # policy, allow_on_headers_stop_iteration, the module make build writes.
    sample = sample_http_filter()
    assert {k: v for k, v in shown.items() if k != "configuration"} == \
        {k: v for k, v in sample["typed_config"]["config"].items() if k != "configuration"}
    assert shown["configuration"]["@type"] == sample["typed_config"]["config"]["configuration"]["@type"]
    assert http_filter["typed_config"]["@type"] == sample["typed_config"]["@type"]


def test_the_readme_minimal_configuration_replays_a_retry(procs) -> None:
    """The README's filter, put in envoy/envoy.yaml's place unchanged (but for the module's
    path), protects a retried POST under /orders as the README says."""
    _, http_filter = readme_minimal_configuration()

    def use_readme_filter(config: dict) -> None:
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [http_filter if f["name"] == "idempotency" else f for f in hcm["http_filters"]]
        assert harness.set_wasm_path(config, helpers.wasm_path()) == 1

    upstream = procs.upstream()
    envoy = helpers.start_envoy(procs, upstream, None, name="envoy-readme", mutate=use_readme_filter)
    path, key = helpers.unique_path("orders"), helpers.new_key()
    first = helpers.post(envoy, path, key=key)
    retry = helpers.post(envoy, path, key=key)
    assert first.status_code == 201 and not helpers.is_replay(first), first.text
    assert retry.status_code == 201 and helpers.is_replay(retry) and retry.content == first.content
    assert upstream.executions(path) == 1
    helpers.problem(helpers.post(envoy, path, key=key, body=b'{"item":"pen","qty":2}'), 422, "key-reused", rule="orders")
    helpers.problem(helpers.post(envoy, helpers.unique_path("orders")), 400, "missing-key", rule="orders")
    assert upstream.executions(path) == 1
    assert not helpers.crash_lines(envoy.log_text())


def test_payment_callback_replays_the_recorded_success_to_every_provider_retry(recipes_envoy) -> None:
    envoy, upstream = recipes_envoy
    tx = f"tx-{uuid.uuid4().hex}"
    path = "/callbacks/payment"
    first = {"transaction_id": tx, "amount": 1999, "currency": "EUR", "status": "paid", "sent_at": "10:00:00", "signature": "a1"}
    # The provider re-signs and re-stamps each retry and serialises keys in another order.
    retry = {"signature": "b2", "status": "paid", "currency": "EUR", "sent_at": "10:05:00", "amount": 1999, "transaction_id": tx}
    before = upstream.executions(path)
    r1 = helpers.post(envoy, path, body=json.dumps(first), headers={"content-type": "application/json"})
    r2 = helpers.post(envoy, path, body=json.dumps(retry, indent=2), headers={"content-type": "application/json"})
    assert r1.status_code == 201 and not helpers.is_replay(r1)
    assert r2.status_code == 201 and helpers.is_replay(r2)
    assert r2.content == r1.content
    assert upstream.executions(path) == before + 1
    # Same transaction, different amount: a different payment, refused.
    tampered = dict(first, amount=1)
    r3 = helpers.post(envoy, path, body=json.dumps(tampered), headers={"content-type": "application/json"})
    helpers.problem(r3, 422, "key-reused", rule="payment-callback")
    # A callback without a transaction id is named precisely.
    r4 = helpers.post(envoy, path, body=json.dumps({"amount": 1}), headers={"content-type": "application/json"})
    doc = helpers.problem(r4, 400, "missing-key", rule="payment-callback")
    assert "/transaction_id" in doc["detail"]
    assert upstream.executions(path) == before + 1


def test_github_webhook_redelivery_is_a_replay(recipes_envoy) -> None:
    envoy, upstream = recipes_envoy
    path = "/webhooks/github"
    delivery = str(uuid.uuid4())
    body = json.dumps({"action": "opened", "number": 7})
    headers = {"x-github-delivery": delivery, "x-github-event": "pull_request", "content-type": "application/json"}
    before = upstream.executions(path)
    r1 = helpers.post(envoy, path, body=body, headers=headers)
    r2 = helpers.post(envoy, path, body=body, headers=headers)
    assert not helpers.is_replay(r1) and helpers.is_replay(r2) and r2.content == r1.content
    # A new delivery id is a new event.
    r3 = helpers.post(envoy, path, body=body, headers=dict(headers, **{"x-github-delivery": str(uuid.uuid4())}))
    assert not helpers.is_replay(r3)
    assert upstream.executions(path) == before + 2


def test_stripe_webhook_keyed_by_the_event_id_in_the_body(recipes_envoy) -> None:
    envoy, upstream = recipes_envoy
    path = "/webhooks/stripe"
    event = f"evt_{uuid.uuid4().hex}"
    payload = {"id": event, "type": "payment_intent.succeeded", "data": {"object": {"id": "pi_1", "amount": 500}}}
    before = upstream.executions(path)
    # Stripe signs every attempt anew (Stripe-Signature carries a timestamp).
    r1 = helpers.post(envoy, path, body=json.dumps(payload), headers={"content-type": "application/json", "stripe-signature": "t=1,v1=aa"})
    r2 = helpers.post(envoy, path, body=json.dumps(payload), headers={"content-type": "application/json", "stripe-signature": "t=2,v1=bb"})
    assert not helpers.is_replay(r1) and helpers.is_replay(r2)
    assert upstream.executions(path) == before + 1
    # A body that is not JSON cannot carry the key: 400 naming the source.
    r3 = helpers.post(envoy, path, body="id=evt_1", headers={"content-type": "application/x-www-form-urlencoded"})
    doc = helpers.problem(r3, 400, "invalid-key", rule="stripe-webhook")
    assert "JSON body field '/id'" in doc["detail"]
    # The event id as an object is not a key.
    r4 = helpers.post(envoy, path, body=json.dumps({"id": {"nested": 1}}), headers={"content-type": "application/json"})
    assert "not a string, number or boolean" in helpers.problem(r4, 400, "invalid-key")["detail"]


def test_cloudevents_keyed_by_source_and_id(recipes_envoy) -> None:
    envoy, upstream = recipes_envoy
    path = "/events"
    event_id = uuid.uuid4().hex
    base = {"ce-specversion": "1.0", "ce-type": "com.example.order.created", "content-type": "application/json"}
    before = upstream.executions(path)
    r1 = helpers.post(envoy, path, body="{}", headers=dict(base, **{"ce-source": "/shop/eu", "ce-id": event_id}))
    r2 = helpers.post(envoy, path, body="{}", headers=dict(base, **{"ce-source": "/shop/eu", "ce-id": event_id}))
    # The same id from another source is another event (ids are unique per source only).
    r3 = helpers.post(envoy, path, body="{}", headers=dict(base, **{"ce-source": "/shop/us", "ce-id": event_id}))
    assert not helpers.is_replay(r1) and helpers.is_replay(r2) and not helpers.is_replay(r3)
    assert upstream.executions(path) == before + 2
    r4 = helpers.post(envoy, path, body="{}", headers=dict(base, **{"ce-id": event_id}))
    assert "header 'ce-source'" in helpers.problem(r4, 400, "missing-key", rule="cloudevents")["detail"]


def test_form_encoded_notify_keyed_by_trade_no(recipes_envoy) -> None:
    envoy, upstream = recipes_envoy
    path = "/notify"
    trade = f"2026{uuid.uuid4().int % 10**12:012d}"
    form = {"trade_no": trade, "out_trade_no": "order-9", "total_amount": "88.00", "trade_status": "TRADE_SUCCESS"}
    ct = {"content-type": "application/x-www-form-urlencoded"}
    before = upstream.executions(path)
    r1 = helpers.post(envoy, path, body=urllib.parse.urlencode(dict(form, notify_time="10:00", sign="s1")), headers=ct)
    r2 = helpers.post(envoy, path, body=urllib.parse.urlencode(dict(form, sign="s2", notify_time="10:04")), headers=ct)
    assert not helpers.is_replay(r1) and helpers.is_replay(r2) and r2.content == r1.content
    assert upstream.executions(path) == before + 1
    r3 = helpers.post(envoy, path, body='{"trade_no":"1"}', headers={"content-type": "application/json"})
    assert "form field 'trade_no'" in helpers.problem(r3, 400, "invalid-key", rule="form-notify")["detail"]


def sign(body: bytes) -> str:
    return "sha256=" + hmac.new(DEMO_SIGNING_KEY, body, hashlib.sha256).hexdigest()


@pytest.mark.parametrize(
    "name, path, refusal",
    [
        # GitHub-style receivers answer a bad signature with 401, Stripe's examples with 400.
        pytest.param("github-webhook", "/webhooks/github", 401, id="github-401"),
        pytest.param("stripe-webhook", "/webhooks/stripe", 400, id="stripe-400"),
        pytest.param("payment-callback", "/callbacks/payment", 403, id="payment-callback-403"),
    ],
)
def test_a_forged_delivery_the_upstream_refuses_never_blocks_the_genuine_one(recipes_envoy, name, path, refusal) -> None:
    """Anyone can post to a webhook URL with a delivery id or transaction id they saw or
    guessed. The upstream checks the signature and refuses the forgery; the filter must not
    record that refusal, or the sender's genuine delivery would get it (or a 422) back for
    the whole TTL and never execute."""
    assert {"4xx", "5xx"} <= set(recipe(name)["rules"][0]["release_on_status"])
    envoy, upstream = recipes_envoy
    event = f"evt_{uuid.uuid4().hex}"
    if name == "github-webhook":
        genuine = json.dumps({"action": "opened", "number": 8}).encode()
        forged = json.dumps({"action": "closed", "number": 8}).encode()
        key_headers = {"x-github-delivery": event, "x-github-event": "pull_request"}
    elif name == "stripe-webhook":
        genuine = json.dumps({"id": event, "type": "charge.refunded", "data": {"object": {"id": "ch_1"}}}).encode()
        forged = json.dumps({"id": event, "type": "charge.refunded", "data": {"object": {"id": "ch_evil"}}}).encode()
        key_headers = {}
    else:
        genuine = json.dumps({"transaction_id": event, "amount": 700, "currency": "EUR", "status": "paid"}).encode()
        forged = json.dumps({"transaction_id": event, "amount": 700, "currency": "EUR", "status": "failed"}).encode()
        key_headers = {}
    headers = dict(key_headers, **{"content-type": "application/json", "x-demo-signed": str(refusal)})
    before = upstream.executions(path)
    # A forgery with another payload, then the genuine payload unsigned: both refused.
    for body, signature in [(forged, "sha256=" + "0" * 64), (genuine, None)]:
        attempt = helpers.post(envoy, path, body=body, headers=dict(headers, **({"x-demo-signature": signature} if signature else {})))
        assert attempt.status_code == refusal and not helpers.is_replay(attempt), attempt.text
    assert upstream.executions(path) == before
    real = helpers.post(envoy, path, body=genuine, headers=dict(headers, **{"x-demo-signature": sign(genuine)}))
    assert real.status_code == 201 and not helpers.is_replay(real), real.text
    assert upstream.executions(path) == before + 1
    # The sender's redelivery of the genuine event is still a replay, and a late forgery
    # cannot execute or overwrite it.
    again = helpers.post(envoy, path, body=genuine, headers=dict(headers, **{"x-demo-signature": sign(genuine)}))
    assert helpers.is_replay(again) and again.content == real.content
    late = helpers.post(envoy, path, body=forged, headers=dict(headers, **{"x-demo-signature": "sha256=" + "1" * 64}))
    helpers.problem(late, 422, "key-reused", rule=name)
    assert upstream.executions(path) == before + 1


def test_query_parameter_key(recipes_envoy) -> None:
    envoy, upstream = recipes_envoy
    order = f"A-{uuid.uuid4().hex[:8]}"
    path = "/checkout"
    before = upstream.executions(path)
    r1 = helpers.post(envoy, f"{path}?order_no={order}")
    r2 = helpers.post(envoy, f"{path}?order_no={urllib.parse.quote(order)}")
    assert not helpers.is_replay(r1) and helpers.is_replay(r2)
    assert upstream.executions(path) == before + 1
    r3 = helpers.post(envoy, f"{path}?other=1")
    assert "query parameter 'order_no'" in helpers.problem(r3, 400, "missing-key", rule="query-key")["detail"]
