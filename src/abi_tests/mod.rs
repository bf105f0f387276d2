//! The filter's side of the proxy-wasm ABI (`host.rs` and `envoy_host.rs`), tested natively
//! against a mocked ABI (`mock_abi.rs`): each of core's host calls reaches the ABI call, map
//! or buffer it means, its bytes cross in Envoy's encodings, and every status Envoy may answer
//! comes back as what the flow decides on (a value, None, or a `HostError` naming the
//! status), never a panic. The Python suite checks the same calls through a real Envoy; these
//! fail in seconds when an index or a status mapping is wrong.
//!
//! The ABI's numbers are written out here as the proxy-wasm 0.2.1 specification gives them,
//! not taken from the SDK's enums the production code uses, so that both are checked.

mod mock_abi;

use idempotency_core::host::{Callout, Host, HostError, SetOutcome, SharedData};

use crate::envoy_host::{new_callback, EnvoyHost};
use mock_abi::{deserialize_map, reset, with};

// Map types.
const REQUEST_HEADERS: u32 = 0;
const REQUEST_TRAILERS: u32 = 1;
const RESPONSE_HEADERS: u32 = 2;
const RESPONSE_TRAILERS: u32 = 3;
const GRPC_INITIAL_METADATA: u32 = 4;
const CALLOUT_RESPONSE_HEADERS: u32 = 6;
// Buffer types.
const REQUEST_BODY: u32 = 0;
const RESPONSE_BODY: u32 = 1;
const CALLOUT_RESPONSE_BODY: u32 = 4;
const GRPC_RECEIVE_BUFFER: u32 = 5;
const PLUGIN_CONFIGURATION: u32 = 7;
// Metric types.
const COUNTER: u32 = 0;
const GAUGE: u32 = 1;

/// Every status but Ok, as Envoy may answer any call, and one no version defines.
const REFUSALS: [(u32, &str); 9] = [
    (mock_abi::NOT_FOUND, "NotFound"),
    (mock_abi::BAD_ARGUMENT, "BadArgument"),
    (mock_abi::SERIALIZATION_FAILURE, "SerializationFailure"),
    (mock_abi::PARSE_FAILURE, "ParseFailure"),
    (mock_abi::EMPTY, "Empty"),
    (mock_abi::CAS_MISMATCH, "CasMismatch"),
    (mock_abi::INTERNAL_FAILURE, "InternalFailure"),
    (mock_abi::UNIMPLEMENTED, "Unimplemented"),
    (99, "UnknownStatus"),
];

fn refuse(call: &'static str, status: u32) {
    with(|abi| abi.refuse.insert(call, status));
}

fn allow(call: &'static str) {
    with(|abi| abi.refuse.remove(call));
}

fn pairs(list: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_vec()))
        .collect()
}

/// The error a refusal with `status` must come back as: its name and number, for the log.
fn names(error: &HostError, status: u32, name: &str) {
    assert_eq!(error.0, format!("{name} ({status})"));
}

type MapRead = fn(&EnvoyHost) -> Result<Vec<(String, Vec<u8>)>, HostError>;

const MAP_READS: [(u32, MapRead); 6] = [
    (REQUEST_HEADERS, |h| h.request_headers()),
    (REQUEST_TRAILERS, |h| h.request_trailers()),
    (RESPONSE_HEADERS, |h| h.response_headers()),
    (RESPONSE_TRAILERS, |h| h.response_trailers()),
    (GRPC_INITIAL_METADATA, |h| h.grpc_initial_metadata()),
    (CALLOUT_RESPONSE_HEADERS, |h| h.callout_response_headers()),
];

