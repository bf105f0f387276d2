//! Envoy's response flags, as the legacy bit vector of `response.flags` numbers them: an
//! unknown outcome's record keeps them, and logs and the `record` command name them.

pub const FAILED_LOCAL_HEALTH_CHECK: u64 = 0x1;
pub const NO_HEALTHY_UPSTREAM: u64 = 0x2;
pub const UPSTREAM_REQUEST_TIMEOUT: u64 = 0x4;
pub const LOCAL_RESET: u64 = 0x8;
pub const UPSTREAM_REMOTE_RESET: u64 = 0x10;
pub const UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
pub const UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;
pub const UPSTREAM_OVERFLOW: u64 = 0x80;
pub const NO_ROUTE_FOUND: u64 = 0x100;
pub const UPSTREAM_RETRY_LIMIT_EXCEEDED: u64 = 0x8000;
pub const NO_CLUSTER_FOUND: u64 = 0x100_0000;
pub const DNS_RESOLUTION_FAILED: u64 = 0x400_0000;
pub const DROP_OVERLOAD: u64 = 0x800_0000;

/// Short names, as Envoy's access log prints them, in bit order.
pub const NAMES: [&str; 29] = [
    "LH", "UH", "UT", "LR", "UR", "UF", "UC", "UO", "NR", "DI", "FI", "RL", "UAEX", "RLSE", "DC",
    "URX", "SI", "IH", "DPE", "UMSDR", "RFCF", "NFCF", "DT", "UPE", "NC", "OM", "DF", "DO", "DR",
];

/// The flags as Envoy's access log prints them (`UT,URX`); `-` for none.
pub fn flag_names(flags: u64) -> String {
    let names: Vec<&str> = NAMES
        .iter()
        .enumerate()
        .filter(|(bit, _)| flags & (1u64 << bit) != 0)
        .map(|(_, name)| *name)
        .collect();
    if names.is_empty() {
        "-".to_string()
    } else {
        names.join(",")
    }
}
