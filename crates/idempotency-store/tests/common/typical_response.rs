//! The response the store's measurements record: a 201 with the six headers a typical API
//! sends and a body of the size asked for. Shared by the Redis memory measurement
//! (`tests/contract.rs`) and the scale run's fill (`examples/stream_load.rs`), so that their
//! bytes per record are of the same record.

use idempotency_protocol::record::RecordedResponse;

pub fn typical_response(body_bytes: usize) -> RecordedResponse {
    let headers = [
        ("content-type", "application/json"),
        ("date", "Thu, 03 Dec 2026 04:00:00 GMT"),
        ("location", "/orders/1234567890"),
        ("x-request-id", "9b2e4c1a-5d7f-4e3b-8a6c-1f0e2d3c4b5a"),
        ("cache-control", "no-store"),
        ("idempotency-key-expires", "Wed, 02 Jun 2027 04:00:00 GMT"),
    ]
    .iter()
    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
    .collect();
    RecordedResponse {
        owner: 1,
        status: 201,
        headers,
        body: vec![b'x'; body_bytes],
        ..RecordedResponse::default()
    }
}