#[test]
fn each_header_map_is_read_from_its_own_map_type_and_decoded_exactly() {
    reset();
    let long = vec![b'v'; 70_000];
    for (map, _) in MAP_READS {
        let name = format!("x-map-{map}");
        let values: Vec<(&str, &[u8])> = vec![
            (":status", b"200"),
            (name.as_str(), b"\x01\xff bytes"),
            ("empty", b""),
            ("long", &long),
            ("repeated", b"1"),
            ("repeated", b"2"),
        ];
        with(|abi| abi.maps.insert(map, pairs(&values)));
    }
    for (map, read) in MAP_READS {
        let got = read(&EnvoyHost).unwrap();
        assert_eq!(got.len(), 6, "map {map}");
        assert_eq!(
            got[1].0,
            format!("x-map-{map}"),
            "map {map} read from another map"
        );
        assert_eq!(got[1].1, b"\x01\xff bytes");
        assert_eq!(got[2], ("empty".to_string(), Vec::new()));
        assert_eq!(got[3].1, long);
        assert_eq!((&got[4].1, &got[5].1), (&b"1".to_vec(), &b"2".to_vec()));
    }
}

#[test]
fn a_refused_header_map_is_an_error_naming_the_status() {
    for (status, name) in REFUSALS {
        reset();
        refuse("proxy_get_header_map_pairs", status);
        for (map, read) in MAP_READS {
            let error = read(&EnvoyHost).expect_err(&format!("map {map}, status {status}"));
            names(&error, status, name);
        }
    }
}

#[test]
fn one_request_header_is_read_from_the_request_map_and_an_absent_one_is_none() {
    reset();
    let values: Vec<(&str, &[u8])> = vec![(":method", b"GET"), ("x-bytes", b"\x01\xff")];
    with(|abi| abi.maps.insert(REQUEST_HEADERS, pairs(&values)));
    with(|abi| {
        abi.maps
            .insert(RESPONSE_HEADERS, pairs(&[(":path", b"/other")]))
    });
    assert_eq!(
        EnvoyHost.request_header(":method").unwrap(),
        Some(b"GET".to_vec())
    );
    assert_eq!(
        EnvoyHost.request_header("x-bytes").unwrap(),
        Some(b"\x01\xff".to_vec())
    );
    // NotFound is the host's way of saying the map has no such header, not an error.
    assert_eq!(EnvoyHost.request_header(":path").unwrap(), None);
    for (status, name) in REFUSALS.iter().filter(|(s, _)| *s != mock_abi::NOT_FOUND) {
        refuse("proxy_get_header_map_value", *status);
        let error = EnvoyHost.request_header(":method").expect_err("refused");
        names(&error, *status, name);
    }
}

type BodyRead = fn(&EnvoyHost, usize) -> Result<Vec<u8>, HostError>;

const BODY_READS: [(u32, BodyRead); 4] = [
    (REQUEST_BODY, |h, n| h.request_body(n)),
    (RESPONSE_BODY, |h, n| h.response_body(n)),
    (CALLOUT_RESPONSE_BODY, |h, n| h.callout_response_body(n)),
    (GRPC_RECEIVE_BUFFER, |h, n| h.grpc_message(n)),
];

#[test]
fn bodies_are_read_from_their_buffer_from_the_start_up_to_the_size_given() {
    reset();
    for (buffer, _) in BODY_READS {
        with(|abi| {
            abi.buffers
                .insert(buffer, format!("body of {buffer}").into_bytes())
        });
    }
    for (buffer, read) in BODY_READS {
        assert_eq!(
            read(&EnvoyHost, 9).unwrap(),
            format!("body of {buffer}").into_bytes()
        );
        assert_eq!(
            with(|abi| *abi.buffer_reads.last().unwrap()),
            (buffer, 0, 9)
        );
    }
    with(|abi| {
        abi.buffers
            .insert(PLUGIN_CONFIGURATION, b"{\"rules\":[]}".to_vec())
    });
    assert_eq!(EnvoyHost.plugin_configuration().unwrap(), b"{\"rules\":[]}");
    assert_eq!(
        with(|abi| *abi.buffer_reads.last().unwrap()),
        (PLUGIN_CONFIGURATION, 0, usize::MAX)
    );
}

#[test]
fn an_absent_or_empty_body_reads_as_empty_and_any_other_refusal_as_an_error() {
    for (status, name) in REFUSALS {
        reset();
        refuse("proxy_get_buffer_bytes", status);
        for (buffer, read) in BODY_READS {
            let got = read(&EnvoyHost, 100);
            if status == mock_abi::NOT_FOUND || status == mock_abi::EMPTY {
                assert_eq!(got.unwrap(), Vec::<u8>::new(), "buffer {buffer}");
            } else {
                names(&got.unwrap_err(), status, name);
            }
        }
    }
}

