//! Whole requests through the exported hooks over the mocked ABI, with the real core and
//! configuration: what happens to a write, and to its retry, when something goes wrong in
//! the native host (a panic in a hook, ...). Each test's doc says what it proves.

use std::ffi::c_void;

use crate::abi::ffi;
use crate::abi::hooks::{self, *};
use crate::abi::mock_abi::with;

const REQ: u32 = ffi::HEADER_TYPE_REQUEST_HEADER;
const RESP: u32 = ffi::HEADER_TYPE_RESPONSE_HEADER;

/// A fresh mocked ABI, and nothing recorded of the store thread's streams.
fn reset() {
    crate::abi::mock_abi::reset();
    crate::store_streams::recorded::clear();
}

fn fake(n: usize) -> *mut c_void {
    n as *mut c_void
}

/// A configuration with one rule on POST /orders: fingerprint none (claimed at the request
/// headers), a one-second lease.
fn config() -> ffi::HttpFilterConfigModulePtr {
    load(
        br#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "fingerprint":"none","lease_seconds":1,"ttl_seconds":60}]}"#,
    )
}

/// The same rule holding duplicates (`on_in_flight: wait`) for 100 ms.
fn wait_config() -> ffi::HttpFilterConfigModulePtr {
    load(
        br#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "fingerprint":"none","lease_seconds":1,"ttl_seconds":60,
        "on_in_flight":"wait","wait_ms":100}]}"#,
    )
}

fn load(json: &[u8]) -> ffi::HttpFilterConfigModulePtr {
    let config = hooks::new_config(crate::FACTORY_BUILDER, fake(9), b"idem", json);
    assert!(
        !config.is_null(),
        "config refused: {:?}",
        with(|a| a.logs.clone())
    );
    config
}

fn request_headers(key: &str) {
    let pairs = [
        (":method", "POST"),
        (":path", "/orders"),
        (":authority", "shop"),
        ("idempotency-key", key),
    ];
    with(|abi| {
        abi.maps.insert(
            REQ,
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
                .collect(),
        );
    });
    upstream_answers("201", b"created");
}

/// The response the next request's upstream gives: `status`, text/plain, `body`.
fn upstream_answers(status: &str, body: &[u8]) {
    with(|abi| {
        abi.maps.insert(
            RESP,
            vec![
                (":status".to_owned(), status.as_bytes().to_vec()),
                ("content-type".to_owned(), b"text/plain".to_vec()),
            ],
        );
        abi.bodies
            .insert(ffi::BODY_TYPE_RECEIVED_RESPONSE_BODY, vec![body.to_vec()]);
    });
}

/// A new request's filter on Envoy's pointer `ptr`; its request headers (no body): the
/// headers status Envoy gets.
fn start(
    config: ffi::HttpFilterConfigModulePtr,
    ptr: usize,
    key: &str,
) -> (ffi::HttpFilterModulePtr, u32) {
    request_headers(key);
    let module = envoy_dynamic_module_on_http_filter_new(config, fake(ptr));
    assert!(!module.is_null());
    let status = envoy_dynamic_module_on_http_filter_request_headers(fake(ptr), module, true);
    (module, status)
}

fn respond(ptr: usize, module: ffi::HttpFilterModulePtr) {
    envoy_dynamic_module_on_http_filter_response_headers(fake(ptr), module, false);
    envoy_dynamic_module_on_http_filter_response_body(fake(ptr), module, true);
}

fn end(ptr: usize, module: ffi::HttpFilterModulePtr) {
    envoy_dynamic_module_on_http_filter_stream_complete(fake(ptr), module);
    envoy_dynamic_module_on_http_filter_destroy(module);
}

/// Runs request `ptr`'s scheduled hook if its scheduler was committed since the last look,
/// as Envoy does on its worker; whether it was.
fn run_if_scheduled(ptr: usize, module: ffi::HttpFilterModulePtr) -> bool {
    let committed = crate::abi::mock_abi::COMMITS
        .lock()
        .is_ok_and(|mut commits| {
            let before = commits.len();
            commits.retain(|(scheduler, _)| *scheduler != ptr);
            commits.len() != before
        });
    if committed {
        envoy_dynamic_module_on_http_filter_scheduled(fake(ptr), module, 1);
    }
    committed
}

fn replies_to(ptr: usize) -> Vec<u32> {
    with(|abi| {
        abi.responses
            .iter()
            .filter(|r| r.0 == ptr)
            .map(|r| r.1)
            .collect()
    })
}

#[test]
fn baseline_a_recorded_write_is_replayed_to_its_retry() {
    reset();
    let config = config();
    let (first, status) = start(config, 101, "attack-baseline");
    assert_eq!(
        status,
        ffi::HEADERS_CONTINUE,
        "the first request goes upstream"
    );
    respond(101, first);
    end(101, first);
    let (retry, status) = start(config, 102, "attack-baseline");
    assert_eq!(
        status,
        ffi::HEADERS_STOP_ITERATION,
        "the retry is answered by the filter"
    );
    assert_eq!(
        replies_to(102),
        vec![201],
        "the retry gets the recorded 201"
    );
    end(102, retry);
}

/// The body of the last local reply to `ptr`, as text.
fn reply_body(ptr: usize) -> String {
    with(|abi| {
        let reply = abi.responses.iter().rev().find(|r| r.0 == ptr).cloned();
        String::from_utf8_lossy(&reply.map(|r| r.3).unwrap_or_default()).into_owned()
    })
}

