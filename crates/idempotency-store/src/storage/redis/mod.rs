//! Shared backend for several store replicas: records live in Redis, and every state
//! transition is one atomic step on the Redis server: a claim is one native
//! `SET key value NX PX lease GET` (it claims a free key, or answers what the key holds
//! without touching it), every other transition one Lua script (`scripts.rs`). Expiry is
//! Redis's own, relative (`PX`): a record leaves when Redis's clock says so, whatever the
//! clocks of the store replicas. The instants a record shows (its lease or TTL end, when it
//! was written) are the writing replica's clock; a renewal decides on Redis's `PTTL`, so a
//! replica whose clock runs behind never shortens another's lease.
//!
//! Layout: one string per record at `idem:{<key>}` (`packed.rs`). The braces make the whole
//! key the Redis Cluster hash tag, so a record always lives on one slot, and every
//! operation touches that one key: on a Redis (or Valkey) Cluster each runs on the node
//! that owns the record's slot, and the client follows MOVED/ASK redirections and topology
//! changes. Records an earlier store wrote as hashes are still read and decided on.
//!
//! The one operation that is not about one key, the operators' prefix search, walks the
//! keyspace with `SCAN` on the server, or on every primary of a cluster.
//!
//! Needs Redis 7.0 or later (or Valkey): `SET` takes `NX` and `GET` together since 7.0.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};

use super::{
    ClaimOutcome, CompleteOutcome, Digest, KeyPrefix, OwnerToken, PrefixMatches, RecordState,
    RecordView, ReleaseOutcome, RenewOutcome, Replacement, SettleOutcome, Storage, StorageError,
};
use crate::clock::{Clock, SystemClock};

mod packed;
mod scripts;

/// Keys one `SCAN` call is asked to look at (a hint: Redis may return more or fewer).
const SCAN_COUNT: u64 = 1_000;
/// Most `SCAN` calls one prefix search makes, over every primary together: about 100,000
/// keys looked at, a few tens of milliseconds of Redis time spread over its calls. A search
/// over a larger keyspace answers `exhaustive: false`; an operator who needs certainty names
/// the whole key, which is one lookup.
pub const SCAN_MAX_CALLS: u64 = 100;
/// A prefix search stops after this long, well within the client's response timeout.
const SCAN_MAX_TIME: Duration = Duration::from_secs(2);

