//! The bindings over a mocked Envoy (`mock_abi`): status handling, header and body access,
//! and the hooks' panic barrier and re-entry handling.

use std::cell::RefCell;
use std::ffi::c_void;
use std::time::Duration;

use super::ffi;
use super::hooks::{self, *};
use super::*;
use crate::mock_abi::{self, reset, with};

const REQ: u32 = ffi::HEADER_TYPE_REQUEST_HEADER;

fn fake(n: usize) -> *mut c_void {
    n as *mut c_void
}

fn filter(n: usize) -> Filter {
    // SAFETY: the mock never dereferences filter pointers.
    unsafe { Filter::from_raw(fake(n)) }
}

fn set_request_headers(pairs: &[(&str, &str)]) {
    with(|abi| {
        abi.maps.insert(
            REQ,
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
                .collect(),
        )
    });
}

// ------------------------------------------------------------------------------------------
// Headers
// ------------------------------------------------------------------------------------------

#[test]
fn reads_one_header_all_values_and_the_whole_map() {
    reset();
    set_request_headers(&[(":path", "/a"), ("x-k", "1"), ("x-k", "2"), ("x-o", "")]);
    let f = filter(1);
    assert_eq!(f.request_header("x-k"), Some(b"1".to_vec()));
    assert_eq!(f.request_header("x-none"), None);
    assert_eq!(f.header(HeaderMap::RequestHeaders, "x-o"), Some(Vec::new()));
    assert_eq!(
        f.header_values(HeaderMap::RequestHeaders, "x-k"),
        vec![b"1".to_vec(), b"2".to_vec()]
    );
    let all = f.headers(HeaderMap::RequestHeaders);
    assert_eq!(all.len(), 4);
    assert_eq!(all[0], (":path".to_owned(), b"/a".to_vec()));
    assert!(f.headers(HeaderMap::ResponseTrailers).is_empty());
}

#[test]
fn a_refused_header_read_is_none_or_empty() {
    reset();
    set_request_headers(&[("x-k", "1")]);
    with(|abi| {
        abi.refuse.insert("get_header");
        abi.refuse.insert("get_headers");
    });
    let f = filter(1);
    assert_eq!(f.request_header("x-k"), None);
    assert!(f.header_values(HeaderMap::RequestHeaders, "x-k").is_empty());
    assert!(f.headers(HeaderMap::RequestHeaders).is_empty());
}

#[test]
fn sets_adds_and_removes_headers() {
    reset();
    set_request_headers(&[("x-k", "1"), ("x-k", "2"), ("x-gone", "g")]);
    let f = filter(1);
    f.set_header(HeaderMap::RequestHeaders, "x-k", b"3")
        .unwrap();
    f.add_header(HeaderMap::RequestHeaders, "x-k", b"4")
        .unwrap();
    f.set_header(HeaderMap::RequestHeaders, "x-empty", b"")
        .unwrap();
    f.remove_header(HeaderMap::RequestHeaders, "x-gone")
        .unwrap();
    f.remove_header(HeaderMap::RequestHeaders, "x-absent")
        .unwrap();
    assert_eq!(
        f.header_values(HeaderMap::RequestHeaders, "x-k"),
        vec![b"3".to_vec(), b"4".to_vec()]
    );
    // An empty value is a value (a non-null pointer), not a removal.
    assert_eq!(f.request_header("x-empty"), Some(Vec::new()));
    assert_eq!(f.request_header("x-gone"), None);
}

#[test]
fn a_refused_header_write_is_an_error() {
    reset();
    with(|abi| {
        abi.refuse.insert("set_header");
        abi.refuse.insert("add_header");
    });
    let f = filter(1);
    assert_eq!(
        f.set_header(HeaderMap::ResponseTrailers, "x", b"1"),
        Err(AbiError::Refused("set_header"))
    );
    assert_eq!(
        f.add_header(HeaderMap::RequestHeaders, "x", b"1"),
        Err(AbiError::Refused("add_header"))
    );
    assert_eq!(
        f.remove_header(HeaderMap::RequestHeaders, "x"),
        Err(AbiError::Refused("remove_header"))
    );
}

// ------------------------------------------------------------------------------------------
// Bodies
// ------------------------------------------------------------------------------------------

fn set_body(body_type: u32, chunks: &[&[u8]]) {
    with(|abi| {
        abi.bodies
            .insert(body_type, chunks.iter().map(|c| c.to_vec()).collect())
    });
}

