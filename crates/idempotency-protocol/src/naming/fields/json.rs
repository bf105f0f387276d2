//! One pass over a JSON body that keeps only the fields asked for.
//!
//! A body may be 64 MiB from an unauthenticated sender, and a tree of it (one value per
//! number, string and member) costs tens of times its size in Wasm heap, which aborts the VM.
//! So nothing is built for what no pointer selects: serde_json's parser drives visitors that
//! follow the pointers' reference tokens down the document, skip every other value (it is
//! still parsed, so the same documents are refused, with the same messages, as by
//! `serde_json::from_slice::<Value>`), and write a selected value straight out as the bytes
//! asked for. The heap a pass takes beyond the body: the selected values, a few words per
//! object or array on a pointer's path, and serde_json's scratch buffer, which holds a string
//! while its escapes are decoded (so up to the longest string with an escape, not the body's
//! token count). serde_json's recursion limit (127 levels of arrays and objects) bounds the
//! nesting, and with it the visitors' recursion: deeper documents are refused as "recursion
//! limit exceeded".
//!
//! A number is kept as its literal text, exactly as sent: `100`, `1e2` and `100.0` are three
//! values, since any normalisation loses precision somewhere (`serde_json::Value` turned two
//! different 28-digit ids into the same f64) and a retry resends the same bytes. The texts are
//! taken from the bytes in the order the parser visits numbers ([`NumberTexts`]). Two other
//! ways were rejected: serde_json's `arbitrary_precision` feature would be unified by Cargo
//! into every crate built with this one (the filter's configuration, the store), changing
//! their `Number`/`Value` and breaking numbers inside untagged or flattened serde types; and
//! `RawValue` gives the text only of values a type asks for in advance.
//!
//! `serde::de::IgnoredAny` would skip faster, but serde_json skips with it more leniently
//! than it parses (no recursion limit, lone surrogates and out-of-range numbers accepted),
//! which would turn refused documents into keys.

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::FieldError;

/// The form a field is wanted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Form {
    /// A key source: a string's content, a number's literal text, `true` or `false`.
    Scalar,
    /// A fingerprint field: its canonical JSON text.
    Canonical,
}

/// A field as read: None when absent.
pub(super) type Read = Result<Option<Vec<u8>>, FieldError>;

/// The RFC 6901 reference tokens of a pointer; None for a pointer that selects nothing (one
/// that is neither empty nor starts with `/`).
fn reference_tokens(pointer: &str) -> Option<Vec<String>> {
    if pointer.is_empty() {
        return Some(Vec::new());
    }
    let rest = pointer.strip_prefix('/')?;
    Some(
        rest.split('/')
            .map(|raw| raw.replace("~1", "/").replace("~0", "~"))
            .collect(),
    )
}

/// An RFC 6901 array index, as serde_json reads it: decimal, no sign, no leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// Reads every `(pointer, form)` of `wanted` in one pass over `bytes`, in the same order;
/// an error when the document is not JSON.
pub(super) fn read_fields(
    bytes: &[u8],
    wanted: &[(String, Form)],
) -> Result<Vec<Read>, FieldError> {
    let fields: Vec<Field> = wanted
        .iter()
        .map(|(pointer, form)| Field {
            tokens: reference_tokens(pointer),
            form: *form,
        })
        .collect();
    let selecting = (0..fields.len())
        .filter(|&i| fields.get(i).is_some_and(|f| f.tokens.is_some()))
        .collect();
    let mut pass = Pass {
        numbers: NumberTexts { bytes, at: 0 },
        numbers_lost: false,
        out: Vec::new(),
        found: vec![Ok(None); fields.len()],
        fields,
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    Node {
        pass: &mut pass,
        fields: selecting,
        depth: 0,
        inside: false,
    }
    .deserialize(&mut de)
    .and_then(|()| de.end())
    .map_err(|e| FieldError::Unparseable(format!("invalid JSON: {e}")))?;
    // Each number's text is taken from the bytes in the order the parser visits numbers (see
    // `NumberTexts`). Were a change of serde_json's features to hand numbers over otherwise,
    // the counts differ: every JSON body with a number is refused, loudly, rather than keyed
    // by the wrong text.
    if pass.numbers_lost || pass.numbers.next().is_some() {
        return Err(FieldError::Unparseable(
            "the numbers of the JSON document could not be located".to_string(),
        ));
    }
    Ok(pass.found)
}

struct Field {
    tokens: Option<Vec<String>>,
    form: Form,
}

/// What a pass has read so far.
struct Pass<'b> {
    numbers: NumberTexts<'b>,
    /// A number was visited with no text left for it.
    numbers_lost: bool,
    /// The canonical text being written: a selected value's, and within an object its members
    /// (`"name":value`, see [`Member`]) until they are sorted.
    out: Vec<u8>,
    fields: Vec<Field>,
    found: Vec<Read>,
}