/// A panic while the module makes a request's filter (a bug anywhere in `new_filter`) used
/// to leave the request with no filter: it went upstream unprotected, and its retry ran the
/// write again. Under Wasm the VM stops and Envoy answers 503. The request is answered 503
/// problem+json and never resumed, and the write goes upstream only once it is protected.
#[test]
fn a_panic_making_a_requests_filter_answers_503_never_an_unprotected_pass() {
    reset();
    let config = config();
    with(|abi| abi.panic_on.insert("new_filter"));
    let (module, status) = start(config, 151, "attack-new-filter-panics");
    assert_eq!(status, ffi::HEADERS_STOP_ITERATION, "not let through");
    assert_eq!(replies_to(151), vec![503]);
    assert!(reply_body(151)
        .contains(r#""type":"urn:idempotency-filter:problem:idempotency-unavailable""#));
    assert!(!with(|a| a
        .calls
        .iter()
        .any(|c| c == "continue_decoding 151")));
    end(151, module);
    // The next request of the key is protected as ever.
    let (first, status) = start(config, 152, "attack-new-filter-panics");
    assert_eq!(
        status,
        ffi::HEADERS_CONTINUE,
        "the write goes upstream, protected"
    );
    respond(152, first);
    end(152, first);
    let (retry, _) = start(config, 153, "attack-new-filter-panics");
    assert_eq!(replies_to(153), vec![201], "its retry is its replay");
    end(153, retry);
}

/// A worker's root that refuses the configuration the main thread accepted (not seen in
/// practice) used to let every request of that worker through unprotected. They are answered
/// 503 problem+json, as a failed Wasm VM's are.
#[test]
fn a_worker_root_that_refuses_its_configuration_answers_503_never_an_unprotected_pass() {
    reset();
    let config = config();
    crate::root::REFUSE_NEXT_CONFIGURE.with(|refuse| refuse.set(true));
    let (module, status) = start(config, 161, "attack-root-refuses");
    assert_eq!(status, ffi::HEADERS_STOP_ITERATION, "not let through");
    assert_eq!(replies_to(161), vec![503]);
    assert!(reply_body(161)
        .contains(r#""type":"urn:idempotency-filter:problem:idempotency-unavailable""#));
    end(161, module);
    let (again, status) = start(config, 162, "attack-root-refuses");
    assert_eq!(
        (status, replies_to(162)),
        (ffi::HEADERS_STOP_ITERATION, vec![503])
    );
    end(162, again);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

fn sleep_ms(ms: u64) {
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

/// A request's own local reply (here: a retry's replay) is made when its hook returns. A
/// panic there was caught by the hook's barrier, whose fallback for the request headers is
/// "continue": the retry of a recorded write went upstream and the write ran twice. The
/// request now fails closed: answered 503, never resumed.
#[test]
fn a_panic_in_a_requests_deferred_reply_never_lets_it_upstream() {
    reset();
    let config = config();
    let (first, status) = start(config, 201, "attack-deferred-reply");
    assert_eq!(status, ffi::HEADERS_CONTINUE);
    respond(201, first);
    end(201, first);
    with(|abi| abi.panic_on.insert("send_response"));
    let (retry, status) = start(config, 203, "attack-deferred-reply");
    assert_ne!(
        status,
        ffi::HEADERS_CONTINUE,
        "a retry of a recorded write went upstream: the write runs twice"
    );
    assert!(!with(|a| a
        .calls
        .iter()
        .any(|c| c == "continue_decoding 203")));
    assert_eq!(replies_to(203), vec![503], "failed closed");
    end(203, retry);
    let (again, _) = start(config, 204, "attack-deferred-reply");
    assert_eq!(replies_to(204), vec![201], "the record is intact");
    end(204, again);
}

/// The root's tick runs in whichever request's scheduled hook carries it (here: a write
/// running upstream); what it has for another request (a held duplicate's 409) is mailed
/// to that request and sent in the duplicate's own hook. A panic making that reply is the
/// duplicate's: it is answered 503, while the running write is not touched and its key is
/// not freed.
#[test]
fn a_panic_in_a_reply_the_tick_mailed_is_the_receivers_alone() {
    reset();
    let config = wait_config();
    let (running, status) = start(config, 301, "attack-carried-tick");
    assert_eq!(status, ffi::HEADERS_CONTINUE, "the write goes upstream");
    let (held, status) = start(config, 302, "attack-carried-tick");
    assert_eq!(status, ffi::HEADERS_STOP_ITERATION, "the duplicate is held");
    // The held duplicate's wait (100 ms) is over; the tick runs in the running write's
    // scheduled hook.
    sleep_ms(300);
    envoy_dynamic_module_on_http_filter_scheduled(fake(301), running, 1);
    assert!(replies_to(301).is_empty() && replies_to(302).is_empty());
    with(|abi| abi.panic_on.insert("send_response"));
    assert!(
        run_if_scheduled(302, held),
        "the duplicate is woken for its letter"
    );
    assert_eq!(
        replies_to(302),
        vec![503],
        "its 409 panicked: failed closed"
    );
    assert!(
        replies_to(301).is_empty(),
        "the running write is not touched"
    );
    // Its response comes, or its client leaves: either way the key must not be free.
    respond(301, running);
    end(301, running);
    end(302, held);
    sleep_ms(1_200); // past the lease
    let (retry, status) = start(config, 303, "attack-carried-tick");
    assert_ne!(
        status,
        ffi::HEADERS_CONTINUE,
        "the retry went upstream: the write runs a second time"
    );
    assert_eq!(replies_to(303), vec![201], "its replay");
    end(303, retry);
}

/// PROVED (fixed): a panic in a running write's own hook, inside its journey's step (here:
/// reading the response headers), abandoned the claim. The step takes the journey's state
/// out (`mem::replace` with `Finished`), so `on_panic` had no claim to settle: no unknown
/// outcome was recorded and the lease stayed in the root's book, renewed until
/// `ttl_seconds`, then let lapse, after which the retry took the key over and the write,
/// which did run upstream, ran again. Now core keeps a running write's claim beside its
/// state (`RequestJourney::after_fault`): the write is an unknown outcome at once, and a
/// retry is told so (409 outcome-unknown), not "still in flight".
#[test]
fn a_panic_in_a_running_writes_own_response_hook_keeps_it_as_an_unknown_outcome() {
    reset();
    let config = load(
        br#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "fingerprint":"none","lease_seconds":1,"ttl_seconds":30}]}"#,
    );
    let (running, status) = start(config, 401, "attack-own-hook");
    assert_eq!(status, ffi::HEADERS_CONTINUE, "the write goes upstream");
    with(|abi| abi.panic_on.insert("get_headers"));
    respond(401, running);
    assert!(
        with(|abi| abi
            .logs
            .iter()
            .any(|(_, l)| l.contains("panic in response_headers"))),
        "the panic was injected"
    );
    end(401, running);
    sleep_ms(1_200); // past the lease
    let (retry, status) = start(config, 402, "attack-own-hook");
    assert_ne!(
        status,
        ffi::HEADERS_CONTINUE,
        "the retry went upstream: the write runs a second time"
    );
    let problem = with(|abi| {
        abi.responses
            .iter()
            .rev()
            .find(|r| r.0 == 402)
            .map(|r| String::from_utf8_lossy(&r.3).into_owned())
    })
    .unwrap_or_default();
    assert!(
        problem.contains("outcome-unknown"),
        "the retry must be told the outcome is unknown: {problem}"
    );
    end(402, retry);
}

/// A configuration with `resolve` on POST /orders, settled one second after the outcome.
fn resolve_config() -> ffi::HttpFilterConfigModulePtr {
    load(
        br#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "fingerprint":"none","ttl_seconds":60,
        "resolve":{"cluster":"shop","path":"/orders/by-key/{key}","settle_seconds":1}}]}"#,
    )
}

/// The main thread runs the configuration `config` (its scheduled event).
fn main_thread_runs(config: ffi::HttpFilterConfigModulePtr) {
    envoy_dynamic_module_on_http_filter_config_scheduled(fake(9), config, 1);
}

/// The store thread's run of the configuration loaded last: its streams' calls are recorded
/// (`store_streams::recorded`).
fn store_thread_runs() {
    let courier = crate::courier::Courier::loaded_last().unwrap();
    courier.run(&crate::store_streams::recorded::Recorded);
}

/// The store says `event` on the store thread's stream `id`.
fn store_says(id: u64, event: crate::store_streams::WireEvent) {
    let courier = crate::courier::Courier::loaded_last().unwrap();
    courier.on_stream_event(id, event);
}

fn lookups_asked() -> Vec<String> {
    with(|abi| {
        abi.config_callouts
            .iter()
            .filter_map(|(cluster, headers, _, _)| {
                let path = headers.iter().find(|(n, _)| n == ":path")?;
                Some(format!("{cluster} {}", String::from_utf8_lossy(&path.1)))
            })
            .collect()
    })
}

/// A write whose client left mid-way is an unknown outcome, resolved on the main thread. A
/// push destroys its configuration before the lookup is due: the resolution must not go with
/// it (its key would answer "come back" until its TTL, and nobody would ask). The next
/// configuration with the same rule asks the service.
#[test]
fn a_resolution_pending_on_the_main_root_outlives_a_push() {
    reset();
    let old = resolve_config();
    let (module, status) = start(old, 401, "attack-push-resolve");
    assert_eq!(status, ffi::HEADERS_CONTINUE, "the write goes upstream");
    // The client leaves before any response: the outcome is unknown.
    end(401, module);
    main_thread_runs(old);
    assert!(lookups_asked().is_empty(), "not due yet");
    envoy_dynamic_module_on_http_filter_config_destroy(old);

    let next = resolve_config();
    main_thread_runs(next);
    std::thread::sleep(std::time::Duration::from_millis(1_100));
    main_thread_runs(next);
    assert_eq!(
        lookups_asked(),
        vec!["shop /orders/by-key/attack-push-resolve".to_string()],
        "the next configuration asks about it: {:?}",
        with(|a| a.logs.clone())
    );
    envoy_dynamic_module_on_http_filter_config_destroy(next);
}

/// A detached rule on POST /orders, sent to `orders-svc` with a minute's timeout, its lease
/// one second.
fn detached_config() -> ffi::HttpFilterConfigModulePtr {
    load(
        br#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "fingerprint":"none","ttl_seconds":600,"execution":"detached","lease_seconds":1,
        "upstream_cluster":"orders-svc","upstream_timeout_ms":60000}]}"#,
    )
}

