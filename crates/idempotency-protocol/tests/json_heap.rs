//! The heap a JSON body field read costs, measured with a counting allocator (one test binary
//! of its own, since a global allocator is per binary). The body is given: what is measured is
//! the heap the read takes on top of it, at its peak, for the shapes a hostile sender picks
//! (many tokens, deep nesting, many keys, long strings, the field at the very end).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use idempotency_protocol::naming::fields::RequestBody;

/// Counts the bytes each thread holds, so that tests running beside this one (and the
/// harness) do not show up in its figures.
struct Counting;

thread_local! {
    static HELD: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn grow(by: usize) {
    let _ = HELD.try_with(|held| {
        let now = held.get().saturating_add(by);
        held.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn shrink(by: usize) {
    let _ = HELD.try_with(|held| held.set(held.get().saturating_sub(by)));
}

// SAFETY: every call is passed to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: the caller's contract is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: as for alloc.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        // SAFETY: as for alloc.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Counted as a move: old and new block may both be held while it copies.
        grow(new_size);
        shrink(layout.size());
        // SAFETY: as for alloc.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The peak heap `read` held beyond what was held before it, and its result.
fn extra_peak<T>(read: impl FnOnce() -> T) -> (usize, T) {
    let before = HELD.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let out = read();
    (PEAK.with(Cell::get).saturating_sub(before), out)
}

// The figures, for the commit that changes them: `--nocapture` natively; wasm-bindgen-test
// shows the console of a failing test.
#[cfg(not(target_arch = "wasm32"))]
use std::println as show;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::console_log as show;

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;

/// `[0,0,...]` of about `size` bytes.
fn zeros(size: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(size + 2);
    body.push(b'[');
    while body.len() < size {
        body.extend_from_slice(b"0,");
    }
    body.extend_from_slice(b"0]");
    body
}

/// `{"k0":0,"k1":0,...,"id":"evt_1"}`: `keys` distinct members, the key field last.
fn many_keys(keys: usize) -> Vec<u8> {
    let mut body = b"{".to_vec();
    for i in 0..keys {
        body.extend_from_slice(format!("\"k{i}\":0,").as_bytes());
    }
    body.extend_from_slice(br#""id":"evt_1"}"#);
    body
}

/// `{"a":{"a":...{"id":"evt_1"}...}}`, the key `/a/a/.../id` at nesting `depth`.
fn nested_objects(depth: usize) -> (Vec<u8>, String) {
    let mut body = Vec::new();
    let mut pointer = String::new();
    for _ in 1..depth {
        body.extend_from_slice(br#"{"a":"#);
        pointer.push_str("/a");
    }
    body.extend_from_slice(br#"{"id":"evt_1"}"#);
    body.extend(std::iter::repeat_n(b'}', depth - 1));
    pointer.push_str("/id");
    (body, pointer)
}

/// `{"x":[[[...0...]]],"id":"evt_1"}` with the array `depth` deep.
fn nested_arrays(depth: usize) -> Vec<u8> {
    let mut body = br#"{"x":"#.to_vec();
    body.extend(std::iter::repeat_n(b'[', depth));
    body.push(b'0');
    body.extend(std::iter::repeat_n(b']', depth));
    body.extend_from_slice(br#","id":"evt_1"}"#);
    body
}

/// `{"s":"<unit × n>","id":"evt_1"}`.
fn long_string(unit: &str, size: usize) -> Vec<u8> {
    let mut body = br#"{"s":""#.to_vec();
    while body.len() < size {
        body.extend_from_slice(unit.as_bytes());
    }
    body.extend_from_slice(br#"","id":"evt_1"}"#);
    body
}

/// A read the filter makes: a key source (`json_scalar`) or a fingerprint field
/// (`json_canonical`).
#[derive(Clone, Copy, Debug)]
enum Read {
    Key,
    Fingerprint,
}

struct Shape {
    name: &'static str,
    body: Vec<u8>,
    pointer: String,
    read: Read,
    /// What the read must give: the value's bytes, or the start of the error's text.
    expect: &'static str,
    /// The heap the read may take beyond the body.
    allowed: usize,
}

fn key(name: &'static str, body: Vec<u8>, pointer: &str, expect: &'static str) -> Shape {
    Shape {
        name,
        body,
        pointer: pointer.to_string(),
        read: Read::Key,
        expect,
        allowed: SMALL,
    }
}

/// What a read may take beyond the body when the fields it selects are small: a few words per
/// level of the pointers' paths, whatever the body's token count, nesting or number of keys.
const SMALL: usize = 64 * KIB;

/// `[<unit>,<unit>,...,<unit>]` of about `size` bytes.
fn array_of(unit: &str, size: usize) -> Vec<u8> {
    let mut body = b"[".to_vec();
    while body.len() < size {
        body.extend_from_slice(unit.as_bytes());
        body.push(b',');
    }
    body.extend_from_slice(unit.as_bytes());
    body.push(b']');
    body
}

/// `{"a":<value>,"data":{"object":{"id":"evt_1","amount":1200}}}`: the fields after it.
fn then_fields(value: &[u8]) -> Vec<u8> {
    let mut body = br#"{"a":"#.to_vec();
    body.extend_from_slice(value);
    body.extend_from_slice(br#","data":{"object":{"id":"evt_1","amount":1200}}}"#);
    body
}

fn shapes() -> Vec<Shape> {
    let id = "/data/object/id";
    let (deep_body, deep_pointer) = nested_objects(127);
    let mut too_deep = br#"{"id":"evt_1","x":"#.to_vec();
    too_deep.extend(std::iter::repeat_n(b'[', MIB));
    vec![
        key("1 MiB array of zeros, /0", zeros(MIB), "/0", "0"),
        key(
            "1 MiB array of zeros, its last element",
            zeros(MIB),
            &format!("/{}", MIB / 2),
            "0",
        ),
        key(
            "1 MiB array of zeros, the field after it",
            then_fields(&zeros(MIB)),
            id,
            "evt_1",
        ),
        Shape {
            read: Read::Fingerprint,
            expect: r#"{"amount":1200,"id":"evt_1"}"#,
            ..key(
                "1 MiB array of zeros, fingerprint after it",
                then_fields(&zeros(MIB)),
                "/data/object",
                "",
            )
        },
        key(
            "100k distinct keys, the field last",
            many_keys(100_000),
            "/id",
            "evt_1",
        ),
        Shape {
            read: Read::Fingerprint,
            expect: r#""evt_1""#,
            ..key(
                "100k distinct keys, fingerprint of the last",
                many_keys(100_000),
                "/id",
                "",
            )
        },
        key(
            "objects 127 deep (the limit), the field at the bottom",
            deep_body,
            &deep_pointer,
            "evt_1",
        ),
        key(
            "arrays 126 deep in an object (the limit) beside the field",
            nested_arrays(126),
            "/id",
            "evt_1",
        ),
        key(
            "arrays 1 MiB deep (beyond the limit)",
            too_deep,
            "/id",
            "the body cannot be parsed: invalid JSON: recursion limit exceeded",
        ),
        key(
            "1 MiB string beside the field",
            long_string("a", MIB),
            "/id",
            "evt_1",
        ),
        Shape {
            // serde_json decodes a string with escapes in its scratch buffer, which grows by
            // doubling: up to twice the decoded string (512 KiB here), once.
            allowed: MIB + SMALL,
            ..key(
                "1 MiB string of escapes beside the field",
                long_string(r"\n", MIB),
                "/id",
                "evt_1",
            )
        },
        key(
            "1 MiB of short strings, the field after it",
            then_fields(&array_of(r#""ab""#, MIB)),
            id,
            "evt_1",
        ),
        key(
            "1 MiB of empty objects and arrays, the field after it",
            then_fields(&array_of("{},[]", MIB)),
            id,
            "evt_1",
        ),
        key(
            "1 MiB of numbers of every kind, the field after it",
            then_fields(&array_of("-1.5e+3,12345678901234567890123,0.25", MIB)),
            id,
            "evt_1",
        ),
        Shape {
            read: Read::Fingerprint,
            expect: r#"{"id":"evt_1","k0":0,"k1":0,"k10":0,"#,
            // Proportional to the selected value, all of the body here: its text, being
            // written and sorted, and three offsets a member.
            allowed: 6 * MIB,
            ..key(
                "100k distinct keys, fingerprint of all of it",
                many_keys(100_000),
                "",
                "",
            )
        },
    ]
}

/// What a key or fingerprint read costs, beyond the body: a small constant whatever the
/// body's token count, nesting or number of keys.
#[test]
fn a_body_field_costs_little_more_than_the_body() {
    let mut over = Vec::new();
    for s in shapes() {
        let (extra, read) = extra_peak(|| {
            let mut body = RequestBody::new("application/json", &s.body);
            match s.read {
                Read::Key => body.json_scalar(&s.pointer),
                Read::Fingerprint => body
                    .json_canonical(&s.pointer)
                    .map(Option::unwrap_or_default),
            }
        });
        let shown = match &read {
            Ok(v) => String::from_utf8_lossy(v).into_owned(),
            Err(e) => e.to_string(),
        };
        show!(
            "{:<55} body {:>8} B, peak beyond it {:>9} B ({shown:.60})",
            s.name,
            s.body.len(),
            extra,
        );
        assert!(shown.starts_with(s.expect), "{}: {shown}", s.name);
        if extra > s.allowed {
            over.push((s.name, extra, s.allowed));
        }
    }
    assert!(over.is_empty(), "over the allowed heap: {over:#?}");
}
