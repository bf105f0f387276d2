//! Logs a recurring failure once per burst: the first occurrence, then at most once per
//! window with the number of repeats in between, so a down store cannot flood Envoy's log.

#[derive(Debug)]
pub struct BurstLog {
    window_ms: u64,
    last_logged_ms: Option<u64>,
    suppressed: u64,
}

impl BurstLog {
    pub const fn new(window_ms: u64) -> BurstLog {
        BurstLog {
            window_ms,
            last_logged_ms: None,
            suppressed: 0,
        }
    }

    /// Some(number of occurrences suppressed since the last log line) when this one should be
    /// logged; None when it should be counted silently.
    pub fn admit(&mut self, now_ms: u64) -> Option<u64> {
        match self.last_logged_ms {
            Some(last) if now_ms.saturating_sub(last) < self.window_ms => {
                self.suppressed = self.suppressed.saturating_add(1);
                None
            }
            _ => {
                self.last_logged_ms = Some(now_ms);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn logs_the_first_then_once_per_window_with_the_repeat_count() {
        let mut b = BurstLog::new(1_000);
        assert_eq!(b.admit(0), Some(0));
        assert_eq!(b.admit(10), None);
        assert_eq!(b.admit(999), None);
        assert_eq!(b.admit(1_000), Some(2));
        assert_eq!(b.admit(5_000), Some(0));
    }
}
