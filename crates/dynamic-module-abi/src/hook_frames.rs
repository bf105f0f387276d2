//! The filters whose hooks are on this thread's stack, and the calls each deferred: a
//! filter's own resume or local reply, made inside one of its hooks, would make Envoy run
//! that filter's hooks inside the call while the hook still holds it; it is made when the
//! hook returns instead.

use std::cell::RefCell;

use crate::ffi;

/// A call that would make Envoy re-enter the filter whose hook is running (Envoy runs the
/// rest of the chain, and possibly a local reply through this filter's encoder hooks,
/// synchronously). Made from that filter's own hook, it is queued and made right after the
/// filter's method returns, when the filter is no longer borrowed.
pub(crate) enum Deferred {
    ContinueDecoding,
    ContinueEncoding,
    SendResponse {
        status: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    },
    SendResponseHeaders {
        headers: Vec<(String, Vec<u8>)>,
        end_stream: bool,
    },
    SendResponseData {
        data: Vec<u8>,
        end_stream: bool,
    },
    SendResponseTrailers {
        trailers: Vec<(String, Vec<u8>)>,
    },
}

impl Deferred {
    /// Whether the call ends the response (and so, as far as the module goes, the stream).
    pub(crate) fn ends_the_response(&self) -> bool {
        match self {
            Deferred::SendResponse { .. } | Deferred::SendResponseTrailers { .. } => true,
            Deferred::SendResponseHeaders { end_stream, .. }
            | Deferred::SendResponseData { end_stream, .. } => *end_stream,
            Deferred::ContinueDecoding | Deferred::ContinueEncoding => false,
        }
    }
}

struct HookFrame {
    filter: usize,
    deferred: Vec<Deferred>,
}

thread_local! {
    /// The requests whose response the module has ended (a local reply sent whole): nothing
    /// more of a response goes to Envoy for them, whichever path asks.
    static ENDED: RefCell<std::collections::HashSet<usize>> =
        RefCell::new(std::collections::HashSet::new());
}

/// Whether `call` may go to Envoy for the request `ptr`: not a response's part after the
/// module ended that response. A call that ends it marks the request so.
pub(crate) fn may_send(ptr: ffi::HttpFilterEnvoyPtr, call: &Deferred) -> bool {
    if matches!(
        call,
        Deferred::ContinueDecoding | Deferred::ContinueEncoding
    ) {
        return true;
    }
    let ended = ENDED
        .try_with(|ended| {
            let mut ended = ended.try_borrow_mut().ok()?;
            if ended.contains(&(ptr as usize)) {
                return Some(true);
            }
            if call.ends_the_response() {
                ended.insert(ptr as usize);
            }
            Some(false)
        })
        .ok()
        .flatten()
        .unwrap_or(false);
    !ended
}

/// The request `ptr` is gone: its pointer may name another request from now on.
pub(crate) fn forget_reply(ptr: usize) {
    let _ = ENDED.try_with(|ended| {
        if let Ok(mut ended) = ended.try_borrow_mut() {
            ended.remove(&ptr);
        }
    });
}

thread_local! {
    /// The filters whose hooks are on this thread's stack, innermost last.
    static HOOKS: RefCell<Vec<HookFrame>> = const { RefCell::new(Vec::new()) };
}

/// Marks `ptr`'s hook as running until the matching [`leave_hook`].
pub(crate) fn enter_hook(ptr: ffi::HttpFilterEnvoyPtr) {
    HOOKS.with(|hooks| {
        if let Ok(mut hooks) = hooks.try_borrow_mut() {
            hooks.push(HookFrame {
                filter: ptr as usize,
                deferred: Vec::new(),
            });
        }
    });
}

/// Drops the calls `ptr`'s running hooks deferred that `which` picks.
pub(crate) fn withdraw(ptr: ffi::HttpFilterEnvoyPtr, which: impl Fn(&Deferred) -> bool) {
    HOOKS.with(|hooks| {
        if let Ok(mut hooks) = hooks.try_borrow_mut() {
            for frame in hooks
                .iter_mut()
                .filter(|frame| frame.filter == ptr as usize)
            {
                frame.deferred.retain(|call| !which(call));
            }
        }
    });
}

/// Ends the innermost hook and hands back the calls its filter deferred.
pub(crate) fn leave_hook() -> Vec<Deferred> {
    HOOKS.with(|hooks| {
        hooks
            .try_borrow_mut()
            .ok()
            .and_then(|mut hooks| hooks.pop())
            .map(|frame| frame.deferred)
            .unwrap_or_default()
    })
}

/// Queues `call` if one of `ptr`'s own hooks is running, to its innermost one: Envoy would otherwise run that filter's hooks inside the call while its
/// hook holds it (a hook deeper in the stack, under another request's, included); gives it
/// back otherwise.
pub(crate) fn defer_if_in_own_hook(
    ptr: ffi::HttpFilterEnvoyPtr,
    call: Deferred,
) -> Option<Deferred> {
    HOOKS.with(|hooks| match hooks.try_borrow_mut() {
        Ok(mut hooks) => match hooks
            .iter_mut()
            .rev()
            .find(|frame| frame.filter == ptr as usize)
        {
            Some(frame) => {
                frame.deferred.push(call);
                None
            }
            None => Some(call),
        },
        Err(_) => Some(call),
    })
}
