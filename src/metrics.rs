//! One Envoy counter per rule and outcome, defined once at configuration.

use idempotency_core::config::Config;
use idempotency_core::outcome::Outcome;

use crate::host;

const OUTCOMES: usize = Outcome::ALL.len();

pub struct Metrics {
    /// Indexed by rule, then by `Outcome::index`; 0 marks a counter the host refused.
    per_rule: Vec<[u32; OUTCOMES]>,
}

impl Metrics {
    pub fn define(config: &Config) -> Metrics {
        let per_rule = config
            .rules
            .iter()
            .map(|rule| {
                let mut ids = [0u32; OUTCOMES];
                for (slot, outcome) in ids.iter_mut().zip(Outcome::ALL) {
                    match host::define_counter(&outcome.metric_name(&rule.name)) {
                        Ok(id) => *slot = id,
                        Err(status) => log::warn!(
                            "metric {} not defined: {status}",
                            outcome.metric_name(&rule.name)
                        ),
                    }
                }
                ids
            })
            .collect();
        Metrics { per_rule }
    }

    pub fn count(&self, rule: usize, outcome: Outcome) {
        if let Some(&id) = self
            .per_rule
            .get(rule)
            .and_then(|ids| ids.get(outcome.index()))
        {
            if id != 0 {
                host::increment_counter(id);
            }
        }
    }
}
