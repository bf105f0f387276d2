//! Drives the server over real loopback sockets: in-process for behaviour,
//! and once as a child process for the command line.

// The helpers below are test code too (clippy only exempts `#[test]` fns):
// a failing unwrap here is a failing test.
#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use demo_upstream::{serve, Counters, Options, BODY_PATTERN};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{handshake, SendRequest};
use hyper::header::HeaderMap;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::net::{TcpListener, TcpStream};

async fn start(options: Options) -> (SocketAddr, Arc<Counters>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counters = Arc::new(Counters::default());
    tokio::spawn(serve(listener, options, Arc::clone(&counters)));
    (addr, counters)
}

async fn connect(addr: SocketAddr) -> SendRequest<Full<Bytes>> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    sender
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).unwrap().to_str().unwrap()
    }
    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }
}

async fn send_on(
    sender: &mut SendRequest<Full<Bytes>>,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &'static [u8],
) -> Answer {
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "test");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from_static(body))).unwrap();
    sender.ready().await.unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .unwrap()
        .unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

async fn send(
    addr: SocketAddr,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &'static [u8],
) -> Answer {
    let mut sender = connect(addr).await;
    send_on(&mut sender, method, uri, headers, body).await
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn counts_executions_per_path_and_describes_them() {
    let (addr, counters) = start(Options::default()).await;
    let body = b"hello world!";
    let a = send(addr, "POST", "/orders/1?a=b", &[], body).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(a.header("content-type"), "application/json");
    assert_eq!(a.header("x-execution"), "1");
    assert_eq!(a.header("set-cookie"), "demo-session=1; HttpOnly");
    assert_eq!(a.header("x-demo-upstream"), "1");
    assert_eq!(a.header("cache-control"), "no-store");
    let expected = format!(
        "{{\"execution\":1,\"method\":\"POST\",\"path\":\"/orders/1\",\"query\":\"a=b\",\
         \"body_bytes\":12,\"body_sha256\":\"{}\"}}",
        hex(&Sha256::digest(body))
    );
    assert_eq!(a.text(), expected);

    // Same path, different query: same counter; the body differs by the count.
    let b = send(addr, "POST", "/orders/1?c=d", &[], body).await;
    assert_eq!(b.header("x-execution"), "2");
    assert!(b.text().starts_with("{\"execution\":2,"));
    assert_ne!(a.body, b.body);

    let other = send(addr, "PUT", "/orders/2", &[], b"").await;
    assert_eq!(other.header("x-execution"), "1");
    assert!(other.text().contains("\"method\":\"PUT\""));
    assert!(other.text().contains("\"query\":\"\""));

    let count = send(addr, "GET", "/__count?path=%2Forders%2F1", &[], b"").await;
    assert_eq!(count.status, StatusCode::OK);
    assert_eq!(
        count.text(),
        "{\"path\":\"/orders/1\",\"executions\":2,\"lookups\":0}"
    );
    let count = send(addr, "GET", "/__count?path=/orders/2", &[], b"").await;
    assert_eq!(
        count.text(),
        "{\"path\":\"/orders/2\",\"executions\":1,\"lookups\":0}"
    );
    let total = send(addr, "GET", "/__count", &[], b"").await;
    assert_eq!(total.text(), "{\"total\":3}");

    // Neither the health check nor the control endpoints count.
    let health = send(addr, "GET", "/healthz", &[], b"").await;
    assert_eq!((health.status, health.text()), (StatusCode::OK, "ok"));
    assert_eq!(counters.total(), 3);

    let reset = send(addr, "POST", "/__reset", &[], b"").await;
    assert_eq!(reset.status, StatusCode::OK);
    assert_eq!(counters.total(), 0);
    let total = send(addr, "GET", "/__count", &[], b"").await;
    assert_eq!(total.text(), "{\"total\":0}");
    let again = send(addr, "POST", "/orders/1", &[], b"").await;
    assert_eq!(again.header("x-execution"), "1");

    let wrong = send(addr, "GET", "/__reset", &[], b"").await;
    assert_eq!(wrong.status, StatusCode::METHOD_NOT_ALLOWED);
    let unknown = send(addr, "POST", "/__nope", &[], b"").await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(counters.total(), 1);
}

#[tokio::test]
async fn headers_choose_status_body_size_and_extra_headers() {
    let (addr, _counters) = start(Options::default()).await;
    let a = send(addr, "POST", "/s", &[("x-demo-status", "503")], b"x").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(a.header("x-execution"), "1");

    let a = send(
        addr,
        "POST",
        "/big",
        &[("x-demo-body-bytes", "100000")],
        b"",
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(a.body.len(), 100_000);
    assert_eq!(a.header("content-type"), "text/plain");
    assert_eq!(&a.body[..64], &BODY_PATTERN[..]);
    assert!(a.body.iter().all(|b| b.is_ascii_graphic() || *b == b'\n'));

    let a = send(addr, "POST", "/empty", &[("x-demo-body-bytes", "0")], b"").await;
    assert!(a.body.is_empty());

    let a = send(addr, "POST", "/nc", &[("x-demo-status", "204")], b"").await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    assert!(a.body.is_empty());

    let a = send(
        addr,
        "POST",
        "/h",
        &[
            ("x-demo-header", "x-one=1"),
            ("x-demo-header", "Cache-Control=max-age=60"),
            ("x-demo-header", "x-one=2"),
        ],
        b"",
    )
    .await;
    let ones: Vec<_> = a.headers.get_all("x-one").iter().collect();
    assert_eq!(ones, ["1", "2"]);
    assert_eq!(a.header("cache-control"), "max-age=60");

    // Invalid control headers are refused and not counted.
    for (name, value) in [
        ("x-demo-status", "abc"),
        ("x-demo-status", "100"),
        ("x-demo-delay-ms", "30001"),
        ("x-demo-body-bytes", "16777217"),
        ("x-demo-header", "no-equals-sign"),
        ("x-demo-header", "transfer-encoding=chunked"),
    ] {
        let a = send(addr, "POST", "/bad", &[(name, value)], b"").await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{name}: {value}");
    }
    let count = send(addr, "GET", "/__count?path=/bad", &[], b"").await;
    assert_eq!(
        count.text(),
        "{\"path\":\"/bad\",\"executions\":0,\"lookups\":0}"
    );
}

#[tokio::test]
async fn delay_holds_the_answer_but_counts_at_once() {
    let (addr, counters) = start(Options::default()).await;
    let started = Instant::now();
    let slow = tokio::spawn(async move {
        send(addr, "POST", "/slow", &[("x-demo-delay-ms", "400")], b"").await
    });
    // The execution is visible while the answer is still delayed.
    let deadline = Instant::now() + Duration::from_secs(5);
    while counters.executions("/slow") == 0 {
        assert!(Instant::now() < deadline, "execution never counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!slow.is_finished());
    let a = slow.await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(a.header("x-execution"), "1");
}

#[tokio::test]
async fn keeps_connections_alive() {
    let (addr, _counters) = start(Options::default()).await;
    let mut sender = connect(addr).await;
    for n in 1..=5 {
        let a = send_on(&mut sender, "POST", "/ka", &[], b"body").await;
        assert_eq!(a.header("x-execution"), n.to_string());
    }
}

#[tokio::test]
async fn fast_mode_answers_ok_without_counting() {
    let (addr, counters) = start(Options {
        fast: true,
        ..Options::default()
    })
    .await;
    let mut sender = connect(addr).await;
    for _ in 0..3 {
        let a = send_on(
            &mut sender,
            "POST",
            "/orders/1",
            &[("x-demo-status", "500")],
            b"payload",
        )
        .await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.text(), "ok");
    }
    assert_eq!(counters.total(), 0);
}

/// Kills the child if the test fails before stopping it.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn binary_announces_its_address_and_serves() {
    let mut child = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_demo-upstream"))
            .args(["--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stdout = child.0.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("demo-upstream listening on ")
        .unwrap()
        .parse()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let a = send(addr, "POST", "/x", &[], b"").await;
        assert_eq!(a.header("x-execution"), "1");
    });
    // SIGTERM is a clean exit.
    let killed = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn binary_rejects_bad_arguments() {
    let out = Command::new(env!("CARGO_BIN_EXE_demo-upstream"))
        .args(["--listen", "not-an-address"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(env!("CARGO_BIN_EXE_demo-upstream"))
        .arg("--bogus")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[tokio::test]
async fn a_reset_request_is_counted_and_its_connection_closed_unanswered() {
    let (addr, counters) = start(Options::default()).await;
    let mut sender = connect(addr).await;
    let req = Request::builder()
        .method("POST")
        .uri("/pay")
        .header("host", "test")
        .header("x-demo-reset", "1")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    sender.ready().await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .unwrap();
    assert!(answer.is_err(), "no answer, the connection is gone");
    assert_eq!(counters.executions("/pay"), 1);
    let bad = send(addr, "POST", "/pay", &[("x-demo-reset", "yes")], b"{}").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(counters.executions("/pay"), 1);
}

#[tokio::test]
async fn echo_lists_the_request_headers_it_received() {
    let (addr, counters) = start(Options::default()).await;
    let answer = send(
        addr,
        "POST",
        "/pay",
        &[
            ("x-demo-echo", "1"),
            ("x-a", "1"),
            ("x-a", "2"),
            ("x-quote", "say \"hi\""),
        ],
        b"{}",
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let doc: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(doc["headers"]["x-a"], "1, 2");
    assert_eq!(doc["headers"]["x-quote"], "say \"hi\"");
    assert_eq!(doc["headers"]["host"], "test");
    assert_eq!(doc["execution"], 1);
    let bad = send(addr, "POST", "/pay", &[("x-demo-echo", "yes")], b"{}").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(counters.executions("/pay"), 1);
}

#[tokio::test]
async fn a_finished_write_is_found_by_its_key_by_the_caller_that_made_it() {
    let (addr, counters) = start(Options::default()).await;
    let alice = [
        ("idempotency-key", "pay 7/x"),
        ("authorization", "Bearer alice"),
    ];
    let lookup = "/payments/by-key/pay%207%2Fx";
    // Not found while it runs (its delay), found once it finished: as a service that commits
    // a payment at its end.
    let slow = tokio::spawn(async move {
        let mut sender = connect(addr).await;
        let headers = [alice[0], alice[1], ("x-demo-delay-ms", "300")];
        send_on(&mut sender, "POST", "/payments", &headers, b"{}").await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let running = send(addr, "GET", lookup, &[alice[1]], b"").await;
    assert_eq!(running.status, StatusCode::NOT_FOUND, "{}", running.text());
    let written = slow.await.unwrap();
    assert_eq!(written.status, StatusCode::CREATED);
    let found = send(addr, "GET", lookup, &[alice[1]], b"").await;
    assert_eq!(found.status, StatusCode::OK);
    assert_eq!(found.body, written.body, "the write's own answer");
    assert_eq!(found.header("x-execution"), "1");
    // Another caller, and a key never written, find nothing; lookups are never executions.
    let bob = send(addr, "GET", lookup, &[("authorization", "Bearer bob")], b"").await;
    assert_eq!(bob.status, StatusCode::NOT_FOUND);
    let none = send(addr, "GET", "/payments/by-key/other", &[alice[1]], b"").await;
    assert_eq!(none.status, StatusCode::NOT_FOUND);
    assert_eq!(counters.total(), 1);
    // A failed write is not one that took effect.
    let failed = [("idempotency-key", "k2"), ("x-demo-status", "500")];
    send(addr, "POST", "/payments", &failed, b"{}").await;
    assert_eq!(
        send(addr, "GET", "/payments/by-key/k2", &[], b"")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    // Lookups can be made to fail, N of them.
    let armed = send(addr, "POST", "/__fail-lookups?n=2", &[], b"").await;
    assert_eq!(armed.status, StatusCode::OK);
    for expected in [503, 503, 200] {
        let answer = send(addr, "GET", lookup, &[alice[1]], b"").await;
        assert_eq!(answer.status.as_u16(), expected);
    }
    // Every lookup is counted by its path, apart from executions: failed, refused to
    // another caller, or found.
    assert_eq!(counters.lookups(lookup), 6);
    let count = send(addr, "GET", "/__count?path=/payments/by-key/k2", &[], b"").await;
    assert_eq!(
        count.text(),
        "{\"path\":\"/payments/by-key/k2\",\"executions\":0,\"lookups\":1}"
    );
}

#[tokio::test]
async fn a_normalising_router_finds_no_write_under_a_key_it_rewrote() {
    let alice = ("authorization", "Bearer alice");
    for normalize_paths in [false, true] {
        let (addr, counters) = start(Options {
            normalize_paths,
            ..Options::default()
        })
        .await;
        for key in ["..", ".", "a/b", "k1"] {
            let written = send(
                addr,
                "POST",
                "/payments",
                &[("idempotency-key", key), alice],
                b"{}",
            )
            .await;
            assert_eq!(written.status, StatusCode::CREATED);
        }
        let found =
            |path: &'static str| async move { send(addr, "GET", path, &[alice], b"").await.status };
        assert_eq!(found("/payments/by-key/k1").await, StatusCode::OK);
        let rewritten = if normalize_paths {
            assert_eq!(found("/payments/./by-key//k1").await, StatusCode::OK);
            // /payments/, /payments/by-key/, and two segments after by-key/: no route.
            StatusCode::NOT_FOUND
        } else {
            StatusCode::OK
        };
        for path in [
            "/payments/by-key/..",
            "/payments/by-key/.",
            "/payments/by-key/%2e%2E",
            "/payments/by-key/a%2Fb",
        ] {
            assert_eq!(
                found(path).await,
                rewritten,
                "{path}, normalize_paths: {normalize_paths}"
            );
        }
        assert_eq!(
            counters.total(),
            4,
            "lookups and unrouted reads are never counted"
        );
    }
}
