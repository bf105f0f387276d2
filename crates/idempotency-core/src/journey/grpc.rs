//! A gRPC rule's own steps: streaming calls let through (refused when they carry a key), the release decided by the
//! `grpc-status` of the trailers (or of a trailers-only response), the filter's answers as
//! trailers-only statuses, and the replay, sent itself when the record has no message or the
//! host can send trailers, or through the echo hop otherwise (see `crate::grpc`).

use std::rc::Rc;

use super::response::judges_gateway_errors;
use super::{pass, send_local, Execution, Journey, RequestJourney, Step, Verdict};
use crate::gave_up::{self, Judgement};
use crate::grpc::frame::{frame_len, framing, Framing};
use crate::grpc::{self, answer, status};
use crate::host::Host;
use crate::outcome::Outcome;
use crate::problem::Problem;
use crate::rule_handle::RuleHandle;
use crate::who_answered::{Answerer, EnvoyReport};
use idempotency_protocol::naming::source::FieldSource;
use idempotency_protocol::record::RecordedResponse;

/// A replay on its way through the echo hop: what the echo's answer is turned back into.
pub struct ReplayHop {
    pub rule: Rc<RuleHandle>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub trailers: Vec<(String, Vec<u8>)>,
}

/// What a gRPC request body holds for the rule.
pub(super) enum CallShape {
    /// One message: a unary (or server-streaming) call, protected.
    Unary,
    /// No message: nothing a method could run on; let through as a stream.
    NoMessage,
    /// A client-streaming or bidirectional call (or a hostile client's unary one).
    SeveralMessages,
    /// Not gRPC framing.
    Malformed,
}

/// The shape of a whole request body.
pub(super) fn call_shape(body: &[u8]) -> CallShape {
    match framing(body) {
        Framing::Messages(0) => CallShape::NoMessage,
        Framing::Messages(1) => CallShape::Unary,
        Framing::Messages(_) => CallShape::SeveralMessages,
        Framing::Partial | Framing::Malformed => CallShape::Malformed,
    }
}

/// The first of `sources` (a gRPC rule's: metadata only) that the call sent, valid or not:
/// a client that sends it asks for protection.
pub(super) fn sent_key_metadata<'h>(
    sources: &[FieldSource],
    find: impl Fn(&str) -> Option<&'h [u8]>,
) -> Option<String> {
    sources.iter().find_map(|source| match source {
        FieldSource::Header(name) if find(name).is_some() => Some(name.clone()),
        _ => None,
    })
}

impl RequestJourney {
    /// The rule as it applies to this request, by its content type; None: the request passes
    /// unprotected (counted). A gRPC rule is for gRPC calls only. An HTTP rule applies gRPC's
    /// semantics to a gRPC call, or lets it pass when it reads what a gRPC call lacks: a
    /// gRPC client never gets an HTTP answer (it would read a 409 as UNKNOWN) and a call's
    /// status is in its trailers, not in its HTTP status.
    pub(super) fn rule_for_call(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        content_type: &str,
    ) -> Option<Rc<RuleHandle>> {
        let is_grpc = grpc::is_grpc_content_type(content_type);
        let Some(calls) = &rule.grpc_calls else {
            if is_grpc {
                return Some(rule);
            }
            // Not a gRPC call (gRPC-Web, or plain HTTP on a gRPC path): this rule is not for it.
            log::debug!("rule {}: not a gRPC request; passes", rule.rule.name);
            self.note(host, &rule, Outcome::PassedThrough);
            return None;
        };
        let why = match &calls.as_grpc {
            Ok(as_grpc) if is_grpc => return Some(Rc::clone(as_grpc)),
            _ if !is_grpc && !grpc::is_grpc_web_content_type(content_type) => return Some(rule),
            Ok(_) => "gRPC-Web carries its status in the body, which the filter does not read",
            Err(reason) => reason.as_str(),
        };
        if !calls.warned.replace(true) {
            log::warn!(
                "rule {}: gRPC calls it matches pass unprotected ({why}); counted as \
                 grpc_on_http_rule. Protect them with a gRPC rule (docs/grpc.md)",
                rule.rule.name
            );
        }
        self.note(host, &rule, Outcome::GrpcOnHttpRule);
        None
    }

    /// A call that sent a second request message: a stream, which the filter does not
    /// protect. Without key metadata it is counted and let through. With it, it is refused
    /// before anything went upstream: grpcio runs a unary method on the first of several
    /// messages, so letting it through would run a recorded key's write again.
    pub(super) fn on_several_messages(
        &self,
        host: &impl Host,
        rule: &RuleHandle,
        key_metadata: Option<&str>,
    ) -> Step {
        let Some(metadata) = key_metadata else {
            return self.pass_streaming(host, rule);
        };
        log::debug!(
            "rule {}: a call with '{metadata}' sent a second request message; refused",
            rule.rule.name
        );
        self.note(host, rule, Outcome::GrpcStreamWithKey);
        self.answer_grpc_problem(host, rule, &Problem::key_on_stream(metadata))
    }

