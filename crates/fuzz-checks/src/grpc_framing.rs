//! gRPC's length-prefixed messages (`idempotency_core::grpc::frame`), as a client sends them
//! in a request body and an upstream in a response: what decides whether a call is unary.

use arbitrary::{Result, Unstructured};
use idempotency_core::grpc::frame::{frame_len, framing, Framing, PREFIX_BYTES};

/// Any bytes read as frames agree with a plain walk over them (count, cut short, or a flag
/// that is neither 0 nor 1), and the first frame's length is what the walk finds. Any
/// sequence of well-formed frames counts as itself, and every cut inside it is partial.
pub fn grpc_framing(data: &[u8]) {
    assert_eq!(framing(data), reference(data), "{data:?}");
    if data.len() >= PREFIX_BYTES && data[0] <= 1 {
        let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
        assert_eq!(frame_len(data), Some(Ok(len + PREFIX_BYTES)));
    }
    let _ = built(&mut Unstructured::new(data));
}

fn reference(data: &[u8]) -> Framing {
    let mut at = 0usize;
    let mut count = 0usize;
    while at < data.len() {
        if data.len() - at < PREFIX_BYTES {
            return Framing::Partial;
        }
        if data[at] > 1 {
            return Framing::Malformed;
        }
        let len =
            u32::from_be_bytes([data[at + 1], data[at + 2], data[at + 3], data[at + 4]]) as usize;
        if data.len() - at - PREFIX_BYTES < len {
            return Framing::Partial;
        }
        at += PREFIX_BYTES + len;
        count += 1;
    }
    Framing::Messages(count)
}

fn built(u: &mut Unstructured<'_>) -> Result<()> {
    let messages: Vec<(bool, Vec<u8>)> = u.arbitrary()?;
    let mut body = Vec::new();
    for (compressed, message) in &messages {
        body.push(u8::from(*compressed));
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
    }
    assert_eq!(framing(&body), Framing::Messages(messages.len()));
    let mut boundaries = vec![0usize];
    for (_, message) in &messages {
        let last = *boundaries.last().unwrap_or(&0);
        boundaries.push(last + PREFIX_BYTES + message.len());
    }
    let cut = u.int_in_range(0..=body.len())?;
    let expected = match boundaries.iter().position(|b| *b == cut) {
        Some(whole) => Framing::Messages(whole),
        None => Framing::Partial,
    };
    assert_eq!(framing(&body[..cut]), expected, "cut at {cut} of {body:?}");
    Ok(())
}
