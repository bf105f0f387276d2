//! The root context's life: configure (or refuse) a configuration, hand each request its
//! journey, deliver store writes on wake-ups and ticks, and stay after a push retired the
//! configuration until the writes it holds are taken.

use std::rc::Rc;

use crate::host::Host;
use crate::journey::RequestJourney;
use crate::plugin::Plugin;

/// How often the root retries store writes that failed.
pub const STORE_RETRY_TICK_MS: u32 = 200;
/// Without a store: how often the root looks after retired tables.
pub const UPKEEP_TICK_MS: u32 = 1_000;

#[derive(Default)]
pub struct PluginRoot {
    plugin: Option<Rc<Plugin>>,
    /// Envoy is retiring this configuration (a push replaced it) but store writes still wait:
    /// the root stays until they are taken or their deadlines pass.
    finishing: bool,
}

impl PluginRoot {
    pub fn new() -> PluginRoot {
        PluginRoot::default()
    }

    /// False makes Envoy refuse the configuration.
    pub fn on_configure(&mut self, host: &impl Host) -> bool {
        match configure(host) {
            Ok(plugin) => {
                log::info!(
                    "configured {} rule(s); local table holds {} records in {} buckets",
                    plugin.rules.len(),
                    plugin.table.capacity(),
                    plugin.table.bucket_count()
                );
                self.plugin = Some(Rc::new(plugin));
                true
            }
            Err(message) => {
                log::error!("{message}");
                false
            }
        }
    }

    /// A new request's journey; None before a configuration was accepted.
    pub fn new_request(&self) -> Option<RequestJourney> {
        self.plugin
            .as_ref()
            .map(|p| RequestJourney::new(Rc::clone(p)))
    }

    /// A push retired this configuration. Completions and releases still waiting out a store
    /// outage live in this root: keep it (its tick and callouts go on) until they are taken
    /// or their deadlines pass, instead of losing them with it. True: done now.
    pub fn on_done(&mut self) -> bool {
        let pending = self.plugin.as_ref().map_or(0, |p| p.writes.pending());
        if pending == 0 {
            return true;
        }
        log::warn!(
            "configuration retired with {pending} store write(s) still waiting; \
             kept until they are taken or their deadlines pass"
        );
        self.finishing = true;
        false
    }

    /// The store answered a write the root sent.
    pub fn on_callout_answer(
        &mut self,
        host: &impl Host,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        if let Some(plugin) = &self.plugin {
            if !plugin.writes.on_answer(host, token, num_headers, body_size) {
                log::debug!("answer for unknown store call {token} ignored");
            }
        }
        self.finish_if_idle(host);
    }

    /// A request queued a store write.
    pub fn on_queue_ready(&self, host: &impl Host, queue_id: u32) {
        if let Some(plugin) = &self.plugin {
            if plugin.writes.is_wake_queue(queue_id) {
                plugin.writes.on_wake(host);
            }
        }
    }

    pub fn on_tick(&mut self, host: &impl Host) {
        if let Some(plugin) = &self.plugin {
            plugin.writes.on_tick(host);
            plugin.upkeep.on_tick(host);
        }
        self.finish_if_idle(host);
    }

    /// A finishing root whose writes are all taken tells Envoy it is done.
    fn finish_if_idle(&mut self, host: &impl Host) {
        if !self.finishing || self.plugin.as_ref().is_some_and(|p| p.writes.pending() > 0) {
            return;
        }
        self.finishing = false;
        match host.done() {
            Ok(()) => log::info!("retired configuration: every waiting store write was taken"),
            Err(e) => log::warn!("retired configuration not released: {}", e.0),
        }
    }
}

fn configure(host: &impl Host) -> Result<Plugin, String> {
    let bytes = host
        .plugin_configuration()
        .map_err(|e| format!("plugin configuration unreadable: {}", e.0))?;
    let plugin = Plugin::configure(host, &bytes)?;
    // The tick is always set: it retries store writes and empties retired tables.
    let tick = if plugin.uses_store() {
        STORE_RETRY_TICK_MS
    } else {
        UPKEEP_TICK_MS
    };
    host.set_tick_period_ms(tick)
        .map_err(|e| format!("tick period refused: {}", e.0))?;
    Ok(plugin)
}
