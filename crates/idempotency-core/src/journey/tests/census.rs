//! The census: what each path of a request costs at the ABI, counted on the fake host, with a
//! realistic request (a dozen headers, a 300-byte JSON body) and response (400 bytes). Every
//! host call is counted by kind with the bytes it copies each way, and so are the log lines
//! the module formats and hands to Envoy. The test prints the table `docs/benchmarks.md`
//! shows, and fails when a path exceeds its budget: what that path minimally needs, each call
//! justified in `BUDGETS` (and in docs/benchmarks.md).

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use idempotency_protocol::stream::{decode_call, encode_answer, Answer, CallOp, Reply};

use super::*;
use crate::fake_host::Tally;
use crate::root::PluginRoot;

const ROOT: u32 = 1;

const SINGLE: &str = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#;
const WAIT: &str = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
    "on_in_flight":"wait"}]}"#;
const CLUSTER: &str = r#"{"store":{"cluster":"store","token":"s3cret"},
    "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#;

const GRPC: &str =
    r#"{"rules":[{"name":"orders","match":{"grpc_methods":["shop.v1.Orders/PlaceOrder"]}}]}"#;

thread_local! {
    static LOG_LINES: Cell<u64> = const { Cell::new(0) };
}

/// Counts the log lines the module would hand to Envoy (the filter's logger passes every
/// level up to debug to `proxy_log`), per thread so that parallel tests do not mix.
struct CountingLogger;

impl log::Log for CountingLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Debug
    }
    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            LOG_LINES.with(|n| n.set(n.get() + 1));
        }
    }
    fn flush(&self) {}
}

static LOGGER: CountingLogger = CountingLogger;

fn count_logs() {
    // Fails when another test installed it first, which then counts as well.
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Debug);
}

fn take_logs() -> u64 {
    LOG_LINES.with(|n| n.replace(0))
}

fn body() -> Vec<u8> {
    let head = r#"{"order":{"sku":"book-978-0131103627","qty":1,"price":{"amount":4599,"currency":"EUR"}},"customer":{"id":"cus_8f3a2b","email":"reader@example.com"},"shipping":{"line1":"1 Main Street","city":"Springfield","postcode":"12345","country":"DE"},"note":""#;
    let body = format!("{head}{}\"}}", "x".repeat(300 - head.len() - 2));
    assert_eq!(body.len(), 300, "the census's request body is 300 bytes");
    body.into_bytes()
}

fn request_headers(key: &str) -> Vec<(String, String)> {
    [
        (":method", "POST"),
        (":path", "/orders"),
        (":authority", "api.local"),
        (":scheme", "https"),
        ("content-type", "application/json"),
        ("content-length", "300"),
        ("user-agent", "shop-app/4.2.1 (iPhone; iOS 18.1)"),
        ("accept", "application/json"),
        (
            "authorization",
            "Bearer eyJhbGciOiJIUzI1NiJ9.c2hvcC1hcHA.sig",
        ),
        ("idempotency-key", key),
        ("x-request-id", "4f1c2b7e-9a8d-4c3b-b2a1-0e9f8d7c6b5a"),
        ("x-forwarded-proto", "https"),
    ]
    .iter()
    .map(|(n, v)| (n.to_string(), v.to_string()))
    .collect()
}

fn set_request(host: &FakeHost, key: &str, body: &[u8]) {
    *host.request_headers.borrow_mut() = request_headers(key)
        .into_iter()
        .map(|(n, v)| (n, v.into_bytes()))
        .collect();
    *host.request_body.borrow_mut() = body.to_vec();
}

fn set_response(host: &FakeHost) {
    let body = format!(
        r#"{{"order_id":"ord_1","status":"accepted","note":"{}"}}"#,
        "y".repeat(350)
    );
    assert_eq!(body.len(), 400, "the census's response body is 400 bytes");
    host.set_response(
        &[
            (":status", "201"),
            ("content-type", "application/json"),
            ("content-length", "400"),
            ("location", "/orders/ord_1"),
            ("cache-control", "no-store"),
            ("x-request-id", "4f1c2b7e-9a8d-4c3b-b2a1-0e9f8d7c6b5a"),
        ],
        body.as_bytes(),
    );
    // Envoy's report of a response the upstream sent, one attempt.
    envoy_reports(host, "via_upstream", 0, 1);
}

