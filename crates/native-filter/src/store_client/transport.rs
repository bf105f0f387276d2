//! The store thread's connections: gRPC streams to a store's `host:port`, over HTTP/2
//! cleartext, each connection shared by up to 100 streams and the name resolved again whenever
//! one is made. What the store says goes back to the courier that asked
//! (its roots' inboxes, or its handoff) as `WireEvent`s.
//!
//! Everything here runs on the store thread (a current-thread runtime): a courier's `run` and
//! the tasks that deliver events never overlap, as the main thread's hooks never did.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::task::AbortHandle;

use super::StoreTraffic;
use crate::store_streams::StreamCalls;
use crate::store_streams::WireEvent;

/// A connection that cannot be made within this is reported as a reset stream (core's calls
/// have their own, shorter, timeouts and give up first).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection whose store stops answering pings is closed, so its streams fail instead of
/// waiting on a peer that is gone (a black-holed address keeps the socket open).
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(10);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Streams one connection carries at most: a store (hyper's server) takes 200 at once by
/// default and queues the rest, which would leave a root's stream, and so its renewals and
/// completions, waiting behind others. Past this a connection of its own is made.
const STREAMS_PER_CONNECTION: usize = 100;

type Headers = Vec<(String, Vec<u8>)>;

/// A request body fed by the courier's sends: each message as one data frame, then the end.
struct Feed(UnboundedReceiver<Option<Bytes>>);

impl Body for Feed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.0.poll_recv(cx) {
            Poll::Ready(Some(Some(data))) => Poll::Ready(Some(Ok(Frame::data(data)))),
            // Our side ended (None sent), or the stream's entry went (sender dropped).
            Poll::Ready(Some(None) | None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// One stream in progress: its feed, and the task that reads the store's side.
struct Open {
    feed: UnboundedSender<Option<Bytes>>,
    task: AbortHandle,
}

/// One connection to an address: made on first use and again after it breaks, shared by up
/// to `streams_per_connection` streams.
#[derive(Default)]
struct Connection {
    sender: tokio::sync::Mutex<Option<SendRequest<Feed>>>,
    streams: AtomicUsize,
}

/// A stream's place on a connection, given back when the stream's task ends (or is aborted).
struct Seat(Arc<Connection>);

impl Drop for Seat {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Default)]
struct State {
    connections: HashMap<String, Vec<Arc<Connection>>>,
    streams: HashMap<u64, Open>,
}

/// The store thread's connections and streams (one for the process).
pub struct Transport {
    state: Mutex<State>,
    next_id: AtomicU64,
    streams_per_connection: usize,
}

impl Default for Transport {
    fn default() -> Transport {
        Transport::with_streams_per_connection(STREAMS_PER_CONNECTION)
    }
}

fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Transport {
    fn with_streams_per_connection(streams_per_connection: usize) -> Transport {
        Transport {
            state: Mutex::new(State::default()),
            next_id: AtomicU64::new(0),
            streams_per_connection: streams_per_connection.max(1),
        }
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }

    /// A seat for one more stream on a connection to `address` with room for it.
    fn seat(&self, address: &str) -> Seat {
        let mut state = relock(&self.state);
        let connections = state.connections.entry(address.to_owned()).or_default();
        let roomy = connections
            .iter()
            .find(|c| c.streams.load(Ordering::Acquire) < self.streams_per_connection)
            .cloned();
        let connection = roomy.unwrap_or_else(|| {
            let made = Arc::new(Connection::default());
            connections.push(Arc::clone(&made));
            made
        });
        connection.streams.fetch_add(1, Ordering::AcqRel);
        Seat(connection)
    }

    /// The seat's connection to `address`, made (and the name resolved) if it has none.
    async fn connection(&self, seat: &Seat, address: &str) -> Result<SendRequest<Feed>, String> {
        let mut slot = seat.0.sender.lock().await;
        if let Some(sender) = slot.as_ref().filter(|s| !s.is_closed()) {
            return Ok(sender.clone());
        }
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(address))
            .await
            .map_err(|_| format!("no connection to the store at {address} within 5 s"))?
            .map_err(|e| format!("no connection to the store at {address}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEP_ALIVE_EVERY)
            .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| format!("HTTP/2 with the store at {address}: {e}"))?;
        let address = address.to_owned();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                log::debug!("store connection to {address} ended: {e}");
            }
        });
        *slot = Some(sender.clone());
        Ok(sender)
    }

    /// Forgets every connection and stream (the runtime they ran on is gone).
    pub fn forget_all(&self) {
        let mut state = relock(&self.state);
        state.connections.clear();
        for (_, open) in state.streams.drain() {
            open.task.abort();
        }
    }

    /// Resets every stream (the courier that owned them is done with).
    pub fn reset_all(&self, ids: impl IntoIterator<Item = u64>) {
        let mut state = relock(&self.state);
        for id in ids {
            if let Some(open) = state.streams.remove(&id) {
                open.task.abort();
            }
        }
    }
}