/// One Redis server (or a Sentinel-managed primary behind one URL), or a Redis Cluster.
#[derive(Clone)]
enum Connection {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Node(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Node(c) => c.req_packed_commands(cmd, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Node(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// The connection for the operations whose second run answers exactly as the first would
/// have, had it reached Redis: a claim (`SET NX` under the caller's owner: its own claim
/// reads back as `claimed`), a completion (its own bytes read back as `completed`), a renewal
/// (never shortens) and a lookup (a read). Such a call whose connection turned out to be
/// dropped (Redis restarted, or failed over, since the connection was pooled) is sent once
/// more on the connection that replaces it, so the restart does not fail a protected write.
/// A release, a settlement or a purge is not: its second run would answer differently
/// (`not_owner`, `not_found`, nothing), so its caller gets the error and retries as it does
/// after any outage.
#[derive(Clone)]
struct Repeatable(Connection);

impl ConnectionLike for Repeatable {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            match self.0.req_packed_command(cmd).await {
                Err(e) if e.is_connection_dropped() => self.0.req_packed_command(cmd).await,
                answer => answer,
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            match self.0.req_packed_commands(cmd, offset, count).await {
                Err(e) if e.is_connection_dropped() => {
                    self.0.req_packed_commands(cmd, offset, count).await
                }
                answer => answer,
            }
        })
    }

    fn get_db(&self) -> i64 {
        self.0.get_db()
    }
}

pub struct RedisStorage {
    conn: Connection,
    /// Stamps the instants a record shows (never when Redis expires it).
    clock: SystemClock,
    legacy_claim: Script,
    complete: Script,
    release: Script,
    settle: Script,
    renew: Script,
    record: Script,
}

fn redis_key(key: &Digest) -> String {
    format!("idem:{{{}}}", key.as_str())
}

/// Where a record with a tombstone keeps its whole response until its TTL: beside the
/// record, in the same hash slot (the braces), outside the prefix search's pattern.
fn whole_key(key: &Digest) -> String {
    format!("idem:{{{}}}:w", key.as_str())
}

/// The tombstone a record with `tombstone_ms` keeps after its TTL; none without.
fn tombstone_of_if(tombstone_ms: u64, record: &[u8]) -> Vec<u8> {
    if tombstone_ms > 0 {
        super::logic::tombstone_of(record)
    } else {
        Vec::new()
    }
}

fn backend(e: redis::RedisError) -> StorageError {
    StorageError::Backend(format!("redis: {e}"))
}

fn unexpected(what: &str, v: &Value) -> StorageError {
    StorageError::Backend(format!("redis: unexpected {what} reply: {v:?}"))
}

/// Bounded timeouts: a stuck Redis must become a 503, not a hung claim.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether a single `--redis-url` names a Redis Cluster (`--redis-cluster`). Several URLs
/// are always the seeds of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterMode {
    /// Ask the server at start (`INFO cluster`); a server that cannot be asked is a start-up
    /// error that says so, never a guess.
    Auto,
    /// A cluster: the cluster client, without asking.
    Cluster,
    /// One server (or a primary behind one address): the plain client. A server that answers
    /// `INFO cluster` with `cluster_enabled:1` is still refused at start.
    Single,
}

impl RedisStorage {
    /// Connects eagerly so a wrong URL fails at startup, not on the first request.
    /// Several URLs (comma-separated) are seed nodes of a Redis Cluster, as is one URL in
    /// [`ClusterMode::Cluster`], or in [`ClusterMode::Auto`] when the server behind it says it
    /// is a cluster node: a plain client there would reach only that node's slots, and every
    /// other key would fail with `MOVED`.
    pub async fn connect_to(urls: &str, mode: ClusterMode) -> Result<Self, StorageError> {
        let seeds: Vec<&str> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        let conn = match (seeds.as_slice(), mode) {
            ([], _) => return Err(StorageError::Backend("redis: no URL given".into())),
            ([one], ClusterMode::Auto | ClusterMode::Single) => {
                if is_cluster_node(one, mode).await? {
                    Connection::Cluster(connect_cluster(&[one]).await?)
                } else {
                    Connection::Node(connect_node(one).await?)
                }
            }
            ([_, _, ..], ClusterMode::Single) => {
                return Err(StorageError::Backend(
                    "redis: several URLs are the seed nodes of a Redis Cluster, but \
                     --redis-cluster=false says a single server: give one URL, or drop \
                     --redis-cluster=false"
                        .into(),
                ))
            }
            (many, _) => Connection::Cluster(connect_cluster(many).await?),
        };
        for seed in &seeds {
            refuse_before_7(seed).await?;
            warn_if_evicting(seed).await;
        }
        Ok(Self::with(conn))
    }

    /// One Redis server at `url`, asked whether it is a cluster node.
    pub async fn connect(url: &str) -> Result<Self, StorageError> {
        Self::connect_to(url, ClusterMode::Auto).await
    }