fn root(host: &FakeHost, config: &str) -> PluginRoot {
    configured_root(host, config, 1)
}

/// The request's side, in its context: headers, then the whole body in one chunk.
fn arrive(
    host: &FakeHost,
    root: &PluginRoot,
    context: u32,
    key: &str,
    body: &[u8],
) -> Rc<RefCell<RequestJourney>> {
    set_request(host, key, body);
    headers_then_body(host, root, context, body.len())
}

/// The request set on the host arrives in `context`: its headers, then its `size`-byte body.
fn headers_then_body(
    host: &FakeHost,
    root: &PluginRoot,
    context: u32,
    size: usize,
) -> Rc<RefCell<RequestJourney>> {
    host.effective_context.set(context);
    let journey = root.new_request(context).unwrap();
    deliver(
        host,
        &mut journey.borrow_mut(),
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    deliver(
        host,
        &mut journey.borrow_mut(),
        Event::RequestBody {
            size,
            end_of_stream: true,
        },
    );
    journey
}

/// One callback of Envoy's: the event, in a callback of its own (the clock is read anew).
fn deliver(host: &FakeHost, journey: &mut RequestJourney, event: Event) {
    host.new_callback();
    journey.on(host, event);
}

/// The upstream's answer passing through, then the stream's end (Envoy's `on_log`).
fn upstream_answers(host: &FakeHost, journey: &Rc<RefCell<RequestJourney>>, context: u32) {
    host.effective_context.set(context);
    set_response(host);
    response_passes(host, &mut journey.borrow_mut(), 400, false);
}

/// The response set on the host passes through: headers, its `size`-byte body (then its
/// trailers, `with_trailers`), and the stream's end.
fn response_passes(host: &FakeHost, j: &mut RequestJourney, size: usize, with_trailers: bool) {
    deliver(
        host,
        j,
        Event::ResponseHeaders {
            end_of_stream: false,
        },
    );
    deliver(
        host,
        j,
        Event::ResponseBody {
            size,
            end_of_stream: !with_trailers,
        },
    );
    if with_trailers {
        deliver(host, j, Event::ResponseTrailers);
    }
    deliver(host, j, Event::StreamEnd);
}

/// The filter's own answer passing back through it, then the stream's end.
fn local_answer_passes(host: &FakeHost, journey: &Rc<RefCell<RequestJourney>>, context: u32) {
    host.effective_context.set(context);
    let mut j = journey.borrow_mut();
    deliver(
        host,
        &mut j,
        Event::ResponseHeaders {
            end_of_stream: false,
        },
    );
    deliver(host, &mut j, Event::StreamEnd);
}

/// A unary gRPC call's request in `context`: the census's headers as gRPC metadata and its
/// 300-byte body as one length-prefixed message, then the call's end of stream.
fn grpc_arrives(
    host: &FakeHost,
    root: &PluginRoot,
    context: u32,
    key: &str,
) -> Rc<RefCell<RequestJourney>> {
    let message = body();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&message);
    let mut headers = request_headers(key);
    for (name, value) in headers.iter_mut() {
        match name.as_str() {
            ":path" => *value = "/shop.v1.Orders/PlaceOrder".into(),
            "content-type" => *value = "application/grpc".into(),
            "content-length" => *value = framed.len().to_string(),
            "accept" => *name = "te".into(),
            _ => {}
        }
    }
    for (name, value) in headers.iter_mut().filter(|(n, _)| n == "te") {
        *name = "te".into();
        *value = "trailers".into();
    }
    *host.request_headers.borrow_mut() = headers
        .into_iter()
        .map(|(n, v)| (n, v.into_bytes()))
        .collect();
    *host.request_body.borrow_mut() = framed.clone();
    headers_then_body(host, root, context, framed.len())
}

/// The service's answer to a unary call: headers, one 400-byte message, `grpc-status: 0`
/// trailers, then the stream's end.
fn grpc_upstream_answers(host: &FakeHost, journey: &Rc<RefCell<RequestJourney>>, context: u32) {
    host.effective_context.set(context);
    let message = vec![b'y'; 400];
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&message);
    host.set_response(
        &[
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("x-request-id", "4f1c2b7e-9a8d-4c3b-b2a1-0e9f8d7c6b5a"),
        ],
        &framed,
    );
    envoy_reports(host, "via_upstream", 0, 1);
    *host.response_trailers.borrow_mut() = vec![
        ("grpc-status".into(), b"0".to_vec()),
        ("grpc-message".into(), b"".to_vec()),
    ];
    response_passes(host, &mut journey.borrow_mut(), framed.len(), true);
}

