//! Collects the upstream response as it streams past, within the rule's cap, so it can be
//! recorded without holding the response back from the client.

use crate::config::Rule;
use idempotency_protocol::record::{RecordedResponse, KEY_EXPIRES_HEADER};

#[derive(Debug, Default)]
pub struct ResponseCapture {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    body_omitted: bool,
    limit: usize,
    trailers: Vec<(String, Vec<u8>)>,
}

impl ResponseCapture {
    /// Starts from the response headers, keeping only those a replay may carry.
    pub fn start<'a>(
        rule: &Rule,
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> ResponseCapture {
        let mut kept = Vec::new();
        let mut body_omitted = false;
        for (name, value) in headers {
            let lower = name.to_ascii_lowercase();
            if lower == "content-length" {
                // Known too large up front: do not copy a single chunk.
                let declared = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok());
                if declared.is_some_and(|n| n > rule.max_response_bytes as u64) {
                    body_omitted = true;
                }
            }
            if rule.replay_headers.keeps(&lower) && lower != rule.replay_header {
                kept.push((lower, value.to_vec()));
            }
        }
        ResponseCapture {
            status,
            headers: kept,
            body: Vec::new(),
            body_omitted,
            limit: rule.max_response_bytes,
            trailers: Vec::new(),
        }
    }

    /// False once the body is over the cap: the caller can stop copying chunks.
    pub fn wants_body(&self) -> bool {
        !self.body_omitted
    }

    /// Records the response without its body (over the cap, or unreadable).
    pub fn omit_body(&mut self) {
        self.body_omitted = true;
        self.body = Vec::new();
    }

    pub fn push_body(&mut self, chunk: &[u8]) {
        if self.body_omitted {
            return;
        }
        if self.body.len().saturating_add(chunk.len()) > self.limit {
            self.omit_body();
        } else {
            self.body.extend_from_slice(chunk);
        }
    }

    /// Keeps a gRPC response's trailers (its status and trailing metadata), filtered as
    /// headers are, but for gRPC's own (`grpc-status`, `grpc-message`, ...), which a replay
    /// cannot do without whatever `replay_skip_headers` says.
    pub fn set_trailers(&mut self, rule: &Rule, trailers: &[(String, Vec<u8>)]) {
        self.trailers = trailers
            .iter()
            .filter(|(n, _)| n.starts_with("grpc-") || rule.replay_headers.keeps(n))
            .cloned()
            .collect();
    }

    /// Records until when the key is remembered (`KEY_EXPIRES_HEADER`), in place of any
    /// copy the upstream sent.
    pub fn set_key_expiry(&mut self, value: &str) {
        self.headers.retain(|(n, _)| n != KEY_EXPIRES_HEADER);
        self.headers
            .push((KEY_EXPIRES_HEADER.to_string(), value.as_bytes().to_vec()));
    }

    /// The status the recorded response carries, for logs.
    pub fn status(&self) -> u16 {
        self.status
    }

    pub fn finish(self) -> RecordedResponse {
        RecordedResponse {
            owner: 0,
            status: self.status,
            headers: self.headers,
            body: self.body,
            trailers: self.trailers,
            body_omitted: self.body_omitted,
            unknown: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn rule(max: u64) -> Rule {
        let json = format!(r#"{{"rules":[{{"name":"r","max_response_bytes":{max}}}]}}"#);
        Config::parse(json.as_bytes()).unwrap().rules.remove(0)
    }

    #[test]
    fn keeps_replayable_headers_and_the_body() {
        let headers: Vec<(&str, &[u8])> = vec![
            ("Content-Type", b"application/json"),
            ("set-cookie", b"s=1"),
            ("x-envoy-upstream-service-time", b"3"),
            ("idempotent-replayed", b"true"),
            ("location", b"/orders/1"),
        ];
        let mut c = ResponseCapture::start(&rule(10), 201, headers);
        c.push_body(b"hello");
        c.push_body(b"world");
        let r = c.finish();
        assert_eq!(r.status, 201);
        assert_eq!(r.body, b"helloworld");
        assert!(!r.body_omitted);
        let names: Vec<_> = r.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, vec!["content-type", "location"]);
    }

    #[test]
    fn bodies_over_the_cap_are_omitted() {
        let mut c = ResponseCapture::start(&rule(10), 200, Vec::<(&str, &[u8])>::new());
        c.push_body(b"0123456789");
        c.push_body(b"!");
        assert!(!c.wants_body());
        let r = c.finish();
        assert!(r.body_omitted && r.body.is_empty());

        let declared: Vec<(&str, &[u8])> = vec![("content-length", b"11")];
        let c = ResponseCapture::start(&rule(10), 200, declared);
        assert!(!c.wants_body());
    }
}