#[test]
fn the_request_body_is_the_buffered_chunks_then_the_running_chunk() {
    reset();
    set_body(ffi::BODY_TYPE_BUFFERED_REQUEST_BODY, &[b"ab", b"cd"]);
    set_body(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY, &[b"ef", b"g"]);
    let f = filter(1);
    assert_eq!(f.request_body().unwrap(), b"abcdefg");
    assert_eq!(f.request_body_chunk().unwrap(), b"efg");
}

#[test]
fn a_received_chunk_that_is_the_buffer_is_not_counted_twice() {
    reset();
    set_body(ffi::BODY_TYPE_BUFFERED_REQUEST_BODY, &[b"abc"]);
    set_body(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY, &[b"abc"]);
    with(|abi| abi.received_is_buffered = true);
    assert_eq!(filter(1).request_body().unwrap(), b"abc");
}

#[test]
fn outside_a_body_hook_the_body_is_the_buffered_part() {
    reset();
    set_body(ffi::BODY_TYPE_BUFFERED_RESPONSE_BODY, &[b"x", b"y"]);
    let f = filter(1);
    assert_eq!(f.response_body().unwrap(), b"xy");
    assert_eq!(f.response_body_chunk().unwrap(), b"");
}

#[test]
fn a_refused_or_inconsistent_body_read_does_not_panic() {
    reset();
    set_body(ffi::BODY_TYPE_BUFFERED_REQUEST_BODY, &[b"ab"]);
    with(|abi| {
        abi.refuse.insert("get_body_chunks");
    });
    assert_eq!(filter(1).request_body().unwrap(), b"");
    with(|abi| {
        abi.refuse.clear();
        abi.body_size_lie = Some(99);
    });
    assert_eq!(
        filter(1).request_body(),
        Err(AbiError::Inconsistent("get_body_chunks"))
    );
}

#[test]
fn replacing_the_request_body_drains_both_parts_and_appends_to_the_running_chunk() {
    reset();
    set_body(ffi::BODY_TYPE_BUFFERED_REQUEST_BODY, &[b"ab", b"cd"]);
    set_body(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY, &[b"ef"]);
    let f = filter(1);
    f.replace_request_body(b"NEW").unwrap();
    assert_eq!(f.request_body().unwrap(), b"NEW");
    with(|abi| {
        assert!(abi
            .bodies
            .get(&ffi::BODY_TYPE_BUFFERED_REQUEST_BODY)
            .unwrap()
            .is_empty());
        assert_eq!(
            abi.bodies
                .get(&ffi::BODY_TYPE_RECEIVED_REQUEST_BODY)
                .unwrap(),
            &vec![b"NEW".to_vec()]
        );
    });
}

#[test]
fn a_refused_body_replacement_is_an_error() {
    reset();
    set_body(ffi::BODY_TYPE_BUFFERED_REQUEST_BODY, &[b"ab"]);
    with(|abi| {
        abi.refuse.insert("drain_body");
    });
    assert_eq!(
        filter(1).replace_request_body(b"x"),
        Err(AbiError::Refused("drain_body"))
    );
    reset();
    with(|abi| {
        abi.refuse.insert("append_body");
    });
    assert_eq!(
        filter(1).replace_request_body(b"x"),
        Err(AbiError::Refused("append_body"))
    );
}

// ------------------------------------------------------------------------------------------
// Attributes, filter state, metrics, callouts, scheduler, logging
// ------------------------------------------------------------------------------------------

#[test]
fn attributes_are_some_when_envoy_has_them() {
    reset();
    with(|abi| {
        abi.attr_strings
            .insert(ffi::ATTRIBUTE_XDS_ROUTE_NAME, b"orders".to_vec());
        abi.attr_ints
            .insert(ffi::ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT, 2);
    });
    let f = filter(1);
    assert_eq!(
        f.attribute_string(AttributeId::XdsRouteName),
        Some(b"orders".to_vec())
    );
    assert_eq!(f.attribute_string(AttributeId::ResponseCodeDetails), None);
    assert_eq!(
        f.attribute_int(AttributeId::UpstreamRequestAttemptCount),
        Some(2)
    );
    assert_eq!(f.attribute_int(AttributeId::ResponseCode), None);
}

