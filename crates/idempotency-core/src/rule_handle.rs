//! A rule as the flow uses it: the configured rule, the store that confirms its claims
//! (cluster mode), its counters, and how it treats the gRPC calls it matches, resolved once
//! at configuration.

use std::cell::Cell;
use std::rc::Rc;

use crate::config::{Rule, StoreConfig};
use crate::host::Host;
use crate::outcome::Outcome;

const OUTCOMES: usize = Outcome::ALL.len();

pub struct RuleHandle {
    pub rule: Rule,
    /// Shared with the store writes this rule's requests leave behind.
    pub store: Option<Rc<StoreConfig>>,
    /// Counter ids by `Outcome::index`; 0 marks a counter the host refused.
    counters: [u32; OUTCOMES],
    /// An HTTP rule's treatment of the gRPC calls it matches; None for a gRPC rule.
    pub grpc_calls: Option<GrpcCalls>,
}

/// What an HTTP rule does with a gRPC call it matches: never HTTP's semantics (a gRPC client
/// reads an HTTP 409 as UNKNOWN, and a call's status is in its trailers, not its HTTP status).
pub struct GrpcCalls {
    /// The rule with gRPC's semantics, sharing the rule's name, store and counters; Err says
    /// what of the rule a gRPC call cannot honour, and such calls pass unprotected.
    pub as_grpc: Result<Rc<RuleHandle>, String>,
    /// A call passed unprotected was already logged on this worker.
    pub warned: Cell<bool>,
}

impl RuleHandle {
    /// Defines the rule's counters. A refused counter is logged and not counted, never
    /// fatal: the configuration matters more than one metric.
    pub fn resolve(rule: Rule, host: &impl Host) -> RuleHandle {
        let mut counters = [0u32; OUTCOMES];
        for (slot, outcome) in counters.iter_mut().zip(Outcome::ALL) {
            let name = outcome.metric_name(&rule.name);
            match host.define_counter(&name) {
                Ok(id) => *slot = id,
                Err(e) => log::warn!("metric {name} not defined: {}", e.0),
            }
        }
        let store = rule.store.clone().map(Rc::new);
        let grpc_calls = match rule.grpc {
            Some(_) => None,
            None => Some(GrpcCalls {
                as_grpc: rule.for_grpc_calls().map(|as_grpc| {
                    Rc::new(RuleHandle {
                        rule: as_grpc,
                        store: store.clone(),
                        counters,
                        grpc_calls: None,
                    })
                }),
                warned: Cell::new(false),
            }),
        };
        RuleHandle {
            store,
            rule,
            counters,
            grpc_calls,
        }
    }

    pub fn count(&self, host: &impl Host, outcome: Outcome) {
        if let Some(&id) = self.counters.get(outcome.index()) {
            if id != 0 {
                host.increment_counter(id);
            }
        }
    }

    /// How problem details name where the rule's key comes from.
    pub fn key_label(&self) -> String {
        match self.rule.key_sources.as_slice() {
            [one] => one.describe(),
            many => format!(
                "combined key ({})",
                many.iter()
                    .map(|s| s.describe())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

impl AsRef<Rule> for RuleHandle {
    fn as_ref(&self) -> &Rule {
        &self.rule
    }
}

/// Selection runs over the plugin's shared handles.
impl AsRef<Rule> for Rc<RuleHandle> {
    fn as_ref(&self) -> &Rule {
        &self.rule
    }
}