fn grpc_new_call() -> Counted {
    let host = FakeHost::default();
    let root = root(&host, GRPC);
    reset(&host);
    let journey = grpc_arrives(&host, &root, 2, "k1");
    grpc_upstream_answers(&host, &journey, 2);
    counted("gRPC new call", &host)
}

/// A retry of a completed call: the filter turns it into a hop to the replay echo carrying
/// the recorded message, and the echo's answer passes back through the filter, which
/// restores the recorded metadata and adds the trailers. The filter's side only: the echo
/// listener's module reads the hop's headers and body and answers it (a local reply).
fn grpc_replay() -> Counted {
    let host = FakeHost::default();
    let root = root(&host, GRPC);
    let first = grpc_arrives(&host, &root, 2, "k1");
    grpc_upstream_answers(&host, &first, 2);
    reset(&host);
    let retry = grpc_arrives(&host, &root, 3, "k1");
    let mut framed = vec![0u8, 0, 0, 1, 144];
    framed.extend_from_slice(&[b'y'; 400]);
    host.set_response(
        &[
            (":status", "200"),
            (crate::grpc::ECHO_MARKER, "1"),
            ("content-length", "405"),
        ],
        &framed,
    );
    response_passes(&host, &mut retry.borrow_mut(), framed.len(), false);
    assert!(
        host.take_effects()
            .iter()
            .any(|e| matches!(e, Effect::AddResponseTrailer(name, _) if name == "grpc-status")),
        "the replay carries the recorded trailers"
    );
    counted("gRPC replay", &host)
}

/// What one path cost.
struct Counted {
    path: &'static str,
    tallies: BTreeMap<&'static str, Tally>,
    logs: u64,
}

fn counted(path: &'static str, host: &FakeHost) -> Counted {
    Counted {
        path,
        tallies: host.census.take(),
        logs: take_logs(),
    }
}

/// Forgets what the set-up of a path cost.
fn reset(host: &FakeHost) {
    let _ = host.census.take();
    let _ = host.take_effects();
    take_logs();
}

fn new_key() -> Counted {
    let host = FakeHost::default();
    let root = root(&host, SINGLE);
    reset(&host);
    let journey = arrive(&host, &root, 2, "k1", &body());
    upstream_answers(&host, &journey, 2);
    counted("new key", &host)
}

/// A request no rule covers (a browser's read, a write on another route), with the
/// census's dozen headers and no body: it arrives, is answered upstream, and ends.
fn unprotected(path: &'static str, method: &str, target: &str) -> Counted {
    let host = FakeHost::default();
    let root = root(&host, SINGLE);
    reset(&host);
    set_request(&host, "k1", b"");
    for (name, value) in host.request_headers.borrow_mut().iter_mut() {
        match name.as_str() {
            ":method" => *value = method.as_bytes().to_vec(),
            ":path" => *value = target.as_bytes().to_vec(),
            _ => {}
        }
    }
    host.effective_context.set(2);
    let journey = root.new_request(2).unwrap();
    let headers = Event::RequestHeaders {
        end_of_stream: true,
    };
    deliver(&host, &mut journey.borrow_mut(), headers);
    assert!(matches!(journey.borrow().state(), Journey::Unprotected));
    upstream_answers(&host, &journey, 2);
    counted(path, &host)
}

/// A retry of a first request with its key (completed, or still in flight), answered by the
/// filter with `status`.
fn retry(path: &'static str, first_completes: bool, body: &[u8], status: u16) -> Counted {
    let host = FakeHost::default();
    let root = root(&host, SINGLE);
    let first = arrive(&host, &root, 2, "k1", &self::body());
    if first_completes {
        upstream_answers(&host, &first, 2);
    }
    reset(&host);
    let retry = arrive(&host, &root, 3, "k1", body);
    local_answer_passes(&host, &retry, 3);
    assert_eq!(the_reply(&host.take_effects()).0, status);
    counted(path, &host)
}