impl<'b> Pass<'b> {
    /// The literal text of the number the parser just visited.
    fn number(&mut self) -> &'b [u8] {
        self.numbers.next().unwrap_or_else(|| {
            self.numbers_lost = true;
            b""
        })
    }

    fn token(&self, field: usize, depth: usize) -> Option<&str> {
        self.fields
            .get(field)?
            .tokens
            .as_ref()?
            .get(depth)
            .map(String::as_str)
    }

    fn ends_at(&self, field: usize, depth: usize) -> bool {
        self.fields
            .get(field)
            .and_then(|f| f.tokens.as_ref())
            .is_some_and(|t| t.len() == depth)
    }

    fn form(&self, field: usize) -> Option<Form> {
        self.fields.get(field).map(|f| f.form)
    }

    fn set(&mut self, field: usize, read: Read) {
        if let Some(slot) = self.found.get_mut(field) {
            *slot = read;
        }
    }

    /// Replaces the members written from `start` by the object's canonical text: sorted by
    /// name, byte for byte as `String`s compare; equal names keep their order (they all
    /// count, so that `{"k":1,"k":2}` and `{"k":2,"k":1}` differ).
    fn close_object(&mut self, start: usize, mut members: Vec<Member>) {
        let out = &self.out;
        let name = |m: &Member| m.name(out);
        // Unstable, with the position as the tie-break: a stable sort's order without its
        // buffer (up to as many members again).
        members.sort_unstable_by(|a, b| name(a).cmp(name(b)).then(a.start.cmp(&b.start)));
        let len: usize = members
            .iter()
            .map(|m| m.end.saturating_sub(m.text) + 1)
            .sum();
        let mut text = Vec::with_capacity(len + 1);
        text.push(b'{');
        for (n, m) in members.iter().enumerate() {
            if n > 0 {
                text.push(b',');
            }
            text.extend_from_slice(out.get(m.text..m.end).unwrap_or_default());
        }
        text.push(b'}');
        if start == 0 {
            // The object is all of the text: its members' buffer can go at once.
            self.out = text;
        } else {
            self.out.truncate(start);
            self.out.extend_from_slice(&text);
        }
    }
}

/// Where one member of an object being written lies in `Pass::out`: from `start`, the name
/// as decoded if it is printed with escapes (members sort by decoded name), then from `text`
/// to `end` its text `"name":value`.
struct Member {
    start: usize,
    text: usize,
    end: usize,
}

impl Member {
    /// The decoded name: its own copy, or else (printed as it is, so without `"`) the text up
    /// to the closing quote.
    fn name<'o>(&self, out: &'o [u8]) -> &'o [u8] {
        if self.text > self.start {
            return out.get(self.start..self.text).unwrap_or_default();
        }
        let printed = out.get(self.text + 1..self.end).unwrap_or_default();
        let len = printed.iter().position(|&b| b == b'"').unwrap_or(0);
        printed.get(..len).unwrap_or_default()
    }
}

/// The literal text of each number of a document, in document order. Outside strings a JSON
/// number is exactly a run that starts with `-` or a digit (`true`, `false` and `null` start
/// with letters); inside strings only `\` (escaping the next byte) and the closing `"` matter.
/// Only bytes the parser has already accepted are read: a number's text is taken just after
/// the parser visits it.
struct NumberTexts<'b> {
    bytes: &'b [u8],
    at: usize,
}

