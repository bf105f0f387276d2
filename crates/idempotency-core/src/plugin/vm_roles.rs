//! The filter and the gRPC replay echo never share a `vm_id`. Every plugin with one `vm_id`
//! shares one shared-data map (and, with the same code and VM settings, one VM): an echo there
//! would lay out its own local table over the filter's. A configured root marks its role in
//! that map, with the time, and renews the mark on its tick; a configuration of the other
//! role that finds a live mark is refused. Envoy checks a configuration in a VM of its own
//! before it uses it, so the mark (not the module's memory) is what that check can see:
//! Envoy refuses the configuration at start, or refuses the push.

use crate::host::Host;
use crate::plugin::NAMESPACE;

/// How often a configured root renews its mark.
pub const MARK_RENEWAL_MS: u64 = 1_000;
/// A mark older than this belongs to a configuration that is gone.
const MARK_LIFE_MS: u64 = 5 * MARK_RENEWAL_MS;

/// What a configured root context is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Filter,
    ReplayEcho,
}

impl Role {
    fn key(self) -> String {
        let name = match self {
            Role::Filter => "filter",
            Role::ReplayEcho => "replay-echo",
        };
        format!("{NAMESPACE}/vm-roles/{name}")
    }

    fn other(self) -> Role {
        match self {
            Role::Filter => Role::ReplayEcho,
            Role::ReplayEcho => Role::Filter,
        }
    }

    /// Before a root of this role is configured: Err (the configuration is refused) when the
    /// other role runs under this `vm_id`.
    pub fn check(self, host: &impl Host) -> Result<(), String> {
        let now = host.now_ms();
        let other_is_live = match host.get(&self.other().key()) {
            Ok(Some((bytes, _))) => std::str::from_utf8(&bytes)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|at| now.saturating_sub(at) < MARK_LIFE_MS),
            Ok(None) => false,
            Err(e) => {
                log::warn!("vm roles unreadable ({}); not checked", e.0);
                false
            }
        };
        if !other_is_live {
            return Ok(());
        }
        let what = match self {
            Role::ReplayEcho => {
                "this configuration is the gRPC replay echo (grpc_replay_echo: true), and the \
                 filter's rules run under the same vm_id"
            }
            Role::Filter => {
                "this configuration has the filter's rules, and the gRPC replay echo \
                 (grpc_replay_echo: true) runs under the same vm_id"
            }
        };
        Err(format!(
            "invalid plugin configuration: vm_config.vm_id: {what}: the echo would share (and \
             re-lay out) the filter's local table; give the echo's vm_config a vm_id of its own \
             (docs/grpc.md)"
        ))
    }

    /// Marks this role as live under this `vm_id` (at configure, then on the tick).
    pub fn mark(self, host: &impl Host) {
        let now = host.now_ms().to_string();
        if let Err(e) = host.set(&self.key(), now.as_bytes(), None) {
            log::warn!("vm role not marked: {}", e.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_host::FakeHost;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_vm_id_runs_the_filter_or_the_echo_never_both() {
        let host = FakeHost::default();
        assert!(Role::Filter.check(&host).is_ok());
        Role::Filter.mark(&host);
        assert!(Role::Filter.check(&host).is_ok(), "filters share a vm_id");
        let refusal = Role::ReplayEcho.check(&host).unwrap_err();
        assert!(refusal.contains("a vm_id of its own"), "{refusal}");

        // A mark not renewed is a configuration that is gone.
        host.clock_ms.set(host.clock_ms.get() + MARK_LIFE_MS);
        assert!(Role::ReplayEcho.check(&host).is_ok());
        Role::ReplayEcho.mark(&host);
        assert!(Role::Filter
            .check(&host)
            .unwrap_err()
            .contains("the gRPC replay echo (grpc_replay_echo: true) runs under the same vm_id"));
    }
}
