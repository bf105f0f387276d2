//! Envoy as core's `Host`, over the dynamic module ABI: each call maps onto the request whose
//! hook runs (a host is made for it there: `request`), the process's shared data, or the
//! configuration's metrics, and the root's store streams (`root_streams.rs`, carried by the
//! store thread's courier). HTTP callouts are a request's own or the main thread's root's
//! (`main_root.rs`, the configuration's own callouts); a worker's root makes none.

use std::cell::Cell;

use idempotency_core::host::{
    Callout, HandedOffWrite, HeaderPairs, Host, HostError, SetOutcome, SharedData,
};

use crate::abi::{AttributeId, Filter, FilterHandle, HeaderMap, MetadataSource};
use crate::config_callouts::MainCalls;
use crate::metrics::Metrics;
use crate::queues;
use crate::request_callouts;
use crate::root_streams::RootStreams;
use crate::shared_data::SharedMap;
use crate::worker;

/// The host as one root sees it: its configuration's bytes and metrics, and where its asked-for
/// tick period goes.
pub struct NativeHost<'a> {
    pub configuration: &'a [u8],
    pub metrics: &'a Metrics,
    pub tick_ms: &'a Cell<u32>,
    /// The root's store streams; None for the configuration's trial root on the main thread.
    pub streams: Option<&'a RootStreams>,
    /// The main thread's root: its configuration's callouts. None for a worker's root, which
    /// has none outside a request (its resolutions go to the main root).
    pub main: Option<MainCalls<'a>>,
    /// The request whose own hook runs (its context id and filter): the one request calls
    /// act on. None for a root's own work.
    pub request: Option<(u32, FilterHandle)>,
}

fn no_request() -> HostError {
    HostError("no request is being handled".into())
}

impl NativeHost<'_> {
    fn streams(&self) -> Result<&RootStreams, HostError> {
        self.streams
            .ok_or_else(|| HostError("store streams are opened by a worker's root only".into()))
    }

    fn filter(&self) -> Result<Filter, HostError> {
        // SAFETY: a host names only the request whose hook runs now, on this worker: it is
        // live for as long as the host (made for that hook, dropped with it).
        self.request
            .map(|(_, handle)| unsafe { handle.filter() })
            .ok_or_else(no_request)
    }
}

impl SharedData for NativeHost<'_> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        Ok(SharedMap::process().get(key))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        Ok(SharedMap::process().set(key, value, cas))
    }
}

/// Envoy hands integer properties to Wasm as 8 little-endian bytes; core reads them so.
fn as_property(n: u64) -> Vec<u8> {
    i64::try_from(n).unwrap_or(i64::MAX).to_le_bytes().to_vec()
}

