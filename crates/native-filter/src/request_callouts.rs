//! A request's own HTTP callouts on its worker (the store's HTTP transport: a claim, a caller's
//! lookup), as core's host calls see them: Envoy's callout ids under core's tokens, and the
//! answer being delivered, which `callout_response_*` read as proxy-wasm's do. Envoy cancels a
//! request's callouts when it ends; its ids are forgotten then.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use idempotency_core::host::HeaderPairs;

thread_local! {
    /// (the request's key, Envoy's callout id) -> core's token.
    static TOKENS: RefCell<HashMap<(usize, u64), u32>> = RefCell::new(HashMap::new());
    static NEXT_TOKEN: Cell<u32> = const { Cell::new(0) };
    static CURRENT: RefCell<Option<(HeaderPairs, Vec<u8>)>> = const { RefCell::new(None) };
}

/// The token core names the callout `callout_id` of request `request` by.
pub fn register(request: usize, callout_id: u64) -> u32 {
    let token = NEXT_TOKEN.with(|next| {
        let token = next.get().wrapping_add(1).max(1);
        next.set(token);
        token
    });
    TOKENS.with(|tokens| tokens.borrow_mut().insert((request, callout_id), token));
    token
}

/// The token of the callout that answered, taken out.
pub fn take(request: usize, callout_id: u64) -> Option<u32> {
    TOKENS.with(|tokens| tokens.borrow_mut().remove(&(request, callout_id)))
}

/// The request is gone, and Envoy cancelled its callouts.
pub fn forget(request: usize) {
    TOKENS.with(|tokens| tokens.borrow_mut().retain(|(r, _), _| *r != request));
}

/// Runs `deliver` while the answer is the one `callout_response_*` read; no longer after,
/// even if `deliver` panics (the hook's barrier catches it, and a later read must not find
/// this answer).
pub fn delivering<T>(headers: HeaderPairs, body: Vec<u8>, deliver: impl FnOnce() -> T) -> T {
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            CURRENT.with(|current| current.replace(None));
        }
    }
    CURRENT.with(|current| current.replace(Some((headers, body))));
    let _clear = Clear;
    deliver()
}

pub fn headers() -> Option<HeaderPairs> {
    CURRENT.with(|current| current.borrow().as_ref().map(|(h, _)| h.clone()))
}

pub fn body(size: usize) -> Option<Vec<u8>> {
    CURRENT.with(|current| {
        current
            .borrow()
            .as_ref()
            .map(|(_, b)| b.get(..size).unwrap_or(b).to_vec())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_read_only_while_it_is_delivered_even_when_its_delivery_panics() {
        let status = vec![(":status".to_owned(), b"200".to_vec())];
        let read = delivering(status.clone(), b"{}".to_vec(), || (headers(), body(1)));
        assert_eq!(read, (Some(status.clone()), Some(b"{".to_vec())));
        assert_eq!(headers(), None);
        let caught = std::panic::catch_unwind(|| {
            delivering(status, b"{}".to_vec(), || panic!("a step panicked"));
        });
        assert!(caught.is_err());
        assert_eq!(headers(), None, "not read by whatever comes next");
    }

    #[test]
    fn a_callout_is_named_by_its_request_and_envoys_id_until_answered_or_forgotten() {
        let first = register(7, 1);
        let other_request = register(8, 1);
        assert_ne!(first, other_request);
        assert_eq!(take(7, 1), Some(first));
        assert_eq!(take(7, 1), None, "answered once");
        forget(8);
        assert_eq!(
            take(8, 1),
            None,
            "the request went, and its callouts with it"
        );
    }
}
