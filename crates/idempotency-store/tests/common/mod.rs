//! Test helpers shared by the integration test binaries.
// Each test binary uses a different subset; a failed unwrap here is a failed test.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use idempotency_store::storage::Digest;

pub mod typical_response;

/// A throwaway `redis-server` on a free loopback port. Killed (by its own
/// PID, via `Child::kill`) when dropped.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    pub fn start() -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().expect("tempdir for redis");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `redis-server` ({e}). The redis backend tests need \
                     redis-server on PATH (Debian: apt-get install redis-server)."
                )
            });
        let server = Self {
            child,
            port,
            _dir: dir,
        };
        server.wait_until_ready();
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Stops this server (by its PID) and starts a new one on the same port, as a Redis
    /// restart does: every connection to the old one is gone.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self._dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server restarts");
        self.wait_until_ready();
    }

    fn wait_until_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if ping(self.port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING within 10s",
            self.port
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A throwaway six-node Redis Cluster (three primaries, three replicas) on free
/// loopback ports, made with `redis-cli --cluster create`. Every node is killed by
/// its own PID when dropped.
pub struct RedisCluster {
    nodes: Vec<Child>,
    pub ports: Vec<u16>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir for the cluster");
        let mut cluster = Self {
            nodes: Vec::new(),
            ports: Vec::new(),
            _dir: tempfile::tempdir().expect("tempdir"),
        };
        for i in 0..6 {
            let port = free_port();
            let node_dir = dir.path().join(format!("node-{i}"));
            std::fs::create_dir_all(&node_dir).unwrap();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                // The bus port is set, not derived (port + 10000 may not exist or be free).
                .args(["--cluster-port", &free_port().to_string()])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&node_dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start `redis-server` ({e})"));
            cluster.nodes.push(child);
            cluster.ports.push(port);
        }
        cluster._dir = dir;
        for &port in &cluster.ports {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !ping(port) {
                assert!(
                    Instant::now() < deadline,
                    "cluster node {port} did not start"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let addrs: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli on PATH (Debian: redis-tools)");
        assert!(created.success(), "redis-cli --cluster create failed");
        cluster.wait_until_ok();
        cluster
    }

    /// Seed URLs, comma-separated, as `--redis-url` takes them.
    pub fn urls(&self) -> String {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}/"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every node reports `cluster_state:ok` (all slots served).
    fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        for &port in &self.ports {
            loop {
                let info = Command::new("redis-cli")
                    .args(["-p", &port.to_string(), "cluster", "info"])
                    .output()
                    .expect("redis-cli");
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster not ok at node {port}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in &mut self.nodes {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// Asks the OS for an unused port. Racy by nature, but the window between
/// dropping the listener and redis binding is tiny.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// A random 64-hex digest, so tests sharing a backend never collide.
pub fn random_digest() -> Digest {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("random");
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Digest::parse(&hex).expect("valid digest")
}

/// The store binary cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_idempotency-store");

/// The store binary, killed by its PID if a test fails before it exits on
/// its own.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the store on a free loopback port and waits for its ready line;
/// returns it and the address it listens on.
pub fn start(args: &[&str], envs: &[(&str, &str)]) -> (Running, String) {
    let (running, addr, _) = start_with_line(args, envs);
    (running, addr)
}

/// Like [`start`], with the whole ready line too.
pub fn start_with_line(args: &[&str], envs: &[(&str, &str)]) -> (Running, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("IDEMPOTENCY_STORE_TOKEN")
        .env_remove("IDEMPOTENCY_STORE_OPERATOR_TOKEN")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let running = Running(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("idempotency-store listening on ")
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("unexpected ready line {line:?}"))
        .to_owned();
    (running, addr, line.trim().to_owned())
}

pub fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits up to `limit` for the child to exit.
pub fn wait_exit_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn wait_exit(child: &mut Child) -> ExitStatus {
    wait_exit_within(child, Duration::from_secs(5))
        .unwrap_or_else(|| panic!("process did not exit within 5s"))
}
