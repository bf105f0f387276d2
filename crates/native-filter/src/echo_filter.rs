//! `{"grpc_replay_echo": true}` on the native build. The native filter replays a recorded gRPC
//! answer itself and sends no hops, so an echo is never needed beside it; the same JSON still
//! loads (one Envoy configuration can switch builds filter by filter), logs once that the
//! native filter does not use it, and answers the hops of a Wasm build's filter as the Wasm
//! echo would. It keeps no root and touches no shared data: on this build every
//! configuration shares the process's map, where a root of the echo would find the filter's
//! role marked (and refuse) or lay a table of its own over the filter's.

use std::cell::Cell;
use std::sync::Arc;

use idempotency_core::journey::{echo, Event, Verdict};

use crate::abi::{BodyStatus, Filter, HeadersStatus, HttpFilter, TrailersStatus};
use crate::host::NativeHost;
use crate::loaded::Shared;
use crate::worker;

/// Logged once per process, at the first echo configuration loaded.
pub fn announce() {
    // Once per process; once per thread under test, where each test's mocked log is its
    // thread's own.
    #[cfg(not(test))]
    static ANNOUNCED: std::sync::Once = std::sync::Once::new();
    #[cfg(test)]
    thread_local! {
        static ANNOUNCED: std::sync::Once = const { std::sync::Once::new() };
    }
    #[cfg(test)]
    let announce = |say: fn()| ANNOUNCED.with(|once| once.call_once(say));
    #[cfg(not(test))]
    let announce = |say: fn()| ANNOUNCED.call_once(say);
    announce(|| {
        log::info!(
            "grpc_replay_echo: the native build's filter replays gRPC answers itself and sends \
             no hops, so it does not use this echo (its internal listener, cluster and route \
             can go, docs/grpc.md); the echo still answers the hops of a Wasm build's filter"
        );
    });
}

pub struct EchoFilter {
    shared: Arc<Shared>,
    context_id: u32,
    /// A hook panicked: let the rest through (the hop then gets no echo marker, and its
    /// filter answers UNAVAILABLE; nothing runs).
    failed: bool,
}

impl EchoFilter {
    pub fn new(shared: Arc<Shared>, _filter: &Filter) -> EchoFilter {
        let context_id = worker::new_context_id();
        worker::register(context_id);
        EchoFilter {
            shared,
            context_id,
            failed: false,
        }
    }

    fn feed(&self, filter: &Filter, event: Event) -> Verdict {
        if self.failed {
            return Verdict::Continue;
        }
        // The echo sets no tick: the cell only satisfies the host's shape.
        let tick_ms = Cell::new(0);
        let host = NativeHost {
            configuration: &self.shared.configuration,
            metrics: &self.shared.metrics,
            tick_ms: &tick_ms,
            streams: None,
            main: None,
            request: Some((self.context_id, filter.handle())),
        };
        echo::on(&host, event)
    }
}

impl HttpFilter for EchoFilter {
    fn on_request_headers(&mut self, filter: &Filter, end_of_stream: bool) -> HeadersStatus {
        match self.feed(filter, Event::RequestHeaders { end_of_stream }) {
            Verdict::Continue => HeadersStatus::Continue,
            Verdict::Pause => HeadersStatus::StopIteration,
        }
    }

    fn on_request_body(&mut self, filter: &Filter, end_of_stream: bool) -> BodyStatus {
        let size = filter.request_body_size();
        let event = Event::RequestBody {
            size,
            end_of_stream,
        };
        match self.feed(filter, event) {
            Verdict::Continue => BodyStatus::Continue,
            Verdict::Pause => BodyStatus::StopIterationAndBuffer,
        }
    }

    fn on_request_trailers(&mut self, filter: &Filter) -> TrailersStatus {
        match self.feed(filter, Event::RequestTrailers) {
            Verdict::Continue => TrailersStatus::Continue,
            Verdict::Pause => TrailersStatus::StopIteration,
        }
    }

    fn on_destroy(&mut self) {
        worker::forget(self.context_id);
    }

    /// The hop is answered 503 (a gRPC client reads UNAVAILABLE), so the replay it carries
    /// fails at once rather than waiting for Envoy's timeout; nothing was run for it.
    fn on_panic(&mut self, filter: &Filter) {
        self.failed = true;
        crate::refusing_filter::answer_unavailable(filter, "the replay echo failed on this hop");
    }
}
