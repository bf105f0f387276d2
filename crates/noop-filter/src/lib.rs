//! A proxy-wasm filter that does nothing, used by `make bench` as the floor every Wasm filter
//! pays: loading a VM, creating a context per request and crossing the ABI for each callback.
//!
//! Plugin configuration (JSON, whitespace ignored):
//!
//! | configuration                | behaviour                                                    |
//! |------------------------------|--------------------------------------------------------------|
//! | empty, `{}`, `{"wait_for_body":false}` | every callback returns `Continue`                  |
//! | `{"wait_for_body":true}`     | request headers and body are held until the end of the stream, then continue, as any filter that fingerprints the body must do |
//!
//! Anything else is refused (`on_configure` returns false, so Envoy refuses the config).
//! The parse is a literal comparison on purpose: no JSON parser in the floor's code size.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_context_id| -> Box<dyn RootContext> {
        Box::new(NoopRoot { wait_for_body: false })
    });
}}

/// Whether requests wait for their whole body, from the plugin configuration; None if the
/// configuration is not one of the accepted forms.
pub fn parse_wait_for_body(config: &[u8]) -> Option<bool> {
    let compact: Vec<u8> = config
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    match compact.as_slice() {
        b"" | b"{}" | b"{\"wait_for_body\":false}" => Some(false),
        b"{\"wait_for_body\":true}" => Some(true),
        _ => None,
    }
}

struct NoopRoot {
    wait_for_body: bool,
}

impl Context for NoopRoot {}

impl RootContext for NoopRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        match parse_wait_for_body(&config) {
            Some(wait) => {
                self.wait_for_body = wait;
                true
            }
            None => {
                // Nothing else to do if the host refuses the log line: Envoy refuses the config.
                let _ = proxy_wasm::hostcalls::log(
                    LogLevel::Error,
                    "noop-filter: configuration must be empty, {} or {\"wait_for_body\": true|false}",
                );
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(NoopRequest {
            wait_for_body: self.wait_for_body,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct NoopRequest {
    wait_for_body: bool,
}

impl Context for NoopRequest {}

impl HttpContext for NoopRequest {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.wait_for_body && !end_of_stream {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_request_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        if self.wait_for_body && !end_of_stream {
            // Envoy keeps buffering; the next call sees more of the body.
            Action::Pause
        } else {
            Action::Continue
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_wait_for_body;

    #[test]
    fn accepts_the_documented_forms_only() {
        assert_eq!(parse_wait_for_body(b""), Some(false));
        assert_eq!(parse_wait_for_body(b" { } \n"), Some(false));
        assert_eq!(
            parse_wait_for_body(b"{\"wait_for_body\": false}"),
            Some(false)
        );
        assert_eq!(
            parse_wait_for_body(b"{ \"wait_for_body\" : true }\n"),
            Some(true)
        );
        assert_eq!(parse_wait_for_body(b"{\"wait_for_body\": 1}"), None);
        assert_eq!(parse_wait_for_body(b"{\"wait\": true}"), None);
        assert_eq!(parse_wait_for_body(b"null"), None);
    }
}
