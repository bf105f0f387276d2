//! The far end of a replay's hop (`grpc_replay_echo: true`, on an internal listener): it
//! answers each hop with the body the hop carried, the recorded messages, as a response
//! the filter that sent the hop turns back into the recorded gRPC response. It keeps no
//! state and reaches no service; anything but a hop gets a 404.

use super::{Event, Verdict};
use crate::grpc::{ECHO_MARKER, REPLAY_PATH};
use crate::host::Host;

/// One step of the echo for one request.
pub fn on(host: &impl Host, event: Event) -> Verdict {
    match event {
        Event::RequestHeaders { end_of_stream } => {
            let is_hop = host
                .request_headers()
                .map(|h| {
                    h.iter()
                        .any(|(n, v)| n == ":path" && v == REPLAY_PATH.as_bytes())
                })
                .unwrap_or(false);
            if !is_hop {
                return reply(host, 404, b"not a replay hop");
            }
            if end_of_stream {
                return answer(host, Vec::new());
            }
            Verdict::Pause
        }
        Event::RequestBody {
            end_of_stream: false,
            ..
        } => Verdict::Pause,
        Event::RequestBody {
            size,
            end_of_stream: true,
        } => answer_with_body(host, size),
        Event::RequestTrailers => answer_with_body(host, usize::MAX),
        _ => Verdict::Continue,
    }
}

/// The hop's body is complete (its end, or trailers): it goes back as the answer.
fn answer_with_body(host: &impl Host, size: usize) -> Verdict {
    match host.request_body(size) {
        Ok(body) => answer(host, body),
        Err(e) => {
            log::error!("replay echo: hop body unreadable: {}", e.0);
            reply(host, 503, b"hop body unreadable")
        }
    }
}

fn answer(host: &impl Host, body: Vec<u8>) -> Verdict {
    let headers: [(&str, &[u8]); 2] = [("content-type", b"application/grpc"), (ECHO_MARKER, b"1")];
    if let Err(e) = host.send_local_reply(200, &headers, &body) {
        log::error!("replay echo: answer refused by the host: {}", e.0);
    }
    Verdict::Pause
}

fn reply(host: &impl Host, status: u16, text: &[u8]) -> Verdict {
    let headers: [(&str, &[u8]); 1] = [("content-type", b"text/plain")];
    if let Err(e) = host.send_local_reply(status, &headers, text) {
        log::error!("replay echo: {status} refused by the host: {}", e.0);
    }
    Verdict::Pause
}
