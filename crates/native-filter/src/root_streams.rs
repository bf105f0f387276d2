//! A worker root's store streams as core's host calls see them: opens, sends and closes go to
//! the configuration's courier (the store thread); what arrives waits in the root's inbox, and
//! while the root takes one event, `grpc_message` / `grpc_initial_metadata` answer from it,
//! as proxy-wasm answers from the event it is delivering.

use std::cell::RefCell;
use std::sync::Arc;

use idempotency_core::host::{HeaderPairs, HostError};

use crate::courier::{Courier, StreamTarget};
use crate::inbox::{Inbox, StreamEvent};
use crate::ledger::Ledger;

pub struct RootStreams {
    pub courier: Arc<Courier>,
    pub inbox: Arc<Inbox>,
    /// The completions and releases this root owes the store, for the courier to land
    /// should this worker stay idle.
    pub ledger: Arc<Ledger>,
    /// The event the root is taking now.
    current: RefCell<Option<StreamEvent>>,
    /// The shared queues this root registered, and its context id: removed with it.
    queues: RefCell<Vec<u32>>,
    context_id: u32,
}

impl Drop for RootStreams {
    fn drop(&mut self) {
        for id in self.queues.take() {
            crate::queues::unregister(id);
        }
        crate::worker::forget_root(self.context_id);
    }
}

fn no_event(what: &str) -> HostError {
    HostError(format!("no store stream {what} is being delivered"))
}

impl RootStreams {
    /// The store streams of the root `context_id` (forgotten as worker state when it goes).
    pub fn new(courier: Arc<Courier>, context_id: u32) -> RootStreams {
        let ledger = Arc::new(Ledger::default());
        courier.handoff.adopt(Arc::clone(&ledger));
        RootStreams {
            courier,
            ledger,
            inbox: Arc::new(Inbox::default()),
            current: RefCell::new(None),
            queues: RefCell::new(Vec::new()),
            context_id,
        }
    }

    /// `id` is a queue of this root's.
    pub fn owns_queue(&self, id: u32) {
        let mut queues = self.queues.borrow_mut();
        if !queues.contains(&id) {
            queues.push(id);
        }
    }

    pub fn open(
        &self,
        target: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError> {
        let (cluster, authority) = grpc_service_target(target);
        let target = StreamTarget {
            cluster,
            authority,
            path: format!("/{service}/{method}"),
            metadata: metadata
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
                .collect(),
        };
        self.courier.open(&self.inbox, target).map_err(HostError)
    }

    pub fn send(&self, token: u32, message: &[u8]) -> Result<(), HostError> {
        self.courier.send(token, message).map_err(HostError)
    }

    pub fn close(&self, token: u32, reset: bool) -> Result<(), HostError> {
        self.courier.close(token, reset).map_err(HostError)
    }

    /// Runs `deliver` with `event` as the one being delivered.
    pub fn delivering<T>(&self, event: StreamEvent, deliver: impl FnOnce(&StreamEvent) -> T) -> T {
        let copy = event.clone();
        self.current.replace(Some(event));
        let answer = deliver(&copy);
        self.current.replace(None);
        answer
    }

    pub fn initial_metadata(&self) -> Result<HeaderPairs, HostError> {
        match &*self.current.borrow() {
            Some(StreamEvent::InitialMetadata { headers, .. }) => Ok(headers.clone()),
            _ => Err(no_event("metadata")),
        }
    }

    pub fn message(&self, size: usize) -> Result<Vec<u8>, HostError> {
        match &*self.current.borrow() {
            Some(StreamEvent::Message { message, .. }) => {
                Ok(message.get(..size).unwrap_or(message).to_vec())
            }
            _ => Err(no_event("message")),
        }
    }
}

/// Link.rs names the stream's target as Envoy's `GrpcService` message (field 1, `envoy_grpc`:
/// cluster name 1, authority 2) passed as text, or a bare cluster name when that would not be
/// text. Gives (cluster, authority); the authority defaults to the cluster name.
fn grpc_service_target(target: &str) -> (String, String) {
    let bytes = target.as_bytes();
    let parsed = field(bytes, 1).and_then(|envoy_grpc| {
        let cluster = field(envoy_grpc, 1)?;
        let authority = field(envoy_grpc, 2).unwrap_or(cluster);
        Some((text(cluster)?, text(authority)?))
    });
    match parsed {
        Some((cluster, authority)) if !cluster.is_empty() => {
            let authority = if authority.is_empty() {
                cluster.clone()
            } else {
                authority
            };
            (cluster, authority)
        }
        _ => (target.to_owned(), target.to_owned()),
    }
}

fn text(bytes: &[u8]) -> Option<String> {
    std::str::from_utf8(bytes).ok().map(str::to_owned)
}

/// The first length-delimited field `number` of a protobuf message made only of
/// length-delimited fields with one-byte tags and lengths below 128 (what link.rs writes);
/// None for anything else.
fn field(message: &[u8], number: u8) -> Option<&[u8]> {
    let mut rest = message;
    // Bounded: each pass consumes at least two bytes.
    while let [tag, len, tail @ ..] = rest {
        if *len >= 0x80 || tag & 0x07 != 2 {
            return None;
        }
        let len = usize::from(*len);
        let value = tail.get(..len)?;
        if tag >> 3 == number {
            return Some(value);
        }
        rest = tail.get(len..)?;
    }
    None
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use idempotency_protocol::stream::envoy_grpc_service;

    #[test]
    fn the_target_gives_cluster_and_authority_or_the_bare_name() {
        let service = envoy_grpc_service("store", "idempotency-store");
        let text = std::str::from_utf8(&service).unwrap();
        assert_eq!(
            grpc_service_target(text),
            ("store".to_owned(), "idempotency-store".to_owned())
        );
        let istio = "outbound|8081||idempotency-store.idempotency.svc.cluster.local";
        let service = envoy_grpc_service(istio, "");
        let text = std::str::from_utf8(&service).unwrap();
        assert_eq!(
            grpc_service_target(text),
            (istio.to_owned(), istio.to_owned())
        );
        assert_eq!(
            grpc_service_target("plain_cluster"),
            ("plain_cluster".to_owned(), "plain_cluster".to_owned())
        );
    }

    #[test]
    fn host_reads_answer_from_the_event_being_delivered_only() {
        let streams = RootStreams::new(Courier::for_tests(), 0);
        assert!(streams.message(10).is_err() && streams.initial_metadata().is_err());
        let message = StreamEvent::Message {
            token: 1,
            message: b"answer".to_vec(),
        };
        let read = streams.delivering(message, |_| streams.message(3));
        assert_eq!(read.unwrap(), b"ans".to_vec());
        let headers = vec![("x".to_owned(), b"1".to_vec())];
        let metadata = StreamEvent::InitialMetadata {
            token: 1,
            headers: headers.clone(),
        };
        let read = streams.delivering(metadata, |_| {
            (streams.initial_metadata(), streams.message(1).is_err())
        });
        assert_eq!(read, (Ok(headers), true));
        assert!(streams.message(10).is_err(), "nothing once delivered");
    }
}