/// An `http::Request` from the header pairs core and the courier write (pseudo-headers
/// among them), to the store at `address`. An `:authority` that is not one (an Istio
/// cluster name that link.rs gives when the authority would not fit its target) is replaced
/// by the address the module dials.
fn request<B>(
    headers: &[(&str, &[u8])],
    address: &str,
    body: B,
) -> Result<hyper::Request<B>, String> {
    let pseudo = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    };
    let path = pseudo(":path").ok_or("no :path")?;
    let authority = pseudo(":authority")
        .filter(|a| a.parse::<hyper::http::uri::Authority>().is_ok())
        .unwrap_or(address);
    let mut builder = hyper::Request::builder()
        .method(pseudo(":method").unwrap_or("POST"))
        .uri(format!("http://{authority}{path}"));
    for (name, value) in headers.iter().filter(|(n, _)| !n.starts_with(':')) {
        builder = builder.header(*name, *value);
    }
    builder
        .body(body)
        .map_err(|e| format!("not a request: {e}"))
}

fn pairs(headers: &hyper::HeaderMap) -> Headers {
    headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

fn with_status(status: hyper::StatusCode, headers: &hyper::HeaderMap) -> Headers {
    let mut all = vec![(":status".to_owned(), status.as_str().as_bytes().to_vec())];
    all.extend(pairs(headers));
    all
}

/// One configuration's calls on the store thread: what its courier starts, sends and resets,
/// with the store of each cluster its configuration names.
pub struct Calls<'a> {
    pub transport: &'a Arc<Transport>,
    pub traffic: &'a Arc<dyn StoreTraffic>,
}

impl Calls<'_> {
    fn address(&self, cluster: &str) -> Result<String, String> {
        self.traffic.address_of(cluster).ok_or_else(|| {
            format!("store cluster {cluster} has no store.address for the native build to dial")
        })
    }
}

