//! `idempotency-store` binary: parse flags, open the chosen backend, serve; or, with the
//! `record` subcommand, look up or purge one record of a running store.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idempotency_store::clock::SystemClock;
use idempotency_store::command::{self, RecordCommand};
use idempotency_store::metrics::{BatchMetrics, Metrics};
use idempotency_store::ops::auth::Auth;
use idempotency_store::ops::AppState;
use idempotency_store::server;
use idempotency_store::storage::embedded::{EmbeddedOptions, EmbeddedStorage};
use idempotency_store::storage::memory::MemoryStorage;
use idempotency_store::storage::redis::{ClusterMode, RedisStorage};
use idempotency_store::storage::Storage;
use idempotency_store::sweeper;
use tracing_subscriber::EnvFilter;

const TOKEN_ENV: &str = command::TOKEN_ENV;
const OPERATOR_TOKEN_ENV: &str = command::OPERATOR_TOKEN_ENV;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// redb file in --data-dir; single node, survives restarts.
    Embedded,
    /// Shared Redis (or Redis-compatible) server at --redis-url.
    Redis,
    /// Process memory; lost on exit. Tests and demos only.
    Memory,
}

impl BackendKind {
    fn name(self) -> &'static str {
        match self {
            Self::Embedded => "embedded",
            Self::Redis => "redis",
            Self::Memory => "memory",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RedisClusterFlag {
    Auto,
    True,
    False,
}

impl From<RedisClusterFlag> for ClusterMode {
    fn from(flag: RedisClusterFlag) -> Self {
        match flag {
            RedisClusterFlag::Auto => Self::Auto,
            RedisClusterFlag::True => Self::Cluster,
            RedisClusterFlag::False => Self::Single,
        }
    }
}

/// Shared idempotency record store for the Envoy idempotency filter (cluster mode).
///
/// Without a subcommand it serves (every flag below); `record` looks up or purges one
/// record of a running store.
// The server's flags stay at the top level, as every existing invocation passes them; they
// cannot be mixed with a subcommand, whose own flags are its own.
#[derive(Debug, Parser)]
#[command(version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    serve: Serve,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Look up or purge one record on a running store (operators; see the README's
    /// "Operations").
    #[command(subcommand)]
    Record(RecordCommand),
}

#[derive(Debug, Args)]
struct Serve {
    /// Address to listen on (HTTP/1.1 and h2c prior knowledge).
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: SocketAddr,

    /// Serve /metrics on this address instead of --listen (which then answers it 404), so
    /// that it can be kept off the data plane's network. /healthz stays on --listen.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,

    #[arg(long, value_enum, default_value_t = BackendKind::Embedded)]
    backend: BackendKind,

    /// Directory for the embedded backend's idempotency.redb file.
    #[arg(long, default_value = "./.run/store-data")]
    data_dir: PathBuf,

    /// Bound on the embedded store's file, in bytes it takes on disk (suffixes KiB, MiB, GiB,
    /// TiB; 0: none). Once a write has grown the file to it, new claims are taken only as the
    /// sweeper frees room, and refused (503, the filter's on_store_error) otherwise;
    /// completions of claims already taken are always recorded. Size the disk above it
    /// (docs/operations.md, "Sizing the embedded store's disk").
    #[arg(long, value_name = "BYTES", default_value = "8GiB", value_parser = parse_bytes)]
    max_db_bytes: u64,

    /// The embedded store saves its allocator state with every commit (redb's quick repair),
    /// so that it opens sooner after a crash, for about a third fewer claims per second
    /// (docs/operations.md, "Restarting the embedded store").
    #[arg(long, value_name = "BOOL", default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    quick_repair: bool,

    /// Redis URL for --backend redis, e.g. redis://127.0.0.1:6379/. Several,
    /// comma-separated, are the seed nodes of a Redis (or Valkey) Cluster.
    #[arg(long)]
    redis_url: Option<String>,

    /// Whether a single --redis-url is a seed node of a Redis Cluster: `true` (also the bare
    /// flag), `false` (one server, or a primary behind one address), or `auto`: ask the server
    /// at start (INFO cluster), and refuse to start, saying why, if it cannot be asked (an ACL
    /// that denies INFO, say). Several URLs are always a cluster's seeds.
    #[arg(
        long,
        value_enum,
        default_value_t = RedisClusterFlag::Auto,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    redis_cluster: RedisClusterFlag,

