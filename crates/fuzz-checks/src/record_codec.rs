//! The recorded response (`idempotency_protocol::record::RecordedResponse`), read back from
//! shared data and from the store.

use arbitrary::{Result, Unstructured};
use idempotency_protocol::record::RecordedResponse;

/// Offset of the flags byte: after the magic, the owner and the status.
const FLAGS_AT: usize = 4 + 8 + 2;
/// The flags the format uses: body omitted, outcome unknown, trailers.
const USED_FLAGS: u8 = 0b111;

/// Any bytes that decode are the one encoding of what they decode to (but for the unused
/// bits of the flags byte), and the replay check refuses exactly the headers and trailers a
/// response could not carry. Any record within the format's limits (up to 65,535 headers with names
/// of up to 65,535 bytes, values and body of up to 4 GiB) decodes to itself, and no cut or
/// padded encoding decodes.
pub fn record_codec(data: &[u8]) {
    raw(data);
    let _ = built(&mut Unstructured::new(data));
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn raw(data: &[u8]) {
    let Some(record) = RecordedResponse::decode(data) else {
        return;
    };
    let mut canonical = data.to_vec();
    canonical[FLAGS_AT] &= USED_FLAGS;
    assert_eq!(record.encode(), canonical);
    // Trailers are replayed as headers are (a gRPC response's), so they are checked alike.
    let replayable = record
        .headers
        .iter()
        .chain(&record.trailers)
        .all(|(name, value)| {
            !name.is_empty()
                && name.bytes().all(is_tchar)
                && !value.iter().any(|b| matches!(b, b'\r' | b'\n' | 0))
        });
    assert_eq!(
        record.check_headers().is_ok(),
        replayable,
        "{:?}",
        record.headers
    );
}

fn built(u: &mut Unstructured<'_>) -> Result<()> {
    let mut headers: Vec<(String, Vec<u8>)> = u.arbitrary()?;
    // Now and then one header value or the body far longer than the fuzzer's inputs, to
    // reach the format's length fields beyond 16 bits.
    let long = u.int_in_range(0..=140_000_usize)?;
    let mut body: Vec<u8> = u.arbitrary()?;
    match (u.int_in_range(0..=3_u8)?, headers.first_mut()) {
        (0, Some((_, value))) => value.resize(value.len() + long, b'v'),
        (1, _) => body.resize(body.len() + long, b'b'),
        _ => {}
    }
    let record = RecordedResponse {
        owner: u.arbitrary()?,
        status: u.arbitrary()?,
        headers,
        body,
        trailers: u.arbitrary()?,
        body_omitted: u.arbitrary()?,
        unknown: crate::gen::unknown_outcome(u)?,
    };
    let encoded = record.encode();
    // A summary, not the values: they may be hundreds of kilobytes.
    assert!(
        RecordedResponse::decode(&encoded).as_ref() == Some(&record),
        "a record of {} headers (values of {:?} bytes) and a {}-byte body",
        record.headers.len(),
        record
            .headers
            .iter()
            .map(|(_, v)| v.len())
            .collect::<Vec<_>>(),
        record.body.len()
    );
    for _ in 0..3 {
        let cut = u.int_in_range(0..=encoded.len() - 1)?;
        assert_eq!(
            RecordedResponse::decode(&encoded[..cut]),
            None,
            "cut at {cut}"
        );
    }
    let padded = [&encoded[..], &[u.arbitrary()?]].concat();
    assert_eq!(RecordedResponse::decode(&padded), None);
    Ok(())
}
