//! The store binary as a network server: silent, half-open and abandoned
//! connections are closed, the connection limit holds, connections that never authenticate
//! cannot hold the store, and SIGTERM ends the process within its grace period whatever the
//! clients are doing.

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
use idempotency_store::grpc::pb;
use idempotency_store::grpc::pb::store_client::StoreClient;

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
            // All from one address: room for every one of them to wait for its timeout.
            "--max-unauthenticated-connections-per-peer",
            "256",
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

/// An HTTP/1.1 keep-alive connection that has made an authenticated request (any data-plane
/// request does under `--insecure-no-auth`), read its answer, and stays open.
async fn open_authenticated_keep_alive(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let body = format!(
        r#"{{"lease_ms":1000,"leases":[{{"key":"{}","owner":"ab"}}]}}"#,
        "a".repeat(64)
    );
    let request = format!(
        "POST /v1/renew HTTP/1.1\r\nhost: store\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"}") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("an answer to the renew")
            .unwrap();
        assert!(n > 0, "closed before answering: {got:?}");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    s
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
    // Authenticated connections: silent ones would push each other out (see below).
    let mut held = Vec::new();
    for _ in 0..LIMIT {
        held.push(open_authenticated_keep_alive(&addr).await);
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

const TOKEN: &str = "connections-test-token";

/// An HTTP/2 connection that asked `GET /healthz` (no token needed) and then sits idle, as a
/// peer holding connections on purpose would.
async fn open_h2_healthz(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&[H2_PREFACE, H2_SETTINGS, &h2_get_healthz()].concat())
        .await
        .unwrap();
    s
}

/// A connection that never authenticates, of one of several kinds.
async fn open_unauthenticated(addr: &str, i: usize) -> TcpStream {
    match i % 4 {
        0 => open_h2_healthz(addr).await,
        1 => open_stalled(addr, Stall::IdleKeepAlive).await,
        2 => open_stalled(addr, Stall::Silent).await,
        _ => open_stalled(addr, Stall::PartialHeaders).await,
    }
}

/// Whether the store has closed `s` (it reads to the end of what the store sent).
async fn is_closed(s: &mut TcpStream) -> bool {
    closed_within(s, Duration::from_millis(100)).await.is_some()
}

/// A gRPC stream with the data-plane token, on a connection of its own.
struct Stream {
    calls: tokio::sync::mpsc::Sender<pb::Call>,
    answers: tonic::Streaming<pb::Answer>,
    next_id: u64,
}

impl Stream {
    async fn open(addr: &str) -> Self {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .unwrap();
        let (calls, rx) = tokio::sync::mpsc::channel(16);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        let answers = tokio::time::timeout(
            Duration::from_secs(5),
            StoreClient::new(channel).coordinate(request),
        )
        .await
        .expect("the stream was not answered")
        .unwrap()
        .into_inner();
        Self {
            calls,
            answers,
            next_id: 1,
        }
    }

    /// Claims a fresh key: the store must answer `claimed`.
    async fn claims(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let key = common::random_digest();
        let call = pb::Call {
            id,
            op: Some(pb::call::Op::Claim(pb::Claim {
                key: key.as_str().to_owned(),
                fingerprint: "f".repeat(64),
                lease_ms: 60_000,
                owner: String::new(),
            })),
        };
        self.calls.send(call).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(5), self.answers.message())
            .await
            .expect("the claim was not answered")
            .unwrap()
            .unwrap();
        assert_eq!(answer.id, id);
        assert!(
            matches!(answer.result, Some(pb::answer::Result::Claimed(_))),
            "{answer:?}"
        );
    }
}

/// The store's /metrics, as text.
async fn metrics_of(addr: &str) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from\n{metrics}"))
}