    /// File holding the bearer token clients must present (surrounding
    /// whitespace ignored). Takes precedence over IDEMPOTENCY_STORE_TOKEN.
    #[arg(long)]
    token_file: Option<PathBuf>,

    /// File holding the operators' bearer token, for the record lookup, search and purge
    /// routes (`idempotency-store record`); surrounding whitespace ignored. Takes precedence
    /// over IDEMPOTENCY_STORE_OPERATOR_TOKEN. Without either, those routes are disabled (403).
    /// It must differ from the data-plane token: neither kind of route takes the other's.
    #[arg(long)]
    operator_token_file: Option<PathBuf>,

    /// Serve the data-plane routes without authentication. Local demos only. The operator
    /// routes still need --operator-token-file.
    #[arg(long)]
    insecure_no_auth: bool,

    /// Largest accepted request body; larger requests get 413.
    #[arg(long, default_value_t = server::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,

    /// Filters' waits for keys in flight (rules with `on_in_flight: "wait"`) held at once;
    /// beyond, a wait is answered "still in flight" at once and its client gets a 409.
    #[arg(long, default_value_t = idempotency_store::waits::DEFAULT_MAX_WAITS)]
    max_waits: usize,

    /// Seconds a client has to send a request's headers: a new connection's
    /// first request (any protocol), and on HTTP/1.1 every later one, idle
    /// keep-alive time included. Silent and half-open connections end here.
    #[arg(long, default_value_t = server::DEFAULT_HEADER_READ_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    header_read_timeout_secs: u64,

    /// Close a connection that had no request in flight for this many seconds.
    #[arg(long, default_value_t = server::DEFAULT_IDLE_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_secs: u64,

    /// Most client connections served at once; further clients wait in the
    /// listen backlog until one closes. Keep it below the open-file limit.
    #[arg(long, default_value_t = server::DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_connections: u32,

    /// Seconds a new connection has to show a valid token (in the gRPC stream's metadata or
    /// a /v1 request's header) before it is closed. /healthz and /metrics need no token:
    /// a connection that only asks them ends here.
    #[arg(long, default_value_t = server::DEFAULT_UNAUTHENTICATED_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    unauthenticated_timeout_secs: u64,

    /// Connections that have not shown a valid token yet, at most, at once (default: a
    /// quarter of --max-connections). A newer one is still taken, and the oldest of them is
    /// closed: the rest of --max-connections is kept for authenticated connections.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_unauthenticated_connections: Option<u32>,

    /// Of those, at most this many from one IP address; a newer one closes that address's
    /// oldest.
    #[arg(long, default_value_t = server::DEFAULT_MAX_UNAUTHENTICATED_PER_PEER, value_parser = clap::value_parser!(u32).range(1..))]
    max_unauthenticated_connections_per_peer: u32,

    /// Seconds between HTTP/2 PINGs the store sends on a connection.
    #[arg(long, default_value_t = server::DEFAULT_H2_KEEPALIVE_INTERVAL.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    h2_keepalive_interval_secs: u64,

    /// Seconds an HTTP/2 PING may go unanswered before the connection is dropped.
    #[arg(long, default_value_t = server::DEFAULT_H2_KEEPALIVE_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    h2_keepalive_timeout_secs: u64,

    /// On SIGTERM/SIGINT (and after an idle close), seconds a connection may
    /// take to finish before it is dropped.
    #[arg(long, default_value_t = server::DEFAULT_SHUTDOWN_GRACE.as_secs(), value_parser = clap::value_parser!(u64).range(0..=3600))]
    shutdown_grace_secs: u64,

    /// How often expired records are deleted (embedded and memory backends).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    sweep_interval_secs: u64,

    /// Log filter (tracing EnvFilter syntax); RUST_LOG overrides it.
    #[arg(long, default_value = "info")]
    log_level: String,
}

/// A size: a whole number of bytes, or of KiB, MiB, GiB or TiB (powers of 1024).
fn parse_bytes(raw: &str) -> Result<u64, String> {
    let raw = raw.trim();
    let digits = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (number, unit) = raw.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{raw:?} is not a size: a number of bytes, e.g. 8GiB or 500MiB"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {raw:?}: use KiB, MiB, GiB or TiB (powers of 1024), \
                 or none for bytes"
            ))
        }
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("{raw:?} is too large"))
}

