//! Resolving an unknown outcome by asking the service (`resolve`, per rule). A write whose
//! outcome is unknown is never run again, but a caller asking with its key deserves a definite
//! answer: once the service guarantees the first attempt has finished or been abandoned (the
//! rule's settle time), the worker that recorded the unknown outcome looks the write up at the
//! service, as the caller would, and the answer settles the key: "took effect" becomes its
//! record and every retry replays it; "never did" frees it and the next retry executes;
//! anything else is asked again later, up to a bound, then left for an operator.
//!
//! [`settings`] is what a rule configures, [`template`] builds the lookup's path from the
//! request, [`lookup`] is one lookup ready to send and how its answer is read. The root's side
//! (scheduling, sending, applying) is `plugin::resolutions`.

pub mod lookup;
pub mod settings;
pub mod template;