    fn with(conn: Connection) -> Self {
        Self {
            conn,
            clock: SystemClock,
            legacy_claim: Script::new(scripts::LEGACY_CLAIM_LUA),
            complete: Script::new(&scripts::complete()),
            release: Script::new(&scripts::release()),
            settle: Script::new(&scripts::settle()),
            renew: Script::new(&scripts::renew()),
            record: Script::new(scripts::RECORD_LUA),
        }
    }
}

/// Whether the server at `url` runs in cluster mode (`INFO cluster` says `cluster_enabled:1`),
/// in `mode` [`ClusterMode::Auto`] or [`ClusterMode::Single`].
///
/// Auto: a server that cannot be asked (unreachable, no answer in time, or `INFO` refused,
/// as an ACL may) is an error naming the reason and the flag that settles it. Taking it for a
/// single server would fail every key of the other nodes' slots with `MOVED` at run time, and
/// taking it for a cluster would fail on a single server: neither guess is safe.
///
/// Single: the operator said so; a server that cannot be asked is trusted, one that says it
/// is a cluster node is an error.
async fn is_cluster_node(url: &str, mode: ClusterMode) -> Result<bool, StorageError> {
    let asked = async {
        let client = redis::Client::open(url)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("INFO")
            .arg("cluster")
            .query_async(&mut conn)
            .await
    };
    let info: Result<String, String> = match tokio::time::timeout(RESPONSE_TIMEOUT, asked).await {
        Ok(answer) => answer.map_err(|e: redis::RedisError| e.to_string()),
        Err(_) => Err(format!("no answer within {} s", RESPONSE_TIMEOUT.as_secs())),
    };
    let shown = redacted(url);
    match (info, mode) {
        (Ok(info), ClusterMode::Single) if cluster_enabled(&info) => {
            Err(StorageError::Backend(format!(
                "redis: {shown} is a cluster node (INFO cluster: cluster_enabled:1), but \
                 --redis-cluster=false says a single server: a plain client would reach only \
                 this node's slots and fail every other key with MOVED. Drop \
                 --redis-cluster=false (or pass --redis-cluster)"
            )))
        }
        (Ok(info), _) if cluster_enabled(&info) => {
            tracing::info!(
                url = %shown,
                "the redis server is a cluster node: using the cluster client \
                 (as --redis-cluster would)"
            );
            Ok(true)
        }
        (Ok(_), _) => Ok(false),
        (Err(e), ClusterMode::Single) => {
            tracing::info!(
                url = %shown,
                "cannot ask redis whether it is a cluster node ({e}); --redis-cluster=false \
                 says it is a single server"
            );
            Ok(false)
        }
        (Err(e), _) => Err(StorageError::Backend(format!(
            "redis: cannot tell whether {shown} is a single server or a cluster node: \
             INFO cluster failed ({e}). Say which: --redis-cluster=false for a single \
             server (or a primary behind one address), --redis-cluster for a Redis Cluster; \
             or let the store's Redis user run INFO"
        ))),
    }
}

/// `url` without its password, for logs and errors.
fn redacted(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((user_info, host)) => {
                let user = user_info
                    .split_once(':')
                    .map_or(user_info, |(user, _)| user);
                if user.is_empty() {
                    format!("{scheme}://***@{host}")
                } else {
                    format!("{scheme}://{user}:***@{host}")
                }
            }
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// Reads `cluster_enabled` from an `INFO cluster` answer.
pub fn cluster_enabled(info: &str) -> bool {
    info.lines().any(|line| line.trim() == "cluster_enabled:1")
}

async fn connect_node(url: &str) -> Result<ConnectionManager, StorageError> {
    let client = redis::Client::open(url).map_err(backend)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_number_of_retries(2);
    client
        .get_connection_manager_with_config(config)
        .await
        .map_err(backend)
}

/// Redis may delete keys under memory pressure unless `maxmemory-policy` is
/// `noeviction`; the `volatile-*` policies pick exactly the keys with a TTL, which
/// every claim and record here has. An evicted claim lets a retry execute again.
pub fn eviction_is_unsafe(policy: &str) -> bool {
    policy != "noeviction"
}

/// The oldest Redis whose `SET` takes `NX` and `GET` together, as every claim sends it.
const OLDEST_VERSION: (u64, u64) = (7, 0);

/// `redis_version` from an `INFO server` answer, as (major, minor). Valkey reports the Redis
/// version it is compatible with there (7.2.4 for Valkey 7 and 8).
pub fn redis_version(info: &str) -> Option<(u64, u64)> {
    let version = info
        .lines()
        .find_map(|line| line.trim().strip_prefix("redis_version:"))?;
    let mut parts = version.split('.').map(|n| n.parse::<u64>().ok());
    Some((parts.next()??, parts.next()??))
}

/// Refuses at start a server too old for the claim's `SET NX GET` (it would fail every
/// claim at run time with a syntax error). A server that will not answer `INFO` is trusted.
async fn refuse_before_7(url: &str) -> Result<(), StorageError> {
    let info: Result<String, redis::RedisError> = async {
        let client = redis::Client::open(url)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await
    }
    .await;
    match info.as_deref().map(redis_version) {
        Ok(Some(found)) if found < OLDEST_VERSION => Err(StorageError::Backend(format!(
            "redis: {} runs Redis {}.{}; the store needs 7.0 or later (or Valkey): a claim is \
             one SET with NX and GET together",
            redacted(url),
            found.0,
            found.1
        ))),
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::info!(
                url = %redacted(url),
                "cannot read the redis version ({e}); the store needs 7.0 or later"
            );
            Ok(())
        }
    }
}

/// Warns at start when the server at `url` may evict claims (only seeds are asked; a
/// server that refuses `CONFIG GET`, as some managed ones do, is noted and trusted).
async fn warn_if_evicting(url: &str) {
    let policy: Result<Vec<String>, redis::RedisError> = async {
        let client = redis::Client::open(url)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut conn)
            .await
    }
    .await;
    match policy.as_deref() {
        Ok([_, policy]) if eviction_is_unsafe(policy) => tracing::warn!(
            url = %redacted(url),
            %policy,
            "redis may evict keys under memory pressure: an evicted claim lets a retry \
             execute twice; set maxmemory-policy noeviction"
        ),
        Ok(_) => {}
        Err(e) => {
            tracing::info!(
                url = %redacted(url),
                "cannot read maxmemory-policy ({e}); make sure it is noeviction"
            )
        }
    }
}