#[test]
fn route_metadata_string_is_some_only_for_a_present_string() {
    use mock_abi::MetadataValue;
    reset();
    with(|abi| {
        let fields = abi
            .metadata
            .entry((ffi::METADATA_SOURCE_ROUTE, "idempotency".to_owned()))
            .or_default();
        fields.insert(
            "rule".to_owned(),
            MetadataValue::String(b"payments".to_vec()),
        );
        fields.insert("ttl".to_owned(), MetadataValue::NotAString);
        fields.insert("empty".to_owned(), MetadataValue::String(Vec::new()));
    });
    let f = filter(1);
    // Present.
    assert_eq!(
        f.metadata_string(MetadataSource::Route, "idempotency", "rule"),
        Some(b"payments".to_vec())
    );
    assert_eq!(
        f.metadata_string(MetadataSource::Route, "idempotency", "empty"),
        Some(Vec::new())
    );
    // Absent namespace, absent key, not a string.
    assert_eq!(
        f.metadata_string(MetadataSource::Route, "other", "rule"),
        None
    );
    assert_eq!(
        f.metadata_string(MetadataSource::Route, "idempotency", "nope"),
        None
    );
    assert_eq!(
        f.metadata_string(MetadataSource::Route, "idempotency", "ttl"),
        None
    );
    // Another source's metadata is not the route's.
    assert_eq!(
        f.metadata_string(MetadataSource::Dynamic, "idempotency", "rule"),
        None
    );
    // Envoy answering false (no route) is None.
    with(|abi| abi.refuse.insert("get_metadata_string"));
    assert_eq!(
        f.metadata_string(MetadataSource::Route, "idempotency", "rule"),
        None
    );
}

#[test]
fn filter_state_is_set_or_refused() {
    reset();
    let f = filter(1);
    f.set_filter_state("idem.outcome", b"replayed").unwrap();
    with(|abi| {
        assert_eq!(
            abi.filter_state.get(b"idem.outcome".as_slice()),
            Some(&b"replayed".to_vec())
        )
    });
    with(|abi| {
        abi.refuse.insert("set_filter_state_bytes");
    });
    assert_eq!(
        f.set_filter_state("idem.outcome", b"x"),
        Err(AbiError::Refused("set_filter_state_bytes"))
    );
}

#[test]
fn metric_statuses_become_errors() {
    reset();
    // SAFETY: the mock never dereferences it.
    let config = unsafe { ConfigHandle::from_raw(fake(9)) };
    let counter = config.define_counter("requests").unwrap();
    let gauge = config.define_gauge("waiting").unwrap();
    config.increment_counter(counter, 2).unwrap();
    config.set_gauge(gauge, 5).unwrap();
    filter(1).increment_counter(counter, 1).unwrap();
    filter(1).set_gauge(gauge, 6).unwrap();
    with(|abi| {
        assert_eq!(
            abi.metric_calls,
            vec![
                ("config_increment_counter", 0, 2),
                ("config_set_gauge", 1, 5),
                ("increment_counter", 0, 1),
                ("set_gauge", 1, 6),
            ]
        );
        abi.metrics_result = ffi::METRICS_FROZEN;
    });
    assert_eq!(
        config.define_counter("late"),
        Err(AbiError::Metrics {
            call: "http_filter_config_define_counter",
            result: 3
        })
    );
    assert!(config.increment_counter(counter, 1).is_err());
    assert!(filter(1).increment_counter(counter, 1).is_err());
    assert!(config.set_gauge(gauge, 1).is_err());
}

#[test]
fn a_callout_passes_its_request_and_a_refusal_is_an_error() {
    reset();
    let f = filter(1);
    let headers: [(&str, &[u8]); 3] = [(":method", b"POST"), (":path", b"/c"), ("host", b"store")];
    let id = f
        .http_callout("store", &headers, b"payload", Duration::from_millis(250))
        .unwrap();
    assert_eq!(id, 1);
    with(|abi| {
        let (cluster, sent, body, timeout) = abi.callouts[0].clone();
        assert_eq!(cluster, "store");
        assert_eq!(sent.len(), 3);
        assert_eq!(sent[0], (":method".to_owned(), b"POST".to_vec()));
        assert_eq!(body, b"payload");
        assert_eq!(timeout, 250);
        abi.callout_result = ffi::CALLOUT_INIT_CLUSTER_NOT_FOUND;
    });
    assert_eq!(
        f.http_callout("nope", &headers, b"", Duration::from_secs(1)),
        Err(AbiError::CalloutNotStarted(2))
    );
}

