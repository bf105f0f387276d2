//! The filter refuses at configure a lease or TTL this store would refuse on every request;
//! both sides must name the same bounds.

use idempotency_core::config as filter;
use idempotency_store::protocol as store;

#[test]
fn the_filter_refuses_exactly_what_the_store_refuses() {
    assert_eq!(filter::STORE_MIN_LEASE_MS, store::MIN_LEASE_MS);
    assert_eq!(filter::STORE_MAX_LEASE_MS, store::MAX_LEASE_MS);
    assert_eq!(filter::STORE_MIN_TTL_MS, store::MIN_TTL_MS);
    assert_eq!(filter::STORE_MAX_TTL_MS, store::MAX_TTL_MS);
}