    /// A call with no request message: counted as a stream, and let through.
    pub(super) fn pass_streaming(&self, host: &impl Host, rule: &RuleHandle) -> Step {
        self.note(host, rule, Outcome::GrpcStreaming);
        pass()
    }

    /// While the body is still arriving: more bytes than its first message holds means a
    /// second message, decided at once rather than held until the client ends its side (a
    /// bidirectional call would wait for an answer first).
    pub(super) fn is_streaming_so_far(&self, host: &impl Host, size: usize) -> bool {
        if size <= grpc::frame::PREFIX_BYTES {
            return false;
        }
        match host
            .request_body(grpc::frame::PREFIX_BYTES)
            .map(|b| frame_len(&b))
        {
            Ok(Some(Ok(first))) => size > first,
            _ => false,
        }
    }

    /// The filter's own answer to a gRPC call: a trailers-only status.
    pub(super) fn answer_grpc_problem(
        &self,
        host: &impl Host,
        rule: &RuleHandle,
        problem: &Problem,
    ) -> Step {
        let headers = answer::trailers_only(problem);
        let pairs: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
        send_local(host, &rule.rule.name, 200, &pairs, b"")
    }

    /// A gRPC response that ended with its status (in `status_metadata`: its trailers, or
    /// the headers of a trailers-only answer): an unknown outcome when it says someone behind
    /// Envoy gave up, released when it says the call did not take effect (unless the router
    /// sent it more than once), recorded otherwise.
    pub(super) fn on_grpc_status(
        &self,
        host: &impl Host,
        mut run: Execution,
        status_metadata: &[(String, Vec<u8>)],
        in_trailers: bool,
        code: Option<Option<u32>>,
    ) -> Step {
        let rule = Rc::clone(&run.rule);
        let Some(code) = code else {
            // No status at all: the call's end is not known, so neither is its effect.
            log::warn!(
                "rule {}: a gRPC response without grpc-status",
                rule.rule.name
            );
            let report = EnvoyReport::read(host, 200);
            return self.unknown_outcome(host, run, &report);
        };
        // A status that is not a number is UNKNOWN to a client, and so it is here.
        let code = code.unwrap_or(status::UNKNOWN);
        if judges_gateway_errors(&rule, status_metadata) {
            if let Judgement::GaveUp(reason) = gave_up::of_grpc(code, status_metadata) {
                let report = EnvoyReport::read(host, 200).gave_up_behind(reason);
                return self.unknown_outcome(host, run, &report);
            }
        }
        let releases = rule
            .rule
            .grpc
            .as_ref()
            .is_some_and(|g| g.release.contains(&code));
        if releases {
            let report = EnvoyReport::read(host, 200);
            return match report.answerer() {
                Answerer::Upstream { resent: true } => self.unknown_outcome(host, run, &report),
                _ => self.release(host, run),
            };
        }
        if let (true, Some(capture)) = (in_trailers, run.capture.as_mut()) {
            capture.set_trailers(&rule.rule, status_metadata);
        }
        self.record(host, run)
    }

    /// The trailers of a gRPC response arrived: its status is among them.
    pub(super) fn on_grpc_trailers(&self, host: &impl Host, run: Execution) -> Step {
        match host.response_trailers() {
            Ok(trailers) => {
                let code = status::status_in(&trailers);
                self.on_grpc_status(host, run, &trailers, true, code)
            }
            Err(e) => {
                log::error!(
                    "rule {}: response trailers unreadable ({}); the call's status is unknown",
                    run.rule.rule.name,
                    e.0
                );
                let report = EnvoyReport::read(host, 200);
                self.unknown_outcome(host, run, &report)
            }
        }
    }

    /// A retry of a recorded gRPC call.
    pub(super) fn replay_grpc(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        recorded: &RecordedResponse,
    ) -> Step {
        if recorded.body_omitted {
            // The call completed; its message is not kept (too large, or its page reused). It
            // is not run again.
            return self.answer_grpc_problem(host, rule, &Problem::response_not_kept());
        }
        let marker: (&str, &[u8]) = (rule.rule.replay_header.as_str(), b"true");
        if recorded.status != 200 {
            // Not a gRPC response (a proxy in between answered): Envoy gives the retry the
            // status a client derives from that HTTP status, as the first call's got.
            let mut pairs: Vec<(&str, &[u8])> = recorded
                .headers
                .iter()
                .filter(|(n, _)| n != "content-type")
                .map(|(n, v)| (n.as_str(), v.as_slice()))
                .collect();
            pairs.push(marker);
            return send_local(host, &rule.rule.name, recorded.status, &pairs, b"");
        }
        if recorded.body.is_empty() {
            // No message: a trailers-only answer carries the status and all the metadata.
            let mut pairs: Vec<(&str, &[u8])> = recorded
                .headers
                .iter()
                .chain(recorded.trailers.iter())
                .map(|(n, v)| (n.as_str(), v.as_slice()))
                .collect();
            pairs.push(marker);
            return send_local(host, &rule.rule.name, 200, &pairs, b"");
        }
        if host.sends_replies_with_trailers() {
            return self.replay_grpc_with_trailers(host, rule, recorded);
        }
        // A message: the hop, which brings it back as the echo's answer.
        // The client's content-length (if it sent one) would not be the new body's.
        let rewritten = host
            .replace_request_header(":path", grpc::REPLAY_PATH.as_bytes())
            .and_then(|()| {
                host.replace_request_header("content-type", grpc::HOP_CONTENT_TYPE.as_bytes())
            })
            .and_then(|()| host.remove_request_header("content-length"))
            .and_then(|()| host.set_request_body(&recorded.body));
        if let Err(e) = rewritten {
            log::error!("rule {}: replay hop not prepared: {}", rule.rule.name, e.0);
            let problem = Problem::unavailable("the proxy could not replay the recorded response");
            return self.answer_grpc_problem(host, rule, &problem);
        }
        let hop = ReplayHop {
            rule: Rc::clone(rule),
            headers: recorded.headers.clone(),
            trailers: recorded.trailers.clone(),
        };
        (Journey::ReplayHop(Box::new(hop)), Verdict::Continue)
    }