/// A detached write is out (the main thread's root sent it) and its client has left when a
/// push destroys its configuration: Envoy cancels the configuration's callouts, so the
/// write may have run and its answer will never come. It must be an unknown outcome, never
/// run again by a retry under the next configuration (its lease would otherwise lapse, and
/// the retry take the key).
#[test]
fn a_detached_write_out_when_its_configuration_goes_is_an_unknown_outcome() {
    reset();
    let old = detached_config();
    let (module, status) = start(old, 501, "attack-push-detached");
    assert_eq!(
        status,
        ffi::HEADERS_STOP_ITERATION,
        "the request waits for its copy"
    );
    main_thread_runs(old);
    assert_eq!(
        with(|a| a.config_callouts.len()),
        1,
        "sent by the main thread"
    );
    end(501, module);
    main_thread_runs(old);
    envoy_dynamic_module_on_http_filter_config_destroy(old);
    // Past the lease nobody renews any more.
    std::thread::sleep(std::time::Duration::from_millis(1_200));

    let next = detached_config();
    let (retry, _) = start(next, 502, "attack-push-detached");
    main_thread_runs(next);
    assert_eq!(with(|a| a.config_callouts.len()), 1, "never sent again");
    assert_eq!(replies_to(502), vec![409], "told the outcome is unknown");
    end(502, retry);
    envoy_dynamic_module_on_http_filter_config_destroy(next);
}

