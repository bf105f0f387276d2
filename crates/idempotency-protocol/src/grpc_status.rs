//! gRPC status codes: their names, where a response carries its status, and which statuses
//! release a claim.

pub const OK: u32 = 0;
pub const CANCELLED: u32 = 1;
pub const UNKNOWN: u32 = 2;
pub const INVALID_ARGUMENT: u32 = 3;
pub const DEADLINE_EXCEEDED: u32 = 4;
pub const NOT_FOUND: u32 = 5;
pub const FAILED_PRECONDITION: u32 = 9;
pub const ABORTED: u32 = 10;
pub const RESOURCE_EXHAUSTED: u32 = 8;
pub const INTERNAL: u32 = 13;
pub const UNAVAILABLE: u32 = 14;
pub const UNAUTHENTICATED: u32 = 16;

/// The canonical names, indexed by code (0 to 16).
const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// Statuses that say the call did not take effect and a retry may run it: the server was
/// unreachable or overloaded, the call was aborted (a concurrency conflict), or it failed
/// inside the server before it could tell more.
pub fn default_release_codes() -> Vec<u32> {
    vec![UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNKNOWN]
}

/// [`default_release_codes`] by name, as `grpc.release_on_status` takes them.
pub fn default_release() -> Vec<String> {
    default_release_codes().into_iter().map(name).collect()
}

/// A code's canonical name ("CODE_17" beyond the known ones).
pub fn name(code: u32) -> String {
    match usize::try_from(code).ok().and_then(|i| NAMES.get(i)) {
        Some(n) => (*n).to_string(),
        None => format!("CODE_{code}"),
    }
}

/// Parses `"UNAVAILABLE"`, `"unavailable"` or `"14"`.
pub fn parse(entry: &str) -> Result<u32, String> {
    let e = entry.trim();
    if let Ok(code) = e.parse::<u32>() {
        if code <= 16 {
            return Ok(code);
        }
    }
    NAMES
        .iter()
        .position(|n| n.eq_ignore_ascii_case(e))
        .and_then(|i| u32::try_from(i).ok())
        .ok_or_else(|| {
            format!("'{entry}' is not a gRPC status code (a name like \"UNAVAILABLE\" or 0 to 16)")
        })
}

/// The `grpc-status` in a header map (trailers, or the headers of a trailers-only response).
/// Some(None) when it is there but not a number, which a client reads as UNKNOWN.
pub fn status_in(headers: &[(String, Vec<u8>)]) -> Option<Option<u32>> {
    headers
        .iter()
        .find(|(n, _)| n == "grpc-status")
        .map(|(_, v)| {
            std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse().ok())
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn names_and_numbers_parse_and_unknown_ones_are_refused() {
        assert_eq!(parse("UNAVAILABLE"), Ok(UNAVAILABLE));
        assert_eq!(parse(" aborted "), Ok(ABORTED));
        assert_eq!(parse("8"), Ok(RESOURCE_EXHAUSTED));
        assert!(parse("17").is_err() && parse("UNAVAIL").is_err() && parse("").is_err());
        assert_eq!(name(14), "UNAVAILABLE");
        assert_eq!(name(99), "CODE_99");
        for n in default_release() {
            assert!(parse(&n).is_ok());
        }
    }

    #[test]
    fn the_status_is_found_or_said_unreadable() {
        let h = |v: &[u8]| vec![("grpc-status".to_string(), v.to_vec())];
        assert_eq!(status_in(&h(b"14")), Some(Some(14)));
        assert_eq!(status_in(&h(b"x")), Some(None));
        assert_eq!(status_in(&[]), None);
    }
}
