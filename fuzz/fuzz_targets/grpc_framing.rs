#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_fuzz_checks::grpc_framing(data));
