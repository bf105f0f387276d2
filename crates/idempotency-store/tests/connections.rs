//! The store binary as a network server: silent, half-open and abandoned
//! connections are closed, the connection limit holds, and SIGTERM ends the
//! process within its grace period whatever the clients are doing.

// Test code: a failed unwrap/index is a failed test, which is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use common::{sigterm, start, wait_exit_within};

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame.
const H2_SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

/// The ways a client can open a connection and then stall.
#[derive(Debug, Clone, Copy)]
enum Stall {
    /// Connects and sends nothing.
    Silent,
    /// Half a request line and header block.
    PartialHeaders,
    /// Part of the HTTP/2 preface.
    PartialPreface,
    /// A whole HTTP/2 preface and SETTINGS, but never a request.
    H2NoRequest,
    /// One complete HTTP/1.1 request, answered, then keep-alive silence.
    IdleKeepAlive,
    /// Complete headers of a POST whose body never arrives (the request is
    /// in flight, waiting for it).
    PartialBody,
}

const STALLS: [Stall; 6] = [
    Stall::Silent,
    Stall::PartialHeaders,
    Stall::PartialPreface,
    Stall::H2NoRequest,
    Stall::IdleKeepAlive,
    Stall::PartialBody,
];

async fn open_stalled(addr: &str, stall: Stall) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let bytes: Vec<u8> = match stall {
        Stall::Silent => Vec::new(),
        Stall::PartialHeaders => b"POST /v1/claim HTTP/1.1\r\nhost: store\r\ncontent-ty".to_vec(),
        Stall::PartialPreface => H2_PREFACE[..10].to_vec(),
        Stall::H2NoRequest => [H2_PREFACE, H2_SETTINGS].concat(),
        Stall::IdleKeepAlive => b"GET /healthz HTTP/1.1\r\nhost: store\r\n\r\n".to_vec(),
        Stall::PartialBody => {
            b"POST /v1/claim HTTP/1.1\r\nhost: store\r\ncontent-length: 100\r\n\r\n{\"key\":"
                .to_vec()
        }
    };
    s.write_all(&bytes).await.unwrap();
    s
}

/// Reads until the server closes the connection (EOF or reset); `None` if
/// it is still open after `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

