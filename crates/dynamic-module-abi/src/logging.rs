//! Envoy's log, and a `log` crate logger over it.

use crate::buffers::module_buffer;
use crate::ffi;

/// Envoy log levels (`--component-log-level dynamic_modules:<level>` selects them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
    Critical,
}

impl LogLevel {
    fn raw(self) -> ffi::LogLevel {
        match self {
            LogLevel::Trace => ffi::LOG_LEVEL_TRACE,
            LogLevel::Debug => ffi::LOG_LEVEL_DEBUG,
            LogLevel::Info => ffi::LOG_LEVEL_INFO,
            LogLevel::Warn => ffi::LOG_LEVEL_WARN,
            LogLevel::Error => ffi::LOG_LEVEL_ERROR,
            LogLevel::Critical => ffi::LOG_LEVEL_CRITICAL,
        }
    }
}

/// Whether Envoy would print a message at `level` (cheap; skip formatting otherwise).
pub fn log_enabled(level: LogLevel) -> bool {
    // SAFETY: plain query, any thread.
    unsafe { ffi::envoy_dynamic_module_callback_log_enabled(level.raw()) }
}

/// Writes `message` to Envoy's log under `[dynamic_modules]`, from any thread.
pub fn log(level: LogLevel, message: &str) {
    // SAFETY: the message is read during the call.
    unsafe {
        ffi::envoy_dynamic_module_callback_log(level.raw(), module_buffer(message.as_bytes()))
    }
}

/// The `log` crate's macros, into Envoy's log.
struct EnvoyLogger;

impl EnvoyLogger {
    fn level(level: ::log::Level) -> LogLevel {
        match level {
            ::log::Level::Error => LogLevel::Error,
            ::log::Level::Warn => LogLevel::Warn,
            ::log::Level::Info => LogLevel::Info,
            ::log::Level::Debug => LogLevel::Debug,
            ::log::Level::Trace => LogLevel::Trace,
        }
    }
}

impl ::log::Log for EnvoyLogger {
    fn enabled(&self, metadata: &::log::Metadata<'_>) -> bool {
        log_enabled(Self::level(metadata.level()))
    }

    fn log(&self, record: &::log::Record<'_>) {
        let level = Self::level(record.level());
        if log_enabled(level) {
            log(level, &record.args().to_string());
        }
    }

    fn flush(&self) {}
}

static LOGGER: EnvoyLogger = EnvoyLogger;

/// Routes the `log` crate to Envoy (once per process; later calls change nothing).
pub fn install_logger() {
    if ::log::set_logger(&LOGGER).is_ok() {
        ::log::set_max_level(::log::LevelFilter::Trace);
    }
}