fn replay() -> Counted {
    retry("replay", true, &body(), 201)
}

fn conflict() -> Counted {
    retry("409 in flight", false, &body(), 409)
}

fn mismatch() -> Counted {
    let mut other = body();
    other[20] = b'X';
    retry("422 reused", true, &other, 422)
}

/// A duplicate held while the first runs, and answered by the root's tick once it completes.
fn wait() -> Counted {
    let host = FakeHost::default();
    let mut root = root(&host, WAIT);
    let first = arrive(&host, &root, 2, "k1", &body());
    reset(&host);
    let held = arrive(&host, &root, 3, "k1", &body());
    let during = host.census.take();
    upstream_answers(&host, &first, 2);
    let _first_costs = host.census.take();
    host.effective_context.set(ROOT);
    host.new_callback();
    root.on_tick(&host);
    local_answer_passes(&host, &held, 3);
    assert_eq!(the_reply(&host.take_effects()).0, 201);
    let mut path = counted("wait, then replay", &host);
    for (kind, t) in during {
        let row = path.tallies.entry(kind).or_default();
        row.calls += t.calls;
        row.bytes_in += t.bytes_in;
        row.bytes_out += t.bytes_out;
    }
    path
}

/// The store's answer to the one call sent since the last look, delivered to the root.
fn store_answers(host: &FakeHost, root: &mut PluginRoot, reply: impl Fn(&CallOp) -> Reply) {
    let sent: Vec<(u32, Vec<u8>)> = host
        .take_effects()
        .into_iter()
        .filter_map(|e| match e {
            Effect::StreamMessage {
                stream, message, ..
            } => Some((stream, message)),
            _ => None,
        })
        .collect();
    assert_eq!(sent.len(), 1, "one call on the stream");
    let (stream, message) = &sent[0];
    let call = decode_call(message).unwrap();
    let answer = encode_answer(&Answer {
        id: call.id,
        reply: reply(&call.op),
    });
    host.effective_context.set(ROOT);
    let size = answer.len();
    *host.grpc_message.borrow_mut() = answer;
    host.new_callback();
    root.on_grpc_message(host, *stream, size);
}

fn claimed(_: &CallOp) -> Reply {
    Reply::Claimed {
        owner: "o1".into(),
        lease_expires_at_ms: 1,
    }
}

fn recorded(_: &CallOp) -> Reply {
    Reply::Recorded
}

fn cluster_new_key() -> Counted {
    let host = FakeHost::default();
    let mut root = root(&host, CLUSTER);
    reset(&host);
    let journey = arrive(&host, &root, 2, "k1", &body());
    store_answers(&host, &mut root, claimed);
    upstream_answers(&host, &journey, 2);
    store_answers(&host, &mut root, recorded);
    counted("cluster new key", &host)
}

fn cluster_replay() -> Counted {
    let host = FakeHost::default();
    let mut root = root(&host, CLUSTER);
    let first = arrive(&host, &root, 2, "k1", &body());
    store_answers(&host, &mut root, claimed);
    upstream_answers(&host, &first, 2);
    store_answers(&host, &mut root, recorded);
    reset(&host);
    let retry = arrive(&host, &root, 3, "k1", &body());
    local_answer_passes(&host, &retry, 3);
    assert_eq!(the_reply(&host.take_effects()).0, 201);
    counted("cluster replay", &host)
}

/// The host calls a path may make, by kind, each with why it is needed; a kind not listed
/// is not allowed at all. Paths that need the same things share their lists.
struct Budget {
    path: &'static str,
    calls: &'static [&'static [Allowed]],
}

/// A kind of host call, how many of it, and why.
type Allowed = (&'static str, u64, &'static str);

/// What every protected request needs to be told apart and counted. (With
/// `access_log_fields`, three `set_property` calls more: rule, key hash, outcome.)
const REQUEST: [Allowed; 4] = [
    (
        "request header",
        1,
        ":method on its own first: a request no rule covers (a read) stops there",
    ),
    (
        "request headers",
        1,
        "one read of the map: rule, key, scope and the fingerprint's method and path",
    ),
    (
        "request body",
        1,
        "the body, once it is whole: the fingerprint",
    ),
    ("metrics", 1, "the outcome's counter"),
];