impl Host for NativeHost<'_> {
    fn now_ms(&self) -> u64 {
        self.now_nanos() / 1_000_000
    }

    fn now_nanos(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    fn request_headers(&self) -> Result<HeaderPairs, HostError> {
        Ok(self.filter()?.headers(HeaderMap::RequestHeaders))
    }

    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        Ok(self.filter()?.header(HeaderMap::RequestHeaders, name))
    }

    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        let mut body = self.filter()?.request_body().map_err(abi_error)?;
        body.truncate(size);
        Ok(body)
    }

    fn request_trailers(&self) -> Result<HeaderPairs, HostError> {
        Ok(self.filter()?.headers(HeaderMap::RequestTrailers))
    }

    fn replace_request_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.filter()?
            .set_header(HeaderMap::RequestHeaders, name, value)
            .map_err(abi_error)
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        self.filter()?
            .remove_header(HeaderMap::RequestHeaders, name)
            .map_err(abi_error)
    }

    fn set_request_body(&self, body: &[u8]) -> Result<(), HostError> {
        self.filter()?.replace_request_body(body).map_err(abi_error)
    }

    fn response_headers(&self) -> Result<HeaderPairs, HostError> {
        Ok(self.filter()?.headers(HeaderMap::ResponseHeaders))
    }

    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        let mut chunk = self.filter()?.response_body_chunk().map_err(abi_error)?;
        chunk.truncate(size);
        Ok(chunk)
    }

    fn replace_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.filter()?
            .set_header(HeaderMap::ResponseHeaders, name, value)
            .map_err(abi_error)
    }

    fn remove_response_header(&self, name: &str) -> Result<(), HostError> {
        self.filter()?
            .remove_header(HeaderMap::ResponseHeaders, name)
            .map_err(abi_error)
    }

    fn add_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.filter()?
            .add_header(HeaderMap::ResponseHeaders, name, value)
            .map_err(abi_error)
    }

    fn response_trailers(&self) -> Result<HeaderPairs, HostError> {
        Ok(self.filter()?.headers(HeaderMap::ResponseTrailers))
    }

    fn add_response_trailer(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.filter()?
            .add_header(HeaderMap::ResponseTrailers, name, value)
            .map_err(abi_error)
    }

    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        let filter = self.filter()?;
        let string = |id| Ok(filter.attribute_string(id));
        let int = |id| Ok(filter.attribute_int(id).map(as_property));
        match path {
            ["xds", "route_name"] => string(AttributeId::XdsRouteName),
            ["xds", "virtual_host_name"] => string(AttributeId::XdsVirtualHostName),
            ["xds", "cluster_name"] => string(AttributeId::XdsClusterName),
            ["xds", "route_metadata", "filter_metadata", namespace, key] => {
                Ok(filter.metadata_string(MetadataSource::Route, namespace, key))
            }
            ["response", "code_details"] => string(AttributeId::ResponseCodeDetails),
            ["response", "flags"] => int(AttributeId::ResponseFlags),
            ["upstream", "request_attempt_count"] => int(AttributeId::UpstreamRequestAttemptCount),
            _ => Err(HostError(format!(
                "property {} is not mapped in the native build",
                path.join(".")
            ))),
        }
    }

    fn send_local_reply(
        &self,
        status: u16,
        headers: &[(&str, &[u8])],
        body: &[u8],
    ) -> Result<(), HostError> {
        if let Some(main) = &self.main {
            return main.remotes.reply(status, headers, body, &[]);
        }
        let filter = self.filter()?;
        match reply_in_parts(status, headers, body) {
            None => filter.send_response(status, headers, body),
            Some(head) => {
                let head: Vec<(&str, &[u8])> = head
                    .iter()
                    .map(|(n, v)| (n.as_str(), v.as_slice()))
                    .collect();
                filter.send_response_headers(&head, body.is_empty());
                if !body.is_empty() {
                    filter.send_response_data(body, true);
                }
            }
        }
        Ok(())
    }

    /// The ABI sends a reply's headers, body and trailers itself, so a gRPC replay needs no
    /// echo hop here.
    fn sends_replies_with_trailers(&self) -> bool {
        true
    }

    fn send_reply_with_trailers(
        &self,
        status: u16,
        headers: &[(&str, &[u8])],
        body: &[u8],
        trailers: &[(&str, &[u8])],
    ) -> Result<(), HostError> {
        if let Some(main) = &self.main {
            return main.remotes.reply(status, headers, body, trailers);
        }
        let filter = self.filter()?;
        let head = reply_head(status, headers);
        let head: Vec<(&str, &[u8])> = head
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        let ends_at_head = body.is_empty() && trailers.is_empty();
        filter.send_response_headers(&head, ends_at_head);
        if !body.is_empty() {
            filter.send_response_data(body, trailers.is_empty());
        }
        if !trailers.is_empty() {
            filter.send_response_trailers(trailers);
        }
        Ok(())
    }

    fn resume_request(&self) -> Result<(), HostError> {
        self.filter()?.continue_decoding();
        Ok(())
    }

    /// The main root's: the configuration's own. A request's: its own (Envoy cancels them
    /// with it, as proxy-wasm does). A worker's root makes none: its store calls go on the
    /// store stream (the native build refuses the store's HTTP transport).
    fn dispatch_callout(&self, callout: &Callout<'_>) -> Result<u32, HostError> {
        if let Some(main) = &self.main {
            return main.dispatch(callout);
        }
        let Some((_, request)) = self.request else {
            return Err(HostError("a worker's root makes no callouts".into()));
        };
        // SAFETY: the request whose hook runs, on this worker (see `filter`).
        let filter = unsafe { request.filter() };
        let headers: Vec<(&str, &[u8])> = callout
            .headers
            .iter()
            .map(|(n, v)| (*n, v.as_bytes()))
            .collect();
        let timeout = std::time::Duration::from_millis(callout.timeout_ms);
        let id = filter
            .http_callout(callout.cluster, &headers, callout.body, timeout)
            .map_err(abi_error)?;
        Ok(request_callouts::register(request.key(), id))
    }

    fn callout_response_headers(&self) -> Result<HeaderPairs, HostError> {
        if let Some(main) = &self.main {
            return main.response_headers();
        }
        request_callouts::headers()
            .ok_or_else(|| HostError("no callout answer is being delivered".into()))
    }

    fn callout_response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        if let Some(main) = &self.main {
            return main.response_body(size);
        }
        request_callouts::body(size)
            .ok_or_else(|| HostError("no callout answer is being delivered".into()))
    }

    fn hand_off_write(&self, write: &HandedOffWrite<'_>) -> Result<(), HostError> {
        self.streams()?
            .ledger
            .record(write, self.now_ms())
            .map_err(HostError)
    }

    fn write_settled(&self, id: u64) {
        if let Some(streams) = self.streams {
            streams.ledger.settle(id);
        }
    }

    fn open_grpc_stream(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError> {
        self.streams()?.open(cluster, service, method, metadata)
    }

    fn send_grpc_message(&self, stream: u32, message: &[u8]) -> Result<(), HostError> {
        self.streams()?.send(stream, message)
    }

    fn close_grpc_stream(&self, stream: u32, reset: bool) -> Result<(), HostError> {
        self.streams()?.close(stream, reset)
    }

    fn grpc_initial_metadata(&self) -> Result<HeaderPairs, HostError> {
        self.streams()?.initial_metadata()
    }

    fn grpc_message(&self, size: usize) -> Result<Vec<u8>, HostError> {
        self.streams()?.message(size)
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        if let Some(main) = &self.main {
            return main.remotes.enter(context_id);
        }
        // Core switches from a request to its root to send on the root's store stream, and
        // back: the stream is the root's whichever request asks, so neither switch changes
        // what this host acts on. Any other request is refused: a request is acted on only in
        // its own hooks.
        if worker::is_root_context(context_id)
            || self.request.is_some_and(|(own, _)| own == context_id)
        {
            Ok(())
        } else {
            Err(HostError(format!(
                "request {context_id} is acted on only in its own hooks"
            )))
        }
    }

    fn define_counter(&self, name: &str) -> Result<u32, HostError> {
        self.metrics.counter(name).map_err(HostError)
    }

    fn increment_counter(&self, id: u32) {
        self.metrics.increment(id);
    }

    fn publish(&self, name: &str, value: &[u8]) {
        // The access log reads `wasm.<name>` on both builds, so one log format serves both.
        let Ok(filter) = self.filter() else { return };
        if let Err(e) = filter.set_filter_state(&format!("wasm.{name}"), value) {
            log::debug!("{name} not published for the access log: {}", e);
        }
    }

    fn define_gauge(&self, name: &str) -> Result<u32, HostError> {
        self.metrics.gauge(name).map_err(HostError)
    }

    fn set_gauge(&self, id: u32, value: u64) {
        self.metrics.set_gauge(id, value);
    }

    fn register_queue(&self, name: &str) -> Result<u32, HostError> {
        let id = queues::register(name);
        // A root's own queues go with it (`RootStreams`'s drop): a push builds new roots.
        if let Some(streams) = self.streams {
            streams.owns_queue(id);
        }
        Ok(id)
    }

    fn enqueue(&self, queue: u32, value: &[u8]) -> Result<(), HostError> {
        if queues::enqueue(queue, value) {
            Ok(())
        } else {
            Err(HostError(format!("no queue {queue}")))
        }
    }

    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, HostError> {
        Ok(queues::dequeue(queue))
    }

    fn plugin_configuration(&self) -> Result<Vec<u8>, HostError> {
        Ok(self.configuration.to_vec())
    }

    fn set_tick_period_ms(&self, period_ms: u32) -> Result<(), HostError> {
        self.tick_ms.set(period_ms);
        Ok(())
    }

    fn done(&self) -> Result<(), HostError> {
        Ok(())
    }
}

