//! The configuration's own one-shot HTTP callouts, as the main thread's root makes them
//! (`main_root.rs`): Envoy's callout ids under core's tokens, and the answer being delivered,
//! which core's `callout_response_*` read as proxy-wasm's do.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::host::{Callout, HeaderPairs, HostError};

use crate::abi::MainThreadConfig;
use crate::inbox::{Inbox, Reply, StreamEvent};

/// The configuration's one-shot callouts (a trait so the main root is tested without Envoy).
pub trait ConfigCallouts {
    fn callout(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, String>;
}

impl ConfigCallouts for MainThreadConfig {
    fn callout(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, String> {
        self.http_callout(cluster, headers, body, Duration::from_millis(timeout_ms))
            .map_err(|e| e.to_string())
    }
}

/// An answer as Envoy delivered it.
pub struct Answer {
    pub callout_id: u64,
    pub headers: HeaderPairs,
    pub body: Vec<u8>,
}

/// The main root's callouts in flight, by Envoy's id, under core's tokens; and the answer
/// being delivered, which `callout_response_*` read as proxy-wasm's do.
#[derive(Default)]
pub struct Callouts {
    pub tokens: RefCell<HashMap<u64, u32>>,
    next_token: Cell<u32>,
    pub current: RefCell<Option<(HeaderPairs, Vec<u8>)>>,
    /// Answers that came while the root was busy (Envoy may answer inside the call that
    /// started the callout), delivered once it is free.
    pub early: RefCell<Vec<Answer>>,
}

/// A worker's request whose detached write the main root runs, as a context of its own.
pub struct Remote {
    pub inbox: Arc<Inbox>,
    /// The request's context id on its worker.
    pub origin: u32,
}

/// The main root's contexts that stand for workers' requests: host calls "in" one of them
/// answer that request through its worker's inbox.
#[derive(Default)]
pub struct Remotes {
    by_context: RefCell<HashMap<u32, Remote>>,
    current: Cell<Option<u32>>,
}

impl Remotes {
    pub fn add(&self, context_id: u32, remote: Remote) {
        self.by_context.borrow_mut().insert(context_id, remote);
    }

    /// The main root's context for the worker's request `origin` (whose inbox is `inbox`),
    /// no longer standing for it.
    pub fn remove_origin(&self, inbox: &Arc<Inbox>, origin: u32) -> Option<u32> {
        let mut by_context = self.by_context.borrow_mut();
        let context_id = by_context
            .iter()
            .find(|(_, r)| r.origin == origin && Arc::ptr_eq(&r.inbox, inbox))
            .map(|(id, _)| *id)?;
        by_context.remove(&context_id);
        Some(context_id)
    }

    /// Host calls act on `context_id` now; Err when it stands for no request (any more).
    pub fn enter(&self, context_id: u32) -> Result<(), HostError> {
        if crate::worker::is_root_context(context_id) {
            self.current.set(None);
            return Ok(());
        }
        if self.by_context.borrow().contains_key(&context_id) {
            self.current.set(Some(context_id));
            Ok(())
        } else {
            Err(HostError(format!("request {context_id} is gone")))
        }
    }

    /// Answers the request host calls act on, through its worker (once: the context then
    /// stands for nothing).
    pub fn reply(
        &self,
        status: u16,
        headers: &[(&str, &[u8])],
        body: &[u8],
        trailers: &[(&str, &[u8])],
    ) -> Result<(), HostError> {
        let Some(context_id) = self.current.get() else {
            return Err(HostError("no request is being handled".into()));
        };
        let Some(remote) = self.by_context.borrow_mut().remove(&context_id) else {
            return Err(HostError(format!("request {context_id} is gone")));
        };
        let owned = |pairs: &[(&str, &[u8])]| -> Vec<(String, Vec<u8>)> {
            pairs
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
                .collect()
        };
        remote.inbox.deliver(StreamEvent::Reply(Box::new(Reply {
            context_id: remote.origin,
            status,
            headers: owned(headers),
            body: body.to_vec(),
            trailers: owned(trailers),
        })));
        Ok(())
    }
}

/// What a main root's host makes its callouts with, for one hook.
#[derive(Clone, Copy)]
pub struct MainCalls<'a> {
    pub config: &'a dyn ConfigCallouts,
    pub callouts: &'a Callouts,
    pub remotes: &'a Remotes,
}

impl MainCalls<'_> {
    pub fn dispatch(&self, callout: &Callout<'_>) -> Result<u32, HostError> {
        let headers: Vec<(&str, &[u8])> = callout
            .headers
            .iter()
            .map(|(n, v)| (*n, v.as_bytes()))
            .collect();
        if !callout.trailers.is_empty() {
            log::debug!("a callout's trailers are not sent (Envoy's callout takes none)");
        }
        let id = self
            .config
            .callout(callout.cluster, &headers, callout.body, callout.timeout_ms)
            .map_err(HostError)?;
        let callouts = self.callouts;
        let token = callouts.next_token.get().wrapping_add(1).max(1);
        callouts.next_token.set(token);
        callouts.tokens.borrow_mut().insert(id, token);
        Ok(token)
    }

    pub fn response_headers(&self) -> Result<HeaderPairs, HostError> {
        match &*self.callouts.current.borrow() {
            Some((headers, _)) => Ok(headers.clone()),
            None => Err(HostError("no callout answer is being delivered".into())),
        }
    }

    pub fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        match &*self.callouts.current.borrow() {
            Some((_, body)) => Ok(body.get(..size).unwrap_or(body).to_vec()),
            None => Err(HostError("no callout answer is being delivered".into())),
        }
    }
}
