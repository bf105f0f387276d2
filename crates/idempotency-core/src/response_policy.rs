//! What happens to an upstream response: whether it releases the claim, and which of its
//! headers a replay may carry.

/// Statuses that release the claim instead of being recorded, so a retry executes again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleasePolicy {
    /// Status classes released as a whole (4 for "4xx", 5 for "5xx").
    classes: Vec<u16>,
    statuses: Vec<u16>,
}

impl ReleasePolicy {
    /// Parses entries such as `"5xx"` or `"429"`.
    pub fn parse(entries: &[String]) -> Result<ReleasePolicy, String> {
        let mut classes = Vec::new();
        let mut statuses = Vec::new();
        for entry in entries {
            let e = entry.trim().to_ascii_lowercase();
            if let Some(class) = e.strip_suffix("xx") {
                match class.parse::<u16>() {
                    Ok(c @ 1..=5) => classes.push(c),
                    _ => return Err(format!("'{entry}' is not a status class like \"5xx\"")),
                }
            } else {
                match e.parse::<u16>() {
                    Ok(s @ 100..=599) => statuses.push(s),
                    _ => return Err(format!("'{entry}' is not a status between 100 and 599")),
                }
            }
        }
        Ok(ReleasePolicy { classes, statuses })
    }

    pub fn releases(&self, status: u16) -> bool {
        self.statuses.contains(&status) || self.classes.contains(&(status / 100))
    }
}

/// Response headers a replay must never carry, whatever the configuration says: they describe
/// one connection or one message framing, not the recorded response.
const ALWAYS_DROPPED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// Decides which recorded response headers are replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderFilter {
    exact: Vec<String>,
    prefixes: Vec<String>,
}

impl HeaderFilter {
    /// `skip` holds lower-case names, or prefixes ending in `*`.
    pub fn new(skip: &[String]) -> Result<HeaderFilter, String> {
        let mut exact = Vec::new();
        let mut prefixes = Vec::new();
        for name in skip {
            let lower = name.trim().to_ascii_lowercase();
            if lower.is_empty() || lower == "*" {
                return Err(format!("'{name}' is not a header name or prefix"));
            }
            match lower.strip_suffix('*') {
                Some(prefix) => prefixes.push(prefix.to_string()),
                None => exact.push(lower),
            }
        }
        Ok(HeaderFilter { exact, prefixes })
    }

    /// True when a header of this (lower-case) name may be recorded and replayed.
    pub fn keeps(&self, name: &str) -> bool {
        !(name.starts_with(':')
            || ALWAYS_DROPPED.contains(&name)
            || self.exact.iter().any(|e| e == name)
            || self.prefixes.iter().any(|p| name.starts_with(p.as_str())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::default_replay_skip_headers;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn release_policy_matches_classes_and_statuses() {
        let p = ReleasePolicy::parse(&["5xx".into(), "408".into(), "429".into()]).unwrap();
        assert!(p.releases(500) && p.releases(504) && p.releases(408) && p.releases(429));
        assert!(!p.releases(400) && !p.releases(409) && !p.releases(201));
        assert!(ReleasePolicy::parse(&["600".into()]).is_err());
        assert!(ReleasePolicy::parse(&["9xx".into()]).is_err());
        assert!(ReleasePolicy::parse(&["abc".into()]).is_err());
    }

    #[test]
    fn default_filter_drops_credentials_hop_by_hop_and_envoy_headers() {
        let f = HeaderFilter::new(&default_replay_skip_headers()).unwrap();
        for dropped in [
            "set-cookie",
            "date",
            "server",
            "x-envoy-upstream-service-time",
            "transfer-encoding",
            "connection",
            "content-length",
            ":status",
        ] {
            assert!(!f.keeps(dropped), "{dropped} must not be replayed");
        }
        for kept in [
            "content-type",
            "location",
            "etag",
            "x-request-id",
            "cache-control",
        ] {
            assert!(f.keeps(kept), "{kept} must be replayed");
        }
    }
}