/// The route's metadata naming a rule (route_metadata_namespace; null turns it off).
const ROUTE_METADATA: [Allowed; 1] = [(
    "properties",
    1,
    "the route's metadata naming a rule (route_metadata_namespace; null turns it off)",
)];

/// A request that goes upstream and is recorded in the local table.
const EXECUTED: [Allowed; 6] = [
    ("properties", 3, "the route's metadata; response.code_details and upstream.request_attempt_count: who answered"),
    ("shared data get", 3, "the table registry (a push on another worker), the bucket to claim, the bucket to complete (a set returns no cas)"),
    ("shared data set", 3, "the claim, the response, the completion"),
    ("header edits", 2, "x-envoy-max-retries: 0, on the way upstream only; idempotency-key-expires on the answer that is recorded"),
    ("response headers", 1, "status and headers to record"),
    ("response body", 1, "the body to record"),
];

/// A retry answered from the local table's copy (single-proxy or cluster: no store call).
const REPLAYED: [Allowed; 3] = [
    ("clock", 1, "the claim"),
    (
        "shared data get",
        2,
        "the bucket, the recorded response (the bucket holds the key: no registry read)",
    ),
    ("local reply", 1, "the replay"),
];

/// A claim the table refuses (409 in flight, 422 reused): nothing to read beyond the bucket.
const REFUSED: [Allowed; 3] = [
    ("clock", 1, "the claim"),
    (
        "shared data get",
        1,
        "the bucket (it holds the key: no registry read)",
    ),
    ("local reply", 1, "the problem"),
];

const BUDGETS: &[Budget] = &[
    Budget {
        path: "unprotected GET",
        calls: &[&[(
            "request header",
            1,
            ":method alone: no rule covers it; no map, nothing on later callbacks",
        )]],
    },
    Budget {
        path: "unprotected POST",
        calls: &[&[
            ("request header", 1, ":method on its own first: a request no rule covers (a read) stops there"),
            ("request headers", 1, "the map: no rule's path matches"),
            ("properties", 1, "the route's metadata, which could name a rule whatever the path (route_metadata_namespace; null turns it off)"),
        ]],
    },
    Budget {
        path: "new key",
        calls: &[&REQUEST, &EXECUTED, &[("clock", 2, "one per callback that decides: the claim, the completion")]],
    },
    Budget { path: "replay", calls: &[&REQUEST, &ROUTE_METADATA, &REPLAYED] },
    Budget { path: "409 in flight", calls: &[&REQUEST, &ROUTE_METADATA, &REFUSED] },
    Budget { path: "422 reused", calls: &[&REQUEST, &ROUTE_METADATA, &REFUSED] },
    Budget {
        path: "wait, then replay",
        calls: &[&ROUTE_METADATA, &[
            ("request header", 1, ":method on its own first: a request no rule covers (a read) stops there"),
            ("request headers", 1, "as any request"),
            ("request body", 1, "as any request"),
            ("metrics", 2, "waited, replayed_after_wait"),
            ("clock", 2, "the claim; the root's tick"),
            ("shared data get", 3, "the bucket at the claim (it holds the key: no registry read); on the tick the bucket and the response"),
            ("context switches", 2, "into the held request to answer it, back to the root"),
            ("local reply", 1, "the replay"),
        ]],
    },
    Budget {
        path: "cluster new key",
        calls: &[&REQUEST, &[
            ("shared data get", 4, "the table registry, the bucket to claim, the bucket to complete, the bucket to mark the record as in the store once the store took it (until then eviction leaves it alone)"),
            ("shared data set", 4, "the claim, the response, the completion, the in-store mark"),
        ], &EXECUTED, &[
            ("clock", 4, "the claim, the store's answer, the completion, its answer"),
            ("stream messages sent", 2, "the claim and the completion, on the worker's stream"),
            ("stream messages read", 2, "their answers"),
            ("context switches", 6, "to the root to send and back, twice; into the request with the claim's answer and back"),
            ("resume", 1, "the request goes upstream once the store confirmed the claim"),
        ]],
    },
    Budget { path: "cluster replay", calls: &[&REQUEST, &ROUTE_METADATA, &REPLAYED] },
    Budget {
        path: "gRPC new call",
        calls: &[&REQUEST, &EXECUTED, &[
            ("clock", 2, "one per callback that decides: the claim, the completion"),
            ("response trailers", 1, "the trailers to record: grpc-status decides, and a replay gives them back"),
        ]],
    },
    Budget {
        path: "gRPC replay",
        calls: &[&REQUEST, &ROUTE_METADATA, &[
            ("clock", 1, "the claim"),
            ("shared data get", 2, "the bucket, the recorded response (the bucket holds the key: no registry read)"),
            ("request body set", 1, "the hop carries the recorded message to the echo (Envoy sends a gRPC call's local reply trailers-only)"),
            ("header edits", 11, "the hop: :path and content-type set, the client's content-length dropped; on the way back the echo's marker and length dropped, the recorded metadata (3 here: 2 and idempotency-key-expires) and the replay marker set, the recorded trailers (2 here) added: one call each"),
            ("response headers", 1, "the echo's answer, to tell it from anything else"),
        ]],
    },
];