#[test]
fn a_scheduler_commits_from_another_thread_and_is_deleted_once() {
    reset();
    let scheduler = filter(0x5ced).new_scheduler().unwrap();
    let shared = std::sync::Arc::new(scheduler);
    let other = std::sync::Arc::clone(&shared);
    std::thread::spawn(move || other.commit(7)).join().unwrap();
    shared.commit(8);
    drop(shared);
    let commits = mock_abi::COMMITS.lock().unwrap().clone();
    assert!(commits.contains(&(0x5ced, 7)) && commits.contains(&(0x5ced, 8)));
    let deleted = mock_abi::DELETED.lock().unwrap().clone();
    assert_eq!(deleted.iter().filter(|p| **p == 0x5ced).count(), 1);

    with(|abi| {
        abi.refuse.insert("scheduler_new");
    });
    assert!(filter(0x5cee).new_scheduler().is_none());
}

#[test]
fn the_worker_index_and_log_reach_envoy() {
    reset();
    with(|abi| abi.worker_index = 3);
    assert_eq!(filter(1).worker_index(), 3);
    log(LogLevel::Warn, "hello");
    with(|abi| assert_eq!(abi.logs, vec![(ffi::LOG_LEVEL_WARN, "hello".to_owned())]));
}

#[test]
fn send_response_outside_a_hook_is_made_at_once() {
    reset();
    filter(4).send_response(409, &[("retry-after", b"1")], b"busy");
    with(|abi| {
        assert_eq!(
            abi.responses,
            vec![(
                4,
                409,
                vec![("retry-after".to_owned(), b"1".to_vec())],
                b"busy".to_vec()
            )]
        )
    });
}

/// Request 5's hook is running, and under it request 6's (Envoy re-entered): a reply to 5
/// made now waits until 5's hook ends, as Envoy would run 5's hooks inside it while 5's
/// filter is held.
#[test]
fn a_call_on_a_request_whose_hook_is_deeper_in_the_stack_waits_for_that_hook() {
    reset();
    enter_hook(fake(5).cast());
    enter_hook(fake(6).cast());
    filter(5).send_response(409, &[], b"held");
    with(|abi| assert!(abi.responses.is_empty()));
    assert!(leave_hook().is_empty(), "6's hook held nothing");
    let held = leave_hook();
    assert_eq!(held.len(), 1, "5's reply waits for 5's hook");
    for call in held {
        filter(5).run(call);
    }
    with(|abi| assert_eq!(abi.responses.len(), 1));
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter()
        .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
        .collect()
}

#[test]
fn a_response_in_parts_outside_a_hook_is_sent_at_once_in_order() {
    use mock_abi::Part;
    reset();
    let f = filter(7);
    f.send_response_headers(
        &[
            (":status", b"201"),
            ("content-type", b"text/plain"),
            ("x-m", b"1"),
            ("x-m", b"2"),
        ],
        false,
    );
    f.send_response_data(b"made", false);
    f.send_response_trailers(&[("x-t", b"done")]);
    filter(8).send_response_headers(&[(":status", b"204")], true);
    // The response is over: nothing more of it reaches Envoy, a whole reply included.
    filter(8).send_response_data(b"", true);
    filter(8).send_response(503, &[], b"late");
    with(|abi| {
        assert_eq!(
            abi.parts,
            vec![
                Part::Headers(
                    7,
                    pairs(&[
                        (":status", "201"),
                        ("content-type", "text/plain"),
                        ("x-m", "1"),
                        ("x-m", "2")
                    ]),
                    false
                ),
                Part::Data(7, b"made".to_vec(), false),
                Part::Trailers(7, pairs(&[("x-t", "done")])),
                Part::Headers(8, pairs(&[(":status", "204")]), true),
            ]
        );
        assert!(abi.responses.is_empty());
    });
}

// ------------------------------------------------------------------------------------------
// Hooks
// ------------------------------------------------------------------------------------------

