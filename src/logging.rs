//! Routes the `log` crate to Envoy's log without the SDK logger, which unwraps host statuses.

use crate::host;

struct HostLogger;

static LOGGER: HostLogger = HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        // proxy-wasm levels: trace 0, debug 1, info 2, warn 3, error 4.
        let level = match record.level() {
            log::Level::Trace => 0,
            log::Level::Debug => 1,
            log::Level::Info => 2,
            log::Level::Warn => 3,
            log::Level::Error => 4,
        };
        host::log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}

pub fn install() {
    // Fails only if a logger is already installed, which then keeps working.
    let _ = log::set_logger(&LOGGER);
    // Envoy filters by its own --log-level / component level as well.
    log::set_max_level(log::LevelFilter::Debug);
    std::panic::set_hook(Box::new(|info| {
        // Reached only by a bug: say where before the VM traps.
        host::log(5, &format!("idempotency: panic: {info}"));
    }));
}
