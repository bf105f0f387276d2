//! `idempotency-store record show|purge|resolve`: an operator's look at one record of a running
//! store, over its HTTP API with the operator token, so it works alike on every backend and
//! the store never sees a raw key or a caller's credentials (the command hashes them
//! itself, with the filter's own functions; see `naming`).
//!
//! `resolve` settles an unknown outcome by hand (the write took effect, with the response to
//! replay, or it never ran), as a rule's `resolve` does by asking the service.
//!
//! Exit codes: 0 found (or purged, or settled), 1 no such record, 2 anything else (usage,
//! connection, token, an ambiguous prefix, a record that is not an unknown outcome), always
//! with a sentence on stderr.

mod naming;
mod report;
mod store_api;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{ArgGroup, Args, Subcommand};
use serde_json::json;

pub use naming::{
    add_key, load_rule, parse_hash, parse_header, storage_key_for, Named, RequestParts,
};
pub use report::Shown;
use store_api::{StoreApi, Token};

use crate::storage::Digest;
use idempotency_protocol::record::RecordedResponse;
use idempotency_protocol::record::RESOLVED_HEADER;

/// The variable the store reads its data-plane token from (the filter's `store.token`).
pub const TOKEN_ENV: &str = "IDEMPOTENCY_STORE_TOKEN";
/// The variable the store reads its operator token from; the command reads the same one.
pub const OPERATOR_TOKEN_ENV: &str = "IDEMPOTENCY_STORE_OPERATOR_TOKEN";

pub const EXIT_FOUND: u8 = 0;
pub const EXIT_NOT_FOUND: u8 = 1;
pub const EXIT_ERROR: u8 = 2;

#[derive(Debug, Subcommand)]
pub enum RecordCommand {
    /// Show a record: its state, age, time left, owner and recorded response.
    Show(RecordArgs),
    /// Remove one record, whatever its state (a claim stuck after a crash, a recorded
    /// response that must not be replayed). Prints what was removed.
    Purge(RecordArgs),
    /// Settle an unknown outcome: it took effect (its retries then replay the response given
    /// here) or it never ran (its key is freed: the next retry executes). Only a record that
    /// still is that unknown outcome changes. The store logs it.
    Resolve(ResolveArgs),
}

/// `record resolve`: which record, and how it ended.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("ending").required(true).args(["took_effect", "never_ran"])))]
pub struct ResolveArgs {
    #[command(flatten)]
    pub record: RecordArgs,

    /// The write took effect: retries get the response given by --status, --response-header
    /// and --response-body (marked `idempotent-resolved: true`).
    #[arg(long)]
    pub took_effect: bool,

    /// The write never ran: the key is freed, and the next retry executes it.
    #[arg(long, conflicts_with_all = ["status", "response_headers", "response_body"])]
    pub never_ran: bool,

    /// The status retries get.
    #[arg(long, default_value_t = 200, value_name = "CODE")]
    pub status: u16,

    /// A header retries get, `'name: value'` (repeatable).
    #[arg(long = "response-header", value_name = "'NAME: VALUE'")]
    pub response_headers: Vec<String>,

    /// The body retries get.
    #[arg(long, value_name = "TEXT")]
    pub response_body: Option<String>,
}

/// How to reach the store, which record, and how to print it.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("record").required(true).args(["hash", "rule"])))]
pub struct RecordArgs {
    /// The store's HTTP address (a path, for a store behind a path-routing proxy, is kept).
    #[arg(long, default_value = "http://127.0.0.1:8081", value_name = "URL")]
    pub store_url: String,

    /// File holding the store's operator token (surrounding whitespace ignored); else the
    /// IDEMPOTENCY_STORE_OPERATOR_TOKEN environment variable, as for the store itself. The
    /// data-plane token (the filter's) is refused.
    #[arg(long, value_name = "PATH")]
    pub operator_token_file: Option<PathBuf>,

    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,