/// A Redis Cluster from its seed nodes: the client learns the slot map from them, sends
/// each script to the node owning its key's slot, and follows MOVED/ASK and failovers.
async fn connect_cluster(seeds: &[&str]) -> Result<ClusterConnection, StorageError> {
    let client = ClusterClientBuilder::new(seeds.to_vec())
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(RESPONSE_TIMEOUT)
        .retries(3)
        .build()
        .map_err(backend)?;
    client.get_async_connection().await.map_err(backend)
}

fn as_bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b.as_slice()),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => std::str::from_utf8(as_bytes(other)?).ok()?.parse().ok(),
    }
}

/// A script's `{tag, payload}` answer (claim, renew).
fn parse_tagged<'a>(what: &str, v: &'a Value) -> Result<(String, Option<&'a Value>), StorageError> {
    let Value::Array(items) = v else {
        return Err(unexpected(what, v));
    };
    let tag = items
        .first()
        .and_then(as_bytes)
        .and_then(|b| std::str::from_utf8(b).ok())
        .ok_or_else(|| unexpected(what, v))?;
    Ok((tag.to_owned(), items.get(1)))
}

fn status_word(what: &str, v: &Value) -> Result<String, StorageError> {
    as_bytes(v)
        .and_then(|b| std::str::from_utf8(b).ok())
        .map(str::to_owned)
        .ok_or_else(|| unexpected(what, v))
}

impl RedisStorage {
    /// RECORD_LUA for `op`, `lookup` or `purge`.
    async fn read_record(
        &self,
        key: &Digest,
        op: &'static str,
    ) -> Result<Option<RecordView>, StorageError> {
        let mut script = self.record.key(redis_key(key));
        script.key(whole_key(key)).arg(op);
        let reply: Value = if op == "lookup" {
            script
                .invoke_async(&mut Repeatable(self.conn.clone()))
                .await
        } else {
            script.invoke_async(&mut self.conn.clone()).await
        }
        .map_err(backend)?;
        parse_view(op, &reply, self.clock.now_ms())
    }

