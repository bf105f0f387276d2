//! Each request's filter: turns Envoy's callbacks into events of core's journey and its
//! verdicts into actions. Where the journey goes is decided in
//! `idempotency_core::journey`.

use std::cell::RefCell;
use std::rc::Rc;

use idempotency_core::journey::{Event, RequestJourney, Verdict};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::envoy_host::EnvoyHost;

pub struct HttpFilter {
    /// Shared with the root, which hands it the answers that arrive on the store stream.
    journey: Rc<RefCell<RequestJourney>>,
}

impl HttpFilter {
    pub fn new(journey: Rc<RefCell<RequestJourney>>) -> HttpFilter {
        HttpFilter { journey }
    }

    fn feed(&mut self, event: Event) -> Action {
        crate::envoy_host::new_callback();
        // Envoy runs one callback at a time, so the root never holds the journey now.
        let verdict = match self.journey.try_borrow_mut() {
            Ok(mut journey) => journey.on(&EnvoyHost, event),
            Err(_) => {
                log::error!("request journey busy; the event is let through");
                Verdict::Continue
            }
        };
        match verdict {
            Verdict::Continue => Action::Continue,
            Verdict::Pause => Action::Pause,
        }
    }
}

impl Context for HttpFilter {
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        // The journey resumes the request itself when it decides to.
        self.feed(Event::CalloutAnswer {
            token,
            num_headers,
            body_size,
        });
    }
}

impl HttpContext for HttpFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.feed(Event::RequestHeaders { end_of_stream })
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        self.feed(Event::RequestBody {
            size,
            end_of_stream,
        })
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.feed(Event::RequestTrailers)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.feed(Event::ResponseHeaders { end_of_stream })
    }

    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        self.feed(Event::ResponseBody {
            size,
            end_of_stream,
        })
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.feed(Event::ResponseTrailers)
    }

    fn on_log(&mut self) {
        self.feed(Event::StreamEnd);
    }
}
