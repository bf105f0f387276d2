//! The floor's steps through the exported hooks over the mocked ABI. The records are the
//! process's, shared by parallel tests: each test uses keys of its own.

use std::ffi::c_void;

use dynamic_module_abi::ffi;
use dynamic_module_abi::hooks::{self, *};
use dynamic_module_abi::mock_abi::{reset, with};

const REQ: u32 = ffi::HEADER_TYPE_REQUEST_HEADER;
const RESP: u32 = ffi::HEADER_TYPE_RESPONSE_HEADER;

fn fake(n: usize) -> *mut c_void {
    n as *mut c_void
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter()
        .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// A request with `key` and `body` through its request hooks: the body hook's status, or
/// the headers' when there is no body.
fn request(
    config: ffi::HttpFilterConfigModulePtr,
    ptr: usize,
    key: &str,
    body: &str,
) -> (ffi::HttpFilterModulePtr, u32) {
    with(|abi| {
        abi.maps.insert(
            REQ,
            pairs(&[
                (":method", "POST"),
                (":path", "/orders"),
                (":authority", "shop"),
                ("idempotency-key", key),
            ]),
        );
        abi.bodies.insert(
            ffi::BODY_TYPE_RECEIVED_REQUEST_BODY,
            vec![body.as_bytes().to_vec()],
        );
    });
    let module = envoy_dynamic_module_on_http_filter_new(config, fake(ptr));
    let headers = envoy_dynamic_module_on_http_filter_request_headers(fake(ptr), module, false);
    assert_eq!(headers, ffi::HEADERS_STOP_ITERATION, "the body is awaited");
    let status = envoy_dynamic_module_on_http_filter_request_body(fake(ptr), module, true);
    (module, status)
}

fn respond(ptr: usize, module: ffi::HttpFilterModulePtr) {
    with(|abi| {
        abi.maps.insert(
            RESP,
            pairs(&[(":status", "201"), ("content-type", "text/plain")]),
        );
        abi.bodies.insert(
            ffi::BODY_TYPE_RECEIVED_RESPONSE_BODY,
            vec![b"created".to_vec()],
        );
    });
    envoy_dynamic_module_on_http_filter_response_headers(fake(ptr), module, false);
    envoy_dynamic_module_on_http_filter_response_body(fake(ptr), module, true);
    envoy_dynamic_module_on_http_filter_destroy(module);
}

fn config() -> ffi::HttpFilterConfigModulePtr {
    let config = hooks::new_config(crate::FACTORY_BUILDER, fake(9), b"floor", b"{}");
    assert!(!config.is_null());
    config
}

fn replies_to(ptr: usize) -> Vec<(u32, Vec<u8>, bool)> {
    with(|abi| {
        abi.responses
            .iter()
            .filter(|r| r.0 == ptr)
            .map(|r| {
                (
                    r.1,
                    r.3.clone(),
                    r.2.iter()
                        .any(|(n, v)| n == "idempotent-replayed" && v == b"true"),
                )
            })
            .collect()
    })
}

#[test]
fn a_new_key_goes_on_and_its_retry_is_replayed() {
    reset();
    let config = config();
    let (first, status) = request(config, 1, "floor-replay", "{}");
    assert_eq!(status, ffi::BODY_CONTINUE);
    respond(1, first);
    let (_retry, status) = request(config, 2, "floor-replay", "{}");
    assert_eq!(status, ffi::BODY_STOP_ITERATION_NO_BUFFER);
    assert_eq!(replies_to(2), vec![(201, b"created".to_vec(), true)]);
    with(|abi| {
        let counted: u64 = abi
            .metric_calls
            .iter()
            .filter(|c| c.0.contains("increment"))
            .map(|c| c.2)
            .sum();
        assert_eq!(
            counted, 2,
            "one count per request with a key: {:?}",
            abi.metric_calls
        );
    });
}

#[test]
fn a_duplicate_in_flight_is_409_and_another_body_422() {
    reset();
    let config = config();
    let (first, status) = request(config, 11, "floor-in-flight", "a");
    assert_eq!(status, ffi::BODY_CONTINUE);
    request(config, 12, "floor-in-flight", "a");
    assert_eq!(replies_to(12)[0].0, 409);
    request(config, 13, "floor-in-flight", "b");
    assert_eq!(replies_to(13)[0].0, 422);
    respond(11, first);
}

#[test]
fn a_request_without_a_key_is_not_touched() {
    reset();
    let config = config();
    with(|abi| {
        abi.maps
            .insert(REQ, pairs(&[(":method", "POST"), (":path", "/orders")]))
    });
    let module = envoy_dynamic_module_on_http_filter_new(config, fake(21));
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(fake(21), module, false),
        ffi::HEADERS_CONTINUE
    );
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_body(fake(21), module, true),
        ffi::BODY_CONTINUE
    );
    assert!(replies_to(21).is_empty());
}