thread_local! {
    /// What the test filters did, in order.
    static EVENTS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

thread_local! {
    /// The module pointer a `destroy-inside` hook has Envoy destroy.
    static DESTROY_INSIDE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

fn event(e: impl Into<String>) {
    EVENTS.with(|events| events.borrow_mut().push(e.into()));
}

fn events() -> Vec<String> {
    EVENTS.with(|events| events.borrow_mut().drain(..).collect())
}

/// A filter whose behaviour the request's `x-act` header picks.
struct Scripted;

impl HttpFilter for Scripted {
    fn on_request_headers(&mut self, f: &Filter, _end_of_stream: bool) -> HeadersStatus {
        match f.request_header("x-act").as_deref() {
            Some(b"panic") => panic!("scripted panic"),
            Some(b"resume-then-panic") => {
                f.continue_decoding();
                panic!("scripted panic after a resume")
            }
            Some(b"reply") => {
                f.send_response(400, &[], b"no");
                event("replied");
                HeadersStatus::StopIteration
            }
            Some(b"reply-twice") => {
                // A reply, then another (a panic's 503 after the filter's own answer).
                f.send_response(400, &[], b"no");
                f.send_response(503, &[], b"again");
                HeadersStatus::StopIteration
            }
            Some(b"destroy-inside") => {
                f.send_response(400, &[], b"no");
                // As an Envoy that destroys the request inside a call the hook makes.
                let module = DESTROY_INSIDE.with(|m| m.take()).unwrap();
                envoy_dynamic_module_on_http_filter_destroy(module as ffi::HttpFilterModulePtr);
                event("destroyed inside");
                HeadersStatus::StopIteration
            }
            Some(b"parts") => {
                f.send_response_headers(
                    &[(":status", b"201"), ("content-type", b"text/plain")],
                    false,
                );
                f.send_response_data(b"ok", true);
                event(format!("sent {} parts", with(|abi| abi.parts.len())));
                HeadersStatus::StopIteration
            }
            _ => {
                event("headers");
                HeadersStatus::StopIteration
            }
        }
    }
    fn on_request_body(&mut self, _f: &Filter, end_of_stream: bool) -> BodyStatus {
        event(format!("body {end_of_stream}"));
        BodyStatus::StopIterationAndBuffer
    }
    fn on_scheduled(&mut self, f: &Filter, event_id: u64) {
        f.continue_decoding();
        event(format!("scheduled {event_id}"));
    }
    fn on_http_callout_done(
        &mut self,
        _f: &Filter,
        callout_id: u64,
        result: CalloutResult,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    ) {
        event(format!(
            "callout {callout_id} {result:?} {headers:?} {}",
            String::from_utf8_lossy(&body)
        ));
    }
    fn on_destroy(&mut self) {
        event("destroy");
    }
    fn on_panic(&mut self, _f: &Filter) {
        event("on_panic");
    }
}

struct ScriptedFactory;

impl FilterFactory for ScriptedFactory {
    fn new_filter(&self, f: &Filter) -> Option<Box<dyn HttpFilter>> {
        match f.request_header("x-act").as_deref() {
            Some(b"skip") => None,
            Some(b"panic-new") => panic!("panic in new_filter"),
            _ => Some(Box::new(Scripted)),
        }
    }
    fn on_config_scheduled(&self, config: &MainThreadConfig, event_id: u64) {
        if event_id == 666 {
            panic!("panic in on_config_scheduled");
        }
        let started = config.http_callout("shop", &[(":path", b"/x")], b"", Duration::ZERO);
        event(format!("config scheduled {event_id} {started:?}"));
    }
}

fn builder(
    _name: &str,
    config: &[u8],
    handle: ConfigHandle,
) -> Result<Box<dyn FilterFactory>, String> {
    match config {
        b"bad" => Err("bad config".to_owned()),
        b"panic" => panic!("panic in the builder"),
        _ => {
            handle.define_counter("n").map_err(|e| e.to_string())?;
            Ok(Box::new(ScriptedFactory))
        }
    }
}

fn new_config() -> ffi::HttpFilterConfigModulePtr {
    let config = hooks::new_config(builder, fake(9), b"idem", b"ok");
    assert!(!config.is_null());
    config
}

fn new_filter(config: ffi::HttpFilterConfigModulePtr, ptr: usize) -> ffi::HttpFilterModulePtr {
    let module = envoy_dynamic_module_on_http_filter_new(config, fake(ptr));
    assert!(!module.is_null());
    module
}

#[test]
fn a_refused_or_panicking_config_is_null_and_logged() {
    reset();
    assert!(hooks::new_config(builder, fake(9), b"idem", b"bad").is_null());
    assert!(hooks::new_config(builder, fake(9), b"idem", b"panic").is_null());
    with(|abi| abi.metrics_result = ffi::METRICS_FROZEN);
    assert!(hooks::new_config(builder, fake(9), b"idem", b"ok").is_null());
    with(|abi| {
        assert_eq!(abi.logs.len(), 3);
        assert!(abi.logs[0].1.contains("bad config"));
        assert!(abi.logs[1].1.contains("panic in the builder"));
    });
}

#[test]
fn hooks_dispatch_to_the_filter_and_destroy_drops_it() {
    reset();
    let config = new_config();
    let module = new_filter(config, 10);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(10), module, false),
        ffi::HEADERS_STOP_ITERATION
    );
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_body(fake(10), module, true),
        ffi::BODY_STOP_ITERATION_AND_BUFFER
    );
    // Unimplemented methods answer Continue.
    assert_eq!(
        envoy_dynamic_module_on_http_filter_response_headers(fake(10), module, true),
        ffi::HEADERS_CONTINUE
    );
    envoy_dynamic_module_on_http_filter_destroy(module);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
    assert_eq!(events(), vec!["headers", "body true", "destroy"]);
}

