//! gRPC's length-prefixed messages (a 1-byte compressed flag, a 4-byte big-endian length,
//! the message), as they arrive in a request or a response body. Only counted and checked
//! here: the messages themselves stay opaque bytes.

/// What a body holds, read as gRPC messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// This many whole messages and nothing else (0: an empty body).
    Messages(usize),
    /// The last message is cut short: more bytes are to come, or the body is malformed.
    Partial,
    /// A compressed flag other than 0 or 1.
    Malformed,
}

/// The length of a frame's prefix.
pub const PREFIX_BYTES: usize = 5;

/// The whole length (prefix included) of the frame that starts `bytes`: None before its
/// prefix is there, Err for a compressed flag that is neither 0 nor 1.
pub fn frame_len(bytes: &[u8]) -> Option<Result<usize, ()>> {
    let prefix = bytes.get(..PREFIX_BYTES)?;
    let (flag, len) = prefix.split_first()?;
    if *flag > 1 {
        return Some(Err(()));
    }
    let len = <[u8; 4]>::try_from(len).ok()?;
    let len = usize::try_from(u32::from_be_bytes(len)).ok()?;
    Some(Ok(len.saturating_add(PREFIX_BYTES)))
}

/// Reads `body` as a sequence of messages.
pub fn framing(body: &[u8]) -> Framing {
    let mut rest = body;
    let mut count = 0usize;
    while !rest.is_empty() {
        match frame_len(rest) {
            None => return Framing::Partial,
            Some(Err(())) => return Framing::Malformed,
            Some(Ok(len)) => match rest.get(len..) {
                Some(after) => {
                    rest = after;
                    count += 1;
                }
                None => return Framing::Partial,
            },
        }
    }
    Framing::Messages(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn frame(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    #[test]
    fn unary_streaming_partial_and_malformed_bodies_are_told_apart() {
        let one = frame(0, b"\x0a\x03abc");
        assert_eq!(framing(&one), Framing::Messages(1));
        assert_eq!(framing(&frame(0, b"")), Framing::Messages(1));
        assert_eq!(framing(&frame(1, b"zz")), Framing::Messages(1));
        let mut two = one.clone();
        two.extend_from_slice(&frame(0, b"x"));
        assert_eq!(framing(&two), Framing::Messages(2));
        assert_eq!(framing(b""), Framing::Messages(0));
        for cut in 1..one.len() {
            assert_eq!(framing(&one[..cut]), Framing::Partial, "cut at {cut}");
        }
        assert_eq!(framing(&frame(2, b"a")), Framing::Malformed);
        // A length near u32::MAX is only ever partial, never an overflow.
        assert_eq!(framing(&[0, 255, 255, 255, 255, 1]), Framing::Partial);
        assert_eq!(frame_len(&one), Some(Ok(one.len())));
        assert_eq!(frame_len(&one[..4]), None);
    }
}
