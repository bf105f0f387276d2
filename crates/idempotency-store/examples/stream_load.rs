//! Load for `make bench`: claims of new keys over the store's gRPC stream, a fixed number in
//! flight (like redis-benchmark's connections, each with one command outstanding), each
//! answer sending the next call, for a fixed time. Prints one JSON line:
//! `{"calls":..,"seconds":..,"rps":..,"p50_ms":..,"p99_ms":..,"errors":..}`.
//!
//! `stream_load --url http://127.0.0.1:PORT --token T [--in-flight 16] [--streams 1]
//! [--seconds 10] [--lease-ms 60000]` (the claims' lease: how soon they expire, for the
//! bench's sweep run)
//!
//! With `--op complete` it fills the store instead (`make bench-scale`): each call records a
//! new key's response at once (a complete carrying the fingerprint, as a filter whose claim
//! lapsed sends it), a 201 with six headers and `--body-bytes` of body, kept whole for
//! `--ttl-ms` (or until `--expire-at-ms`, ms since the epoch, so that a whole batch ages at
//! one instant) and then `--tombstone-ms` as its tombstone; every `--whole-every`-th record
//! is kept whole for `--whole-ttl-ms` instead. `--count` stops after that many calls.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idempotency_store::grpc::pb;
use idempotency_store::grpc::pb::answer::Result as Reply;
use idempotency_store::grpc::pb::store_client::StoreClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Request;

#[path = "../tests/common/typical_response.rs"]
mod typical_response;
use typical_response::typical_response;

struct Args {
    url: String,
    token: String,
    in_flight: usize,
    streams: usize,
    seconds: f64,
    lease_ms: u64,
    count: u64,
    fill: Option<Fill>,
}

/// What `--op complete` records.
#[derive(Clone)]
struct Fill {
    record: Vec<u8>,
    ttl_ms: u64,
    expire_at_ms: Option<u64>,
    tombstone_ms: u64,
    whole_every: u64,
    whole_ttl_ms: u64,
}

impl Fill {
    fn ttl_ms_of(&self, id: u64) -> u64 {
        if self.whole_every > 0 && id.is_multiple_of(self.whole_every) {
            return self.whole_ttl_ms;
        }
        match self.expire_at_ms {
            Some(at) => at.saturating_sub(epoch_ms()).max(1),
            None => self.ttl_ms,
        }
    }
}

/// Only to give records an expiry instant, never to time anything.
#[allow(clippy::disallowed_methods)]
fn epoch_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        url: String::new(),
        token: String::new(),
        in_flight: 16,
        streams: 1,
        seconds: 10.0,
        lease_ms: 60_000,
        count: 0,
        fill: None,
    };
    let mut op = String::from("claim");
    let mut body_bytes = 500usize;
    let mut fill = Fill {
        record: Vec::new(),
        ttl_ms: 86_400_000,
        expire_at_ms: None,
        tombstone_ms: 0,
        whole_every: 0,
        whole_ttl_ms: 86_400_000,
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
            "--count" => a.count = number()? as u64,
            "--op" => op = value.clone(),
            "--body-bytes" => body_bytes = number()? as usize,
            "--ttl-ms" => fill.ttl_ms = number()? as u64,
            "--expire-at-ms" => fill.expire_at_ms = Some(number()? as u64),
            "--tombstone-ms" => fill.tombstone_ms = number()? as u64,
            "--whole-every" => fill.whole_every = number()? as u64,
            "--whole-ttl-ms" => fill.whole_ttl_ms = number()? as u64,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    let known_op = op == "claim" || op == "complete";
    if a.url.is_empty() || a.in_flight == 0 || a.streams == 0 || a.seconds <= 0.0 || !known_op {
        return Err(
            "usage: stream_load --url URL --token T [--in-flight N] [--streams N] [--seconds S] \
             [--lease-ms MS] [--count N] [--op claim|complete [--body-bytes N] [--ttl-ms MS | \
             --expire-at-ms T] [--tombstone-ms MS] [--whole-every K --whole-ttl-ms MS]]"
                .into(),
        );
    }
    if op == "complete" {
        fill.record = typical_response(body_bytes).encode();
        a.fill = Some(fill);
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

/// One stream's share of the run.
struct Plan {
    in_flight: usize,
    until: Instant,
    /// Most calls this stream sends (None: as many as the time allows).
    count: Option<u64>,
    prefix: String,
    lease_ms: u64,
    fill: Option<Fill>,
}

impl Plan {
    fn call(&self, id: u64) -> pb::Call {
        let key = key(&self.prefix, id);
        let fingerprint = "ab".repeat(32);
        let op = match &self.fill {
            None => pb::call::Op::Claim(pb::Claim {
                key,
                fingerprint,
                lease_ms: self.lease_ms,
                owner: String::new(),
            }),
            Some(fill) => pb::call::Op::Complete(pb::Complete {
                key,
                owner: "0f".repeat(16),
                ttl_ms: fill.ttl_ms_of(id),
                record: fill.record.clone(),
                fingerprint,
                tombstone_ms: fill.tombstone_ms,
            }),
        };
        pb::Call { id, op: Some(op) }
    }

    fn answered_as_asked(&self, answer: &Option<Reply>) -> bool {
        match self.fill {
            None => matches!(answer, Some(Reply::Claimed(_))),
            Some(_) => matches!(answer, Some(Reply::Recorded(_))),
        }
    }

    fn more(&self, sent: u64) -> bool {
        Instant::now() < self.until && self.count.is_none_or(|count| sent < count)
    }
}

async fn one_stream(channel: Channel, token: String, plan: Plan) -> Result<Tally, String> {
    let (calls, rx) = mpsc::channel(plan.in_flight.max(1) * 2);
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
    while sent_at.len() < plan.in_flight && plan.more(next) {
        next += 1;
        sent_at.insert(next, Instant::now());
        calls
            .send(plan.call(next))
            .await
            .map_err(|e| e.to_string())?;
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
        if !plan.answered_as_asked(&answer.result) {
            tally.errors += 1;
        }
        if plan.more(next) {
            next += 1;
            sent_at.insert(next, Instant::now());
            calls
                .send(plan.call(next))
                .await
                .map_err(|e| e.to_string())?;
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
        let count = (a.count > 0).then(|| {
            a.count / a.streams as u64 + u64::from((s as u64) < a.count % a.streams as u64)
        });
        let plan = Plan {
            in_flight: share,
            until,
            count,
            prefix: prefix.chars().take(48).collect(),
            lease_ms: a.lease_ms,
            fill: a.fill.clone(),
        };
        tasks.push(tokio::spawn(one_stream(
            channel.clone(),
            a.token.clone(),
            plan,
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
