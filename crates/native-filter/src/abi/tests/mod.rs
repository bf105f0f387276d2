//! Tests over a mocked ABI.