/// A local reply ends the stream (Envoy 1.39 clears the request's callbacks then): a second
/// reply held in the same hook reached a stream that was gone. Only the first is made.
#[test]
fn nothing_held_after_a_requests_reply_reaches_envoy() {
    reset();
    set_request_headers(&[("x-act", "reply-twice")]);
    let config = new_config();
    let module = new_filter(config, 14);
    envoy_dynamic_module_on_http_filter_request_headers(fake(14), module, true);
    let statuses: Vec<u32> = with(|abi| abi.responses.iter().map(|r| r.1).collect());
    assert_eq!(statuses, vec![400]);
    envoy_dynamic_module_on_http_filter_destroy(module);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

/// Envoy may destroy a request inside a call its hook makes (Envoy 1.39 does not defer it).
/// The filter was leaked then, its `on_destroy` never run: the module's tables kept reaching
/// a request Envoy had freed. It is freed as the hook returns, its `on_destroy` run, and the
/// calls held for the request dropped (its pointer is gone).
#[test]
fn a_request_destroyed_inside_its_own_hook_is_freed_as_the_hook_returns() {
    reset();
    set_request_headers(&[("x-act", "destroy-inside")]);
    let config = new_config();
    let module = new_filter(config, 13);
    DESTROY_INSIDE.with(|m| m.set(Some(module as usize)));
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(13), module, true),
        ffi::HEADERS_STOP_ITERATION
    );
    assert_eq!(events(), vec!["destroyed inside", "destroy"]);
    assert!(
        with(|abi| abi.responses.is_empty()),
        "nothing sent to a freed request"
    );
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

#[test]
fn a_request_the_factory_skips_still_gets_an_object_that_continues() {
    reset();
    set_request_headers(&[("x-act", "skip")]);
    let config = new_config();
    let module = new_filter(config, 11);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(11), module, true),
        ffi::HEADERS_CONTINUE
    );
    envoy_dynamic_module_on_http_filter_destroy(module);
    set_request_headers(&[("x-act", "panic-new")]);
    let module = new_filter(config, 12);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(12), module, true),
        ffi::HEADERS_CONTINUE
    );
    envoy_dynamic_module_on_http_filter_destroy(module);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
    assert!(events().is_empty());
}

/// A hook asked for its request's resume, then panicked before its step was over: the
/// resume is not made (the request would go upstream on the word of a step that did not
/// finish); the hook holds the request.
#[test]
fn a_resume_asked_for_before_a_panic_is_not_made() {
    reset();
    set_request_headers(&[("x-act", "resume-then-panic")]);
    let config = new_config();
    let module = new_filter(config, 17);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(17), module, false),
        ffi::HEADERS_STOP_ITERATION
    );
    with(|abi| {
        assert!(
            !abi.calls.iter().any(|c| c == "continue_decoding 17"),
            "{:?}",
            abi.calls
        )
    });
    assert_eq!(events(), vec!["on_panic"]);
    envoy_dynamic_module_on_http_filter_destroy(module);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

#[test]
fn a_panicking_filter_is_caught_holds_its_request_and_is_poisoned() {
    reset();
    set_request_headers(&[("x-act", "panic")]);
    let config = new_config();
    let module = new_filter(config, 13);
    // The hook returns (no unwinding out of it) and holds the request: it never goes
    // upstream unseen (`on_panic` answers it).
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(13), module, false),
        ffi::HEADERS_STOP_ITERATION
    );
    // Poisoned: later hooks do not reach the filter, and hold what they see.
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_body(fake(13), module, true),
        ffi::BODY_STOP_ITERATION_AND_BUFFER
    );
    // A response hook lets the response go on.
    assert_eq!(
        envoy_dynamic_module_on_http_filter_response_headers(fake(13), module, false),
        ffi::HEADERS_CONTINUE
    );
    envoy_dynamic_module_on_http_filter_destroy(module);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
    assert_eq!(events(), vec!["on_panic", "destroy"]);
    with(|abi| assert!(abi.logs.iter().any(|(_, m)| m.contains("scripted panic"))));
}

