//! A proxy-wasm filter that does nothing, used by `make bench` as the floor every Wasm filter
//! pays: loading a VM, creating a context per request and crossing the ABI for each callback.
//!
//! Plugin configuration (JSON, whitespace ignored):
//!
//! | configuration                | behaviour                                                    |
//! |------------------------------|--------------------------------------------------------------|
//! | empty, `{}`, `{"wait_for_body":false}` | every callback returns `Continue`                  |
//! | `{"wait_for_body":true}`     | request headers and body are held until the end of the stream, then continue, as any filter that fingerprints the body must do |
//! | `{"stream_cluster":"NAME"}`  | the coordination floor: as `wait_for_body`, then one message on a gRPC stream to cluster NAME, and the request continues when its answer arrives |
//!
//! Anything else is refused (`on_configure` returns false, so Envoy refuses the config).
//! The parse is a literal comparison on purpose: no JSON parser in the floor's code size.
//!
//! The stream mode does what the idempotency filter's cluster mode does per request, and
//! nothing else: the root context opens one bidirectional stream
//! (`idempotency.store.v1.Store/Coordinate`) per worker from its first tick and keeps it; a
//! request, once its body is in, sends one `Call` (a claim) on it as the root (the stream
//! belongs to the context that opened it) and pauses; the root reads each `Answer`, finds
//! the request by the answer's id and resumes it. A stream that closes is reopened on the
//! tick; requests waiting on it, or arriving while none is open, get 503.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use idempotency_protocol::stream::{self, CallOp, Reply};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(NoopRoot { context_id, mode: Mode::Pass, link: None })
    });
}}

/// What each request does, from the plugin configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Every callback continues.
    Pass,
    /// Requests are held until their body has arrived.
    WaitForBody,
    /// As `WaitForBody`, then one round trip on a gRPC stream to this cluster.
    Stream(String),
}

/// The mode the plugin configuration asks for; None if it is not one of the accepted forms.
pub fn parse_config(config: &[u8]) -> Option<Mode> {
    let compact: Vec<u8> = config
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    match compact.as_slice() {
        b"" | b"{}" | b"{\"wait_for_body\":false}" => Some(Mode::Pass),
        b"{\"wait_for_body\":true}" => Some(Mode::WaitForBody),
        other => {
            let name = other
                .strip_prefix(b"{\"stream_cluster\":\"")?
                .strip_suffix(b"\"}")?;
            let valid = !name.is_empty() && !name.iter().any(|&b| b == b'"' || b == b'\\');
            let name = std::str::from_utf8(name).ok().filter(|_| valid)?;
            Some(Mode::Stream(name.to_string()))
        }
    }
}

/// The store's streaming method, as the idempotency filter opens it.
const SERVICE: &str = "idempotency.store.v1.Store";
const METHOD: &str = "Coordinate";
/// The first tick opens the stream (the worker's cluster may not exist while configuring);
/// later ticks reopen it if it closed.
const FIRST_TICK: Duration = Duration::from_millis(10);
const TICK: Duration = Duration::from_millis(100);
/// Calls waiting for an answer at most; a request beyond that gets 503.
const MAX_WAITING: usize = 16_384;

/// A digest-shaped key and fingerprint, as the filter's claims carry.
const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// The worker's stream, shared by the root (which opens it and reads its answers) and the
/// requests (which send on it).
pub struct Link {
    root_id: u32,
    cluster: String,
    stream: Option<u32>,
    next_id: u64,
    /// Call id -> the context id of the request waiting for its answer.
    waiting: HashMap<u64, u32>,
    claim: CallOp,
}

impl Link {
    fn new(root_id: u32, cluster: String) -> Link {
        Link {
            root_id,
            cluster,
            stream: None,
            next_id: 1,
            waiting: HashMap::new(),
            claim: CallOp::Claim {
                key: HEX.to_string(),
                fingerprint: HEX.to_string(),
                lease_ms: 60_000,
                owner: "0123456789abcdef0123456789abcdef".to_string(),
            },
        }
    }
}

fn log(level: LogLevel, message: &str) {
    // Nothing else to do if the host refuses a log line.
    let _ = hostcalls::log(level, message);
}

struct NoopRoot {
    context_id: u32,
    mode: Mode,
    link: Option<Rc<RefCell<Link>>>,
}

impl Context for NoopRoot {
    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        let Some(link) = &self.link else { return };
        // Read while the root is the effective context: the buffer is looked up through it.
        let bytes = match hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, message_size) {
            Ok(Some(bytes)) => bytes,
            _ => return,
        };
        let Ok(answer) = stream::decode_answer(&bytes) else {
            log(
                LogLevel::Warn,
                "noop-filter: stream message is not an Answer",
            );
            return;
        };
        let (root_id, waiter) = {
            let mut link = link.borrow_mut();
            if link.stream != Some(token_id) {
                return;
            }
            (link.root_id, link.waiting.remove(&answer.id))
        };
        let Some(request) = waiter else { return };
        // A request gone before its answer (client reset) is BadArgument: nothing to resume.
        if hostcalls::set_effective_context(request).is_ok() {
            match answer.reply {
                Reply::Claimed { .. } => {
                    let _ = hostcalls::resume_http_request();
                }
                _ => refuse("the stream answered something else than claimed"),
            }
        }
        let _ = hostcalls::set_effective_context(root_id);
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        let Some(link) = &self.link else { return };
        let (root_id, waiting) = {
            let mut link = link.borrow_mut();
            if link.stream != Some(token_id) {
                return;
            }
            link.stream = None;
            (link.root_id, std::mem::take(&mut link.waiting))
        };
        log(
            LogLevel::Warn,
            &format!("noop-filter: stream closed with status {status_code}; reopened on the tick"),
        );
        // Envoy keeps a remotely closed stream until it is closed here too.
        let _ = hostcalls::close_grpc_stream(token_id);
        for request in waiting.into_values() {
            if hostcalls::set_effective_context(request).is_ok() {
                refuse("the stream closed before its answer");
            }
        }
        let _ = hostcalls::set_effective_context(root_id);
    }
}

