//! The request's journey without Envoy: each test drives `RequestJourney::on` (and the
//! root's `PluginRoot`) through a `FakeHost` and asserts what a client would see: the
//! verdicts, local replies, callouts, counters and what a retry gets afterwards.

mod access_log;
mod census;
mod cluster;
mod detached;
mod gave_up;
mod grpc;
mod grpc_stream;
mod intake;
mod local_claim;
mod lookup;
mod mail;
mod resolve;
mod response;
mod root;
mod stream;
mod unknown_outcome;
mod wait;

use std::rc::Rc;

use crate::fake_host::{Effect, FakeHost};
use crate::journey::{Event, Journey, RequestJourney, Verdict};
use crate::plugin::Plugin;

/// One rule on `/orders`, key from `Idempotency-Key`, required.
pub(super) const ORDERS: &str =
    r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#;

pub(super) fn plugin(host: &FakeHost, config: &str) -> Rc<Plugin> {
    match Plugin::configure(host, config.as_bytes()) {
        Ok(p) => Rc::new(p),
        Err(e) => panic!("test configuration refused: {e}"),
    }
}

/// Headers of a POST to `path`, with the key when given.
pub(super) fn post_headers<'a>(path: &'a str, key: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "api.local"),
        ("content-type", "application/json"),
    ];
    if let Some(k) = key {
        headers.push(("idempotency-key", k));
    }
    headers
}

/// Delivers request headers and, when there is one, the whole body in one chunk; returns
/// the request and the last verdict.
pub(super) fn send(
    host: &FakeHost,
    plugin: &Rc<Plugin>,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (RequestJourney, Verdict) {
    host.set_request(headers, body);
    let mut request = RequestJourney::new(Rc::clone(plugin));
    let mut verdict = request.on(
        host,
        Event::RequestHeaders {
            end_of_stream: body.is_empty(),
        },
    );
    if !body.is_empty() {
        verdict = request.on(
            host,
            Event::RequestBody {
                size: body.len(),
                end_of_stream: true,
            },
        );
    }
    (request, verdict)
}

/// A POST to /orders with `key` in the host's context `context`, the journey as the root
/// hands it out (reachable from the root); returns it and the last verdict.
pub(super) fn post_in_context(
    host: &FakeHost,
    root: &crate::root::PluginRoot,
    context: u32,
    key: &str,
) -> (Rc<std::cell::RefCell<RequestJourney>>, Verdict) {
    request_in_context(
        host,
        root,
        context,
        &post_headers("/orders", Some(key)),
        b"{}",
    )
}

/// A request with `headers` and a non-empty `body` in the host's context `context`, the
/// journey as the root hands it out; returns it and the last verdict.
pub(super) fn request_in_context(
    host: &FakeHost,
    root: &crate::root::PluginRoot,
    context: u32,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (Rc<std::cell::RefCell<RequestJourney>>, Verdict) {
    host.effective_context.set(context);
    host.set_request(headers, body);
    let journey = root.new_request(context).unwrap();
    journey.borrow_mut().on(
        host,
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    let verdict = journey.borrow_mut().on(
        host,
        Event::RequestBody {
            size: body.len(),
            end_of_stream: true,
        },
    );
    (journey, verdict)
}

/// A root context `root_id` configured with `config` as Envoy does it (the root's context is
/// the effective one).
pub(super) fn configured_root(
    host: &FakeHost,
    config: &str,
    root_id: u32,
) -> crate::root::PluginRoot {
    *host.configuration.borrow_mut() = config.as_bytes().to_vec();
    host.effective_context.set(root_id);
    let mut root = crate::root::PluginRoot::new(root_id);
    assert!(root.on_configure(host));
    root
}

/// The worker's held duplicates and the bytes of their requests.
pub(super) fn held_duplicates(root: &crate::root::PluginRoot) -> (usize, usize) {
    root.plugin().unwrap().waits.held()
}

/// A POST to /orders with `key` and `body`.
pub(super) fn post(
    host: &FakeHost,
    plugin: &Rc<Plugin>,
    key: &str,
    body: &[u8],
) -> (RequestJourney, Verdict) {
    send(host, plugin, &post_headers("/orders", Some(key)), body)
}

/// The upstream answers `status` with `body` in one chunk, and the stream ends.
pub(super) fn respond(host: &FakeHost, request: &mut RequestJourney, status: u16, body: &[u8]) {
    let status = status.to_string();
    host.set_response(
        &[
            (":status", status.as_str()),
            ("content-type", "application/json"),
        ],
        body,
    );
    request.on(
        host,
        Event::ResponseHeaders {
            end_of_stream: body.is_empty(),
        },
    );
    if !body.is_empty() {
        request.on(
            host,
            Event::ResponseBody {
                size: body.len(),
                end_of_stream: true,
            },
        );
    }
    request.on(host, Event::StreamEnd);
}

/// What Envoy reports of the stream: `response.code_details`, `response.flags` and
/// `upstream.request_attempt_count`, as the host hands them to the filter.
/// Envoy's `response.code_details` for a stream the HTTP/2 upstream refused (flag `UR`), on
/// 1.36 and 1.40.
pub(super) const REFUSED_STREAM: &str =
    "upstream_reset_before_response_started{remote_refused_stream_reset}";

pub(super) fn envoy_reports(host: &FakeHost, details: &str, flags: u64, attempts: i64) {
    let mut properties = host.properties.borrow_mut();
    properties.insert("response.code_details".into(), details.as_bytes().to_vec());
    properties.insert(
        "response.flags".into(),
        (flags as i64).to_le_bytes().to_vec(),
    );
    properties.insert(
        "upstream.request_attempt_count".into(),
        attempts.to_le_bytes().to_vec(),
    );
}

/// A local reply: status, headers and body.
pub(super) type Reply = (u16, Vec<(String, Vec<u8>)>, Vec<u8>);

/// The local replies among `effects`.
pub(super) fn replies(effects: &[Effect]) -> Vec<Reply> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::LocalReply {
                status,
                headers,
                body,
            } => Some((*status, headers.clone(), body.clone())),
            _ => None,
        })
        .collect()
}

/// The one local reply of `effects`; fails the test if there is not exactly one.
pub(super) fn the_reply(effects: &[Effect]) -> Reply {
    let all = replies(effects);
    assert_eq!(all.len(), 1, "expected one local reply, got {effects:?}");
    all.into_iter().next().unwrap()
}

pub(super) fn header<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_slice())
}

/// The problem type of a problem+json body.
pub(super) fn problem_type(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    v["type"].as_str().unwrap_or_default().to_string()
}

pub(super) fn is_executing(request: &RequestJourney) -> bool {
    matches!(request.state(), Journey::Executing(_))
}
