//! One lookup, built from the original request while the filter still has it (its headers
//! are gone once its body arrives, and the unknown outcome comes later still), kept with the
//! claim until the resolution needs it.

use super::settings::Resolve;
use super::template::{LookupInput, Unfit, Values};

/// What a lookup takes from the request's headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LookupParts {
    /// The request's headers the lookup carries or its path names (every value of each).
    pub headers: Vec<(String, Vec<u8>)>,
    pub authority: String,
    /// The cluster the request's route chose, when the rule names none.
    pub route_cluster: Option<String>,
}

impl LookupParts {
    /// Reads what `resolve` needs from the request headers.
    pub fn read(
        resolve: &Resolve,
        headers: &[(String, Vec<u8>)],
        route_cluster: Option<String>,
    ) -> LookupParts {
        let wanted = |name: &str| {
            resolve.forwarded_headers.iter().any(|h| h == name)
                || resolve.path.headers().any(|h| h == name)
        };
        let authority = headers
            .iter()
            .find(|(n, _)| n == ":authority")
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .unwrap_or("")
            .to_string();
        LookupParts {
            headers: headers.iter().filter(|(n, _)| wanted(n)).cloned().collect(),
            authority,
            route_cluster,
        }
    }
}

/// Why a request has no lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoLookup {
    /// The request's own value cannot go into it: the request is refused before it runs.
    Unfit(Unfit),
    /// Its route gives no cluster to ask and the rule names none: the write runs, and an
    /// unknown outcome of it stays unknown, as without `resolve`.
    NoCluster,
}

/// A lookup ready to send as a callout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupRequest {
    pub cluster: String,
    /// Pseudo-headers first, then the headers carried from the request.
    pub headers: Vec<(String, String)>,
    /// Empty, but for a gRPC lookup's empty request message.
    pub body: Vec<u8>,
    /// A gRPC lookup's key metadata, as sent (also among `headers`): its answer must echo it.
    pub key_metadata: Vec<(String, String)>,
    pub timeout_ms: u64,
}

impl LookupRequest {
    /// The lookup for a request whose key's sources had `key_sources` values; Err says why
    /// none can be built.
    pub fn build(
        resolve: &Resolve,
        parts: &LookupParts,
        key_sources: &[Vec<u8>],
    ) -> Result<LookupRequest, NoLookup> {
        let path = resolve
            .path
            .render(&Values {
                key_sources,
                headers: &parts.headers,
            })
            .map_err(NoLookup::Unfit)?;
        let authority = resolve
            .authority
            .clone()
            .unwrap_or_else(|| parts.authority.clone());
        let mut headers = vec![
            (":method".to_string(), resolve.method.clone()),
            (":path".to_string(), path),
            (":authority".to_string(), authority),
        ];
        if resolve.grpc {
            headers.push(("content-type".to_string(), "application/grpc".to_string()));
            headers.push(("te".to_string(), "trailers".to_string()));
        }
        for (name, value) in &parts.headers {
            if !resolve.forwarded_headers.contains(name) {
                continue; // named by the path only
            }
            let Ok(text) = std::str::from_utf8(value) else {
                return Err(NoLookup::Unfit(Unfit {
                    input: LookupInput::Header(name.clone()),
                    why: "is not UTF-8, and a lookup carries header values as text".to_string(),
                }));
            };
            headers.push((name.clone(), text.to_string()));
        }
        // A gRPC lookup names the write by the key's metadata as the call sent it: only a
        // key sent once and exactly as it names the record (no quotes or spaces a service
        // might keep) asks about the same write, whichever retry builds the lookup.
        for (name, key) in resolve.key_metadata.iter().zip(key_sources) {
            let mut sent = parts.headers.iter().filter(|(n, _)| n == name);
            let why = match (sent.next(), sent.next()) {
                (Some((_, value)), None) if value == key => continue,
                (Some(_), None) => "differs from the key it names (quotes or spaces around it)",
                _ => "is sent more than once",
            };
            return Err(NoLookup::Unfit(Unfit {
                input: LookupInput::Header(name.clone()),
                why: format!("{why}: a lookup of it could ask about another write"),
            }));
        }
        // Last: a request that cannot make a lookup is refused whatever its route.
        let cluster = resolve
            .cluster
            .clone()
            .or_else(|| parts.route_cluster.clone())
            .filter(|c| resolve.store_cluster.as_deref() != Some(c.as_str()))
            .ok_or(NoLookup::NoCluster)?;
        let body = if resolve.grpc {
            super::settings::EMPTY_GRPC_MESSAGE.to_vec()
        } else {
            Vec::new()
        };
        let key_metadata = headers
            .iter()
            .filter(|(n, _)| resolve.key_metadata.contains(n))
            .cloned()
            .collect();
        Ok(LookupRequest {
            cluster,
            headers,
            body,
            key_metadata,
            timeout_ms: resolve.timeout_ms,
        })
    }

    /// Bytes it holds while it waits for its resolution.
    pub fn bytes(&self) -> usize {
        self.cluster.len()
            + self.body.len()
            + self
                .key_metadata
                .iter()
                .map(|(n, v)| n.len() + v.len())
                .sum::<usize>()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::super::settings::{validate, RawResolve, RuleFacts};
    use super::*;

    #[test]
    fn the_lookup_carries_the_callers_scope_and_names_the_write() {
        let raw: RawResolve =
            serde_json::from_str(r#"{"path":"/payments/by-key/{key}","settle_seconds":5}"#)
                .unwrap();
        let scope = vec![":authority".to_string(), "authorization".to_string()];
        let resolve = validate(
            raw,
            &RuleFacts {
                key_sources: 1,
                scope_headers: &scope,
                ttl_ms: 60_000,
                releases_unknown: false,
                is_grpc: false,
                key_metadata: &[],
                store_cluster: None,
            },
        )
        .unwrap();
        let headers = vec![
            (":authority".to_string(), b"shop.example".to_vec()),
            (":path".to_string(), b"/payments".to_vec()),
            ("authorization".to_string(), b"Bearer alice".to_vec()),
            ("cookie".to_string(), b"secret".to_vec()),
        ];
        let parts = LookupParts::read(&resolve, &headers, Some("payments".to_string()));
        let lookup = LookupRequest::build(&resolve, &parts, &[b"k-1".to_vec()]).unwrap();
        assert_eq!(lookup.cluster, "payments");
        assert_eq!(
            lookup.headers,
            vec![
                (":method".to_string(), "GET".to_string()),
                (":path".to_string(), "/payments/by-key/k-1".to_string()),
                (":authority".to_string(), "shop.example".to_string()),
                ("authorization".to_string(), "Bearer alice".to_string()),
            ]
        );
        let no_cluster = LookupParts {
            route_cluster: None,
            ..parts
        };
        assert_eq!(
            LookupRequest::build(&resolve, &no_cluster, &[b"k".to_vec()]),
            Err(NoLookup::NoCluster)
        );
        // A route whose cluster is the store's: never asked there.
        let to_the_store = Resolve {
            store_cluster: Some("payments".to_string()),
            ..resolve.clone()
        };
        let parts = LookupParts::read(&resolve, &headers, Some("payments".to_string()));
        assert_eq!(
            LookupRequest::build(&to_the_store, &parts, &[b"k".to_vec()]),
            Err(NoLookup::NoCluster)
        );
    }
}