    /// A claim that met a record in the older layout (a hash): decided by the script that
    /// layout was written for, or made as `fresh` (`claimed`) if the hash expired meanwhile.
    async fn claim_legacy(
        &self,
        key: &Digest,
        fingerprint: &Digest,
        lease_ms: u64,
        owner: &OwnerToken,
        fresh: Vec<u8>,
        claimed: ClaimOutcome,
    ) -> Result<ClaimOutcome, StorageError> {
        let mut conn = self.conn.clone();
        let reply: Value = self
            .legacy_claim
            .key(redis_key(key))
            .arg(fingerprint.as_str())
            .arg(lease_ms)
            .arg(owner.as_str())
            .arg(fresh)
            .invoke_async(&mut conn)
            .await
            .map_err(backend)?;
        let (tag, payload) = parse_tagged("claim", &reply)?;
        let bad = || unexpected("claim", &reply);
        Ok(match tag.as_str() {
            "fresh" => claimed,
            "mismatch" => ClaimOutcome::Mismatch,
            "in_flight" => ClaimOutcome::InFlight {
                retry_after_ms: payload.and_then(as_u64).ok_or_else(bad)?.max(1),
            },
            "completed" => ClaimOutcome::Completed {
                record: payload.and_then(as_bytes).ok_or_else(bad)?.to_vec(),
            },
            "claimed" => ClaimOutcome::Claimed {
                owner: owner.clone(),
                lease_expires_at_ms: payload.and_then(as_u64).ok_or_else(bad)?,
            },
            _ => return Err(bad()),
        })
    }
}

/// Reads what RECORD_LUA answers: nil (no record), `{'packed', value, whole}` (`whole`: the
/// whole response a record with a tombstone keeps apart, or nil), or a hash record's fields followed by
/// Redis's clock.
fn parse_view(what: &str, reply: &Value, now_ms: u64) -> Result<Option<RecordView>, StorageError> {
    let items = match reply {
        Value::Nil => return Ok(None),
        Value::Array(items) => items,
        other => return Err(unexpected(what, other)),
    };
    if let [tag, value, whole @ ..] = items.as_slice() {
        if as_bytes(tag) == Some(b"packed") {
            let whole = whole.first().and_then(as_bytes);
            return as_bytes(value)
                .and_then(packed::parse)
                .map(|record| Some(record.view(now_ms, whole)))
                .ok_or_else(|| unexpected(what, reply));
        }
    }
    let bad = || unexpected(what, reply);
    let field = |i: usize| items.get(i).filter(|v| !matches!(v, Value::Nil));
    let state = match field(0).and_then(as_bytes) {
        Some(b"in_flight") => RecordState::InFlight,
        Some(b"completed") => RecordState::Completed,
        _ => return Err(bad()),
    };
    let fingerprint = field(1)
        .and_then(as_bytes)
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|s| Digest::parse(s).ok())
        .ok_or_else(bad)?;
    let expires_at_ms = field(2).and_then(as_u64).ok_or_else(bad)?;
    let (record, owner) = match state {
        RecordState::InFlight => {
            let owner = field(4)
                .and_then(as_bytes)
                .and_then(|b| std::str::from_utf8(b).ok())
                .and_then(|s| OwnerToken::parse(s).ok())
                .ok_or_else(bad)?;
            (None, Some(owner))
        }
        RecordState::Completed => (
            Some(field(3).and_then(as_bytes).ok_or_else(bad)?.to_vec()),
            None,
        ),
    };
    Ok(Some(RecordView {
        state,
        fingerprint,
        expires_at_ms,
        record,
        owner,
        // Absent on records written before the field existed.
        written_at_ms: field(5).and_then(as_u64),
        now_ms: field(6).and_then(as_u64).ok_or_else(bad)?,
    }))
}

/// The primaries of a cluster as host and port, from the client's own slot map (a PING
/// sent to all of them answers one entry per primary, keyed by its address).
async fn primaries(conn: &mut ClusterConnection) -> Result<Vec<(String, u16)>, StorageError> {
    let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
    let reply = conn
        .route_command(redis::cmd("PING"), routing)
        .await
        .map_err(backend)?;
    let Value::Map(entries) = &reply else {
        return Err(unexpected("primaries", &reply));
    };
    entries
        .iter()
        .map(|(addr, _)| {
            as_bytes(addr)
                .and_then(|b| std::str::from_utf8(b).ok())
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
                .ok_or_else(|| unexpected("primaries", &reply))
        })
        .collect()
}

/// How a node's walk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeEnd {
    /// Its cursor came back to 0: every key it holds was looked at.
    Walked,
    /// More records matched than the search answers.
    Enough,
    /// The calls or the time of the search ran out.
    Bounded,
}