/// The headers to send a filter's answer with in parts (`send_response_headers`, then the
/// body), or None when Envoy's local reply (`send_response`) carries it unchanged.
///
/// Envoy's local reply (`Http::Utility::prepareLocalReply`, after the module's headers are
/// added) removes content-type and content-length from a reply without a body, and adds
/// `content-type: text/plain` to a body without a content-type. The Wasm build's reply passes
/// back through its own filter, which restores a replay's content-type; a dynamic module's own
/// local reply never reaches its encoder hooks (Envoy skips them once it sent one), so the
/// native build sends such a reply as given instead: the status, every header, and the body's
/// length, as Envoy's local reply would set it. Problems (a body and a content-type) and most
/// replays still go as Envoy's local reply, reported as `dynamic_module` in
/// `response.code_details` (a reply in parts gets empty details from Envoy 1.40).
fn reply_in_parts(
    status: u16,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> Option<Vec<(String, Vec<u8>)>> {
    let named = |name: &str| headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name));
    if !body.is_empty() && named("content-type") {
        return None;
    }
    let mut head = reply_head(status, headers);
    if !body.is_empty() {
        head.push((
            "content-length".to_owned(),
            body.len().to_string().into_bytes(),
        ));
    }
    Some(head)
}

/// A reply's headers as sent in parts: `:status` first, then the headers as given but for any
/// `:status` or `content-length` of theirs (a reply with trailers has no length: it would end
/// an HTTP/1 response before them).
fn reply_head(status: u16, headers: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    let mut head = vec![(":status".to_owned(), status.to_string().into_bytes())];
    head.extend(
        headers
            .iter()
            .filter(|(n, _)| !n.eq_ignore_ascii_case(":status"))
            .filter(|(n, _)| !n.eq_ignore_ascii_case("content-length"))
            .map(|(n, v)| ((*n).to_owned(), v.to_vec())),
    );
    head
}