    /// 16 to 64 hex digits of the storage key: the access log's idempotency_key_hash (a
    /// prefix, searched for) or the whole key.
    #[arg(long, value_name = "HEX", conflicts_with_all = ["rule", "plugin_config", "headers", "key", "path", "body_file"])]
    pub hash: Option<String>,

    /// The rule that protected the request (its name is part of the storage key).
    #[arg(long, value_name = "NAME")]
    pub rule: Option<String>,

    /// The filter's plugin configuration (JSON, as in envoy/envoy.yaml), for the rule's
    /// scope headers and key sources. Without it: the defaults (scope `:authority` and
    /// `authorization`, key from the Idempotency-Key header).
    #[arg(long, value_name = "FILE")]
    pub plugin_config: Option<PathBuf>,

    /// A header the request carried, `'name: value'`: each scope header (repeat a
    /// repeated header, in order; leave out one the request did not have). `Host` is
    /// taken as `:authority`.
    #[arg(short = 'H', long = "header", value_name = "'NAME: VALUE'")]
    pub headers: Vec<String>,

    /// The request's Idempotency-Key value (the rule's key header), quoted or bare.
    #[arg(long, value_name = "VALUE")]
    pub key: Option<String>,

    /// The request's path with its query, for a rule whose key.sources read the query.
    #[arg(long, value_name = "PATH?QUERY")]
    pub path: Option<String>,

    /// The request's body, for a rule whose key.sources read body fields (its type from
    /// -H 'content-type: ...').
    #[arg(long, value_name = "FILE")]
    pub body_file: Option<PathBuf>,
}

/// A failure with its exit code.
struct Failure(u8, String);

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure(EXIT_ERROR, message)
    }
}

/// Runs the command; the exit code and what to print are decided here, never by a panic.
pub async fn run(command: RecordCommand) -> ExitCode {
    let done = match command {
        RecordCommand::Show(args) => execute(false, &args).await,
        RecordCommand::Purge(args) => execute(true, &args).await,
        RecordCommand::Resolve(args) => settle_by_hand(&args).await,
    };
    match done {
        Ok(()) => ExitCode::from(EXIT_FOUND),
        Err(Failure(code, message)) => {
            eprintln!("idempotency-store record: {message}");
            ExitCode::from(code)
        }
    }
}

/// The record the arguments name.
pub fn resolve(args: &RecordArgs) -> Result<Named, String> {
    if let Some(hash) = &args.hash {
        return parse_hash(hash);
    }
    let rule_name = args
        .rule
        .as_deref()
        .ok_or("name the record with --hash, or with --rule (and its headers and --key)")?;
    let rule = load_rule(args.plugin_config.as_deref(), rule_name)?;
    let mut parts = RequestParts {
        headers: args
            .headers
            .iter()
            .map(|h| parse_header(h))
            .collect::<Result<_, _>>()?,
        path: args.path.clone().unwrap_or_default(),
        body: match &args.body_file {
            Some(path) => std::fs::read(path)
                .map_err(|e| format!("cannot read --body-file {}: {e}", path.display()))?,
            None => Vec::new(),
        },
    };
    if let Some(key) = &args.key {
        add_key(&rule, &mut parts, key)?;
    }
    storage_key_for(&rule, &parts).map(Named::Key)
}

fn token(args: &RecordArgs) -> Result<Option<Token>, String> {
    let token = match &args.operator_token_file {
        Some(path) => {
            let raw = std::fs::read_to_string(path).map_err(|e| {
                format!("cannot read --operator-token-file {}: {e}", path.display())
            })?;
            Some(Token {
                secret: raw.trim().to_owned(),
                source: format!("--operator-token-file {}", path.display()),
            })
        }
        None => std::env::var(OPERATOR_TOKEN_ENV).ok().map(|t| Token {
            secret: t.trim().to_owned(),
            source: OPERATOR_TOKEN_ENV.to_owned(),
        }),
    };
    match token {
        Some(t) if t.secret.is_empty() => Err(format!("the token from {} is empty", t.source)),
        other => Ok(other),
    }
}