impl<'b> NumberTexts<'b> {
    fn next(&mut self) -> Option<&'b [u8]> {
        let bytes = self.bytes;
        // Each call starts after a number or at the start: outside a string.
        let mut in_string = false;
        while let Some(&b) = bytes.get(self.at) {
            if in_string {
                match b {
                    b'\\' => self.at += 1,
                    b'"' => in_string = false,
                    _ => {}
                }
                self.at += 1;
            } else if b == b'"' {
                in_string = true;
                self.at += 1;
            } else if b == b'-' || b.is_ascii_digit() {
                let start = self.at;
                while bytes
                    .get(self.at)
                    .is_some_and(|c| matches!(c, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                {
                    self.at += 1;
                }
                return bytes.get(start..self.at);
            } else {
                self.at += 1;
            }
        }
        None
    }
}

/// A value no field selects: parsed (so validated) and dropped.
struct Skip<'p, 'b>(&'p mut Pass<'b>);

impl<'de> DeserializeSeed<'de> for Skip<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Skip<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.0.number();
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.0.number();
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        self.0.number();
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Skip(&mut *self.0))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key_seed(SkipName)?.is_some() {
            map.next_value_seed(Skip(&mut *self.0))?;
        }
        Ok(())
    }
}

/// A member name no field selects.
struct SkipName;

impl<'de> DeserializeSeed<'de> for SkipName {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        // As serde_json's `Value` reads names, so that the same names are refused.
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for SkipName {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
}

/// A value some field selects, or that lies on the way to one, or inside a selected value
/// whose canonical text is being written.
struct Node<'p, 'b> {
    pass: &'p mut Pass<'b>,
    /// The fields whose pointer leads to this value or below it.
    fields: Vec<usize>,
    /// How many reference tokens lead here.
    depth: usize,
    /// An ancestor's canonical text is being written, and this value's belongs in it.
    inside: bool,
}

impl Node<'_, '_> {
    /// Whether this value's canonical text is written: an ancestor's includes it, or a field
    /// wants it.
    fn writes(&self) -> bool {
        self.inside
            || self.fields.iter().any(|&i| {
                self.pass.ends_at(i, self.depth) && self.pass.form(i) == Some(Form::Canonical)
            })
    }

    /// The fields that go on below this value.
    fn below(&self) -> Vec<usize> {
        self.fields
            .iter()
            .copied()
            .filter(|&i| !self.pass.ends_at(i, self.depth))
            .collect()
    }

    /// Gives the fields that end here what they asked for: the canonical text written from
    /// `start`, or `scalar`. The text then goes, unless an ancestor's includes it.
    fn settle(self, start: usize, scalar: Result<&[u8], FieldError>) {
        let pass = self.pass;
        let ending: Vec<usize> = self
            .fields
            .iter()
            .copied()
            .filter(|&i| pass.ends_at(i, self.depth))
            .collect();
        let mut texts_left = ending
            .iter()
            .filter(|&&i| pass.form(i) == Some(Form::Canonical))
            .count();
        for i in ending {
            let read = match pass.form(i) {
                Some(Form::Canonical) => {
                    texts_left -= 1;
                    // The last (usually only) field given the whole buffer takes it as it is.
                    if texts_left == 0 && !self.inside && start == 0 {
                        Ok(Some(std::mem::take(&mut pass.out)))
                    } else {
                        Ok(Some(pass.out.get(start..).unwrap_or_default().to_vec()))
                    }
                }
                Some(Form::Scalar) | None => scalar.clone().map(|s| Some(s.to_vec())),
            };
            pass.set(i, read);
        }
        if !self.inside {
            pass.out.truncate(start);
        }
    }

    fn leaf<E: serde::de::Error>(
        self,
        text: &[u8],
        scalar: Result<&[u8], FieldError>,
    ) -> Result<(), E> {
        let start = self.pass.out.len();
        if self.writes() {
            self.pass.out.extend_from_slice(text);
        }
        self.settle(start, scalar);
        Ok(())
    }
}

/// The next element (an array's) or value (an object's): skipped when no field needs it and
/// no text is being written.
enum Next<'p, 'b> {
    Skip(Skip<'p, 'b>),
    Node(Node<'p, 'b>),
}

fn next<'p, 'b>(
    pass: &'p mut Pass<'b>,
    fields: Vec<usize>,
    depth: usize,
    inside: bool,
) -> Next<'p, 'b> {
    if fields.is_empty() && !inside {
        Next::Skip(Skip(pass))
    } else {
        Next::Node(Node {
            pass,
            fields,
            depth,
            inside,
        })
    }
}

impl<'de> DeserializeSeed<'de> for Next<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        match self {
            Next::Skip(skip) => skip.deserialize(deserializer),
            Next::Node(node) => node.deserialize(deserializer),
        }
    }
}