#[test]
fn a_body_is_replaced_whole() {
    reset();
    with(|abi| abi.buffers.insert(REQUEST_BODY, b"0123456789".to_vec()));
    EnvoyHost.set_request_body(b"new").unwrap();
    assert_eq!(
        with(|abi| abi.buffer_writes.clone()),
        vec![(REQUEST_BODY, 0, 10, b"new".to_vec())]
    );
    for (status, name) in REFUSALS {
        reset();
        refuse("proxy_get_buffer_status", status);
        names(
            &EnvoyHost.set_request_body(b"new").unwrap_err(),
            status,
            name,
        );
        assert!(
            with(|abi| abi.buffer_writes.is_empty()),
            "written without its length"
        );
        allow("proxy_get_buffer_status");
        refuse("proxy_set_buffer_bytes", status);
        names(
            &EnvoyHost.set_request_body(b"new").unwrap_err(),
            status,
            name,
        );
    }
}

#[test]
fn shared_data_is_read_and_written_with_its_cas() {
    reset();
    let host = EnvoyHost;
    assert_eq!(SharedData::get(&host, "k").unwrap(), None);
    assert_eq!(host.set("k", b"v1", None).unwrap(), SetOutcome::Stored);
    let (value, cas) = SharedData::get(&host, "k").unwrap().unwrap();
    assert_eq!(value, b"v1");
    assert_eq!(
        host.set("k", b"v2", Some(cas + 1)).unwrap(),
        SetOutcome::CasMismatch
    );
    assert_eq!(host.set("k", b"v2", Some(cas)).unwrap(), SetOutcome::Stored);
    assert_eq!(SharedData::get(&host, "k").unwrap().unwrap().0, b"v2");
    // No cas is 0 on the ABI: an unconditional write.
    let writes = with(|abi| abi.shared_writes.clone());
    assert_eq!(writes[0], ("k".to_string(), b"v1".to_vec(), 0));
    assert_eq!(writes[2].2, cas);
    // An empty value is a value.
    host.set("empty", b"", None).unwrap();
    assert_eq!(
        SharedData::get(&host, "empty").unwrap().unwrap().0,
        Vec::<u8>::new()
    );
}

#[test]
fn a_refused_shared_data_call_is_an_error_unless_it_says_absent_or_cas_mismatch() {
    for (status, name) in REFUSALS {
        reset();
        refuse("proxy_get_shared_data", status);
        match SharedData::get(&EnvoyHost, "k") {
            Ok(None) => assert_eq!(status, mock_abi::NOT_FOUND),
            Ok(Some(_)) => panic!("a refused read returned a value"),
            Err(error) => names(&error, status, name),
        }
        refuse("proxy_set_shared_data", status);
        match EnvoyHost.set("k", b"v", Some(3)) {
            Ok(SetOutcome::CasMismatch) => assert_eq!(status, mock_abi::CAS_MISMATCH),
            Ok(SetOutcome::Stored) => panic!("a refused write was stored"),
            Err(error) => names(&error, status, name),
        }
    }
}

#[test]
fn properties_travel_as_nul_joined_paths_and_a_missing_one_reads_as_none() {
    reset();
    let path = b"xds\0route_metadata".to_vec();
    with(|abi| abi.properties.insert(path, b"meta".to_vec()));
    assert_eq!(
        EnvoyHost.property(&["xds", "route_metadata"]).unwrap(),
        Some(b"meta".to_vec())
    );
    assert_eq!(EnvoyHost.property(&["response", "code"]).unwrap(), None);
    EnvoyHost.publish("idempotency_outcome", b"replayed");
    let published = with(|abi| {
        abi.properties
            .get(b"idempotency_outcome".as_slice())
            .cloned()
    });
    assert_eq!(published, Some(b"replayed".to_vec()));
    for (status, name) in REFUSALS {
        reset();
        refuse("proxy_get_property", status);
        match EnvoyHost.property(&["xds", "route_metadata"]) {
            Ok(None) => assert_eq!(status, mock_abi::NOT_FOUND),
            Ok(Some(_)) => panic!("a refused read returned a value"),
            Err(error) => names(&error, status, name),
        }
        // Publishing is best effort: a refusal costs the access log its field, nothing more.
        refuse("proxy_set_property", status);
        EnvoyHost.publish("idempotency_outcome", b"replayed");
    }
}