impl RootContext for NoopRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        let Some(mode) = parse_config(&config) else {
            log(
                LogLevel::Error,
                "noop-filter: configuration must be empty, {}, {\"wait_for_body\": true|false} \
                 or {\"stream_cluster\": \"NAME\"}",
            );
            return false;
        };
        if let Mode::Stream(cluster) = &mode {
            self.link = Some(Rc::new(RefCell::new(Link::new(
                self.context_id,
                cluster.clone(),
            ))));
            if hostcalls::set_tick_period(FIRST_TICK).is_err() {
                log(LogLevel::Error, "noop-filter: tick period refused");
                return false;
            }
        }
        self.mode = mode;
        true
    }

    fn on_tick(&mut self) {
        let Some(link) = &self.link else { return };
        let cluster = {
            let link = link.borrow();
            if link.stream.is_some() {
                return;
            }
            link.cluster.clone()
        };
        // Opened by the root, so the SDK routes the stream's messages to the root.
        match hostcalls::open_grpc_stream(&cluster, SERVICE, METHOD, vec![]) {
            Ok(token) => {
                link.borrow_mut().stream = Some(token);
                let _ = hostcalls::set_tick_period(TICK);
            }
            Err(status) => log(
                LogLevel::Warn,
                &format!("noop-filter: stream to cluster {cluster} not opened: {status:?}"),
            ),
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(NoopRequest {
            context_id,
            wait_for_body: self.mode != Mode::Pass,
            link: self.link.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Answers the effective context's request with a 503 of its own.
fn refuse(why: &str) {
    let _ = hostcalls::send_http_response(503, vec![("x-noop-filter", why)], None);
}

struct NoopRequest {
    context_id: u32,
    wait_for_body: bool,
    link: Option<Rc<RefCell<Link>>>,
}

impl NoopRequest {
    /// The request's body is in: continue, or (stream mode) send its call and wait.
    fn body_complete(&mut self) -> Action {
        let Some(link) = &self.link else {
            return Action::Continue;
        };
        let prepared = {
            let mut link = link.borrow_mut();
            match link.stream {
                Some(handle) if link.waiting.len() < MAX_WAITING => {
                    let id = link.next_id;
                    link.next_id += 1;
                    Some((
                        link.root_id,
                        handle,
                        id,
                        stream::encode_call_parts(id, &link.claim),
                    ))
                }
                _ => None,
            }
        };
        let Some((root_id, handle, id, message)) = prepared else {
            refuse("no stream is open");
            return Action::Pause;
        };
        // The stream belongs to the root: send as the root, then come back.
        let sent = hostcalls::set_effective_context(root_id)
            .and_then(|()| hostcalls::send_grpc_stream_message(handle, Some(&message), false));
        let _ = hostcalls::set_effective_context(self.context_id);
        if sent.is_err() {
            refuse("the stream refused the message");
            return Action::Pause;
        }
        link.borrow_mut().waiting.insert(id, self.context_id);
        Action::Pause
    }
}

impl Context for NoopRequest {}

impl HttpContext for NoopRequest {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if !self.wait_for_body {
            Action::Continue
        } else if end_of_stream {
            self.body_complete()
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        if !self.wait_for_body {
            Action::Continue
        } else if end_of_stream {
            self.body_complete()
        } else {
            // Envoy keeps buffering; the next call sees more of the body.
            Action::Pause
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_config, Mode};

    #[test]
    fn accepts_the_documented_forms_only() {
        assert_eq!(parse_config(b""), Some(Mode::Pass));
        assert_eq!(parse_config(b" { } \n"), Some(Mode::Pass));
        assert_eq!(
            parse_config(b"{\"wait_for_body\": false}"),
            Some(Mode::Pass)
        );
        assert_eq!(
            parse_config(b"{ \"wait_for_body\" : true }\n"),
            Some(Mode::WaitForBody)
        );
        assert_eq!(parse_config(b"{\"wait_for_body\": 1}"), None);
        assert_eq!(parse_config(b"{\"wait\": true}"), None);
        assert_eq!(parse_config(b"null"), None);
    }

    #[test]
    fn stream_mode_names_its_cluster() {
        assert_eq!(
            parse_config(b"{ \"stream_cluster\" : \"idempotency_store\" }"),
            Some(Mode::Stream("idempotency_store".into()))
        );
        assert_eq!(
            parse_config(b"{\"stream_cluster\":\"outbound|8081||store.ns.svc.cluster.local\"}"),
            Some(Mode::Stream(
                "outbound|8081||store.ns.svc.cluster.local".into()
            ))
        );
        for refused in [
            &b"{\"stream_cluster\":\"\"}"[..],
            b"{\"stream_cluster\":\"a\\\"b\"}",
            b"{\"stream_cluster\":1}",
            b"{\"stream_cluster\":\"a\",\"wait_for_body\":true}",
        ] {
            assert_eq!(parse_config(refused), None, "{refused:?}");
        }
    }
}
