//! What the store thread's streams share, the roots' (courier.rs) and the handoff's
//! (handoff.rs): where a stream goes, the calls that carry them, what the store's side of a
//! stream does, gRPC framing.

use idempotency_core::grpc::frame::PREFIX_BYTES;

/// Where a root's store stream goes, as link.rs names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamTarget {
    pub cluster: String,
    pub authority: String,
    /// `/<service>/<method>`.
    pub path: String,
    pub metadata: Vec<(String, Vec<u8>)>,
}

impl StreamTarget {
    /// Starts a gRPC stream to this target; its id.
    pub fn start(&self, calls: &impl StreamCalls) -> Result<u64, String> {
        let headers = self.headers();
        let headers: Vec<(&str, &[u8])> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        calls.start(&self.cluster, &headers)
    }

    /// The request headers of a gRPC stream to this target.
    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        let mut headers: Vec<(String, Vec<u8>)> = [
            (":method", b"POST".as_slice()),
            (":path", self.path.as_bytes()),
            (":authority", self.authority.as_bytes()),
            (":scheme", b"http"),
            ("content-type", b"application/grpc"),
            ("te", b"trailers"),
        ]
        .iter()
        .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
        .collect();
        headers.extend(self.metadata.iter().cloned());
        headers
    }
}

/// The store thread's stream calls (a trait so the courier's rules are tested without a
/// store).
pub trait StreamCalls {
    fn start(&self, cluster: &str, headers: &[(&str, &[u8])]) -> Result<u64, String>;
    fn send(&self, stream_id: u64, data: &[u8], end_stream: bool) -> bool;
    fn reset(&self, stream_id: u64);
}

/// What the store's side of a stream did, as the transport reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireEvent {
    Headers {
        headers: Vec<(String, Vec<u8>)>,
        end_stream: bool,
    },
    Data {
        data: Vec<u8>,
        end_stream: bool,
    },
    Trailers(Vec<(String, Vec<u8>)>),
    /// Both directions ended.
    Complete,
    /// Reset, refused, or broken.
    Reset,
}

/// The largest frame either store stream reassembles: the store's announced limit is taken
/// up to 16 MiB (link.rs), and an answer carries at most one recorded response of that size
/// plus its envelope. A length prefix over this is garbage: the stream is closed, rather than
/// the store thread buffering whatever follows (up to 4 GiB per stream).
pub const MAX_FRAME_BYTES: usize = 32 * 1024 * 1024;

/// A message as gRPC frames it: uncompressed, 4-byte big-endian length, the bytes.
pub fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(message.len() + PREFIX_BYTES);
    frame.push(0);
    frame.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    frame.extend_from_slice(message);
    frame
}

/// Tests run a courier with these in place of the store thread's connections: each stream
/// started and each send is recorded, on the test's own thread.
#[cfg(test)]
pub mod recorded {
    use std::cell::RefCell;

    thread_local! {
        static STARTED: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
        static SENT: RefCell<Vec<(u64, Vec<u8>, bool)>> = const { RefCell::new(Vec::new()) };
    }

    /// The store thread's calls, recorded (ids count from 1 on each thread).
    pub struct Recorded;

    impl super::StreamCalls for Recorded {
        fn start(&self, cluster: &str, _headers: &[(&str, &[u8])]) -> Result<u64, String> {
            STARTED.with(|started| {
                let mut started = started.borrow_mut();
                started.push(cluster.to_owned());
                Ok(started.len() as u64)
            })
        }
        fn send(&self, stream_id: u64, data: &[u8], end_stream: bool) -> bool {
            SENT.with(|sent| {
                sent.borrow_mut()
                    .push((stream_id, data.to_vec(), end_stream))
            });
            true
        }
        fn reset(&self, _stream_id: u64) {}
    }

    /// What was sent on this thread so far: stream id, data, end of stream.
    pub fn sent() -> Vec<(u64, Vec<u8>, bool)> {
        SENT.with(|sent| sent.borrow().clone())
    }

    /// Forgets what this thread recorded (a test's start).
    pub fn clear() {
        STARTED.with(|started| started.borrow_mut().clear());
        SENT.with(|sent| sent.borrow_mut().clear());
    }
}
