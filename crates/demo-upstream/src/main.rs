//! `demo-upstream [--listen ADDR] [--fast | --grpc-echo] [--normalize-paths] [--threads N]`: the counting test
//! upstream (see the library docs for what it answers), or the benchmark's instant store
//! (`--grpc-echo`, see `demo_upstream::grpc_echo`).

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use demo_upstream::grpc_echo::{serve_grpc_echo, EchoCounters};
use demo_upstream::{serve, Counters, Options};

const USAGE: &str =
    "usage: demo-upstream [--listen ADDR] [--fast | --grpc-echo] [--normalize-paths] [--threads N]

  --listen ADDR   address to listen on (default 127.0.0.1:8080; port 0 picks one)
  --fast          answer every request with `200 ok` at once, counting nothing
  --grpc-echo     be an instant store instead: answer every call on the store's gRPC
                  stream (idempotency.store.v1.Store/Coordinate, cleartext HTTP/2) at once
  --normalize-paths
                  route GET and HEAD on the path as a normalising proxy passes it on:
                  decoded, slashes merged, `.` and `..` segments removed
  --threads N     runtime worker threads (default: one per core)";

struct Args {
    listen: SocketAddr,
    options: Options,
    grpc_echo: bool,
    threads: Option<usize>,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut parsed = Args {
        listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
        options: Options::default(),
        grpc_echo: false,
        threads: None,
    };
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_owned(), Some(value.to_owned()))
            }
            _ => (arg, None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "--listen" => {
                let v = value("--listen")?;
                parsed.listen = v.parse().map_err(|e| format!("--listen {v:?}: {e}"))?;
            }
            "--threads" => {
                let v = value("--threads")?;
                let n: usize = v.parse().map_err(|e| format!("--threads {v:?}: {e}"))?;
                if n == 0 {
                    return Err(String::from("--threads must be at least 1"));
                }
                parsed.threads = Some(n);
            }
            "--fast" => parsed.options.fast = true,
            "--normalize-paths" => parsed.options.normalize_paths = true,
            "--grpc-echo" => parsed.grpc_echo = true,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if parsed.grpc_echo && parsed.options.fast {
        return Err(String::from("--fast and --grpc-echo exclude each other"));
    }
    Ok(Some(parsed))
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("demo-upstream: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(n) = args.threads {
        builder.worker_threads(n);
    }
    let runtime = match builder.build() {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("demo-upstream: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(args))
}

async fn run(args: Args) -> ExitCode {
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(err) => {
            eprintln!("demo-upstream: cannot listen on {}: {err}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = listener.local_addr().unwrap_or(args.listen);
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "demo-upstream listening on {addr}");
        let _ = out.flush();
    }
    if args.grpc_echo {
        eprintln!("demo-upstream: gRPC echo mode, answering every store call at once");
        let counters = Arc::new(EchoCounters::default());
        return tokio::select! {
            () = serve_grpc_echo(listener, counters) => ExitCode::SUCCESS,
            () = shutdown_signal() => ExitCode::SUCCESS,
        };
    }
    if args.options.fast {
        eprintln!("demo-upstream: fast mode, answering 200 ok to everything, counting nothing");
    }
    let counters = Arc::new(Counters::default());
    tokio::select! {
        () = serve(listener, args.options, counters) => ExitCode::SUCCESS,
        () = shutdown_signal() => ExitCode::SUCCESS,
    }
}

/// Resolves on SIGTERM or SIGINT, so a stop by signal is a clean exit.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        // Without handlers the default action (terminate) still applies.
        _ => std::future::pending().await,
    }
}