impl Budget {
    fn allowed(&self) -> impl Iterator<Item = &Allowed> {
        self.calls.iter().flat_map(|list| list.iter())
    }
}

fn total(c: &Counted) -> Tally {
    c.tallies.values().fold(Tally::default(), |a, t| Tally {
        calls: a.calls + t.calls,
        bytes_in: a.bytes_in + t.bytes_in,
        bytes_out: a.bytes_out + t.bytes_out,
    })
}

fn table(paths: &[Counted]) -> String {
    let mut kinds: Vec<&'static str> = paths
        .iter()
        .flat_map(|p| p.tallies.keys().copied())
        .collect();
    kinds.sort_unstable();
    kinds.dedup();
    let mut out = String::from("| host call |");
    for p in paths {
        out.push_str(&format!(" {} |", p.path));
    }
    out.push_str("\n| --- |");
    out.push_str(&" ---: |".repeat(paths.len()));
    out.push('\n');
    let cell = |t: Option<&Tally>| match t {
        None => "–".to_string(),
        Some(t) => format!("{} ({} in, {} out)", t.calls, t.bytes_in, t.bytes_out),
    };
    for kind in kinds {
        out.push_str(&format!("| {kind} |"));
        for p in paths {
            out.push_str(&format!(" {} |", cell(p.tallies.get(kind))));
        }
        out.push('\n');
    }
    out.push_str("| log lines |");
    for p in paths {
        out.push_str(&format!(" {} |", p.logs));
    }
    out.push_str("\n| **all host calls** |");
    for p in paths {
        let t = total(p);
        out.push_str(&format!(
            " **{}** ({} in, {} out) |",
            t.calls + p.logs,
            t.bytes_in,
            t.bytes_out
        ));
    }
    out.push('\n');
    out
}

#[test]
fn census_of_host_calls_per_path_within_budget() {
    count_logs();
    take_logs();
    let paths = vec![
        new_key(),
        replay(),
        conflict(),
        mismatch(),
        wait(),
        cluster_new_key(),
        cluster_replay(),
        grpc_new_call(),
        grpc_replay(),
        unprotected("unprotected GET", "GET", "/catalog/items/42"),
        unprotected("unprotected POST", "POST", "/search"),
    ];
    let printed = table(&paths);
    println!("census-begin\n{printed}census-end");
    println!("budgets-begin");
    for budget in BUDGETS {
        let reasons: Vec<String> = budget
            .allowed()
            .map(|(k, n, why)| format!("{k} {n}: {why}"))
            .collect();
        println!("- {}: {}", budget.path, reasons.join("; "));
    }
    println!("budgets-end");
    let mut over = Vec::new();
    for budget in BUDGETS {
        let Some(path) = paths.iter().find(|p| p.path == budget.path) else {
            panic!("no path {}", budget.path);
        };
        for (kind, tally) in &path.tallies {
            let allowed = budget
                .allowed()
                .find(|(k, _, _)| k == kind)
                .map_or(0, |(_, n, _)| *n);
            if tally.calls > allowed {
                over.push(format!("{}: {kind} {} > {allowed}", path.path, tally.calls));
            }
        }
        let logs_allowed = budget
            .allowed()
            .find(|(k, _, _)| *k == "log lines")
            .map_or(0, |(_, n, _)| *n);
        if path.logs > logs_allowed {
            over.push(format!(
                "{}: log lines {} > {logs_allowed}",
                path.path, path.logs
            ));
        }
    }
    assert!(
        over.is_empty(),
        "over budget:\n{}\n{printed}",
        over.join("\n")
    );
}