#[test]
fn a_local_reply_carries_its_status_headers_and_body_as_envoy_reads_them() {
    reset();
    let headers: Vec<(&str, &[u8])> = vec![
        ("content-type", b"application/problem+json"),
        ("retry-after", b"1"),
    ];
    EnvoyHost
        .send_local_reply(409, &headers, b"{\"status\":409}")
        .unwrap();
    let (status, body, sent_headers, grpc_status) = with(|abi| abi.local_replies[0].clone());
    assert_eq!((status, body.as_slice()), (409, &b"{\"status\":409}"[..]));
    assert_eq!(deserialize_map(&sent_headers), pairs(&headers));
    assert_eq!(grpc_status, -1, "an HTTP reply names no gRPC status");
    for (status, name) in REFUSALS {
        refuse("proxy_send_local_response", status);
        names(
            &EnvoyHost.send_local_reply(500, &[], b"").unwrap_err(),
            status,
            name,
        );
    }
}

#[test]
fn header_edits_go_to_the_map_they_name() {
    reset();
    let h = EnvoyHost;
    h.replace_request_header("x-envoy-max-retries", b"0")
        .unwrap();
    h.remove_request_header("content-length").unwrap();
    h.add_response_header("idempotent-replayed", b"true")
        .unwrap();
    h.add_response_trailer("grpc-status", b"0").unwrap();
    h.replace_response_header("content-type", b"application/grpc")
        .unwrap();
    h.remove_response_header("x-echo").unwrap();
    let edits: Vec<(&str, u32, String)> = with(|abi| {
        abi.header_edits
            .iter()
            .map(|(call, map, name, _)| (*call, *map, name.clone()))
            .collect()
    });
    assert_eq!(
        edits,
        vec![
            (
                "proxy_replace_header_map_value",
                REQUEST_HEADERS,
                "x-envoy-max-retries".into()
            ),
            (
                "proxy_remove_header_map_value",
                REQUEST_HEADERS,
                "content-length".into()
            ),
            (
                "proxy_add_header_map_value",
                RESPONSE_HEADERS,
                "idempotent-replayed".into()
            ),
            (
                "proxy_add_header_map_value",
                RESPONSE_TRAILERS,
                "grpc-status".into()
            ),
            (
                "proxy_replace_header_map_value",
                RESPONSE_HEADERS,
                "content-type".into()
            ),
            (
                "proxy_remove_header_map_value",
                RESPONSE_HEADERS,
                "x-echo".into()
            ),
        ]
    );
    assert_eq!(with(|abi| abi.header_edits[0].3.clone()), b"0");
    for (status, name) in REFUSALS {
        for call in [
            "proxy_replace_header_map_value",
            "proxy_remove_header_map_value",
            "proxy_add_header_map_value",
        ] {
            refuse(call, status);
        }
        names(
            &h.replace_request_header("a", b"b").unwrap_err(),
            status,
            name,
        );
        names(&h.remove_request_header("a").unwrap_err(), status, name);
        names(&h.add_response_header("a", b"b").unwrap_err(), status, name);
        names(
            &h.add_response_trailer("a", b"b").unwrap_err(),
            status,
            name,
        );
    }
}

