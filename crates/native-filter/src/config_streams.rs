//! What the store thread's streams share, the roots' (courier.rs) and the handoff's
//! (handoff.rs): where a stream goes, the calls that carry them, gRPC framing.

use idempotency_core::grpc::frame::PREFIX_BYTES;

#[cfg(test)]
use crate::abi::MainThreadConfig;

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

/// The mocked ABI's configuration streams record what a courier starts and sends: tests run
/// a courier with them in place of the store thread's connections.
#[cfg(test)]
impl StreamCalls for MainThreadConfig {
    fn start(&self, cluster: &str, headers: &[(&str, &[u8])]) -> Result<u64, String> {
        // No timeout: the stream lives as long as the store keeps it (its calls have theirs).
        self.start_http_stream(cluster, headers, std::time::Duration::ZERO)
            .map_err(|e| e.to_string())
    }
    fn send(&self, stream_id: u64, data: &[u8], end_stream: bool) -> bool {
        self.send_stream_data(stream_id, data, end_stream)
    }
    fn reset(&self, stream_id: u64) {
        self.reset_stream(stream_id);
    }
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