/// One prefix search: its bounds, shared by every node it walks, and what it found (a set:
/// SCAN may return a key twice while the keyspace is rehashed).
struct Scan<'a> {
    prefix: &'a KeyPrefix,
    pattern: String,
    limit: usize,
    calls: u64,
    deadline: Instant,
    found: BTreeSet<Digest>,
}

impl Scan<'_> {
    /// Walks one node's keyspace with `send` (which sends a command to that node).
    async fn node<F, Fut>(&mut self, send: F) -> Result<NodeEnd, StorageError>
    where
        F: Fn(Cmd) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<Value>>,
    {
        let mut cursor = 0u64;
        loop {
            if self.found.len() > self.limit {
                return Ok(NodeEnd::Enough);
            }
            if self.calls >= SCAN_MAX_CALLS || Instant::now() >= self.deadline {
                return Ok(NodeEnd::Bounded);
            }
            self.calls = self.calls.saturating_add(1);
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(cursor)
                .arg("MATCH")
                .arg(&self.pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT);
            let reply = send(cmd).await.map_err(backend)?;
            let (next, keys) = parse_scan(&reply)?;
            for key in keys {
                let digest = key
                    .strip_prefix("idem:{")
                    .and_then(|rest| rest.strip_suffix('}'))
                    .and_then(|hex| Digest::parse(hex).ok());
                if let Some(digest) = digest.filter(|d| self.prefix.matches(d)) {
                    self.found.insert(digest);
                }
            }
            if next == 0 {
                return Ok(NodeEnd::Walked);
            }
            cursor = next;
        }
    }
}

/// A SCAN reply: the next cursor and the keys of this step.
fn parse_scan(reply: &Value) -> Result<(u64, Vec<String>), StorageError> {
    let bad = || unexpected("scan", reply);
    let Value::Array(items) = reply else {
        return Err(bad());
    };
    let next = items.first().and_then(as_u64).ok_or_else(bad)?;
    let Some(Value::Array(keys)) = items.get(1) else {
        return Err(bad());
    };
    let keys = keys
        .iter()
        .filter_map(|k| as_bytes(k).and_then(|b| std::str::from_utf8(b).ok()))
        .map(str::to_owned)
        .collect();
    Ok((next, keys))
}