#[test]
fn a_callout_carries_its_cluster_headers_body_and_a_timeout_envoy_honours() {
    reset();
    let callout = Callout {
        cluster: "idempotency_store",
        headers: vec![
            (":method", "POST"),
            (":path", "/v1/claim"),
            (":authority", "store"),
            ("authorization", "Bearer s3cret"),
        ],
        body: b"{\"key\":\"k\"}",
        trailers: vec![],
        timeout_ms: 0,
    };
    let token = EnvoyHost.dispatch_callout(&callout).unwrap();
    let (cluster, headers, body, trailers, timeout) = with(|abi| abi.http_calls[0].clone());
    assert_eq!(cluster, "idempotency_store");
    let sent: Vec<(String, Vec<u8>)> = callout
        .headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    assert_eq!(deserialize_map(&headers), sent);
    assert_eq!(body, b"{\"key\":\"k\"}");
    assert!(deserialize_map(&trailers).is_empty());
    assert_eq!(
        timeout, 1,
        "a zero timeout is none to Envoy: at least 1 ms is sent"
    );
    let second = EnvoyHost
        .dispatch_callout(&Callout {
            timeout_ms: 2500,
            ..callout.clone()
        })
        .unwrap();
    assert_ne!(token, second);
    assert_eq!(with(|abi| abi.http_calls[1].4), 2500);
    // What Envoy answers a callout it cannot make (an unknown cluster, a bad header).
    for (status, name) in [(2, "BadArgument"), (10, "InternalFailure")] {
        refuse("proxy_http_call", status);
        names(
            &EnvoyHost.dispatch_callout(&callout).unwrap_err(),
            status,
            name,
        );
    }
}

#[test]
fn a_store_stream_opens_sends_and_closes_through_the_abi() {
    reset();
    let metadata: Vec<(&str, &[u8])> = vec![("authorization", b"Bearer s3cret")];
    let stream = EnvoyHost
        .open_grpc_stream(
            "store",
            "idempotency.store.v1.Store",
            "Coordinate",
            &metadata,
        )
        .unwrap();
    let (cluster, service, method, sent_metadata) = with(|abi| abi.grpc_streams[0].clone());
    assert_eq!(
        (cluster.as_str(), service.as_str(), method.as_str()),
        ("store", "idempotency.store.v1.Store", "Coordinate")
    );
    assert_eq!(deserialize_map(&sent_metadata), pairs(&metadata));
    EnvoyHost.send_grpc_message(stream, b"\x00call").unwrap();
    assert_eq!(
        with(|abi| abi.grpc_sent.clone()),
        vec![(stream, b"\x00call".to_vec(), 0)],
        "a message never ends the stream"
    );
    EnvoyHost.close_grpc_stream(stream, false).unwrap();
    EnvoyHost.close_grpc_stream(stream, true).unwrap();
    assert_eq!(
        with(|abi| abi.grpc_closed.clone()),
        vec![(stream, false), (stream, true)]
    );
    // What Envoy answers a stream it cannot open (an unknown cluster, no stream).
    for (status, name) in [(4, "ParseFailure"), (10, "InternalFailure")] {
        refuse("proxy_grpc_stream", status);
        let refused = EnvoyHost.open_grpc_stream("store", "s", "m", &metadata);
        names(&refused.unwrap_err(), status, name);
    }
    for (status, name) in REFUSALS {
        refuse("proxy_grpc_send", status);
        refuse("proxy_grpc_close", status);
        refuse("proxy_grpc_cancel", status);
        names(
            &EnvoyHost.send_grpc_message(stream, b"m").unwrap_err(),
            status,
            name,
        );
        names(
            &EnvoyHost.close_grpc_stream(stream, false).unwrap_err(),
            status,
            name,
        );
        names(
            &EnvoyHost.close_grpc_stream(stream, true).unwrap_err(),
            status,
            name,
        );
    }
}

