//! A rule as the flow uses it: the configured rule, the store that confirms its claims
//! (cluster mode) and its counters, resolved once at configuration.

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
        RuleHandle {
            store: rule.store.clone().map(Rc::new),
            rule,
            counters,
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
