//! Load for `make bench`: claims of new keys over the store's gRPC stream, a fixed number in
//! flight (like redis-benchmark's connections, each with one command outstanding), each
//! answer sending the next call, for a fixed time. Prints one JSON line:
//! `{"calls":..,"seconds":..,"rps":..,"p50_ms":..,"p99_ms":..,"errors":..}`.
//!
//! `stream_load --url http://127.0.0.1:PORT --token T [--in-flight 16] [--streams 1]
//! [--seconds 10] [--lease-ms 60000]` (the claims' lease: how soon they expire, for the
//! bench's sweep run)

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idempotency_store::grpc::pb;
use idempotency_store::grpc::pb::answer::Result as Reply;
use idempotency_store::grpc::pb::store_client::StoreClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Request;

struct Args {
    url: String,
    token: String,
    in_flight: usize,
    streams: usize,
    seconds: f64,
    lease_ms: u64,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        url: String::new(),
        token: String::new(),
        in_flight: 16,
        streams: 1,
        seconds: 10.0,
        lease_ms: 60_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = || value.parse::<f64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--url" => a.url = value.clone(),
            "--token" => a.token = value.clone(),
            "--in-flight" => a.in_flight = number()? as usize,
            "--streams" => a.streams = number()? as usize,
            "--seconds" => a.seconds = number()?,
            "--lease-ms" => a.lease_ms = number()? as u64,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.url.is_empty() || a.in_flight == 0 || a.streams == 0 || a.seconds <= 0.0 {
        return Err(
            "usage: stream_load --url URL --token T [--in-flight N] [--streams N] [--seconds S] \
             [--lease-ms MS]"
                .into(),
        );
    }
    Ok(a)
}

/// Distinct 64-hex keys: a per-stream random prefix, then a counter.
fn key(prefix: &str, n: u64) -> String {
    format!("{prefix}{n:016x}")
}

struct Tally {
    latencies_us: Vec<u64>,
    errors: u64,
}

async fn one_stream(
    channel: Channel,
    token: String,
    in_flight: usize,
    until: Instant,
    prefix: String,
    lease_ms: u64,
) -> Result<Tally, String> {
    let (calls, rx) = mpsc::channel(in_flight.max(1) * 2);
    let mut request = Request::new(ReceiverStream::new(rx));
    let bearer = format!("Bearer {token}")
        .parse()
        .map_err(|e| format!("token: {e}"))?;
    request.metadata_mut().insert("authorization", bearer);
    let mut client = StoreClient::new(channel);
    let mut answers = client
        .coordinate(request)
        .await
        .map_err(|e| format!("stream refused: {e}"))?
        .into_inner();
    let mut sent_at: HashMap<u64, Instant> = HashMap::new();
    let mut next = 0u64;
    let claim = |id: u64| pb::Call {
        id,
        op: Some(pb::call::Op::Claim(pb::Claim {
            key: key(&prefix, id),
            fingerprint: "ab".repeat(32),
            lease_ms,
            owner: String::new(),
        })),
    };
    for _ in 0..in_flight {
        next += 1;
        sent_at.insert(next, Instant::now());
        calls.send(claim(next)).await.map_err(|e| e.to_string())?;
    }
    let mut tally = Tally {
        latencies_us: Vec::new(),
        errors: 0,
    };
    while !sent_at.is_empty() {
        let answer = match answers.message().await {
            Ok(Some(a)) => a,
            Ok(None) => return Err("the store ended the stream".into()),
            Err(status) => return Err(format!("stream failed: {status}")),
        };
        if let Some(at) = sent_at.remove(&answer.id) {
            tally.latencies_us.push(at.elapsed().as_micros() as u64);
        }
        if !matches!(answer.result, Some(Reply::Claimed(_))) {
            tally.errors += 1;
        }
        if Instant::now() < until {
            next += 1;
            sent_at.insert(next, Instant::now());
            calls.send(claim(next)).await.map_err(|e| e.to_string())?;
        }
    }
    Ok(tally)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let at = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted.get(at).or(sorted.last()).copied().unwrap_or(0) as f64 / 1000.0
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let a = args()?;
    let channel = Channel::from_shared(a.url.clone())
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", a.url))?;
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(a.seconds);
    // Only to tell runs apart, not to time anything.
    #[allow(clippy::disallowed_methods)]
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut tasks = Vec::new();
    for s in 0..a.streams {
        // Streams share the in-flight budget; the first ones take the remainder.
        let share = a.in_flight / a.streams + usize::from(s < a.in_flight % a.streams);
        let prefix = format!("{:032x}{:016x}", nonce, s);
        tasks.push(tokio::spawn(one_stream(
            channel.clone(),
            a.token.clone(),
            share,
            until,
            prefix.chars().take(48).collect(),
            a.lease_ms,
        )));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let tally = t.await.map_err(|e| e.to_string())??;
        latencies.extend(tally.latencies_us);
        errors += tally.errors;
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    println!(
        "{{\"calls\":{},\"seconds\":{:.3},\"rps\":{:.1},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"errors\":{}}}",
        latencies.len(),
        elapsed,
        latencies.len() as f64 / elapsed,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        errors
    );
    Ok(())
}