fn init_logging(level: &str) -> Result<(), String> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(from_env) if !from_env.is_empty() => EnvFilter::try_new(from_env),
        _ => EnvFilter::try_new(level),
    }
    .map_err(|e| format!("invalid log filter: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only help a human at a terminal; they garble log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    Ok(())
}

/// A token from `file` if given, else from the environment variable `env`, with where it came
/// from; an empty one is an error.
fn read_token(
    file: Option<&PathBuf>,
    flag: &str,
    env: &str,
) -> Result<Option<(String, String)>, String> {
    let token = if let Some(path) = file {
        let raw = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {flag} {}: {e}", path.display()))?;
        Some((raw.trim().to_owned(), format!("{flag} {}", path.display())))
    } else {
        std::env::var(env)
            .ok()
            .map(|t| (t.trim().to_owned(), env.to_owned()))
    };
    match token {
        Some((t, source)) if t.is_empty() => Err(format!("the token from {source} is empty")),
        other => Ok(other),
    }
}

fn resolve_auth(cli: &Serve) -> Result<Auth, String> {
    let token = read_token(cli.token_file.as_ref(), "--token-file", TOKEN_ENV)?;
    let operator = read_token(
        cli.operator_token_file.as_ref(),
        "--operator-token-file",
        OPERATOR_TOKEN_ENV,
    )?;
    let auth = match (&token, cli.insecure_no_auth) {
        (Some((t, _)), false) => Auth::bearer(t),
        (Some(_), true) => {
            return Err(
                "--insecure-no-auth given together with a token; drop one of them".to_owned(),
            )
        }
        (None, true) => {
            tracing::warn!(
                "--insecure-no-auth: the data-plane routes accept requests from anyone who \
                 can reach {}",
                cli.listen
            );
            Auth::insecure()
        }
        (None, false) => {
            return Err(format!(
                "no auth token configured: pass --token-file PATH or set {TOKEN_ENV} \
                 (or --insecure-no-auth for a local demo)"
            ))
        }
    };
    match (operator, token) {
        (Some((o, _)), Some((t, _))) if o == t => Err(format!(
            "the operator token ({OPERATOR_TOKEN_ENV} or --operator-token-file) is the \
             data-plane token: give operators a token of their own"
        )),
        (Some((o, _)), _) => Ok(auth.with_operator_token(&o)),
        (None, _) => {
            tracing::info!(
                "no operator token (--operator-token-file or {OPERATOR_TOKEN_ENV}): the \
                 record lookup, search and purge routes are disabled"
            );
            Ok(auth)
        }
    }
}

/// The backend, plus the embedded backend's group-commit statistics for `/metrics`.
async fn open_storage(cli: &Serve) -> Result<(Arc<dyn Storage>, Option<BatchMetrics>), String> {
    Ok(match cli.backend {
        BackendKind::Memory => (Arc::new(MemoryStorage::new(Arc::new(SystemClock))), None),
        BackendKind::Embedded => {
            let options = EmbeddedOptions {
                max_file_bytes: (cli.max_db_bytes > 0).then_some(cli.max_db_bytes),
                quick_repair: cli.quick_repair,
            };
            let storage = EmbeddedStorage::open_with(&cli.data_dir, Arc::new(SystemClock), options)
                .map_err(|e| {
                    format!(
                        "cannot open embedded store in {}: {e}",
                        cli.data_dir.display()
                    )
                })?;
            let batches = storage.batch_metrics().clone();
            (Arc::new(storage), Some(batches))
        }
        BackendKind::Redis => {
            let url = cli
                .redis_url
                .as_deref()
                .ok_or("--backend redis needs --redis-url redis://HOST:PORT/")?;
            (
                Arc::new(
                    RedisStorage::connect_to(url, cli.redis_cluster.into())
                        .await
                        .map_err(|e| format!("cannot connect to redis: {e}"))?,
                ),
                None,
            )
        }
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for SIGINT: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutting down: draining connections");
}

async fn run(cli: Serve) -> Result<(), String> {
    if let Some(n) = cli.max_unauthenticated_connections {
        if n >= cli.max_connections {
            return Err(format!(
                "--max-unauthenticated-connections {n} must be below --max-connections {}: \
                 the rest is kept for connections that authenticated",
                cli.max_connections
            ));
        }
    }
    let auth = resolve_auth(&cli)?;
    let (storage, batches) = open_storage(&cli).await?;
    let mut metrics = Metrics::new();
    if let Some(batches) = &batches {
        metrics.register_embedded_batches(batches);
    }
    metrics.start_error_counters_at_zero(storage.backend_name());
    let metrics = Arc::new(metrics);
    let connection_metrics = metrics.connections();
    let sweeper = sweeper::spawn(
        Arc::clone(&storage),
        Arc::clone(&metrics),
        Duration::from_secs(cli.sweep_interval_secs),
    );
    let listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", cli.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read bound address: {e}"))?;
    let metrics_listener = match cli.metrics_listen {
        Some(at) => Some(
            tokio::net::TcpListener::bind(at)
                .await
                .map_err(|e| format!("cannot listen on --metrics-listen {at}: {e}"))?,
        ),
        None => None,
    };
    let metrics_addr = metrics_listener
        .as_ref()
        .map(tokio::net::TcpListener::local_addr)
        .transpose()
        .map_err(|e| format!("cannot read the metrics address: {e}"))?;
    let draining = tokio_util::sync::CancellationToken::new();
    let state = AppState::new(storage, metrics, auth, draining.clone(), cli.max_waits);
    let app = server::router_with(
        state.clone(),
        server::RouterOptions {
            max_body_bytes: cli.max_body_bytes,
            serve_metrics: metrics_listener.is_none(),
            ..server::RouterOptions::default()
        },
    );
    // Scripts and tests wait for exactly this line on stdout (the address first).
    match metrics_addr {
        Some(at) => println!(
            "idempotency-store listening on {addr} backend={} metrics={at}",
            cli.backend.name()
        ),
        None => println!(
            "idempotency-store listening on {addr} backend={}",
            cli.backend.name()
        ),
    }
    tracing::info!(%addr, backend = cli.backend.name(), metrics = ?metrics_addr, "listening");
    let limits = server::ConnectionLimits {
        header_read_timeout: Duration::from_secs(cli.header_read_timeout_secs),
        idle_timeout: Duration::from_secs(cli.idle_timeout_secs),
        max_connections: cli.max_connections,
        unauthenticated_timeout: Duration::from_secs(cli.unauthenticated_timeout_secs),
        max_unauthenticated: cli.max_unauthenticated_connections,
        max_unauthenticated_per_peer: cli.max_unauthenticated_connections_per_peer,
        h2_keepalive_interval: Duration::from_secs(cli.h2_keepalive_interval_secs),
        h2_keepalive_timeout: Duration::from_secs(cli.h2_keepalive_timeout_secs),
        shutdown_grace: Duration::from_secs(cli.shutdown_grace_secs),
    };
    // The metrics listener stops with the main one.
    let metrics_server = metrics_listener.map(|listener| {
        tokio::spawn(server::serve_with(
            listener,
            server::metrics_router(state),
            limits,
            draining.clone().cancelled_owned(),
        ))
    });
    let shutdown = async move {
        shutdown_signal().await;
        draining.cancel();
    };
    let served = server::serve_observed(listener, app, limits, connection_metrics, shutdown).await;
    sweeper.abort();
    if let Some(metrics_server) = metrics_server {
        match metrics_server.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("metrics server error: {e}"),
            Err(e) => tracing::warn!("metrics server task failed: {e}"),
        }
    }
    served.map_err(|e| format!("server error: {e}"))
}

fn main() -> ExitCode {
    let Cli {
        command,
        serve: cli,
    } = Cli::parse();
    if let Some(Command::Record(record)) = command {
        return match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(command::run(record)),
            Err(e) => {
                eprintln!("idempotency-store record: cannot start async runtime: {e}");
                ExitCode::from(command::EXIT_ERROR)
            }
        };
    }
    if let Err(e) = init_logging(&cli.log_level) {
        eprintln!("idempotency-store: {e}");
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idempotency-store: cannot start async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("idempotency-store: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_take_binary_units() {
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_bytes("500MiB"), Ok(500 << 20));
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("2 TiB"), Ok(2 << 40));
        for bad in ["", "GiB", "8GB", "8 gigs", "-1", "99999999999TiB"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