/// This machine's clock, for an older store that does not send its own.
fn now_ms() -> u64 {
    use crate::clock::Clock as _;
    crate::clock::SystemClock.now_ms()
}

/// What a prefix search found, for messages.
struct Found {
    keys: Vec<Digest>,
    truncated: bool,
    exhaustive: bool,
}

async fn find(api: &StoreApi, named: &Named) -> Result<Found, Failure> {
    match named {
        Named::Key(key) => Ok(Found {
            keys: vec![key.clone()],
            truncated: false,
            exhaustive: true,
        }),
        Named::Prefix(prefix) => {
            let answer = api.search(prefix).await?;
            let keys = answer
                .keys
                .iter()
                .map(|k| Digest::parse(k))
                .collect::<Result<_, _>>()
                .map_err(|why| format!("the store answered a key that {why}"))?;
            Ok(Found {
                keys,
                truncated: answer.truncated,
                exhaustive: answer.exhaustive,
            })
        }
    }
}

fn describe(named: &Named) -> String {
    match named {
        Named::Key(key) => format!("key {}", key.as_str()),
        Named::Prefix(prefix) => format!("keys starting with {}", prefix.as_str()),
    }
}

/// Notes on a search's answer that change what it means.
fn caveats(found: &Found) -> Vec<String> {
    let mut notes = Vec::new();
    if found.truncated {
        notes.push(format!(
            "more than {} records match: give more hex digits",
            found.keys.len()
        ));
    }
    if !found.exhaustive && !found.truncated {
        notes.push(
            "the store stopped searching at its bounds before it had seen every record: \
             others may match (give the whole 64-digit key to be sure)"
                .to_owned(),
        );
    }
    notes
}

async fn execute(purge: bool, args: &RecordArgs) -> Result<(), Failure> {
    let named = resolve(args)?;
    let api = StoreApi::new(&args.store_url, token(args)?)?;
    let found = find(&api, &named).await?;
    if purge {
        return purge_one(&api, args, &named, &found).await;
    }
    let mut shown = Vec::new();
    for key in &found.keys {
        // A record may expire between the search and its lookup.
        if let Some(answer) = api.lookup(key).await? {
            shown.push(Shown::new(key.as_str(), &answer, now_ms()));
        }
    }
    let notes = caveats(&found);
    if args.json {
        let records: Vec<_> = shown.iter().map(Shown::json).collect();
        println!(
            "{}",
            json!({"records": records, "truncated": found.truncated, "exhaustive": found.exhaustive})
        );
    } else {
        for (i, record) in shown.iter().enumerate() {
            if i > 0 {
                println!();
            }
            print!("{}", record.text());
        }
        for note in &notes {
            eprintln!("note: {note}");
        }
    }
    if shown.is_empty() {
        let mut message = format!("no live record for {}", describe(&named));
        for note in notes {
            message.push_str("; ");
            message.push_str(&note);
        }
        return Err(Failure(EXIT_NOT_FOUND, message));
    }
    Ok(())
}