#[test]
fn own_continue_and_reply_are_made_after_the_method_returns() {
    reset();
    let config = new_config();
    let module = new_filter(config, 14);
    with(|abi| abi.on_continue = Some(|_| event("envoy resumed")));
    envoy_dynamic_module_on_http_filter_scheduled(fake(14), module, 5);
    // The filter logged "scheduled" after asking to continue; Envoy resumed after that.
    assert_eq!(events(), vec!["scheduled 5", "envoy resumed"]);

    set_request_headers(&[("x-act", "reply")]);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(14), module, true),
        ffi::HEADERS_STOP_ITERATION
    );
    assert_eq!(events(), vec!["replied"]);
    with(|abi| assert_eq!(abi.responses.len(), 1));

    // A response in parts from another request's own hook: none of it while the method
    // runs, all of it, in order, before the hook returns to Envoy.
    let parts = new_filter(config, 114);
    set_request_headers(&[("x-act", "parts")]);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(114), parts, false),
        ffi::HEADERS_STOP_ITERATION
    );
    assert_eq!(events(), vec!["sent 0 parts"]);
    with(|abi| {
        assert_eq!(
            abi.parts,
            vec![
                mock_abi::Part::Headers(
                    114,
                    pairs(&[(":status", "201"), ("content-type", "text/plain")]),
                    false
                ),
                mock_abi::Part::Data(114, b"ok".to_vec(), true),
            ]
        )
    });
    envoy_dynamic_module_on_http_filter_destroy(parts);
    envoy_dynamic_module_on_http_filter_destroy(module);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

thread_local! {
    static MODULES: RefCell<Vec<ffi::HttpFilterModulePtr>> = const { RefCell::new(Vec::new()) };
}

/// Resumes request 15 (module 0) from request 16's hook, and Envoy, resuming it, calls 15's
/// body hook (fine) and then re-enters 16's own body hook (guarded: held, not passed).
struct Resumer;

impl HttpFilter for Resumer {
    fn on_scheduled(&mut self, _f: &Filter, _event_id: u64) {
        // SAFETY: request 15 is alive (the test destroys it later) and on this thread.
        let other = unsafe { filter(15).handle().filter() };
        other.continue_decoding();
        event("resumer done");
    }
    fn on_request_body(&mut self, _f: &Filter, _end_of_stream: bool) -> BodyStatus {
        event("resumer body");
        BodyStatus::StopIterationNoBuffer
    }
}

#[test]
fn another_request_is_resumed_at_once_and_a_re_entered_filter_is_skipped() {
    reset();
    let config = new_config();
    let waiting = new_filter(config, 15);
    let resumer_object = hooks::FilterObject::new(Some(Box::new(Resumer)));
    let resumer: ffi::HttpFilterModulePtr =
        Box::into_raw(Box::new(resumer_object)).cast_const().cast();
    MODULES.with(|m| *m.borrow_mut() = vec![waiting, resumer]);
    with(|abi| {
        abi.on_continue = Some(|_| {
            let (waiting, resumer) = MODULES.with(|m| (m.borrow()[0], m.borrow()[1]));
            let a = envoy_dynamic_module_on_http_filter_request_body(fake(15), waiting, true);
            let b = envoy_dynamic_module_on_http_filter_request_body(fake(16), resumer, true);
            event(format!("envoy got {a} {b}"));
        })
    });
    envoy_dynamic_module_on_http_filter_scheduled(fake(16), resumer, 1);
    assert_eq!(
        events(),
        vec![
            "body true",
            // 16's body hook, re-entered while 16's on_scheduled runs: not delivered, and
            // the body held (buffered) rather than passed unseen.
            format!(
                "envoy got {} {}",
                ffi::BODY_STOP_ITERATION_AND_BUFFER,
                ffi::BODY_STOP_ITERATION_AND_BUFFER
            )
            .as_str(),
            "resumer done",
        ]
    );
    with(|abi| assert!(abi.logs.iter().any(|(_, m)| m.contains("re-entered"))));
    envoy_dynamic_module_on_http_filter_destroy(waiting);
    envoy_dynamic_module_on_http_filter_destroy(resumer);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
    assert_eq!(events(), vec!["destroy"]);
}

