//! The shipped binary: startup checks, the ready line, graceful SIGTERM.

// Test code: a failed unwrap/index is a failed test, which is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::process::Command;

use common::{sigterm, start, wait_exit, BIN};

#[test]
fn refuses_to_start_without_a_token() {
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--backend", "memory"])
        .env_remove("IDEMPOTENCY_STORE_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no auth token configured"), "{stderr}");
    assert!(stderr.contains("--token-file"), "{stderr}");
}

#[test]
fn refuses_an_empty_token_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("token");
    std::fs::write(&path, "  \n").unwrap();
    let out = Command::new(BIN)
        .args(["--backend", "memory", "--token-file"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("empty"));
}

#[tokio::test]
async fn embedded_binary_serves_persists_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "file-token\n").unwrap();
    let args = [
        "--backend",
        "embedded",
        "--data-dir",
        data.to_str().unwrap(),
        "--token-file",
        token_file.to_str().unwrap(),
    ];
    let key = "e".repeat(64);
    let fp = "f".repeat(64);
    let client = reqwest::Client::new();
    let claim = serde_json::json!({"key": key, "fingerprint": fp, "lease_ms": 60000});

    let (mut run, addr) = start(&args, &[]);
    let resp = client
        .post(format!("http://{addr}/v1/claim"))
        .bearer_auth("file-token")
        .json(&claim)
        .send()
        .await
        .unwrap();
    let body: serde_json::Value = resp.json().await.unwrap();
    let owner = body["owner"].as_str().unwrap().to_owned();
    let resp = client
        .post(format!("http://{addr}/v1/complete"))
        .bearer_auth("file-token")
        .json(&serde_json::json!({"key": key, "owner": owner, "ttl_ms": 60000, "record": "cGVyc2lzdGVk"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    sigterm(&run.0);
    assert!(wait_exit(&mut run.0).success(), "graceful exit code 0");
    assert!(data.join("idempotency.redb").exists());

    // Restarted on the same directory, the completion is still there.
    let (mut run, addr) = start(&args, &[]);
    let resp = client
        .post(format!("http://{addr}/v1/claim"))
        .bearer_auth("file-token")
        .json(&claim)
        .send()
        .await
        .unwrap();
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(
        body,
        serde_json::json!({"outcome": "completed", "record": "cGVyc2lzdGVk"})
    );
    sigterm(&run.0);
    assert!(wait_exit(&mut run.0).success());
}

#[tokio::test]
async fn redis_binary_uses_env_token() {
    let redis = common::RedisServer::start();
    let url = redis.url();
    let (mut run, addr) = start(
        &["--backend", "redis", "--redis-url", &url],
        &[("IDEMPOTENCY_STORE_TOKEN", "env-token")],
    );
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("http://{addr}/v1/claim"))
        .bearer_auth("env-token")
        .json(&serde_json::json!({"key": "1".repeat(64), "fingerprint": "2".repeat(64), "lease_ms": 1000}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["outcome"], "claimed");
    sigterm(&run.0);
    assert!(wait_exit(&mut run.0).success());
}

#[test]
fn insecure_mode_starts_and_serves_healthz() {
    let (mut run, addr) = start(&["--backend", "memory", "--insecure-no-auth"], &[]);
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    use std::io::{Read, Write};
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.ends_with("ok"), "{resp}");
    sigterm(&run.0);
    assert!(wait_exit(&mut run.0).success());
}
