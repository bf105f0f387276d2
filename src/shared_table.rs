//! Envoy's shared data as the core table's `SharedData`.

use idempotency_core::table::{HostError, SetOutcome, SharedData};

use crate::host::{self, HostStatus};

pub struct EnvoySharedData;

impl SharedData for EnvoySharedData {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        match host::get_shared_data(key) {
            Ok(Some((value, cas))) => Ok(Some((value.unwrap_or_default(), cas))),
            Ok(None) => Ok(None),
            Err(status) => Err(HostError(status.to_string())),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        match host::set_shared_data(key, value, cas.unwrap_or(0)) {
            Ok(()) => Ok(SetOutcome::Stored),
            Err(HostStatus::CAS_MISMATCH) => Ok(SetOutcome::CasMismatch),
            Err(status) => Err(HostError(status.to_string())),
        }
    }
}