impl<'de> DeserializeSeed<'de> for Node<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<(), E> {
        let text: &[u8] = if v { b"true" } else { b"false" };
        self.leaf(text, Ok(text))
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        let text = self.pass.number();
        self.leaf(text, Ok(text))
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        let text = self.pass.number();
        self.leaf(text, Ok(text))
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        let text = self.pass.number();
        self.leaf(text, Ok(text))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        let start = self.pass.out.len();
        if self.writes() {
            // Escaped as serde_json prints strings, as fingerprints always were.
            serde_json::to_writer(&mut self.pass.out, v).map_err(E::custom)?;
        }
        self.settle(start, Ok(v.as_bytes()));
        Ok(())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.leaf(b"null", Err(FieldError::NotScalar))
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
        self.visit_unit()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let writes = self.writes();
        let below: Vec<(usize, Option<usize>)> = self
            .below()
            .into_iter()
            .map(|i| (i, self.pass.token(i, self.depth).and_then(array_index)))
            .collect();
        let start = self.pass.out.len();
        if writes {
            self.pass.out.push(b'[');
        }
        let mut index = 0usize;
        loop {
            let before = self.pass.out.len();
            if writes && index > 0 {
                self.pass.out.push(b',');
            }
            let fields = below
                .iter()
                .filter(|(_, at)| *at == Some(index))
                .map(|(i, _)| *i)
                .collect();
            let element = next(&mut *self.pass, fields, self.depth + 1, writes);
            if seq.next_element_seed(element)?.is_none() {
                self.pass.out.truncate(before);
                break;
            }
            index = index.saturating_add(1);
        }
        if writes {
            self.pass.out.push(b']');
        }
        self.settle(start, Err(FieldError::NotScalar));
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let writes = self.writes();
        let below = self.below();
        // How often each field's next token has been a member's name.
        let mut named = vec![0usize; below.len()];
        let mut members = Vec::new();
        let start = self.pass.out.len();
        loop {
            let member_start = self.pass.out.len();
            let name = Name {
                pass: &mut *self.pass,
                writes,
                below: &below,
                depth: self.depth,
            };
            let Some(name) = map.next_key_seed(name)? else {
                break;
            };
            let mut fields = Vec::new();
            for k in name.selects {
                if let (Some(n), Some(&i)) = (named.get_mut(k), below.get(k)) {
                    *n = n.saturating_add(1);
                    // A second member of the name is only validated: the field fails below.
                    if *n == 1 {
                        fields.push(i);
                    }
                }
            }
            map.next_value_seed(next(&mut *self.pass, fields, self.depth + 1, writes))?;
            if writes {
                members.push(Member {
                    start: member_start,
                    text: name.text,
                    end: self.pass.out.len(),
                });
            }
        }
        // A member named twice on a pointer's way: serde_json would take the last, other
        // parsers the first, so the upstream may well read another value than the key.
        for (&i, &n) in below.iter().zip(&named) {
            if n > 1 {
                self.pass.set(i, Err(FieldError::Duplicate));
            }
        }
        if writes {
            self.pass.close_object(start, members);
        }
        self.settle(start, Err(FieldError::NotScalar));
        Ok(())
    }
}

/// A member name where fields go on below: which of them it selects, and its part of the
/// object's text when that is written.
struct Name<'p, 'b, 'f> {
    pass: &'p mut Pass<'b>,
    writes: bool,
    /// The fields that go on below the object.
    below: &'f [usize],
    /// The object's depth: the fields' tokens at it name members.
    depth: usize,
}

/// What a [`Name`] gives: the positions in `below` of the fields it selects, and where the
/// member's text starts in `Pass::out` (when written).
struct NameRead {
    selects: Vec<usize>,
    text: usize,
}

impl<'de> DeserializeSeed<'de> for Name<'_, '_, '_> {
    type Value = NameRead;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<NameRead, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Name<'_, '_, '_> {
    type Value = NameRead;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<NameRead, E> {
        let mut text = 0;
        if self.writes {
            let out = &mut self.pass.out;
            text = out.len();
            serde_json::to_writer(&mut *out, v).map_err(E::custom)?;
            // An escape lengthens the name: then its decoded form, to sort by, goes first.
            if out.len() != text + v.len() + 2 {
                out.splice(text..text, v.bytes());
                text += v.len();
            }
            out.push(b':');
        }
        let selects = self
            .below
            .iter()
            .enumerate()
            .filter(|(_, &i)| self.pass.token(i, self.depth) == Some(v))
            .map(|(k, _)| k)
            .collect();
        Ok(NameRead { selects, text })
    }
}