#[async_trait]
impl Storage for RedisStorage {
    fn backend_name(&self) -> &'static str {
        "redis"
    }

    fn shared_with_other_instances(&self) -> bool {
        true
    }

    async fn claim(
        &self,
        key: &Digest,
        fingerprint: &Digest,
        lease_ms: u64,
        owner: &OwnerToken,
    ) -> Result<ClaimOutcome, StorageError> {
        let now_ms = self.clock.now_ms();
        let lease_expires_at_ms = now_ms.saturating_add(lease_ms);
        let value = packed::in_flight(fingerprint, owner, lease_expires_at_ms, now_ms);
        let claimed = ClaimOutcome::Claimed {
            owner: owner.clone(),
            lease_expires_at_ms,
        };
        let mut conn = Repeatable(self.conn.clone());
        let answer: redis::RedisResult<Value> = redis::cmd("SET")
            .arg(redis_key(key))
            .arg(&value)
            .arg("NX")
            .arg("PX")
            .arg(lease_ms)
            .arg("GET")
            .query_async(&mut conn)
            .await;
        let held = match answer {
            Ok(Value::Nil) => return Ok(claimed),
            Ok(held) => held,
            Err(e) if e.code() == Some("WRONGTYPE") => {
                return self
                    .claim_legacy(key, fingerprint, lease_ms, owner, value, claimed)
                    .await
            }
            Err(e) => return Err(backend(e)),
        };
        let record = as_bytes(&held)
            .and_then(packed::parse)
            .ok_or_else(|| unexpected("claim", &held))?;
        // `decision::claim`'s order: another payload, the caller's own claim (its lease end,
        // unchanged), someone else's claim, a completed record. Not `decision::claim` itself:
        // it would first judge the record's liveness by its lease or TTL end, which on Redis
        // is the writing instance's clock, while the key existing already proves it live
        // (Redis expired it otherwise) and `SET NX` has refused to replace it.
        Ok(if record.fingerprint != *fingerprint {
            ClaimOutcome::Mismatch
        } else {
            match (record.state, record.owner.clone()) {
                (RecordState::InFlight, Some(holder)) if holder == *owner => {
                    ClaimOutcome::Claimed {
                        owner: holder,
                        lease_expires_at_ms: record.expires_at_ms,
                    }
                }
                (RecordState::InFlight, _) => ClaimOutcome::InFlight {
                    retry_after_ms: record.expires_at_ms.saturating_sub(now_ms).max(1),
                },
                (RecordState::Completed, _) if record.whole_apart => {
                    let whole: Option<Vec<u8>> = redis::cmd("GET")
                        .arg(whole_key(key))
                        .query_async(&mut conn)
                        .await
                        .map_err(backend)?;
                    ClaimOutcome::Completed {
                        record: record.answered(whole.as_deref()),
                    }
                }
                (RecordState::Completed, _) => ClaimOutcome::Completed {
                    record: record.record.to_vec(),
                },
            }
        })
    }

    async fn complete_or_create(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        ttl_ms: u64,
        tombstone_ms: u64,
        record: Vec<u8>,
        fingerprint: Option<&Digest>,
    ) -> Result<CompleteOutcome, StorageError> {
        let mut conn = Repeatable(self.conn.clone());
        let tombstone = tombstone_of_if(tombstone_ms, &record);
        let reply: Value = self
            .complete
            .key(redis_key(key))
            .key(whole_key(key))
            .arg(owner.as_str())
            .arg(ttl_ms)
            .arg(record)
            .arg(fingerprint.map_or("", Digest::as_str))
            .arg(self.clock.now_ms())
            .arg(tombstone_ms)
            .arg(tombstone)
            .invoke_async(&mut conn)
            .await
            .map_err(backend)?;
        match status_word("complete", &reply)?.as_str() {
            "completed" => Ok(CompleteOutcome::Completed),
            "not_owner" => Ok(CompleteOutcome::NotOwner),
            _ => Err(unexpected("complete", &reply)),
        }
    }

    async fn release(
        &self,
        key: &Digest,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, StorageError> {
        let mut conn = self.conn.clone();
        let reply: Value = self
            .release
            .key(redis_key(key))
            .arg(owner.as_str())
            .invoke_async(&mut conn)
            .await
            .map_err(backend)?;
        match status_word("release", &reply)?.as_str() {
            "released" => Ok(ReleaseOutcome::Released),
            "not_owner" => Ok(ReleaseOutcome::NotOwner),
            _ => Err(unexpected("release", &reply)),
        }
    }

    async fn settle_exactly(
        &self,
        key: &Digest,
        current: &[u8],
        replacement: Option<Replacement>,
    ) -> Result<SettleOutcome, StorageError> {
        let mut conn = self.conn.clone();
        let (record, ttl_ms, tombstone_ms, mode) = match &replacement {
            Some(r) => (
                r.record.as_slice(),
                r.ttl_ms.unwrap_or(0),
                r.tombstone_ms,
                "replace",
            ),
            None => (&[][..], 0, 0, "remove"),
        };
        let reply: Value = self
            .settle
            .key(redis_key(key))
            .key(whole_key(key))
            .arg(current)
            .arg(record)
            .arg(ttl_ms)
            .arg(self.clock.now_ms())
            .arg(mode)
            .arg(tombstone_ms)
            .arg(tombstone_of_if(tombstone_ms, record))
            .invoke_async(&mut conn)
            .await
            .map_err(backend)?;
        match status_word("settle", &reply)?.as_str() {
            "replaced" => Ok(SettleOutcome::Replaced),
            "removed" => Ok(SettleOutcome::Removed),
            "not_found" => Ok(SettleOutcome::NotFound),
            _ => Err(unexpected("settle", &reply)),
        }
    }

    async fn renew(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        lease_ms: u64,
    ) -> Result<RenewOutcome, StorageError> {
        let mut conn = Repeatable(self.conn.clone());
        let reply: Value = self
            .renew
            .key(redis_key(key))
            .arg(owner.as_str())
            .arg(lease_ms)
            .arg(self.clock.now_ms())
            .invoke_async(&mut conn)
            .await
            .map_err(backend)?;
        let (tag, payload) = parse_tagged("renew", &reply)?;
        match tag.as_str() {
            "renewed" => Ok(RenewOutcome::Renewed {
                lease_expires_at_ms: payload
                    .and_then(as_u64)
                    .ok_or_else(|| unexpected("renew", &reply))?,
            }),
            "not_owner" => Ok(RenewOutcome::NotOwner),
            _ => Err(unexpected("renew", &reply)),
        }
    }

    async fn lookup(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        self.read_record(key, "lookup").await
    }

    async fn purge(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        self.read_record(key, "purge").await
    }

    async fn find_by_prefix(
        &self,
        prefix: &KeyPrefix,
        limit: usize,
    ) -> Result<PrefixMatches, StorageError> {
        let mut scan = Scan {
            prefix,
            // `{` and `}` are plain characters to SCAN's glob; the braces hold the digest.
            pattern: format!("idem:{{{}*}}", prefix.as_str()),
            limit,
            calls: 0,
            deadline: Instant::now() + SCAN_MAX_TIME,
            found: BTreeSet::new(),
        };
        let mut walked_all = true;
        match &self.conn {
            Connection::Node(conn) => {
                let end = scan
                    .node(|cmd| {
                        let mut conn = conn.clone();
                        async move { cmd.query_async::<Value>(&mut conn).await }
                    })
                    .await?;
                walked_all = end == NodeEnd::Walked;
            }
            Connection::Cluster(conn) => {
                // Every primary holds its own slots' keys; a replica would only repeat them.
                for (host, port) in primaries(&mut conn.clone()).await? {
                    let routing =
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
                    let end = scan
                        .node(|cmd| {
                            let (mut conn, routing) = (conn.clone(), routing.clone());
                            async move { conn.route_command(cmd, routing).await }
                        })
                        .await?;
                    if end != NodeEnd::Walked {
                        walked_all = false;
                        break;
                    }
                }
            }
        }
        let truncated = scan.found.len() > limit;
        Ok(PrefixMatches {
            keys: scan.found.into_iter().take(limit).collect(),
            truncated,
            // Stopping because enough matched is not being cut short.
            exhaustive: walked_all || truncated,
        })
    }

    async fn sweep_expired(&self) -> Result<u64, StorageError> {
        // Redis expires keys itself (PEXPIRE); nothing to do.
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{eviction_is_unsafe, redacted, redis_version, OLDEST_VERSION};

    #[test]
    fn a_url_is_shown_without_its_password() {
        assert_eq!(
            redacted("redis://store:s3cret@10.0.0.5:6379/"),
            "redis://store:***@10.0.0.5:6379/"
        );
        assert_eq!(
            redacted("rediss://:s3cret@redis:6379/0"),
            "rediss://***@redis:6379/0"
        );
        assert_eq!(redacted("redis://10.0.0.5:6379/"), "redis://10.0.0.5:6379/");
    }

    #[test]
    fn a_cluster_node_says_so_in_its_info() {
        use super::cluster_enabled;
        assert!(cluster_enabled("# Cluster\r\ncluster_enabled:1\r\n"));
        assert!(!cluster_enabled("# Cluster\r\ncluster_enabled:0\r\n"));
        assert!(!cluster_enabled(""));
    }

    #[test]
    fn the_version_is_read_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n";
        assert_eq!(redis_version(info), Some((7, 0)));
        assert_eq!(redis_version("redis_version:6.2.14\r\n"), Some((6, 2)));
        assert!(redis_version("redis_version:6.2.14").unwrap() < OLDEST_VERSION);
        assert_eq!(redis_version("# Server\r\n"), None);
    }

    #[test]
    fn only_noeviction_keeps_every_claim() {
        assert!(!eviction_is_unsafe("noeviction"));
        // volatile-* pick keys with a TTL, which every claim and record has.
        for policy in [
            "volatile-lru",
            "volatile-ttl",
            "allkeys-lru",
            "allkeys-random",
        ] {
            assert!(eviction_is_unsafe(policy), "{policy}");
        }
    }
}
