//! The host layer over a mocked Envoy (`abi::mock_abi`): what core's calls reach, in
//! the form core reads, and what they answer when there is no request to act on.

use idempotency_core::host::{Host, SetOutcome, SharedData};

use crate::abi::ffi;
use crate::abi::mock_abi::{reset, with, MetadataValue};
use crate::abi::{ConfigHandle, Filter};
use crate::host::NativeHost;
use crate::metrics::Metrics;
use crate::worker;

fn filter(n: usize) -> Filter {
    // SAFETY: the mock never dereferences filter pointers.
    unsafe { Filter::from_raw(n as *mut std::ffi::c_void) }
}

fn config() -> ConfigHandle {
    // SAFETY: the mock never dereferences config pointers.
    unsafe { ConfigHandle::from_raw(9 as *mut std::ffi::c_void) }
}

fn with_host<T>(f: impl FnOnce(&NativeHost<'_>) -> T) -> T {
    with_host_of(None, f)
}

/// A host acting on `request` (its context id and filter), as one made in its own hook.
fn with_host_of<T>(
    request: Option<(u32, crate::abi::FilterHandle)>,
    f: impl FnOnce(&NativeHost<'_>) -> T,
) -> T {
    let metrics = Metrics::new(config());
    let tick = std::cell::Cell::new(0);
    let host = NativeHost {
        configuration: b"{}",
        metrics: &metrics,
        tick_ms: &tick,
        streams: None,
        main: None,
        request,
    };
    f(&host)
}

#[test]
fn the_first_counter_defined_is_counted() {
    // Core reads a counter id of 0 as "not defined" and counts nothing: the first counter a
    // configuration defined (`executed`) was never counted when ids started at 0.
    reset();
    let metrics = Metrics::new(config());
    let first = metrics.counter("idempotency.rule.orders.executed").unwrap();
    assert_ne!(first, 0);
    metrics.increment(first);
    let counted = with(|abi| abi.metric_calls.len());
    assert_eq!(counted, 1);
}

#[test]
fn a_worker_finds_the_metrics_defined_at_load_and_defines_none_after() {
    reset();
    let metrics = Metrics::new(config());
    let at_load = metrics.counter("a").unwrap();
    let gauge = metrics.gauge("g").unwrap();
    metrics.freeze();
    assert_eq!(metrics.counter("a").unwrap(), at_load);
    assert_eq!(metrics.gauge("g").unwrap(), gauge);
    assert!(metrics.counter("defined-too-late").is_err());
    let defined = with(|abi| abi.next_metric_id);
    metrics.increment(at_load);
    metrics.set_gauge(gauge, 7);
    // No definition reached Envoy after the freeze.
    assert_eq!(with(|abi| abi.next_metric_id), defined);
}

#[test]
fn integer_properties_cross_as_core_reads_them() {
    reset();
    with(|abi| {
        abi.attr_ints
            .insert(ffi::ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT, 2)
    });
    let attempts = with_host_of(Some((1, filter(1).handle())), |host| {
        host.property(&["upstream", "request_attempt_count"])
    });
    assert_eq!(attempts.unwrap(), Some(2i64.to_le_bytes().to_vec()));
}

#[test]
fn the_routes_metadata_names_its_rule() {
    reset();
    with(|abi| {
        abi.metadata
            .entry((ffi::METADATA_SOURCE_ROUTE, "idempotency".to_owned()))
            .or_default()
            .insert(
                "rule".to_owned(),
                MetadataValue::String(b"payments".to_vec()),
            )
    });
    let own = Some((1, filter(1).handle()));
    let path = [
        "xds",
        "route_metadata",
        "filter_metadata",
        "idempotency",
        "rule",
    ];
    let rule = with_host_of(own, |host| host.property(&path));
    assert_eq!(rule.unwrap(), Some(b"payments".to_vec()));
    let other = ["xds", "route_metadata", "filter_metadata", "other", "rule"];
    assert_eq!(
        with_host_of(own, |host| host.property(&other)).unwrap(),
        None
    );
}

#[test]
fn outside_a_request_stream_calls_are_refused() {
    reset();
    with_host(|host| {
        assert!(host.request_headers().is_err());
        assert!(host.send_local_reply(200, &[], b"").is_err());
        assert!(host.resume_request().is_err());
    });
    assert!(with(|abi| abi.calls.is_empty()));
}

/// Core switches from a request to its root (to send on the root's store stream) and back;
/// any other request is refused: a request is acted on only in its own hooks, and its host
/// acts on it alone whatever core switches to.
#[test]
fn only_the_request_whose_hook_runs_can_be_switched_to() {
    reset();
    let root = worker::new_root_context_id();
    let own = worker::new_context_id();
    let other = worker::new_context_id();
    worker::register(own);
    worker::register(other);
    with_host_of(Some((own, filter(5).handle())), |host| {
        assert!(host.set_effective_context(other).is_err());
        assert!(host.set_effective_context(root).is_ok());
        assert!(host.set_effective_context(other).is_err());
        assert!(host.set_effective_context(own).is_ok());
        host.send_local_reply(409, &[], b"mine").unwrap();
    });
    let replied_to = |abi: &mut crate::abi::mock_abi::Abi| {
        let whole = abi.responses.iter().map(|r| r.0);
        let parts = abi.parts.iter().filter_map(|p| match p {
            crate::abi::mock_abi::Part::Headers(to, ..) => Some(*to),
            _ => None,
        });
        whole.chain(parts).collect::<Vec<_>>()
    };
    assert_eq!(
        with(replied_to),
        vec![5],
        "the reply went to the request alone"
    );
    with_host(|host| {
        assert!(
            host.set_effective_context(own).is_err(),
            "a root's host acts on none"
        );
        assert!(host.send_local_reply(409, &[], b"nobody's").is_err());
    });
    worker::forget(own);
    worker::forget(other);
}

#[test]
fn claims_race_on_the_process_table_through_the_host() {
    with_host(|host| {
        let key = "tests/host/claim";
        assert_eq!(host.set(key, b"free", None).unwrap(), SetOutcome::Stored);
        let (_, cas) = host.get(key).unwrap().unwrap();
        assert_eq!(
            host.set(key, b"mine", Some(cas)).unwrap(),
            SetOutcome::Stored
        );
        assert_eq!(
            host.set(key, b"theirs", Some(cas)).unwrap(),
            SetOutcome::CasMismatch
        );
        assert_eq!(host.get(key).unwrap().unwrap().0, b"mine");
    });
}