#[test]
fn callout_done_copies_envoys_headers_and_body() {
    reset();
    let config = new_config();
    let module = new_filter(config, 17);
    let (k, v) = (b":status", b"200");
    let mut headers = [ffi::EnvoyHttpHeader {
        key_ptr: k.as_ptr().cast(),
        key_length: k.len(),
        value_ptr: v.as_ptr().cast(),
        value_length: v.len(),
    }];
    let (c1, c2) = (b"hel", b"lo");
    let mut chunks = [
        ffi::EnvoyBuffer {
            ptr: c1.as_ptr().cast(),
            length: c1.len(),
        },
        ffi::EnvoyBuffer {
            ptr: c2.as_ptr().cast(),
            length: c2.len(),
        },
    ];
    envoy_dynamic_module_on_http_filter_http_callout_done(
        fake(17),
        module,
        4,
        ffi::CALLOUT_RESULT_SUCCESS,
        headers.as_mut_ptr(),
        1,
        chunks.as_mut_ptr(),
        2,
    );
    // A failed callout: null arrays.
    envoy_dynamic_module_on_http_filter_http_callout_done(
        fake(17),
        module,
        5,
        ffi::CALLOUT_RESULT_RESET,
        std::ptr::null_mut(),
        0,
        std::ptr::null_mut(),
        0,
    );
    envoy_dynamic_module_on_http_filter_destroy(module);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
    assert_eq!(
        events(),
        vec![
            r#"callout 4 Success [(":status", [50, 48, 48])] hello"#,
            "callout 5 Reset [] ",
            "destroy"
        ]
    );
}

#[test]
fn null_pointers_from_envoy_are_answered_continue() {
    reset();
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(1), std::ptr::null(), true),
        ffi::HEADERS_CONTINUE
    );
    envoy_dynamic_module_on_http_filter_destroy(std::ptr::null());
    envoy_dynamic_module_on_http_filter_config_destroy(std::ptr::null());
    assert!(!envoy_dynamic_module_on_http_filter_new(std::ptr::null(), fake(1)).is_null());
}

// The program-init hook, as a module defines it.
crate::dynamic_module!(Module {
    name: "scripted_module",
    factory_builder: builder,
});

fn envoy_buffer(bytes: &[u8]) -> ffi::EnvoyBuffer {
    ffi::EnvoyBuffer {
        ptr: bytes.as_ptr().cast(),
        length: bytes.len(),
    }
}

#[test]
fn program_init_registers_the_module_and_reports_the_abi_version() {
    reset();
    let version = envoy_dynamic_module_on_program_init();
    // SAFETY: a static NUL-terminated string.
    let version = unsafe { std::ffi::CStr::from_ptr(version) };
    assert_eq!(version.to_str().unwrap(), ABI_VERSION);
    // The config-new hook builds with the registered builder and logs under its name.
    let refused = envoy_dynamic_module_on_http_filter_config_new(
        fake(9),
        envoy_buffer(b"idem"),
        envoy_buffer(b"bad"),
    );
    assert!(refused.is_null());
    with(|abi| {
        assert!(abi.logs[0]
            .1
            .starts_with("scripted_module: filter config \"idem\" refused: bad config"))
    });
    let config = envoy_dynamic_module_on_http_filter_config_new(
        fake(9),
        envoy_buffer(b"idem"),
        envoy_buffer(b"ok"),
    );
    assert!(!config.is_null());
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

#[test]
fn a_config_scheduler_commits_from_another_thread_and_is_deleted_once() {
    reset();
    // SAFETY: a fake pointer, only handed to the mock.
    let handle = unsafe { ConfigHandle::from_raw(fake(0xc5)) };
    let scheduler = std::sync::Arc::new(handle.new_scheduler().unwrap());
    let other = std::sync::Arc::clone(&scheduler);
    std::thread::spawn(move || other.commit(3)).join().unwrap();
    drop(scheduler);
    assert!(mock_abi::CONFIG_COMMITS
        .lock()
        .unwrap()
        .contains(&(0xc5, 3)));
    let deleted = mock_abi::CONFIG_DELETED.lock().unwrap().clone();
    assert_eq!(deleted.iter().filter(|p| **p == 0xc5).count(), 1);
    with(|abi| {
        abi.refuse.insert("config_scheduler_new");
    });
    assert!(handle.new_scheduler().is_none());
}

#[test]
fn config_hooks_reach_the_factory_and_survive_a_panic() {
    reset();
    let config = new_config();
    envoy_dynamic_module_on_http_filter_config_scheduled(fake(9), config, 4);
    envoy_dynamic_module_on_http_filter_config_scheduled(fake(9), config, 666);
    // A null config (refused at load) gets nothing.
    envoy_dynamic_module_on_http_filter_config_scheduled(fake(9), std::ptr::null(), 5);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
    assert_eq!(events(), vec!["config scheduled 4 Ok(1)".to_owned()]);
    with(|abi| {
        assert!(abi
            .logs
            .iter()
            .any(|(_, l)| l.contains("panic in config_scheduled")))
    });
}