/// `record resolve`: the one record named, if it is an unknown outcome, settled as told.
async fn settle_by_hand(args: &ResolveArgs) -> Result<(), Failure> {
    let replacement = if args.took_effect {
        Some(stated_response(args)?)
    } else {
        None
    };
    let named = resolve(&args.record)?;
    let api = StoreApi::new(&args.record.store_url, token(&args.record)?)?;
    let found = find(&api, &named).await?;
    let key = the_one(&named, &found, "resolve settles", "nothing settled")?;
    let Some(answer) = api.lookup(key).await? else {
        return Err(Failure(
            EXIT_NOT_FOUND,
            format!("no live record for key {}; nothing settled", key.as_str()),
        ));
    };
    let shown = Shown::new(key.as_str(), &answer, now_ms());
    let current = match (&shown.response, &answer.record) {
        (Some(report::Response::OutcomeUnknown(_)), Some(text)) => {
            idempotency_protocol::wire::decode_record(text)
                .map_err(|e| format!("the store's record is not base64: {e}"))?
        }
        _ => {
            return Err(Failure(
                EXIT_ERROR,
                format!(
                    "resolve settles an unknown outcome; this record is not one (nothing \
                     settled):\n{}",
                    shown.text()
                ),
            ))
        }
    };
    // The rule's TTL and tombstone, as the unknown outcome carries them: the settled record
    // is kept as the filter's own resolution would keep it.
    let retention = RecordedResponse::decode(&current)
        .and_then(|r| r.unknown)
        .and_then(|u| u.retention)
        .filter(|_| replacement.is_some());
    let record = replacement.map(|r| r.encode());
    let outcome = api
        .settle(key, &current, record.as_deref(), retention)
        .await?;
    let settled = Shown::new(
        key.as_str(),
        &api.lookup(key).await?.unwrap_or(answer),
        now_ms(),
    );
    if args.record.json {
        println!("{}", json!({"outcome": outcome, "record": settled.json()}));
    } else if args.never_ran {
        println!("settled: the write never ran; key {} is free", key.as_str());
    } else {
        println!("settled: the write took effect; retries replay:");
        print!("{}", settled.text());
    }
    Ok(())
}

/// The response an operator says a write that took effect answered.
fn stated_response(args: &ResolveArgs) -> Result<RecordedResponse, String> {
    if !(200..=599).contains(&args.status) {
        return Err(format!(
            "--status {}: an HTTP status, 200 to 599",
            args.status
        ));
    }
    let mut headers = Vec::new();
    for raw in &args.response_headers {
        let (name, value) = parse_header(raw)?;
        if name.starts_with(':') {
            return Err(format!("--response-header {raw:?}: not a pseudo-header"));
        }
        headers.push((name, value));
    }
    headers.push((RESOLVED_HEADER.to_owned(), b"true".to_vec()));
    Ok(RecordedResponse {
        status: args.status,
        headers,
        body: args.response_body.clone().unwrap_or_default().into_bytes(),
        ..RecordedResponse::default()
    })
}

/// The one key found, or why an operation that changes one record will not pick one.
fn the_one<'a>(
    named: &Named,
    found: &'a Found,
    what: &str,
    nothing: &str,
) -> Result<&'a Digest, Failure> {
    match found.keys.as_slice() {
        [] => {
            let mut message = format!("no live record for {}; {nothing}", describe(named));
            for note in caveats(found) {
                message.push_str("; ");
                message.push_str(&note);
            }
            Err(Failure(EXIT_NOT_FOUND, message))
        }
        [one] if !found.truncated && found.exhaustive => Ok(one),
        many => {
            let listed: Vec<&str> = many.iter().map(Digest::as_str).collect();
            let mut message = format!(
                "{what} one record, named without doubt; {}: {} ({nothing}). \
                 Name it by its whole key, --hash <64 hex digits>:\n  {}",
                describe(named),
                if many.len() > 1 || found.truncated {
                    format!("{} or more records match", many.len())
                } else {
                    "one record found, but the search did not see every record".to_owned()
                },
                listed.join("\n  ")
            );
            for note in caveats(found) {
                message.push_str("\nnote: ");
                message.push_str(&note);
            }
            Err(Failure(EXIT_ERROR, message))
        }
    }
}

async fn purge_one(
    api: &StoreApi,
    args: &RecordArgs,
    named: &Named,
    found: &Found,
) -> Result<(), Failure> {
    let key = the_one(named, found, "purge removes", "nothing purged")?;
    let Some(answer) = api.purge(key).await? else {
        return Err(Failure(
            EXIT_NOT_FOUND,
            format!("no live record for key {}; nothing purged", key.as_str()),
        ));
    };
    let removed = Shown::new(key.as_str(), &answer.purged, now_ms());
    if args.json {
        println!("{}", json!({"purged": removed.json()}));
    } else {
        println!("purged:");
        print!("{}", removed.text());
    }
    Ok(())
}