/// The calls the store thread sent on its streams so far, decoded: (stream, call).
fn store_calls() -> Vec<(u64, idempotency_protocol::stream::Call)> {
    crate::store_streams::recorded::sent()
        .into_iter()
        .filter_map(|(stream, frame, _)| {
            let call = idempotency_protocol::stream::decode_call(frame.get(5..)?).ok()?;
            Some((stream, call))
        })
        .collect()
}

/// The store answers call `id` on `stream` with `reply`.
fn store_replies(stream: u64, id: u64, reply: idempotency_protocol::stream::Reply) {
    let answer =
        idempotency_protocol::stream::encode_answer(&idempotency_protocol::stream::Answer {
            id,
            reply,
        });
    store_says(
        stream,
        crate::store_streams::WireEvent::Data {
            data: crate::courier::grpc_frame(&answer),
            end_stream: false,
        },
    );
}

/// The store opens `stream` (its answer's headers).
fn store_opens(stream: u64) {
    store_says(
        stream,
        crate::store_streams::WireEvent::Headers {
            headers: vec![(":status".into(), b"200".to_vec())],
            end_stream: false,
        },
    );
}

/// The store claims the last claim sent for its owner.
fn store_claims_the_last_claim() {
    let (stream, id, owner) = store_calls()
        .into_iter()
        .rev()
        .find_map(|(stream, call)| match call.op {
            idempotency_protocol::stream::CallOp::Claim { owner, .. } => {
                Some((stream, call.id, owner))
            }
            _ => None,
        })
        .unwrap();
    store_replies(
        stream,
        id,
        idempotency_protocol::stream::Reply::Claimed {
            owner,
            lease_expires_at_ms: 1,
        },
    );
}

/// The completions sent so far: (stream, call id).
fn completions_sent() -> Vec<(u64, u64)> {
    store_calls()
        .into_iter()
        .filter(|(_, c)| matches!(c.op, idempotency_protocol::stream::CallOp::Complete { .. }))
        .map(|(stream, c)| (stream, c.id))
        .collect()
}