/// The issue's attack: a peer that reaches the store's port takes connections and holds them
/// (`/healthz` needs no token, and an idle connection used to live 300 s). It used to hold
/// every slot, and a filter that connected afterwards (a restart, a new pod) waited in the
/// listen backlog until its calls timed out. Now connections that have not authenticated
/// take a share of the slots only, each newcomer pushes out the oldest of them, and the
/// filter's streams are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_holding_connections_cannot_keep_an_authenticated_stream_out() {
    const LIMIT: usize = 16;
    const WAITING: usize = 4;
    let (_run, addr) = start(
        &[
            "--backend",
            "memory",
            "--max-connections",
            &LIMIT.to_string(),
            "--max-unauthenticated-connections",
            &WAITING.to_string(),
            // Neither timeout frees anything during the test: only the limits do.
            "--unauthenticated-timeout-secs",
            "60",
            "--header-read-timeout-secs",
            "60",
            "--idle-timeout-secs",
            "300",
        ],
        &[("IDEMPOTENCY_STORE_TOKEN", TOKEN)],
    );
    // More than every slot of the store.
    let mut hostile = Vec::new();
    for i in 0..3 * LIMIT {
        hostile.push(open_unauthenticated(&addr, i).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut open = Vec::new();
    for (i, s) in hostile.iter_mut().enumerate() {
        if !is_closed(s).await {
            open.push(i);
        }
    }
    let newest: Vec<usize> = (3 * LIMIT - WAITING..3 * LIMIT).collect();
    assert_eq!(open, newest, "only the newest {WAITING} of them are held");

    // A filter connecting now: its streams are taken and served, more of them than the
    // waiting connections may hold.
    let mut streams = Vec::new();
    for _ in 0..2 * WAITING {
        let mut stream = Stream::open(&addr).await;
        stream.claims().await;
        streams.push(stream);
    }
    // More hostile connections push out the unauthenticated ones only.
    for i in 0..2 * LIMIT {
        hostile.push(open_unauthenticated(&addr, i).await);
    }
    for stream in &mut streams {
        stream.claims().await;
    }
    let metrics = metrics_of(&addr).await;
    assert_eq!(
        sample(
            &metrics,
            r#"idempotency_store_connections{state="authenticated"}"#
        ),
        (2 * WAITING) as f64
    );
    assert!(
        sample(
            &metrics,
            r#"idempotency_store_connections{state="unauthenticated"}"#
        ) <= WAITING as f64
    );
    // All from one address here, so the per-peer limit (never above the share) pushed them
    // out.
    let pushed_out: f64 = ["evicted", "peer_limit"]
        .iter()
        .map(|why| {
            sample(
                &metrics,
                &format!(
                    "idempotency_store_unauthenticated_connections_closed_total{{reason=\"{why}\"}}"
                ),
            )
        })
        .sum();
    assert!(
        pushed_out >= (5 * LIMIT - 2 * WAITING) as f64,
        "{pushed_out}"
    );
}

/// A connection has `--unauthenticated-timeout-secs` to show a token; one that did is served
/// like before (here: kept until the idle timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_does_not_authenticate_in_time_is_closed() {
    let (_run, addr) = start(
        &[
            "--backend",
            "memory",
            "--insecure-no-auth",
            "--unauthenticated-timeout-secs",
            "1",
            "--header-read-timeout-secs",
            "60",
            "--idle-timeout-secs",
            "60",
        ],
        &[],
    );
    let opened = Instant::now();
    let mut h2_probe = open_h2_healthz(&addr).await;
    let mut h1_probe = open_stalled(&addr, Stall::IdleKeepAlive).await;
    let mut silent = open_stalled(&addr, Stall::Silent).await;
    let mut filter = open_authenticated_keep_alive(&addr).await;
    for (what, s) in [
        ("h2 /healthz", &mut h2_probe),
        ("h1 /healthz", &mut h1_probe),
        ("silent", &mut silent),
    ] {
        let seen = closed_within(s, Duration::from_secs(4))
            .await
            .unwrap_or_else(|| panic!("{what}: still open 4 s after a 1 s limit"));
        if what != "silent" {
            assert!(
                seen.starts_with(b"HTTP/1.1 200") || what.starts_with("h2"),
                "{what}: answered before it was closed: {seen:?}"
            );
        }
    }
    let took = opened.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(
        closed_within(&mut filter, Duration::from_secs(1))
            .await
            .is_none(),
        "the authenticated connection was closed with them"
    );
    let metrics = metrics_of(&addr).await;
    assert_eq!(
        sample(
            &metrics,
            r#"idempotency_store_unauthenticated_connections_closed_total{reason="timeout"}"#
        ),
        3.0
    );
}

/// Connects to `addr` from the loopback address `from` (127.0.0.0/8 is all loopback on
/// Linux), as another peer would.
async fn connect_from(addr: &str, from: [u8; 4]) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::from((from, 0))).unwrap();
    socket.connect(addr.parse().unwrap()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_take_every_waiting_place() {
    let (_run, addr) = start(
        &[
            "--backend",
            "memory",
            "--insecure-no-auth",
            "--max-unauthenticated-connections",
            "8",
            "--max-unauthenticated-connections-per-peer",
            "2",
            "--unauthenticated-timeout-secs",
            "60",
            "--header-read-timeout-secs",
            "60",
        ],
        &[],
    );
    let mut others = Vec::new();
    for from in [[127, 0, 0, 3], [127, 0, 0, 4]] {
        others.push(connect_from(&addr, from).await);
    }
    let mut greedy = Vec::new();
    for _ in 0..6 {
        greedy.push(connect_from(&addr, [127, 0, 0, 2]).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut open = Vec::new();
    for s in &mut greedy {
        open.push(!is_closed(s).await);
    }
    assert_eq!(open, [false, false, false, false, true, true]);
    for s in &mut others {
        assert!(
            !is_closed(s).await,
            "another peer's connection was pushed out"
        );
    }
    let metrics = metrics_of(&addr).await;
    assert_eq!(
        sample(
            &metrics,
            r#"idempotency_store_unauthenticated_connections_closed_total{reason="peer_limit"}"#
        ),
        4.0
    );
}

#[test]
fn the_unauthenticated_share_must_leave_room_for_the_rest() {
    let out = std::process::Command::new(common::BIN)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "memory",
            "--insecure-no-auth",
        ])
        .args([
            "--max-connections",
            "10",
            "--max-unauthenticated-connections",
            "10",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--max-unauthenticated-connections 10 must be below --max-connections 10"),
        "{stderr}"
    );
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

/// GET /healthz on stream 1 (HPACK: indexed :method GET and :scheme http, literal :path and
/// :authority), END_STREAM | END_HEADERS.
fn h2_get_healthz() -> Vec<u8> {
    const FRAME_HEADERS: u8 = 1;
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
    headers
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
    let mut s = open_h2_healthz(&addr).await;
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