#[test]
fn the_clock_is_read_once_per_callback_and_a_refused_reading_is_not_kept() {
    reset();
    let clock_reads = || {
        with(|abi| {
            abi.calls
                .iter()
                .filter(|c| **c == "proxy_get_current_time_nanoseconds")
                .count()
        })
    };
    with(|abi| abi.now_nanos = 5_000_000_000);
    new_callback();
    assert_eq!(EnvoyHost.now_ms(), 5_000);
    with(|abi| abi.now_nanos = 6_000_000_000);
    assert_eq!(
        EnvoyHost.now_nanos(),
        5_000_000_000,
        "one reading per callback"
    );
    assert_eq!(clock_reads(), 1);
    new_callback();
    assert_eq!(EnvoyHost.now_ms(), 6_000);
    new_callback();
    refuse(
        "proxy_get_current_time_nanoseconds",
        mock_abi::INTERNAL_FAILURE,
    );
    assert_eq!(EnvoyHost.now_ms(), 0);
    allow("proxy_get_current_time_nanoseconds");
    assert_eq!(
        EnvoyHost.now_ms(),
        6_000,
        "a refused reading is asked again"
    );
}

#[test]
fn a_queue_is_registered_filled_and_drained() {
    reset();
    let queue = EnvoyHost
        .register_queue("envoy.filters.http.idempotency/wake")
        .unwrap();
    EnvoyHost.enqueue(queue, b"wake").unwrap();
    with(|abi| abi.queues.get_mut(&queue).unwrap().push_back(None));
    assert_eq!(EnvoyHost.dequeue(queue).unwrap(), Some(b"wake".to_vec()));
    assert_eq!(
        EnvoyHost.dequeue(queue).unwrap(),
        Some(Vec::new()),
        "an empty entry"
    );
    assert_eq!(EnvoyHost.dequeue(queue).unwrap(), None, "drained");
    names(&EnvoyHost.dequeue(queue + 1).unwrap_err(), 1, "NotFound");
    for (status, name) in REFUSALS {
        refuse("proxy_register_shared_queue", status);
        refuse("proxy_enqueue_shared_queue", status);
        names(&EnvoyHost.register_queue("q").unwrap_err(), status, name);
        names(&EnvoyHost.enqueue(queue, b"x").unwrap_err(), status, name);
    }
}

#[test]
fn counters_and_gauges_are_defined_and_set_and_a_refusal_costs_only_the_value() {
    reset();
    let counter = EnvoyHost
        .define_counter("idempotency.orders.replayed")
        .unwrap();
    let gauge = EnvoyHost.define_gauge("idempotency.retention_ms").unwrap();
    EnvoyHost.increment_counter(counter);
    EnvoyHost.set_gauge(gauge, 7);
    let defined = with(|abi| abi.metrics.clone());
    assert_eq!(defined["idempotency.orders.replayed"], (counter, COUNTER));
    assert_eq!(defined["idempotency.retention_ms"], (gauge, GAUGE));
    assert_eq!(
        with(|abi| abi.metric_values.clone()),
        vec![(counter, 1), (gauge, 7)]
    );
    for (status, name) in REFUSALS {
        refuse("proxy_define_metric", status);
        refuse("proxy_increment_metric", status);
        refuse("proxy_record_metric", status);
        names(&EnvoyHost.define_counter("c").unwrap_err(), status, name);
        names(&EnvoyHost.define_gauge("g").unwrap_err(), status, name);
        EnvoyHost.increment_counter(counter);
        EnvoyHost.set_gauge(gauge, 8);
    }
}

#[test]
fn the_roots_calls_reach_the_abi_and_every_refusal_comes_back() {
    reset();
    EnvoyHost.set_tick_period_ms(20).unwrap();
    EnvoyHost.set_effective_context(7).unwrap();
    EnvoyHost.resume_request().unwrap();
    EnvoyHost.done().unwrap();
    assert_eq!(with(|abi| abi.tick_periods.clone()), vec![20]);
    assert_eq!(with(|abi| abi.effective_context.clone()), vec![7]);
    for (status, name) in REFUSALS {
        for call in [
            "proxy_set_tick_period_milliseconds",
            "proxy_set_effective_context",
            "proxy_continue_stream",
            "proxy_done",
        ] {
            refuse(call, status);
        }
        names(&EnvoyHost.set_tick_period_ms(20).unwrap_err(), status, name);
        names(
            &EnvoyHost.set_effective_context(7).unwrap_err(),
            status,
            name,
        );
        names(&EnvoyHost.resume_request().unwrap_err(), status, name);
        names(&EnvoyHost.done().unwrap_err(), status, name);
    }
}