/// Milliseconds of a monotonic clock, on both targets.
#[cfg(not(target_arch = "wasm32"))]
fn now_ms() -> f64 {
    thread_local! {
        static START: std::time::Instant = std::time::Instant::now();
    }
    START.with(|s| s.elapsed().as_secs_f64() * 1000.0)
}

#[cfg(target_arch = "wasm32")]
fn now_ms() -> f64 {
    js_sys::Date::now()
}

/// Not a test: a loop for a profiler, the module's own work on the replay and new-key paths
/// without Envoy, its fake host included. Natively: `CENSUS_LOOP_ROUNDS=100000 cargo test
/// --release -p idempotency-core --lib census_loop -- --ignored --nocapture` (under `perf
/// record`); in V8, as Envoy runs the module: `scripts/profile-module.sh`, which builds it for
/// wasm32 with the rounds fixed at compile time (a wasm32 test reads no environment).
#[test]
#[ignore]
fn census_loop() {
    #[cfg(not(target_arch = "wasm32"))]
    let rounds = std::env::var("CENSUS_LOOP_ROUNDS").ok();
    #[cfg(target_arch = "wasm32")]
    let rounds = option_env!("CENSUS_LOOP_ROUNDS").map(str::to_string);
    let rounds: u32 = rounds.and_then(|v| v.parse().ok()).unwrap_or(20_000);
    // A path's rounds left out (`CENSUS_LOOP_ONLY=replay` or `new_key`), for an instruction
    // count of one path under callgrind; `cluster_new_key` runs that path alone.
    #[cfg(not(target_arch = "wasm32"))]
    let only = std::env::var("CENSUS_LOOP_ONLY").unwrap_or_default();
    #[cfg(target_arch = "wasm32")]
    let only = String::new();
    if only == "cluster_new_key" {
        // Cluster mode's new key: the claim and the completion on the stream, answered.
        let host = FakeHost::default();
        let mut root = root(&host, CLUSTER);
        let started = now_ms();
        for n in 0..rounds {
            let j = arrive(&host, &root, 3 + n, &format!("c{n}"), &body());
            store_answers(&host, &mut root, claimed);
            upstream_answers(&host, &j, 3 + n);
            store_answers(&host, &mut root, recorded);
            let _ = host.take_effects();
            let _ = host.census.take();
        }
        let us = (now_ms() - started) * 1000.0 / f64::from(rounds);
        println!("census loop, {rounds} rounds, per request: cluster new key {us:.2} us");
        return;
    }
    let replay_rounds = if only == "new_key" { 0 } else { rounds };
    let new_key_rounds = if only == "replay" { 0 } else { rounds };
    let host = FakeHost::default();
    let root = root(&host, SINGLE);
    let first = arrive(&host, &root, 2, "k1", &body());
    upstream_answers(&host, &first, 2);
    let body = body();
    let started = now_ms();
    for n in 0..replay_rounds {
        let retry = arrive(&host, &root, 3 + n, "k1", &body);
        local_answer_passes(&host, &retry, 3 + n);
        let _ = host.take_effects();
        let _ = host.census.take();
    }
    let replay_us = (now_ms() - started) * 1000.0 / f64::from(rounds);
    let started = now_ms();
    for n in 0..new_key_rounds {
        let key = format!("n{n}");
        let j = arrive(&host, &root, 3 + rounds + n, &key, &body);
        upstream_answers(&host, &j, 3 + rounds + n);
        let _ = host.take_effects();
        let _ = host.census.take();
    }
    let new_key_us = (now_ms() - started) * 1000.0 / f64::from(rounds);
    let line = format!(
        "census loop, {rounds} rounds, per request: replay {replay_us:.2} us, new key {new_key_us:.2} us"
    );
    #[cfg(target_arch = "wasm32")]
    wasm_bindgen_test::console_log!("{line}");
    #[cfg(not(target_arch = "wasm32"))]
    println!("{line}");
}