    /// A recorded message and its trailers, sent by a host that can (no hop): the initial
    /// metadata as recorded and marked, the message, then the trailers.
    fn replay_grpc_with_trailers(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        recorded: &RecordedResponse,
    ) -> Step {
        let mut headers: Vec<(&str, &[u8])> = recorded
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        headers.push((rule.rule.replay_header.as_str(), b"true"));
        let trailers: Vec<(&str, &[u8])> = recorded
            .trailers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        match host.send_reply_with_trailers(200, &headers, &recorded.body, &trailers) {
            Ok(()) => (Journey::AnsweredLocally, Verdict::Pause),
            Err(e) => {
                log::error!("rule {}: replay not sent: {}", rule.rule.name, e.0);
                let problem =
                    Problem::unavailable("the proxy could not replay the recorded response");
                self.answer_grpc_problem(host, rule, &problem)
            }
        }
    }

    /// The echo's answer to a hop: the recorded metadata goes back on it. An answer without
    /// the echo's marker came from elsewhere (no route to the echo): the client gets
    /// UNAVAILABLE instead, and nothing was executed (no service has the hop's method).
    pub(super) fn on_hop_headers(
        &self,
        host: &impl Host,
        hop: Box<ReplayHop>,
        end_of_stream: bool,
    ) -> Step {
        let from_echo = host
            .response_headers()
            .map(|h| h.iter().any(|(n, _)| n == grpc::ECHO_MARKER))
            .unwrap_or(false);
        if !from_echo {
            self.note(host, &hop.rule, Outcome::ReplayEchoUnrouted);
            let admitted = self
                .plugin
                .echo_unrouted_log
                .borrow_mut()
                .admit(host.now_ms());
            if let Some(suppressed) = admitted {
                log::error!(
                    "rule {}: a replay's hop to {} was not answered by the replay echo: the \
                     route for {} to the echo's listener is missing, and every retry of a call \
                     recorded with a message gets UNAVAILABLE ({suppressed} similar not logged; \
                     counted as replay_echo_unrouted; see docs/grpc.md)",
                    hop.rule.rule.name,
                    grpc::REPLAY_PATH,
                    grpc::REPLAY_SERVICE_PREFIX
                );
            }
            let problem = Problem::unavailable("the proxy could not replay the recorded response");
            return self.answer_grpc_problem(host, &hop.rule, &problem);
        }
        for name in [grpc::ECHO_MARKER, "content-length"] {
            if let Err(e) = host.remove_response_header(name) {
                log::warn!("replay: {name} not removed: {}", e.0);
            }
        }
        for (i, (name, value)) in hop.headers.iter().enumerate() {
            // A repeated name keeps every value: the first replaces the echo's, the rest add.
            let repeated = hop.headers.iter().take(i).any(|(n, _)| n == name);
            let restored = if repeated {
                host.add_response_header(name, value)
            } else {
                host.replace_response_header(name, value)
            };
            if let Err(e) = restored {
                log::warn!("replay: {name} not restored: {}", e.0);
            }
        }
        if let Err(e) = host.replace_response_header(&hop.rule.rule.replay_header, b"true") {
            log::warn!("replay: marker not set: {}", e.0);
        }
        if end_of_stream {
            return (Journey::AnsweredLocally, Verdict::Continue);
        }
        (Journey::ReplayHop(hop), Verdict::Continue)
    }

    /// The last chunk of the echo's answer: the recorded trailers follow it.
    pub(super) fn on_hop_body(
        &self,
        host: &impl Host,
        hop: Box<ReplayHop>,
        end_of_stream: bool,
    ) -> Step {
        if !end_of_stream {
            return (Journey::ReplayHop(hop), Verdict::Continue);
        }
        for (name, value) in &hop.trailers {
            if let Err(e) = host.add_response_trailer(name, value) {
                log::error!("replay: trailer {name} not added: {}", e.0);
            }
        }
        (Journey::AnsweredLocally, Verdict::Continue)
    }
}
