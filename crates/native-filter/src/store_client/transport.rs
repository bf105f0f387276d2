//! The store thread's connections: gRPC streams to a store's `host:port`, over HTTP/2
//! cleartext, one connection per address shared by every stream and
//! resolved again whenever it is made. What the store says goes back to the courier that asked
//! (its roots' inboxes, or its handoff), as Envoy's configuration streams reported it.
//!
//! Everything here runs on the store thread (a current-thread runtime): a courier's `run` and
//! the tasks that deliver events never overlap, as the main thread's hooks never did.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::task::JoinHandle;

use super::StoreTraffic;
use crate::abi::ConfigStreamEvent;
use crate::config_streams::StreamCalls;

/// A connection that cannot be made within this is reported as a reset stream (core's calls
/// have their own, shorter, timeouts and give up first).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection whose store stops answering pings is closed, so its streams fail instead of
/// waiting on a peer that is gone (a black-holed address keeps the socket open).
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(10);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

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

type RequestBody = Feed;

/// One stream in progress: its feed, and the task that reads the store's side.
struct Open {
    feed: UnboundedSender<Option<Bytes>>,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct State {
    /// A connection per address, made on first use and again after it breaks.
    connections: HashMap<String, Arc<tokio::sync::Mutex<Option<SendRequest<RequestBody>>>>>,
    streams: HashMap<u64, Open>,
}

/// The store thread's connections and streams (one for the process).
#[derive(Default)]
pub struct Transport {
    state: Mutex<State>,
    next_id: AtomicU64,
}

fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Transport {
    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }

    /// The connection to `address`, made (and the name resolved) if there is none.
    async fn connection(&self, address: &str) -> Result<SendRequest<RequestBody>, String> {
        let slot = Arc::clone(
            relock(&self.state)
                .connections
                .entry(address.to_owned())
                .or_default(),
        );
        let mut slot = slot.lock().await;
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
/// among them).
fn request<B>(headers: &[(&str, &[u8])], body: B) -> Result<hyper::Request<B>, String> {
    let pseudo = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    };
    let authority = pseudo(":authority").unwrap_or("idempotency-store");
    let path = pseudo(":path").ok_or("no :path")?;
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
        let request = request(headers, Feed(fed))?;
        let id = self.transport.new_id();
        let (transport, courier) = (Arc::clone(self.transport), Arc::clone(self.traffic));
        let task = tokio::spawn(async move {
            let event = |event| courier.on_stream_event(id, event);
            let response = match transport.connection(&address).await {
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
                    return event(ConfigStreamEvent::Reset);
                }
            };
            let (parts, mut body): (_, Incoming) = response.into_parts();
            let end_stream = body.is_end_stream();
            event(ConfigStreamEvent::Headers {
                headers: with_status(parts.status, &parts.headers),
                end_stream,
            });
            if !end_stream {
                loop {
                    match body.frame().await {
                        Some(Ok(frame)) => match frame.into_data() {
                            Ok(data) => event(ConfigStreamEvent::Data {
                                data: data.to_vec(),
                                end_stream: false,
                            }),
                            Err(frame) => {
                                let trailers = frame.into_trailers().ok().unwrap_or_default();
                                event(ConfigStreamEvent::Trailers(pairs(&trailers)));
                                break;
                            }
                        },
                        Some(Err(_)) => {
                            event(ConfigStreamEvent::Reset);
                            break;
                        }
                        None => {
                            event(ConfigStreamEvent::Complete);
                            break;
                        }
                    }
                }
            }
            relock(&transport.state).streams.remove(&id);
        });
        relock(&self.transport.state)
            .streams
            .insert(id, Open { feed, task });
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