fn abi_error(e: crate::abi::AbiError) -> HostError {
    HostError(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::reply_in_parts;

    fn owned(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn a_body_with_a_content_type_goes_as_envoys_local_reply() {
        let problem: [(&str, &[u8]); 1] = [("content-type", b"application/problem+json")];
        assert_eq!(reply_in_parts(409, &problem, b"{}"), None);
    }

    #[test]
    fn a_reply_without_a_body_keeps_its_content_type_in_parts() {
        let replay: [(&str, &[u8]); 4] = [
            ("content-type", b"text/plain"),
            ("x-m", b"1"),
            ("x-m", b"2"),
            ("idempotent-replayed", b"true"),
        ];
        assert_eq!(
            reply_in_parts(201, &replay, b""),
            Some(owned(&[
                (":status", "201"),
                ("content-type", "text/plain"),
                ("x-m", "1"),
                ("x-m", "2"),
                ("idempotent-replayed", "true"),
            ]))
        );
    }

    #[test]
    fn a_body_without_a_content_type_gets_none_added_and_its_length_in_parts() {
        let replay: [(&str, &[u8]); 2] = [("Content-Length", b"99"), ("x-a", b"b")];
        assert_eq!(
            reply_in_parts(200, &replay, b"hello"),
            Some(owned(&[
                (":status", "200"),
                ("x-a", "b"),
                ("content-length", "5")
            ]))
        );
    }
}
