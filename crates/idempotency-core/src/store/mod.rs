//! The store, from the filter's side: what it sends and how it reads the answers (`client`),
//! and the one gRPC stream per worker those calls travel on (`stream`).

pub mod client;
pub mod stream;