async fn healthz_on(s: &mut TcpStream) {
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: store\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_are_closed_after_the_header_read_timeout() {
    let (_run, addr) = start(
        &[
            "--backend",
            "memory",
            "--insecure-no-auth",
            "--header-read-timeout-secs",
            "1",
            "--idle-timeout-secs",
            "60",
        ],
        &[],
    );
    // Everything but a request in flight: that one is the idle timeout's
    // (and the shutdown grace's) business, not the header timeout's.
    let kinds: Vec<Stall> = STALLS
        .into_iter()
        .filter(|k| !matches!(k, Stall::PartialBody))
        .collect();
    let opened = Instant::now();
    let mut conns = JoinSet::new();
    for i in 0..200 {
        let kind = kinds[i % kinds.len()];
        let addr = addr.clone();
        conns.spawn(async move {
            let mut s = open_stalled(&addr, kind).await;
            let seen = closed_within(&mut s, Duration::from_secs(8)).await;
            (kind, seen, opened.elapsed())
        });
    }
    let mut slowest = Duration::ZERO;
    while let Some(done) = conns.join_next().await {
        let (kind, seen, after) = done.unwrap();
        let Some(seen) = seen else {
            panic!("a {kind:?} connection was still open 8 s after the 1 s header timeout");
        };
        if matches!(kind, Stall::IdleKeepAlive) {
            assert!(seen.starts_with(b"HTTP/1.1 200"), "{kind:?}: {seen:?}");
        }
        slowest = slowest.max(after);
    }
    println!("200 stalled connections, the last closed {slowest:?} after opening");
    assert!(slowest < Duration::from_secs(4), "{slowest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_limit_holds() {
    const LIMIT: usize = 8;
    let (_run, addr) = start(
        &[
            "--backend",
            "memory",
            "--insecure-no-auth",
            "--max-connections",
            &LIMIT.to_string(),
            "--header-read-timeout-secs",
            "60",
        ],
        &[],
    );
    let mut held = Vec::new();
    for _ in 0..LIMIT {
        held.push(open_stalled(&addr, Stall::Silent).await);
    }
    // One over the limit: the kernel completes the handshake, but the store
    // does not take the connection while all its slots are in use.
    let mut extra = TcpStream::connect(&addr).await.unwrap();
    healthz_on(&mut extra).await;
    let mut buf = [0u8; 64];
    assert!(
        tokio::time::timeout(Duration::from_secs(1), extra.read(&mut buf))
            .await
            .is_err(),
        "a connection over the limit of {LIMIT} was served"
    );
    // A slot frees up: the waiting client is served.
    drop(held.pop());
    let answer = closed_within(&mut extra, Duration::from_secs(5))
        .await
        .expect("the waiting connection was not served once a slot was free");
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    // The others were held open all along, not dropped to make room.
    for s in &mut held {
        assert!(closed_within(s, Duration::from_millis(50)).await.is_none());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_process_within_the_grace_period() {
    const GRACE_SECS: u64 = 2;
    let (mut run, addr) = start(
        &[
            "--backend",
            "memory",
            "--insecure-no-auth",
            "--header-read-timeout-secs",
            "60",
            "--idle-timeout-secs",
            "60",
            "--shutdown-grace-secs",
            &GRACE_SECS.to_string(),
        ],
        &[],
    );
    let mut stalled = Vec::new();
    for i in 0..200 {
        stalled.push(open_stalled(&addr, STALLS[i % STALLS.len()]).await);
    }
    // The store still serves while they hang around.
    let mut probe = TcpStream::connect(&addr).await.unwrap();
    healthz_on(&mut probe).await;
    let answer = closed_within(&mut probe, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");

    let signalled = Instant::now();
    sigterm(&run.0);
    let status = wait_exit_within(&mut run.0, Duration::from_secs(GRACE_SECS + 4));
    let took = signalled.elapsed();
    println!("exited {took:?} after SIGTERM with 200 stalled connections open");
    let status = status
        .unwrap_or_else(|| panic!("still running {took:?} after SIGTERM (grace {GRACE_SECS} s)"));
    assert!(status.success(), "{status:?}");
    assert!(
        took < Duration::from_secs(GRACE_SECS + 2),
        "{took:?} after SIGTERM"
    );
    // And every one of them has been closed, not left dangling.
    for s in &mut stalled {
        assert!(closed_within(s, Duration::from_secs(1)).await.is_some());
    }
}

/// Reads HTTP/2 frames until the connection closes; returns the frame types
/// seen, or `None` if it is still open after `limit`.
async fn h2_frames_until_close(s: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut types = Vec::new();
    loop {
        let mut head = [0u8; 9];
        match tokio::time::timeout_at(deadline, s.read_exact(&mut head)).await {
            Err(_) => return None,
            Ok(Err(_)) => return Some(types),
            Ok(Ok(_)) => {}
        }
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        types.push(head[3]);
        let mut payload = vec![0u8; len];
        match tokio::time::timeout_at(deadline, s.read_exact(&mut payload)).await {
            Err(_) => return None,
            Ok(Err(_)) => return Some(types),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_peer_that_stops_answering_pings_is_dropped() {
    const FRAME_HEADERS: u8 = 1;
    const FRAME_PING: u8 = 6;
    let (_run, addr) = start(
        &[
            "--backend",
            "memory",
            "--insecure-no-auth",
            "--header-read-timeout-secs",
            "60",
            "--idle-timeout-secs",
            "60",
            "--h2-keepalive-interval-secs",
            "1",
            "--h2-keepalive-timeout-secs",
            "1",
        ],
        &[],
    );
    let mut s = TcpStream::connect(&addr).await.unwrap();
    // GET /healthz on stream 1 (HPACK: indexed :method GET and :scheme http,
    // literal :path and :authority), END_STREAM | END_HEADERS.
    let block: Vec<u8> = [
        &[0x82, 0x86, 0x04, 8][..],
        b"/healthz",
        &[0x01, 5],
        b"store",
    ]
    .concat();
    let mut headers = vec![
        0,
        0,
        u8::try_from(block.len()).unwrap(),
        FRAME_HEADERS,
        0x05,
        0,
        0,
        0,
        1,
    ];
    headers.extend_from_slice(&block);
    s.write_all(&[H2_PREFACE, H2_SETTINGS, &headers].concat())
        .await
        .unwrap();
    // From here on this peer reads but never answers anything, PINGs included,
    // like one whose process hangs behind a live socket.
    let started = Instant::now();
    let frames = h2_frames_until_close(&mut s, Duration::from_secs(8))
        .await
        .unwrap_or_else(|| panic!("the silent HTTP/2 peer was not dropped within 8 s"));
    println!(
        "dropped after {:?}; frames seen {frames:?}",
        started.elapsed()
    );
    assert!(
        frames.contains(&FRAME_HEADERS),
        "the request was answered: {frames:?}"
    );
    assert!(frames.contains(&FRAME_PING), "the store pinged: {frames:?}");
}
