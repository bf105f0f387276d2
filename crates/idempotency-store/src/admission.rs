//! Connections that have not authenticated yet, and the room they may take.
//!
//! The store takes a connection before it knows who is calling: a filter's connection shows
//! its token in its first request (the gRPC stream's metadata, or a `/v1` request's header),
//! microseconds after it is accepted, but a peer that never sends one (a scanner, a
//! misbehaving client, someone holding connections on purpose) would otherwise keep its slot
//! for the whole idle timeout. So until a request on it has passed a route's token check, a
//! connection is *waiting*:
//!
//! * it has `--unauthenticated-timeout-secs` from its opening to authenticate, then it is
//!   closed (`/healthz` and `/metrics` answer without a token, on such connections);
//! * at most `--max-unauthenticated-connections` wait at once, and at most
//!   `--max-unauthenticated-connections-per-peer` from one IP address. A new connection over
//!   either limit is still taken: the oldest waiting connection (of that peer, for the
//!   per-peer limit) is closed to make room. Newcomers are never turned away, so a peer that
//!   holds connections cannot keep a filter from connecting; the rest of
//!   `--max-connections` is kept for authenticated connections.
//!
//! A connection that authenticated is served like before (idle timeout, keepalive).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio_util::sync::CancellationToken;

use crate::metrics::{ConnectionMetrics, ConnectionState, WaitingClosed};

/// The waiting connections of one listener.
pub(crate) struct Gate {
    max_waiting: usize,
    max_waiting_per_peer: usize,
    book: Mutex<Book>,
    metrics: ConnectionMetrics,
}

/// Waiting connections by age (ids grow with each admission), and by peer.
#[derive(Default)]
struct Book {
    next_id: u64,
    waiting: BTreeMap<u64, Waiting>,
    by_peer: HashMap<IpAddr, BTreeSet<u64>>,
}

struct Waiting {
    peer: IpAddr,
    /// Cancelled when the connection is evicted: its task drops it at once.
    evicted: CancellationToken,
}

impl Book {
    /// Takes `id` out of the book; false if it was not there (authenticated, evicted or
    /// expired already).
    fn remove(&mut self, id: u64) -> Option<Waiting> {
        let waiting = self.waiting.remove(&id)?;
        if let Some(ids) = self.by_peer.get_mut(&waiting.peer) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_peer.remove(&waiting.peer);
            }
        }
        Some(waiting)
    }

    fn oldest_of(&self, peer: &IpAddr) -> Option<u64> {
        self.by_peer.get(peer)?.first().copied()
    }

    fn oldest(&self) -> Option<u64> {
        self.waiting.keys().next().copied()
    }
}

impl Gate {
    /// A gate letting `max_waiting` connections wait at once, `max_waiting_per_peer` of them
    /// from one address (both at least 1).
    pub(crate) fn new(
        max_waiting: usize,
        max_waiting_per_peer: usize,
        metrics: ConnectionMetrics,
    ) -> Arc<Self> {
        let max_waiting = max_waiting.max(1);
        Arc::new(Self {
            max_waiting,
            max_waiting_per_peer: max_waiting_per_peer.clamp(1, max_waiting),
            book: Mutex::new(Book::default()),
            metrics,
        })
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        // Nothing panics while holding it; and a poisoned book is still a consistent one.
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a new connection from `peer` as waiting, closing the oldest waiting connection
    /// (that peer's first) if it would go over a limit.
    pub(crate) fn admit(self: &Arc<Self>, peer: IpAddr) -> ConnectionAuth {
        let peer = peer.to_canonical();
        let evicted = CancellationToken::new();
        let id = {
            let mut book = self.book();
            if book.by_peer.get(&peer).map_or(0, BTreeSet::len) >= self.max_waiting_per_peer {
                if let Some(oldest) = book.oldest_of(&peer) {
                    self.evict(&mut book, oldest, WaitingClosed::PeerLimit);
                }
            }
            if book.waiting.len() >= self.max_waiting {
                if let Some(oldest) = book.oldest() {
                    self.evict(&mut book, oldest, WaitingClosed::Evicted);
                }
            }
            let id = book.next_id;
            book.next_id = book.next_id.wrapping_add(1);
            book.waiting.insert(
                id,
                Waiting {
                    peer,
                    evicted: evicted.clone(),
                },
            );
            book.by_peer.entry(peer).or_default().insert(id);
            id
        };
        self.metrics.opened(ConnectionState::Unauthenticated);
        ConnectionAuth(Arc::new(Ticket {
            id,
            gate: Arc::clone(self),
            authenticated: AtomicBool::new(false),
            evicted,
        }))
    }

    fn evict(&self, book: &mut Book, id: u64, why: WaitingClosed) {
        if let Some(waiting) = book.remove(id) {
            waiting.evicted.cancel();
            self.metrics.closed(ConnectionState::Unauthenticated);
            self.metrics.waiting_closed(why);
        }
    }

    /// Connections waiting now.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.book().waiting.len()
    }
}

/// One connection's standing, shared by its task and (as a request extension) by every
/// request on it, so that a route that checked the token can mark the connection.
#[derive(Clone)]
pub struct ConnectionAuth(Arc<Ticket>);

