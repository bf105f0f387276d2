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

/// Runs `deliver` while the answer is the one `callout_response_*` read.
pub fn delivering<T>(headers: HeaderPairs, body: Vec<u8>, deliver: impl FnOnce() -> T) -> T {
    CURRENT.with(|current| current.replace(Some((headers, body))));
    let answer = deliver();
    CURRENT.with(|current| current.replace(None));
    answer
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