impl StreamCalls for Calls<'_> {
    fn start(&self, cluster: &str, headers: &[(&str, &[u8])]) -> Result<u64, String> {
        let address = self.address(cluster)?;
        let (feed, fed) = unbounded_channel();
        let request = request(headers, &address, Feed(fed))?;
        let id = self.transport.new_id();
        let (transport, courier) = (Arc::clone(self.transport), Arc::clone(self.traffic));
        let seat = self.transport.seat(&address);
        let task = tokio::spawn(async move {
            let event = |event| courier.on_stream_event(id, event);
            let response = match transport.connection(&seat, &address).await {
                Ok(mut sender) => sender
                    .send_request(request)
                    .await
                    .map_err(|e| e.to_string()),
                Err(why) => Err(why),
            };
            let response = match response {
                Ok(response) => response,
                Err(why) => {
                    log::warn!("store stream to {address} failed: {why}");
                    relock(&transport.state).streams.remove(&id);
                    return event(WireEvent::Reset);
                }
            };
            let (parts, mut body): (_, Incoming) = response.into_parts();
            let end_stream = body.is_end_stream();
            event(WireEvent::Headers {
                headers: with_status(parts.status, &parts.headers),
                end_stream,
            });
            if !end_stream {
                loop {
                    match body.frame().await {
                        Some(Ok(frame)) => match frame.into_data() {
                            Ok(data) => event(WireEvent::Data {
                                data: data.to_vec(),
                                end_stream: false,
                            }),
                            Err(frame) => {
                                let trailers = frame.into_trailers().ok().unwrap_or_default();
                                event(WireEvent::Trailers(pairs(&trailers)));
                                break;
                            }
                        },
                        Some(Err(_)) => {
                            event(WireEvent::Reset);
                            break;
                        }
                        None => {
                            event(WireEvent::Complete);
                            break;
                        }
                    }
                }
            }
            relock(&transport.state).streams.remove(&id);
        });
        // A panic in the stream's task (in the courier's event handling) would end it
        // without a word, leaving its root to wait on a stream nobody serves: it is reported
        // as a reset instead, so core fails its calls and opens another. An abort (the
        // stream reset on purpose) is not reported.
        let (watched, transport, courier) = (
            task.abort_handle(),
            Arc::clone(self.transport),
            Arc::clone(self.traffic),
        );
        relock(&self.transport.state).streams.insert(
            id,
            Open {
                feed,
                task: watched,
            },
        );
        // Detached: it ends with the stream's task.
        drop(tokio::spawn(async move {
            if task.await.is_err_and(|e| e.is_panic()) {
                log::error!("a store stream's task panicked; the stream is reset");
                relock(&transport.state).streams.remove(&id);
                courier.on_stream_event(id, WireEvent::Reset);
            }
        }));
        Ok(id)
    }

    fn send(&self, stream_id: u64, data: &[u8], end_stream: bool) -> bool {
        let state = relock(&self.transport.state);
        let Some(open) = state.streams.get(&stream_id) else {
            return false;
        };
        let mut sent =
            data.is_empty() || open.feed.send(Some(Bytes::copy_from_slice(data))).is_ok();
        if end_stream {
            sent &= open.feed.send(None).is_ok();
        }
        sent
    }

    fn reset(&self, stream_id: u64) {
        self.transport.reset_all([stream_id]);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    /// What the store thread reported, for one configuration that dials `address`.
    struct Recorder {
        address: String,
        events: Mutex<Vec<(u64, WireEvent)>>,
        /// The next headers event panics (once).
        panic_at_headers: std::sync::atomic::AtomicBool,
    }

    impl StoreTraffic for Recorder {
        fn address_of(&self, _cluster: &str) -> Option<String> {
            Some(self.address.clone())
        }
        fn run(&self, _calls: &Calls<'_>) {}
        fn is_done(&self) -> bool {
            false
        }
        fn stream_ids(&self) -> Vec<u64> {
            Vec::new()
        }
        fn on_stream_event(&self, id: u64, event: WireEvent) {
            let panics = matches!(event, WireEvent::Headers { .. })
                && self.panic_at_headers.swap(false, Ordering::AcqRel);
            relock(&self.events).push((id, event));
            assert!(
                !panics,
                "the courier panics at the stream's headers (as asked)"
            );
        }
        fn streams_lost(&self) {}
    }

    /// A response body that never ends: the store keeps the stream open.
    struct Open;

    impl Body for Open {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Pending
        }
    }

    /// A store whose connections take `streams` streams at once (the rest wait), each
    /// answered with its headers at once and kept open. Its address, the connections made,
    /// and each stream's `:authority`.
    async fn store(streams: u32) -> (String, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (connections, authorities) = (Arc::default(), Arc::default());
        let (made, seen): (Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) =
            (Arc::clone(&connections), Arc::clone(&authorities));
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                made.fetch_add(1, Ordering::AcqRel);
                let seen = Arc::clone(&seen);
                let service =
                    hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                        let authority = request.uri().authority().map(|a| a.to_string());
                        relock(&seen).push(authority.unwrap_or_default());
                        async { Ok::<_, Infallible>(hyper::Response::new(Open)) }
                    });
                tokio::spawn(
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .max_concurrent_streams(streams)
                        .serve_connection(TokioIo::new(tcp), service),
                );
            }
        });
        (address, connections, authorities)
    }

    fn headers_events(recorder: &Recorder) -> usize {
        relock(&recorder.events)
            .iter()
            .filter(|(_, e)| matches!(e, WireEvent::Headers { .. }))
            .count()
    }

    /// A store takes a bounded number of streams per connection and queues the rest: a root
    /// whose stream waited there could neither renew its leases nor complete its writes. Past
    /// its share a stream gets a connection of its own, and every stream is answered.
    #[test]
    fn streams_past_a_connections_share_get_a_connection_of_their_own() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (address, connections, authorities) = store(2).await;
            let transport = Arc::new(Transport::with_streams_per_connection(2));
            let recorder = Arc::new(Recorder {
                address: address.clone(),
                events: Mutex::default(),
                panic_at_headers: false.into(),
            });
            let traffic: Arc<dyn StoreTraffic> = recorder.clone();
            let calls = Calls {
                transport: &transport,
                traffic: &traffic,
            };
            // An Istio cluster name, as link.rs gives it when the authority would not fit.
            let authority = b"outbound|8081||idempotency-store.a-long-namespace.svc.cluster.local";
            let headers: [(&str, &[u8]); 3] = [
                (":method", b"POST"),
                (":path", b"/idempotency.store.v1.Store/Coordinate"),
                (":authority", authority),
            ];
            for _ in 0..3 {
                calls.start("store", &headers).unwrap();
            }
            for _ in 0..500 {
                if headers_events(&recorder) == 3 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(headers_events(&recorder), 3, "every stream answered");
            assert_eq!(connections.load(Ordering::Acquire), 2);
            assert_eq!(
                *relock(&authorities),
                vec![address.clone(), address.clone(), address],
                "an authority that is not one is the address dialled"
            );
        });
    }

    /// A panic in the courier's handling of a stream's event ends the stream's task: the
    /// stream is reported reset (its root fails its calls and opens another), not left open
    /// with nobody reading it.
    #[test]
    fn a_panic_handling_a_streams_event_is_reported_as_a_reset() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (address, _, _) = store(10).await;
            let transport = Arc::new(Transport::default());
            let recorder = Arc::new(Recorder {
                address,
                events: Mutex::default(),
                panic_at_headers: true.into(),
            });
            let traffic: Arc<dyn StoreTraffic> = recorder.clone();
            let calls = Calls {
                transport: &transport,
                traffic: &traffic,
            };
            let headers: [(&str, &[u8]); 2] = [
                (":method", b"POST"),
                (":path", b"/idempotency.store.v1.Store/Coordinate"),
            ];
            let id = calls.start("store", &headers).unwrap();
            let reset = || {
                relock(&recorder.events)
                    .iter()
                    .any(|(i, e)| *i == id && matches!(e, WireEvent::Reset))
            };
            for _ in 0..500 {
                if reset() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(reset(), "{:?}", relock(&recorder.events));
            assert!(!calls.send(id, b"more", false), "the stream is gone");
        });
    }
}