struct Ticket {
    id: u64,
    gate: Arc<Gate>,
    /// Set, under the gate's lock, once a request on the connection passed a token check.
    authenticated: AtomicBool,
    evicted: CancellationToken,
}

impl ConnectionAuth {
    /// A request on this connection passed a route's token check: the connection no longer
    /// waits. Cheap once done (every request of an authenticated connection calls it).
    pub fn authenticated(&self) {
        let ticket = &self.0;
        if ticket.authenticated.load(Ordering::Acquire) {
            return;
        }
        let gate = &ticket.gate;
        let mut book = gate.book();
        // Evicted or expired meanwhile: it is closing, and stays counted as it was.
        if book.remove(ticket.id).is_some() {
            ticket.authenticated.store(true, Ordering::Release);
            drop(book);
            gate.metrics.closed(ConnectionState::Unauthenticated);
            gate.metrics.opened(ConnectionState::Authenticated);
        }
    }

    pub fn is_authenticated(&self) -> bool {
        self.0.authenticated.load(Ordering::Acquire)
    }

    /// Resolves when the connection was closed to make room for a newer one.
    pub(crate) async fn evicted(&self) {
        self.0.evicted.cancelled().await;
    }

    /// The connection's time to authenticate ran out: it leaves the waiting ones (and is to
    /// be closed) unless it authenticated just now; answers whether it left.
    pub(crate) fn expire(&self) -> bool {
        let ticket = &self.0;
        let gate = &ticket.gate;
        let left = gate.book().remove(ticket.id).is_some();
        if left {
            gate.metrics.closed(ConnectionState::Unauthenticated);
            gate.metrics.waiting_closed(WaitingClosed::Timeout);
        }
        left
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let gate = &self.gate;
        let mut book = gate.book();
        if self.authenticated.load(Ordering::Acquire) {
            drop(book);
            gate.metrics.closed(ConnectionState::Authenticated);
        } else if book.remove(self.id).is_some() {
            drop(book);
            gate.metrics.closed(ConnectionState::Unauthenticated);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn is_evicted(c: &ConnectionAuth) -> bool {
        c.0.evicted.is_cancelled()
    }

    #[test]
    fn newcomers_push_out_the_oldest_waiting_connection() {
        let metrics = Metrics::new();
        let gate = Gate::new(3, 3, metrics.connections());
        let first: Vec<_> = (1..=3).map(|i| gate.admit(ip(i))).collect();
        assert_eq!(gate.waiting(), 3);
        let fourth = gate.admit(ip(4));
        assert!(is_evicted(&first[0]));
        assert!(!is_evicted(&first[1]) && !is_evicted(&first[2]) && !is_evicted(&fourth));
        assert_eq!(gate.waiting(), 3);
        // Authenticated connections leave the waiting ones and are never evicted.
        first[1].authenticated();
        first[1].authenticated();
        assert!(first[1].is_authenticated());
        let more: Vec<_> = (5..=7).map(|i| gate.admit(ip(i))).collect();
        assert!(!is_evicted(&first[1]));
        assert!(is_evicted(&first[2]) && is_evicted(&fourth));
        assert_eq!(gate.waiting(), 3);
        let text = metrics.encode().unwrap();
        assert!(
            text.contains("idempotency_store_connections{state=\"authenticated\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("idempotency_store_connections{state=\"unauthenticated\"} 3"),
            "{text}"
        );
        assert!(
            text.contains(
                "idempotency_store_unauthenticated_connections_closed_total{reason=\"evicted\"} 3"
            ),
            "{text}"
        );
        drop(more);
        drop(first);
        drop(fourth);
        let text = metrics.encode().unwrap();
        assert!(
            text.contains("idempotency_store_connections{state=\"authenticated\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("idempotency_store_connections{state=\"unauthenticated\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn a_peer_over_its_share_pushes_out_its_own_oldest() {
        let metrics = Metrics::new();
        let gate = Gate::new(10, 2, metrics.connections());
        let other = gate.admit(ip(9));
        let a = gate.admit(ip(1));
        let b = gate.admit(ip(1));
        let c = gate.admit(ip(1));
        assert!(is_evicted(&a) && !is_evicted(&b) && !is_evicted(&c));
        assert!(!is_evicted(&other), "another peer's connection stays");
        // IPv4 and IPv4-mapped IPv6 are one peer.
        let d = gate.admit("::ffff:10.0.0.1".parse().unwrap());
        assert!(is_evicted(&b) && !is_evicted(&d));
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(
                "idempotency_store_unauthenticated_connections_closed_total{reason=\"peer_limit\"} 2"
            ),
            "{text}"
        );
    }

    #[test]
    fn an_expired_connection_leaves_once_and_not_after_authenticating() {
        let metrics = Metrics::new();
        let gate = Gate::new(4, 4, metrics.connections());
        let slow = gate.admit(ip(1));
        assert!(slow.expire());
        assert!(!slow.expire());
        // Gone from the book: authenticating now changes nothing.
        slow.authenticated();
        assert!(!slow.is_authenticated());
        let fast = gate.admit(ip(1));
        fast.authenticated();
        assert!(!fast.expire());
        assert_eq!(gate.waiting(), 0);
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(
                "idempotency_store_unauthenticated_connections_closed_total{reason=\"timeout\"} 1"
            ),
            "{text}"
        );
    }
}
