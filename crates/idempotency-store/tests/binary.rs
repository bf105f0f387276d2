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

use common::{sigterm, start, wait_exit, Running, BIN};

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

#[test]
fn refuses_an_operator_token_that_is_the_data_plane_token() {
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--backend", "memory"])
        .env("IDEMPOTENCY_STORE_TOKEN", "one-token")
        .env("IDEMPOTENCY_STORE_OPERATOR_TOKEN", " one-token\n")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the operator token") && stderr.contains("is the data-plane token"),
        "{stderr}"
    );
}

#[tokio::test]
async fn operator_routes_are_disabled_without_an_operator_token_and_take_it_from_the_env() {
    let lookup = |addr: &str, token: &str| {
        let url = format!("http://{addr}/v1/records/{}", "a".repeat(64));
        let token = token.to_owned();
        async move {
            reqwest::Client::new()
                .get(url)
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let (_run, addr) = start(
        &["--backend", "memory"],
        &[("IDEMPOTENCY_STORE_TOKEN", "data-token")],
    );
    assert_eq!(lookup(&addr, "data-token").await, 403);
    let (_run, addr) = start(
        &["--backend", "memory"],
        &[
            ("IDEMPOTENCY_STORE_TOKEN", "data-token"),
            ("IDEMPOTENCY_STORE_OPERATOR_TOKEN", "operator-token"),
        ],
    );
    assert_eq!(lookup(&addr, "operator-token").await, 404);
    assert_eq!(lookup(&addr, "data-token").await, 403);
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
    claims_then_stops(&mut run, &addr, "env-token").await;
}

/// The running binary answers a claim of a new key with `token` as `claimed`, then stops
/// cleanly on SIGTERM.
async fn claims_then_stops(run: &mut Running, addr: &str, token: &str) {
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/claim"))
        .bearer_auth(token)
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

#[tokio::test]
async fn metrics_move_to_their_own_listener_and_healthz_stays() {
    let (mut run, addr, line) = common::start_with_line(
        &["--backend", "memory", "--metrics-listen", "127.0.0.1:0"],
        &[("IDEMPOTENCY_STORE_TOKEN", "t")],
    );
    let metrics_addr = line
        .rsplit_once(" metrics=")
        .map(|(_, at)| at.to_owned())
        .unwrap_or_else(|| panic!("no metrics address in {line:?}"));
    assert_ne!(metrics_addr, addr);
    let client = reqwest::Client::new();
    let get = |url: String| {
        let client = client.clone();
        async move { client.get(url).send().await.unwrap() }
    };
    let metrics = get(format!("http://{metrics_addr}/metrics")).await;
    assert_eq!(metrics.status(), 200);
    assert!(metrics.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/openmetrics-text"));
    assert!(metrics
        .text()
        .await
        .unwrap()
        .contains("idempotency_store_backend_errors_total"));
    // Off the main port; the probes' /healthz stays there, and only there.
    assert_eq!(get(format!("http://{addr}/metrics")).await.status(), 404);
    assert_eq!(get(format!("http://{addr}/healthz")).await.status(), 200);
    assert_eq!(
        get(format!("http://{metrics_addr}/healthz")).await.status(),
        404
    );
    assert_eq!(
        get(format!("http://{metrics_addr}/v1/claim"))
            .await
            .status(),
        404
    );
    sigterm(&run.0);
    assert!(
        wait_exit(&mut run.0).success(),
        "both listeners stop on SIGTERM"
    );
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

/// The `record` command, run as the binary it is, against a real store.
mod record_command {
    use super::*;
    use idempotency_protocol::naming::{storage_key, to_hex};
    use idempotency_protocol::record::RecordedResponse;
    use idempotency_protocol::wire::encode_record;
    use serde_json::{json, Value};
    use std::process::Output;

    /// The data plane's token (the filter's), and the operators' own.
    const TOKEN: &str = "data-plane-token";
    const OPERATOR_TOKEN: &str = "ops-token";

    struct Store {
        _run: common::Running,
        url: String,
        token_file: std::path::PathBuf,
        operator_token_file: std::path::PathBuf,
        _dir: tempfile::TempDir,
        client: reqwest::Client,
    }

    impl Store {
        fn start() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let token_file = dir.path().join("token");
            std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
            let operator_token_file = dir.path().join("operator-token");
            std::fs::write(&operator_token_file, format!("{OPERATOR_TOKEN}\n")).unwrap();
            let (run, addr) = start(
                &[
                    "--backend",
                    "memory",
                    "--token-file",
                    token_file.to_str().unwrap(),
                    "--operator-token-file",
                    operator_token_file.to_str().unwrap(),
                ],
                &[],
            );
            Self {
                _run: run,
                url: format!("http://{addr}"),
                token_file,
                operator_token_file,
                _dir: dir,
                client: reqwest::Client::new(),
            }
        }

        async fn post(&self, op: &str, body: Value) -> Value {
            let resp = self
                .client
                .post(format!("{}/v1/{op}", self.url))
                .bearer_auth(TOKEN)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{op}");
            resp.json().await.unwrap()
        }

        async fn claim(&self, key: &str, owner: &str) {
            let claimed = self
                .post(
                    "claim",
                    json!({"key": key, "fingerprint": "f".repeat(64), "lease_ms": 60000, "owner": owner}),
                )
                .await;
            assert_eq!(claimed["outcome"], "claimed");
        }

        /// Runs `idempotency-store record <args>` with this store's URL and operator token.
        fn record(&self, args: &[&str]) -> Output {
            self.record_with(
                args,
                &[
                    "--operator-token-file",
                    self.operator_token_file.to_str().unwrap(),
                ],
            )
        }

        fn record_with(&self, args: &[&str], auth: &[&str]) -> Output {
            let out = Command::new(BIN)
                .arg("record")
                .args(args)
                .args(["--store-url", &self.url])
                .args(auth)
                .env_remove("IDEMPOTENCY_STORE_TOKEN")
                .env_remove("IDEMPOTENCY_STORE_OPERATOR_TOKEN")
                // A panic would print its backtrace: none may appear.
                .env("RUST_BACKTRACE", "1")
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                !stderr.contains("panicked") && !stderr.contains("backtrace"),
                "{stderr}"
            );
            out
        }
    }

    fn text(bytes: &[u8]) -> String {
        String::from_utf8_lossy(bytes).into_owned()
    }

    /// The storage key the filter computes for `POST` with this Host, Authorization and
    /// Idempotency-Key under the `orders` rule's default scope.
    fn filter_key(key: &str) -> String {
        to_hex(&storage_key(
            "orders",
            &[Some(b"api.test"), Some(b"Bearer caller")],
            key.as_bytes(),
        ))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn show_finds_a_record_by_hash_or_by_request_and_purge_removes_it() {
        let store = Store::start();
        let done = filter_key("order-42");
        store.claim(&done, "0a1b").await;
        let response = RecordedResponse {
            owner: 5,
            status: 201,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: b"{\"id\":42}".to_vec(),
            trailers: Vec::new(),
            body_omitted: false,
            unknown: None,
        };
        let completed = store
            .post(
                "complete",
                json!({"key": done, "owner": "0a1b", "ttl_ms": 86_400_000,
                       "record": encode_record(&response.encode())}),
            )
            .await;
        assert_eq!(completed["outcome"], "completed");

        // The access log's 16 hex digits.
        let out = store.record(&["show", "--hash", &done[..16]]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let shown = text(&out.stdout);
        for needle in [
            done.as_str(),
            "state        completed",
            "status       201",
            "headers      1",
            "body         9 bytes",
            "ttl left     23h59m",
        ] {
            assert!(shown.contains(needle), "{needle} in\n{shown}");
        }
        assert!(
            shown.contains("age          ") && !shown.contains("unknown"),
            "{shown}"
        );

        // The request itself: rule, scope headers, key (quoted: the same key).
        let request = |authorization: &'static str, key: &'static str| {
            let mut args = vec!["show", "--rule", "orders", "-H", "Host: api.test"];
            args.extend(["-H", authorization, "--key", key]);
            args
        };
        let mut args = request("authorization: Bearer caller", "\"order-42\"");
        args.push("--json");
        let out = store.record(&args);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(doc["records"][0]["key"], done.as_str());
        assert_eq!(doc["records"][0]["response"]["status"], 201);
        assert!(doc["records"][0]["age_ms"].as_u64().is_some());

        // Another caller's request is another record: not found, exit 1.
        let out = store.record(&request("authorization: Bearer someone-else", "order-42"));
        assert_eq!(out.status.code(), Some(1));
        assert!(
            text(&out.stderr).contains("no live record for key"),
            "{}",
            text(&out.stderr)
        );

        // A claim stuck in flight: shown with its owner and lease, then purged.
        let stuck = filter_key("order-43");
        store.claim(&stuck, "51bd921f").await;
        let out = store.record(&["show", "--hash", &stuck[..16]]);
        let shown = text(&out.stdout);
        assert!(shown.contains("state        in_flight"), "{shown}");
        assert!(shown.contains("lease left   59"), "{shown}");
        // A short hash of the owner (SHA-256 of "51bd921f"), never the owner token itself.
        assert!(shown.contains("owner hash   7b58675034c52992"), "{shown}");
        assert!(!shown.contains("51bd921f"), "{shown}");
        let out = store.record(&["purge", "--hash", &stuck[..16]]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let purged = text(&out.stdout);
        assert!(
            purged.starts_with("purged:") && purged.contains(&stuck),
            "{purged}"
        );
        assert!(purged.contains("in_flight"), "{purged}");
        let out = store.record(&["show", "--hash", &stuck]);
        assert_eq!(out.status.code(), Some(1));
        let out = store.record(&["purge", "--hash", &stuck, "--json"]);
        assert_eq!(out.status.code(), Some(1));
        assert!(text(&out.stderr).contains("nothing purged"));
        // The key is free again.
        store.claim(&stuck, "0c").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ambiguous_prefix_is_listed_and_never_purged() {
        let store = Store::start();
        let prefix = "0123456789abcdef";
        let (a, b) = (
            format!("{prefix}{}", "1".repeat(48)),
            format!("{prefix}{}", "2".repeat(48)),
        );
        store.claim(&a, "01").await;
        store.claim(&b, "02").await;
        let out = store.record(&["show", "--hash", prefix, "--json"]);
        assert_eq!(out.status.code(), Some(0));
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(doc["records"].as_array().unwrap().len(), 2);
        let out = store.record(&["purge", "--hash", prefix]);
        assert_eq!(out.status.code(), Some(2));
        let stderr = text(&out.stderr);
        assert!(stderr.contains(&a) && stderr.contains(&b), "{stderr}");
        assert!(stderr.contains("nothing purged"), "{stderr}");
        let out = store.record(&["show", "--hash", &a]);
        assert_eq!(out.status.code(), Some(0), "still there");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn token_connection_and_usage_errors_exit_2_with_a_sentence() {
        let store = Store::start();
        let dir = tempfile::tempdir().unwrap();
        let wrong = dir.path().join("wrong");
        std::fs::write(&wrong, "not-the-token").unwrap();
        let out = store.record_with(
            &["show", "--hash", "0123456789abcdef"],
            &["--operator-token-file", wrong.to_str().unwrap()],
        );
        assert_eq!(out.status.code(), Some(2));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("refused the token from --operator-token-file"),
            "{stderr}"
        );
        // The data plane's token, which every Envoy holds, is refused, and the store says why.
        let out = store.record_with(
            &["purge", "--hash", "0123456789abcdef"],
            &["--operator-token-file", store.token_file.to_str().unwrap()],
        );
        assert_eq!(out.status.code(), Some(2));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("(403)") && stderr.contains("this is the data-plane token"),
            "{stderr}"
        );
        let out = store.record_with(&["show", "--hash", "0123456789abcdef"], &[]);
        assert_eq!(out.status.code(), Some(2));
        assert!(text(&out.stderr).contains("IDEMPOTENCY_STORE_OPERATOR_TOKEN"));
        let out = store.record(&["show", "--hash", "0123"]);
        assert_eq!(out.status.code(), Some(2));
        assert!(text(&out.stderr).contains("16 to 64 hex digits"));
        // resolve says how the write ended, one way, and a response only for "took effect".
        for (args, says) in [
            (
                &["resolve", "--hash", "0123456789abcdef"][..],
                "--took-effect",
            ),
            (
                &[
                    "resolve",
                    "--hash",
                    "0123456789abcdef",
                    "--took-effect",
                    "--never-ran",
                ],
                "cannot be used with",
            ),
            (
                &[
                    "resolve",
                    "--hash",
                    "0123456789abcdef",
                    "--never-ran",
                    "--status",
                    "201",
                ],
                "cannot be used with",
            ),
            (
                &[
                    "resolve",
                    "--hash",
                    "0123456789abcdef",
                    "--took-effect",
                    "--status",
                    "99",
                ],
                "200 to 599",
            ),
        ] {
            let out = store.record(args);
            assert_eq!(out.status.code(), Some(2), "{args:?}");
            let stderr = text(&out.stderr);
            assert!(stderr.contains(says), "{args:?}: {stderr}");
        }

        let closed = format!("http://127.0.0.1:{}", common::free_port());
        let out = Command::new(BIN)
            .args([
                "record",
                "purge",
                "--hash",
                "0123456789abcdef",
                "--store-url",
                &closed,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(
            text(&out.stderr).contains("cannot reach the store"),
            "{}",
            text(&out.stderr)
        );
    }

    #[test]
    fn the_servers_flags_stay_at_the_top_and_do_not_mix_with_record() {
        let out = Command::new(BIN)
            .args([
                "--backend",
                "memory",
                "record",
                "show",
                "--hash",
                "0123456789abcdef",
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(
            text(&out.stderr).contains("cannot be used with"),
            "{}",
            text(&out.stderr)
        );
        let out = Command::new(BIN).args(["record", "show"]).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(
            text(&out.stderr).contains("--hash"),
            "{}",
            text(&out.stderr)
        );
        let out = Command::new(BIN)
            .args([
                "record",
                "show",
                "--hash",
                "0123456789abcdef",
                "--rule",
                "orders",
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let out = Command::new(BIN).args(["--help"]).output().unwrap();
        let help = text(&out.stdout);
        assert!(
            help.contains("--listen") && help.contains("record"),
            "{help}"
        );
    }
}

/// A Redis user whose ACL denies `INFO`: the store cannot ask whether the server is a
/// cluster node. It used to take such a server for a single one without a word (and on a
/// cluster node then failed every other node's key with `MOVED` at run time); it now refuses
/// to start, saying why and which flag settles it, and starts when told.
#[tokio::test]
async fn a_redis_user_denied_info_stops_the_start_unless_the_flag_says_what_redis_is() {
    let redis = common::RedisServer::start();
    let acl = Command::new("redis-cli")
        .args(["-p", &redis.port.to_string()])
        .args(["ACL", "SETUSER", "store", "on", ">s3cret-pw", "~*", "&*"])
        .args(["+@all", "-info"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&acl.stdout).trim(), "OK");
    let url = format!("redis://store:s3cret-pw@127.0.0.1:{}/", redis.port);

    let refused = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--backend", "redis"])
        .args(["--redis-url", &url])
        .env("IDEMPOTENCY_STORE_TOKEN", "t")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("cannot tell whether")
            && stderr.contains("INFO cluster failed")
            && stderr.to_lowercase().contains("noperm"),
        "{stderr}"
    );
    assert!(
        stderr.contains("--redis-cluster=false") && stderr.contains("--redis-cluster "),
        "the error names the flag that settles it: {stderr}"
    );
    assert!(
        !stderr.contains("s3cret-pw"),
        "the password is not shown: {stderr}"
    );
    assert!(
        String::from_utf8_lossy(&refused.stdout).is_empty(),
        "no ready line"
    );

    // Told it is one server, it starts on that user and serves.
    let (mut run, addr) = start(
        &[
            "--backend",
            "redis",
            "--redis-url",
            &url,
            "--redis-cluster=false",
        ],
        &[("IDEMPOTENCY_STORE_TOKEN", "t")],
    );
    claims_then_stops(&mut run, &addr, "t").await;

    // The flag takes true, false and auto, and only with `=` (a bare `--redis-cluster` is
    // `true`, as in deploy/kubernetes/store-on-redis-cluster.yaml).
    let bad = Command::new(BIN)
        .args([
            "--backend",
            "redis",
            "--redis-url",
            &url,
            "--redis-cluster=maybe",
        ])
        .env("IDEMPOTENCY_STORE_TOKEN", "t")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("auto") && stderr.contains("false"),
        "{stderr}"
    );
}
