//! The store, from the filter's side, in one place: what it sends and how it reads the
//! answers (`client`); the one gRPC stream per worker those calls travel on (`stream`: its
//! books; `link`: the root's handle on it and who waits for each call); a call as an HTTP
//! callout (`calls`); and the completions and releases the root delivers, retrying them
//! through store outages (`writes`, each one a `pending_write`).

pub mod calls;
pub mod client;
pub mod link;
pub mod pending_write;
pub mod stream;
pub mod writes;