/// Cluster mode: a write's client leaves mid-way (an unknown outcome) on a worker that then
/// gets no more requests; its completion reaches the store, and an operator (or another
/// proxy's resolution) settles it there as never run, freeing the key. A retry on another
/// worker of this proxy must take the store's word and run the write, as every other proxy
/// does. It answered 409 instead, for as long as the recording worker stayed idle: only that
/// worker's root, taking the store's answer, marked the local record as in the store, and
/// until then a free key in the store reads as "the record never got there".
#[test]
fn an_unknown_outcome_the_store_took_is_marked_so_without_its_idle_worker() {
    reset();
    let config = grpc_store_config();
    let (module, status) = start(config, 801, "attack-idle-mark");
    assert_eq!(
        status,
        ffi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK,
        "held for the store"
    );
    store_thread_runs();
    let stream = store_calls()[0].0;
    store_opens(stream);
    store_claims_the_last_claim();
    // The worker takes the answer in the request's scheduled event: the write goes upstream.
    envoy_dynamic_module_on_http_filter_scheduled(fake(801), module, 1);
    assert!(with(|a| a
        .calls
        .iter()
        .any(|c| c == "continue_decoding 801")));
    // The client leaves before any response: the outcome is unknown, recorded here and sent
    // to the store at once.
    end(801, module);
    store_thread_runs();
    let sent = completions_sent();
    assert_eq!(sent.len(), 1, "sent at once: {sent:?}");
    // The store takes it; the answer waits in the idle worker's inbox, and the store thread,
    // seeing the write unsettled past its grace, lands it again on a stream of its own: the
    // store takes it again.
    store_replies(
        sent[0].0,
        sent[0].1,
        idempotency_protocol::stream::Reply::Recorded,
    );
    sleep_ms(2_200); // past the grace: the store's timeout (2 s) and the first backoff
    store_thread_runs();
    let sent = completions_sent();
    assert_eq!(sent.len(), 2, "landed by the store thread: {sent:?}");
    assert_ne!(sent[1].0, stream, "on the handoff's own stream");
    store_opens(sent[1].0);
    store_replies(
        sent[1].0,
        sent[1].1,
        idempotency_protocol::stream::Reply::Recorded,
    );

    // The store settled it as never run: its claim answer is "claimed". Another worker's
    // retry runs the write.
    let courier = crate::courier::Courier::loaded_last().unwrap();
    let config_address = config as usize;
    let (replies, resumed) = std::thread::spawn(move || {
        let config = config_address as ffi::HttpFilterConfigModulePtr;
        let (retry, status) = start(config, 802, "attack-idle-mark");
        assert_eq!(status, ffi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK);
        courier.run(&crate::store_streams::recorded::Recorded);
        let (stream, _) = store_calls().last().cloned().unwrap();
        courier.on_stream_event(
            stream,
            crate::store_streams::WireEvent::Headers {
                headers: vec![(":status".into(), b"200".to_vec())],
                end_stream: false,
            },
        );
        let (stream, id, owner) = store_calls()
            .into_iter()
            .find_map(|(stream, call)| match call.op {
                idempotency_protocol::stream::CallOp::Claim { owner, .. } => {
                    Some((stream, call.id, owner))
                }
                _ => None,
            })
            .unwrap();
        let answer =
            idempotency_protocol::stream::encode_answer(&idempotency_protocol::stream::Answer {
                id,
                reply: idempotency_protocol::stream::Reply::Claimed {
                    owner,
                    lease_expires_at_ms: 1,
                },
            });
        courier.on_stream_event(
            stream,
            crate::store_streams::WireEvent::Data {
                data: crate::courier::grpc_frame(&answer),
                end_stream: false,
            },
        );
        envoy_dynamic_module_on_http_filter_scheduled(fake(802), retry, 1);
        let resumed = with(|a| a.calls.iter().any(|c| c == "continue_decoding 802"));
        let replies = replies_to(802);
        end(802, retry);
        (replies, resumed)
    })
    .join()
    .unwrap();
    assert_eq!(replies, Vec::<u32>::new(), "not answered 409 by the filter");
    assert!(resumed, "the retry goes upstream");
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

thread_local! {
    /// Envoy's pointer -> the module's, for hooks a test re-enters from a mock callback.
    static MODULES: std::cell::RefCell<std::collections::HashMap<usize, usize>> =
        std::cell::RefCell::default();
}

/// What the filter logged of events it could not hand to a request's busy journey.
fn journey_busy_logs() -> Vec<String> {
    with(|a| a.logs.clone())
        .into_iter()
        .filter(|(_, line)| line.contains("busy"))
        .map(|(_, line)| line)
        .collect()
}

/// As Envoy does inside a local reply: the request's stream ends.
fn stream_ends_inside_the_reply(filter: ffi::HttpFilterEnvoyPtr) {
    let Some(module) = MODULES.with(|m| m.borrow().get(&(filter as usize)).copied()) else {
        return;
    };
    envoy_dynamic_module_on_http_filter_stream_complete(filter, module as ffi::HttpFilterModulePtr);
}

/// Envoy runs a request's hooks inside that request's own local reply (its stream's end, at
/// least). A held duplicate's replay is mailed by the root's tick, which runs in another
/// request's hook, and sent in the duplicate's own scheduled hook, which defers it until
/// its step is over: its stream's end reaches its journey, none is lost as "busy".
#[test]
fn a_held_duplicates_replay_is_sent_in_its_own_hook_after_its_step() {
    reset();
    crate::abi::install_logger();
    let config = wait_config();
    let (first, status) = start(config, 211, "attack-own-reply");
    assert_eq!(status, ffi::HEADERS_CONTINUE);
    let (held, status) = start(config, 212, "attack-own-reply");
    assert_eq!(status, ffi::HEADERS_STOP_ITERATION, "the duplicate is held");
    MODULES.with(|m| m.borrow_mut().insert(212, held as usize));
    respond(211, first);
    end(211, first);
    // The root's tick is due; the next request's hook runs it, and it replays to the held
    // duplicate, whose stream Envoy ends inside the reply.
    sleep_ms(150);
    with(|abi| abi.on_reply = Some(stream_ends_inside_the_reply));
    let (next, _) = start(config, 213, "attack-own-reply-other");
    assert!(
        replies_to(212).is_empty(),
        "nothing sent from another request's hook"
    );
    assert!(
        run_if_scheduled(212, held),
        "the duplicate is woken for its letter"
    );
    with(|abi| abi.on_reply = None);
    assert_eq!(replies_to(212), vec![201], "the duplicate gets the replay");
    let busy = journey_busy_logs();
    assert!(busy.is_empty(), "{busy:?}");
    envoy_dynamic_module_on_http_filter_destroy(held);
    end(213, next);
}

/// Cluster mode over the store's stream (the default transport).
fn grpc_store_config() -> ffi::HttpFilterConfigModulePtr {
    load(
        br#"{"store":{"cluster":"store","address":"127.0.0.1:1","timeout_ms":2000},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "fingerprint":"none","lease_seconds":1,"ttl_seconds":60}]}"#,
    )
}

/// As Envoy's router does when it cannot reach the upstream at all (no healthy host, a
/// circuit breaker): the resumed request is answered 503 inside the resume, its stream ends.
fn router_answers_inside_the_resume(filter: ffi::HttpFilterEnvoyPtr) {
    let Some(module) = MODULES.with(|m| m.borrow().get(&(filter as usize)).copied()) else {
        return;
    };
    let module = module as ffi::HttpFilterModulePtr;
    upstream_answers("503", b"no healthy upstream");
    envoy_dynamic_module_on_http_filter_response_headers(filter, module, false);
    envoy_dynamic_module_on_http_filter_response_body(filter, module, true);
    envoy_dynamic_module_on_http_filter_stream_complete(filter, module);
}

/// Cluster mode: the store's answer to a request's claim reaches its worker while another
/// request's hook runs, which mails it to the waiting request. That request resumes in its
/// own scheduled hook; Envoy runs it on inside the resume, and when its router answers there
/// (no healthy upstream) the request's response hooks run. The resume waits until the step
/// is over, so the journey takes Envoy's own answer as any other: the key is not left in
/// flight (409 to every retry until the lease lapsed).
#[test]
fn a_request_the_root_resumes_sees_a_reply_envoy_makes_inside_the_resume() {
    reset();
    crate::abi::install_logger();
    let config = grpc_store_config();
    let (module, status) = start(config, 311, "attack-resume-inside");
    assert_eq!(status, ffi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK);
    MODULES.with(|m| m.borrow_mut().insert(311, module as usize));
    store_thread_runs();
    let (stream_id, claim) = {
        let (id, frame, _) = crate::store_streams::recorded::sent()
            .last()
            .cloned()
            .unwrap();
        (id, frame)
    };
    let call = idempotency_protocol::stream::decode_call(&claim[5..]).unwrap();
    let idempotency_protocol::stream::CallOp::Claim { owner, .. } = call.op else {
        panic!("not a claim: {call:?}");
    };
    let claimed =
        idempotency_protocol::stream::encode_answer(&idempotency_protocol::stream::Answer {
            id: call.id,
            reply: idempotency_protocol::stream::Reply::Claimed {
                owner,
                lease_expires_at_ms: 1,
            },
        });
    store_says(
        stream_id,
        crate::store_streams::WireEvent::Headers {
            headers: vec![(":status".into(), b"200".to_vec())],
            end_stream: false,
        },
    );
    store_says(
        stream_id,
        crate::store_streams::WireEvent::Data {
            data: crate::courier::grpc_frame(&claimed),
            end_stream: false,
        },
    );
    // Another request's arrival takes the answer in and mails it; the waiting request
    // resumes in its own hook, and the router answers inside the resume.
    with(|abi| abi.on_continue = Some(router_answers_inside_the_resume));
    let (other, _) = start(config, 312, "attack-resume-other");
    assert!(!with(|a| a
        .calls
        .iter()
        .any(|c| c == "continue_decoding 311")));
    assert!(run_if_scheduled(311, module), "woken for its letter");
    with(|abi| abi.on_continue = None);
    assert!(with(|a| a
        .calls
        .iter()
        .any(|c| c == "continue_decoding 311")));
    let busy = journey_busy_logs();
    assert!(busy.is_empty(), "events lost: {busy:?}");
    // Envoy's own 503 ended the request before any upstream: the key is not left in flight.
    let (retry, status) = start(config, 313, "attack-resume-inside");
    assert_eq!(replies_to(313), Vec::<u32>::new(), "no 409 in flight");
    assert_eq!(
        status,
        ffi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK,
        "the retry asks the store"
    );
    end(312, other);
    end(313, retry);
    envoy_dynamic_module_on_http_filter_destroy(module);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

/// The native build dials the store itself: a rule in cluster mode without `store.address`
/// is refused at load, naming the field, and so is the store's HTTP transport, whose claims
/// would go through Envoy's cluster while the writes go through the module's own connection
/// (one path failing alone would let a write's lease lapse unrenewed and its retry run it).
#[test]
fn a_cluster_mode_configuration_the_native_build_cannot_carry_is_refused_at_load() {
    for (json, field) in [
        (
            &br#"{"store":{"cluster":"store"},"rules":[{"name":"orders"}]}"#[..],
            "store.address",
        ),
        (
            &br#"{"store":{"cluster":"store","address":"127.0.0.1:1","transport":"http"},
            "rules":[{"name":"orders"}]}"#[..],
            "store.transport",
        ),
    ] {
        reset();
        let config = hooks::new_config(crate::FACTORY_BUILDER, fake(9), b"idem", json);
        assert!(
            config.is_null(),
            "loaded: {}",
            String::from_utf8_lossy(json)
        );
        let logs = with(|a| a.logs.clone());
        assert!(
            logs.iter().any(|(_, line)| line.contains(field)),
            "{field} not named: {logs:?}"
        );
    }
}

// ------------------------------------------------------------------------------------------
// The mailbox: what a worker's root has for a request is taken in that request's own hook.
// ------------------------------------------------------------------------------------------

/// Envoy forgets request `ptr`'s pending scheduled events (it destroyed the request).
fn forget_commits(ptr: usize) {
    if let Ok(mut commits) = crate::abi::mock_abi::COMMITS.lock() {
        commits.retain(|(scheduler, _)| *scheduler != ptr);
    }
}

/// The owner of the last claim sent on the store's streams.
fn last_claims_owner() -> String {
    store_calls()
        .into_iter()
        .rev()
        .find_map(|(_, call)| match call.op {
            idempotency_protocol::stream::CallOp::Claim { owner, .. } => Some(owner),
            _ => None,
        })
        .unwrap()
}

/// Where on the store's streams the calls went, in order: "claim <owner>", "release <owner>".
fn claims_and_releases() -> Vec<String> {
    store_calls()
        .into_iter()
        .filter_map(|(_, call)| match call.op {
            idempotency_protocol::stream::CallOp::Claim { owner, .. } => {
                Some(format!("claim {owner}"))
            }
            idempotency_protocol::stream::CallOp::Release { owner, .. } => {
                Some(format!("release {owner}"))
            }
            _ => None,
        })
        .collect()
}

/// A request held for the store (cluster mode) whose claim the store answered "claimed";
/// another request's arrival takes the answer in and mails it. Returns the held request's
/// module, its claim's owner, and the other request's module.
fn claimed_and_mailed(
    config: ffi::HttpFilterConfigModulePtr,
    ptr: usize,
    key: &str,
    other_ptr: usize,
) -> (ffi::HttpFilterModulePtr, String, ffi::HttpFilterModulePtr) {
    let (module, status) = start(config, ptr, key);
    assert_eq!(status, ffi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK);
    store_thread_runs();
    let stream = store_calls()[0].0;
    store_opens(stream);
    let owner = last_claims_owner();
    store_claims_the_last_claim();
    let (other, _) = start(config, other_ptr, &format!("{key}-other"));
    store_thread_runs();
    assert!(
        !with(|a| a
            .calls
            .iter()
            .any(|c| *c == format!("continue_decoding {ptr}"))),
        "never resumed from another request's hook"
    );
    (module, owner, other)
}

/// Envoy gave the request no scheduler (`scheduler_new` answered null): nothing could bring
/// the store's answer to it, so it stayed held at its headers, neither resumed nor answered,
/// until Envoy's own timeouts ended it. It now fails closed at once: answered 503, its claim
/// let go.
#[test]
fn a_request_without_a_scheduler_is_not_left_hanging_by_its_claims_answer() {
    reset();
    let config = grpc_store_config();
    with(|abi| abi.refuse.insert("scheduler_new"));
    let (module, status) = start(config, 921, "attack-no-scheduler");
    assert_eq!(status, ffi::HEADERS_STOP_ITERATION, "not let through");
    assert_eq!(replies_to(921), vec![503], "failed closed at once");
    assert!(!with(|a| a
        .calls
        .iter()
        .any(|c| c == "continue_decoding 921")));
    end(921, module);
    // Nothing of its claim is left to answer 409: the next request of the key asks the store.
    with(|abi| abi.refuse.remove("scheduler_new"));
    let (retry, status) = start(config, 922, "attack-no-scheduler");
    assert_eq!(status, ffi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK);
    assert!(replies_to(922).is_empty(), "no 409 from the local table");
    end(922, retry);
    forget_commits(922);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

/// The store's "claimed" is in the request's mailbox when its client resets (stream end,
/// then destroy, before its scheduled hook runs): the request is never resumed, the claim is
/// released in the store before the retry's claim goes out, and the retry on this worker is
/// not told 409 by the local table: it asks the store.
#[test]
fn a_claimed_letter_pending_when_the_client_resets_is_released_before_the_retry_claims() {
    reset();
    let config = grpc_store_config();
    let (module, owner, other) = claimed_and_mailed(config, 931, "attack-mail-reset", 932);
    end(931, module);
    forget_commits(931);
    assert!(!with(|a| a
        .calls
        .iter()
        .any(|c| c == "continue_decoding 931")));
    let (retry, status) = start(config, 933, "attack-mail-reset");
    assert_eq!(status, ffi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK);
    assert!(replies_to(933).is_empty(), "no 409 from the local table");
    store_thread_runs();
    let order = claims_and_releases();
    let released = order.iter().position(|c| *c == format!("release {owner}"));
    let retry_claim = order.iter().rposition(|c| c.starts_with("claim "));
    assert!(
        matches!((released, retry_claim), (Some(r), Some(c)) if r < c),
        "the release goes before the retry's claim: {order:?}"
    );
    end(933, retry);
    end(932, other);
    forget_commits(932);
    forget_commits(933);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

/// Envoy may run a request's scheduled event after its stream ended and before it destroys
/// it: a "claimed" letter still waiting then is not delivered (the mailbox closed at the
/// stream's end), so a request whose client left never goes upstream.
#[test]
fn a_claimed_letter_is_not_delivered_after_the_stream_ended() {
    reset();
    let config = grpc_store_config();
    let (module, owner, other) = claimed_and_mailed(config, 941, "attack-mail-late", 942);
    envoy_dynamic_module_on_http_filter_stream_complete(fake(941), module);
    envoy_dynamic_module_on_http_filter_scheduled(fake(941), module, 1);
    assert!(!with(|a| a
        .calls
        .iter()
        .any(|c| c == "continue_decoding 941")));
    assert!(replies_to(941).is_empty());
    envoy_dynamic_module_on_http_filter_destroy(module);
    forget_commits(941);
    store_thread_runs();
    assert!(claims_and_releases().contains(&format!("release {owner}")));
    end(942, other);
    forget_commits(942);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
}

/// Envoy answers a request held for the store itself (its request timeout: a local 504
/// through the response hooks) while the store's "claimed" waits in its mailbox, and its
/// scheduled hook runs before its stream's end (HTTP/2 ends the stream once the reply is
/// flushed). `AwaitingStore` let Envoy's response pass and stayed; the letter then made it
/// `Executing` (a resume Envoy ignores), and the stream's end recorded a write that never
/// went upstream as an unknown outcome: every retry was told 409 "outcome unknown" until it
/// was settled or its TTL ended. Envoy's own answer now ends the wait and frees the key.
#[test]
fn a_claimed_letter_taken_after_envoy_answered_the_request_itself_frees_the_key() {
    reset();
    let config = grpc_store_config();
    let (module, _owner, other) = claimed_and_mailed(config, 951, "attack-mail-envoy-504", 952);
    upstream_answers("504", b"upstream request timeout");
    envoy_dynamic_module_on_http_filter_response_headers(fake(951), module, false);
    envoy_dynamic_module_on_http_filter_response_body(fake(951), module, true);
    assert!(run_if_scheduled(951, module), "woken for its letter");
    end(951, module);
    store_thread_runs();
    let calls: Vec<String> = store_calls()
        .into_iter()
        .map(|(_, c)| format!("{:?}", c.op))
        .collect();
    let (retry, _) = start(config, 953, "attack-mail-envoy-504");
    let told = replies_to(953);
    end(953, retry);
    end(952, other);
    forget_commits(952);
    forget_commits(953);
    envoy_dynamic_module_on_http_filter_config_destroy(config);
    assert!(
        told.is_empty(),
        "the retry told {told:?}; store calls {calls:?}"
    );
    assert!(
        !calls.iter().any(|c| c.starts_with("Complete")),
        "a write that never ran was recorded: {calls:?}"
    );
}

/// A held duplicate's end (its wait timed out: 409) waits in its mailbox when Envoy answers
/// it itself (its request timeout): the wait is abandoned at Envoy's response, and the
/// letter taken afterwards sends nothing more (a second reply after a response began).
#[test]
fn a_wait_over_letter_taken_after_envoy_answered_the_duplicate_sends_nothing() {
    reset();
    let config = wait_config();
    let (first, status) = start(config, 961, "attack-mail-wait-504");
    assert_eq!(status, ffi::HEADERS_CONTINUE);
    let (held, status) = start(config, 962, "attack-mail-wait-504");
    assert_eq!(status, ffi::HEADERS_STOP_ITERATION, "the duplicate is held");
    sleep_ms(150);
    // The tick, in another request's hook, mails the duplicate its 409.
    let (other, _) = start(config, 963, "attack-mail-wait-504-other");
    assert!(replies_to(962).is_empty());
    upstream_answers("504", b"upstream request timeout");
    envoy_dynamic_module_on_http_filter_response_headers(fake(962), held, false);
    envoy_dynamic_module_on_http_filter_response_body(fake(962), held, true);
    assert!(run_if_scheduled(962, held), "woken for its letter");
    assert!(
        replies_to(962).is_empty(),
        "nothing sent after Envoy's own answer"
    );
    end(962, held);
    upstream_answers("201", b"created");
    respond(961, first);
    end(961, first);
    end(963, other);
    for ptr in [961, 962, 963] {
        forget_commits(ptr);
    }
    let (retry, _) = start(config, 964, "attack-mail-wait-504");
    assert_eq!(replies_to(964), vec![201], "the first's record is intact");
    end(964, retry);
    forget_commits(964);
}

// ------------------------------------------------------------------------------------------
// Round 2b: a host per request (8f5bfac), the mailbox's fixes (af44066), fallbacks (618f738).
// ------------------------------------------------------------------------------------------

/// The body of every local reply to `ptr`, as text.
fn reply_bodies(ptr: usize) -> Vec<String> {
    with(|abi| {
        abi.responses
            .iter()
            .filter(|r| r.0 == ptr)
            .map(|r| String::from_utf8_lossy(&r.3).into_owned())
            .collect()
    })
}

/// Envoy gives the request no scheduler (`scheduler_new` null) right when its step lets it
/// upstream (single-proxy mode, the key claimed at the headers). The request fails closed:
/// answered 503 and held, never both; its write never ran, so its claim is released and the
/// retry is not told "outcome unknown" for a write that did not run.
#[test]
fn a_request_without_a_scheduler_whose_write_was_let_through_is_not_both_passed_and_refused() {
    reset();
    let config = config();
    with(|abi| abi.refuse.insert("scheduler_new"));
    let (module, status) = start(config, 971, "attack-no-scheduler-local");
    let replied = replies_to(971);
    end(971, module);
    with(|abi| abi.refuse.remove("scheduler_new"));
    let (retry, _) = start(config, 972, "attack-no-scheduler-local");
    let retry_told = reply_bodies(972);
    end(972, retry);
    forget_commits(972);
    assert!(
        !(status == ffi::HEADERS_CONTINUE && replied == vec![503]),
        "let through (status {status}) and answered {replied:?} in the same hook"
    );
    assert!(
        !retry_told.iter().any(|b| b.contains("outcome-unknown")),
        "the retry of a write its client was refused is told: {retry_told:?}"
    );
}

/// A write is upstream (key claimed at its headers, its body still streaming) and its
/// response has begun when a response hook panics: the filter is poisoned. The rest of the
/// request body goes on: held, an upstream that answers while it reads (a bidirectional
/// stream, an early answer) would wait until Envoy's idle timeout for a body that never came.
#[test]
fn a_panic_after_the_response_began_does_not_hold_the_rest_of_the_request_body() {
    reset();
    let config = config();
    request_headers("attack-poisoned-mid-upload");
    let module = envoy_dynamic_module_on_http_filter_new(config, fake(981));
    let status = envoy_dynamic_module_on_http_filter_request_headers(fake(981), module, false);
    assert_eq!(
        status,
        ffi::HEADERS_CONTINUE,
        "the write goes upstream at its headers"
    );
    with(|abi| {
        abi.bodies.insert(
            ffi::BODY_TYPE_RECEIVED_REQUEST_BODY,
            vec![b"part one".to_vec()],
        )
    });
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_body(fake(981), module, false),
        ffi::BODY_CONTINUE,
        "its body streams upstream"
    );
    with(|abi| abi.panic_on.insert("get_headers"));
    envoy_dynamic_module_on_http_filter_response_headers(fake(981), module, false);
    assert!(
        with(|abi| abi
            .logs
            .iter()
            .any(|(_, l)| l.contains("panic in response_headers"))),
        "the panic was injected"
    );
    let rest = envoy_dynamic_module_on_http_filter_request_body(fake(981), module, true);
    end(981, module);
    forget_commits(981);
    assert_eq!(
        rest,
        ffi::BODY_CONTINUE,
        "the rest of an upstream request's body is held after its response began"
    );
}

/// A panic in one of the replay echo's (`grpc_replay_echo`) hooks: the hop is answered 503
/// (the gRPC client reads UNAVAILABLE) rather than left held until Envoy's timeout, with the
/// Wasm filter replaying through it.
#[test]
fn a_panic_in_the_replay_echo_does_not_leave_the_hop_hanging() {
    reset();
    let echo = load(br#"{"grpc_replay_echo": true}"#);
    with(|abi| {
        abi.maps.insert(
            REQ,
            [
                (":method", "POST"),
                (":path", "/idempotency.filter.v1.Replay/Echo"),
                ("content-type", "application/x-idempotency-replay"),
            ]
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect(),
        );
        abi.panic_on.insert("get_headers");
    });
    let hop = envoy_dynamic_module_on_http_filter_new(echo, fake(991));
    let headers = envoy_dynamic_module_on_http_filter_request_headers(fake(991), hop, false);
    let body = envoy_dynamic_module_on_http_filter_request_body(fake(991), hop, true);
    let answered = !replies_to(991).is_empty();
    end(991, hop);
    envoy_dynamic_module_on_http_filter_config_destroy(echo);
    assert!(
        answered || (headers == ffi::HEADERS_CONTINUE && body == ffi::BODY_CONTINUE),
        "the hop is held (headers {headers}, body {body}) and never answered"
    );
}
