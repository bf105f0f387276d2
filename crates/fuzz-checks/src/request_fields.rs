//! Request fields (`idempotency_protocol::naming::fields`): JSON Pointer scalars and canonical
//! subtrees, form and query values; and the fingerprint over selected fields
//! (`idempotency_core::fingerprint`).

use arbitrary::{Result, Unstructured};
use idempotency_core::fingerprint::{fingerprint, FingerprintMode, Protocol};
use idempotency_protocol::naming::fields::{query_value, FieldError, RequestBody};
use idempotency_protocol::naming::source::FieldSource;
use serde_json::Value;

use crate::gen::{any_string, json_string, percent_encode, short_name, Tree};

const JSON: &str = "application/json";
const FORM: &str = "application/x-www-form-urlencoded";

/// Any body: JSON fields agree with serde_json's own reading (the same documents accepted,
/// the same value at a pointer), the canonical form is stable and reads back as that value,
/// a scalar and its canonical form agree, and a field read in one pass with others reads as
/// alone; form values are UTF-8, re-encode to themselves and read the same from a query.
/// Built bodies: the canonical form and the fingerprint ignore member order and whitespace,
/// and two different field values (JSON or form) never give the same fingerprint.
pub fn request_fields(data: &[u8]) {
    let _ = raw(Unstructured::new(data));
    let _ = json_fingerprints(&mut Unstructured::new(data));
    let _ = form_fingerprints(&mut Unstructured::new(data));
}

fn raw(mut u: Unstructured<'_>) -> Result<()> {
    let u = &mut u;
    let content_type = *u.choose(&[
        JSON,
        "application/problem+json; charset=utf-8",
        FORM,
        "text/plain",
    ])?;
    let name = if u.ratio(1, 2)? {
        format!("/{}", short_name(u)?)
    } else {
        u.arbitrary::<String>()?
    };
    let body = std::mem::replace(u, Unstructured::new(&[])).take_rest();
    if content_type == FORM {
        form_and_query(body, &name);
    } else {
        json_fields(content_type, body, &name);
    }
    Ok(())
}

fn json_fields(content_type: &str, body: &[u8], pointer: &str) {
    let mut parsed = RequestBody::new(content_type, body);
    let canonical = parsed.json_canonical(pointer);
    let scalar = parsed.json_scalar(pointer);
    // Read in one pass with other fields (its parent, itself in both forms, others): the same.
    let parent = pointer.rsplit_once('/').map_or("", |(p, _)| p);
    let mut together = RequestBody::new(content_type, body);
    together.will_read_json([parent, pointer, "/0"], [pointer, "/a", parent]);
    assert_eq!(
        together.json_scalar(pointer),
        scalar,
        "one pass, {pointer:?}"
    );
    assert_eq!(
        together.json_canonical(pointer),
        canonical,
        "one pass, {pointer:?}"
    );
    if content_type == "text/plain" {
        assert!(matches!(
            canonical,
            Err(FieldError::WrongContentType { .. })
        ));
        assert!(matches!(scalar, Err(FieldError::WrongContentType { .. })));
        return;
    }
    let reference = serde_json::from_slice::<Value>(body);
    let Ok(reference) = reference else {
        assert!(
            matches!(canonical, Err(FieldError::Unparseable(_))),
            "{canonical:?}"
        );
        return;
    };
    let canonical = match canonical {
        // A member named twice on the way: serde_json would pick one, the filter picks none.
        Err(FieldError::Duplicate) => {
            assert_eq!(scalar, Err(FieldError::Duplicate));
            return;
        }
        Err(e) => panic!("a document serde_json reads is refused: {e}"),
        Ok(canonical) => canonical,
    };
    let at = reference.pointer(pointer);
    let Some(canonical) = canonical else {
        assert_eq!(at, None, "absent at {pointer:?}");
        assert_eq!(scalar, Err(FieldError::Missing));
        return;
    };
    let at = at.expect("present for serde_json too");
    let reread: Value = serde_json::from_slice(&canonical).expect("canonical JSON is JSON");
    assert_eq!(&reread, at, "the canonical form is the value");
    let again = RequestBody::new(JSON, &canonical).json_canonical("");
    assert_eq!(again, Ok(Some(canonical.clone())), "canonical twice");
    match (at, scalar) {
        (Value::String(s), Ok(v)) => {
            assert_eq!(v, s.as_bytes());
            assert_eq!(canonical, json_string(s).into_bytes());
        }
        (Value::Number(_) | Value::Bool(_), Ok(v)) => assert_eq!(v, canonical),
        (Value::Null | Value::Array(_) | Value::Object(_), Err(FieldError::NotScalar)) => {}
        (value, scalar) => panic!("{value:?} read as the scalar {scalar:?}"),
    }
}

fn form_and_query(body: &[u8], name: &str) {
    let mut parsed = RequestBody::new(FORM, body);
    let single = parsed.form_value(name);
    let all = parsed.form_values(name);
    match (&single, &all) {
        (Ok(Some(v)), Ok(values)) => assert_eq!(values, &vec![v.clone()]),
        (Ok(None), Ok(values)) => assert!(values.is_empty()),
        (Err(FieldError::Duplicate), Ok(values)) => assert!(values.len() >= 2),
        (Err(FieldError::Duplicate), Err(FieldError::BadEncoding(_))) => {}
        (Err(FieldError::BadEncoding(_)), Err(FieldError::BadEncoding(_))) => {}
        other => panic!("form_value and form_values disagree: {other:?}"),
    }
    if let Ok(values) = &all {
        for v in values {
            assert!(std::str::from_utf8(v).is_ok(), "{v:?} is not UTF-8");
        }
        // The same values, encoded afresh among other fields, read back as they were.
        let name_enc = percent_encode(name.as_bytes(), false);
        let noise = if name == "other" { "another" } else { "other" };
        let mut form = format!("{noise}=1");
        for (i, v) in values.iter().enumerate() {
            form.push_str(&format!("&{name_enc}={}", percent_encode(v, i % 2 == 0)));
        }
        let mut again = RequestBody::new(FORM, form.as_bytes());
        assert_eq!(again.form_values(name).as_ref(), Ok(values));
    }
    if let Ok(text) = std::str::from_utf8(body) {
        let query = text.split('#').next().unwrap_or(text);
        let expected = RequestBody::new(FORM, query.as_bytes()).form_value(name);
        assert_eq!(query_value(&format!("/p?{text}"), name), expected);
    }
}

fn fields_fingerprint(fields: &[FieldSource], content_type: &str, body: &[u8]) -> Option<[u8; 32]> {
    let mode = FingerprintMode::Fields(fields.to_vec());
    let mut parsed = RequestBody::new(content_type, body);
    fingerprint(
        &mode,
        "POST",
        "/orders?sig=1",
        &mut parsed,
        body,
        Protocol::Http,
    )
    .ok()
}

fn json_fingerprints(u: &mut Unstructured<'_>) -> Result<()> {
    // Two documents with the fields "/a" and "/b" (either may be absent) and other members.
    let pick = |u: &mut Unstructured<'_>| -> Result<Option<Tree>> {
        Ok(if u.ratio(1, 5)? {
            None
        } else {
            Some(Tree::generate(u, 3)?)
        })
    };
    let (a1, b1, a2, b2) = (pick(u)?, pick(u)?, pick(u)?, pick(u)?);
    let noise = Tree::generate(u, 2)?;
    let doc = |a: &Option<Tree>, b: &Option<Tree>, noise: &Tree| {
        let mut members = vec![("n".to_string(), noise.clone())];
        members.extend(a.clone().map(|t| ("a".to_string(), t)));
        members.extend(b.clone().map(|t| ("b".to_string(), t)));
        Tree::Object(members)
    };
    let fields = [
        FieldSource::Json("/a".to_string()),
        FieldSource::Json("/b".to_string()),
    ];
    let first = doc(&a1, &b1, &noise);
    let compact = first.text(false);
    let spread = first.text(true);
    let fp = fields_fingerprint(&fields, JSON, compact.as_bytes());
    let fp_spread = fields_fingerprint(&fields, JSON, spread.as_bytes());
    assert!(fp.is_some(), "{compact}");
    assert_eq!(fp, fp_spread, "order and whitespace: {compact} / {spread}");
    for (field, tree) in [("/a", &a1), ("/b", &b1)] {
        let mut parsed = RequestBody::new(JSON, spread.as_bytes());
        let canonical = parsed.json_canonical(field).expect("readable");
        let expected = tree.as_ref().map(|t| t.canonical().into_bytes());
        assert_eq!(canonical, expected, "canonical form of {field} in {spread}");
    }
    // Other values for the fields: the same fingerprint exactly when the same canonical
    // values (absent counting as a value of its own); the other members never matter.
    let other_noise = Tree::generate(u, 2)?;
    let second = doc(&a2, &b2, &other_noise).text(u.arbitrary()?);
    let fp2 = fields_fingerprint(&fields, JSON, second.as_bytes());
    assert!(fp2.is_some(), "{second}");
    let canon = |t: &Option<Tree>| t.as_ref().map(Tree::canonical);
    let same = canon(&a1) == canon(&a2) && canon(&b1) == canon(&b2);
    assert_eq!(fp == fp2, same, "{compact} / {second}");
    Ok(())
}

fn form_fingerprints(u: &mut Unstructured<'_>) -> Result<()> {
    let values = |u: &mut Unstructured<'_>| -> Result<Vec<String>> {
        let n = u.int_in_range(0..=3)?;
        (0..n).map(|_| any_string(u)).collect()
    };
    let (item1, total1, item2, total2) = (values(u)?, values(u)?, values(u)?, values(u)?);
    // Fields interleaved with each other and with noise, in an order the input picks.
    let form = |u: &mut Unstructured<'_>, item: &[String], total: &[String]| -> Result<String> {
        let mut pairs: Vec<String> = vec![format!(
            "sign={}",
            percent_encode(&u.arbitrary::<Vec<u8>>()?, false)
        )];
        let (mut i, mut t) = (0, 0);
        while i < item.len() || t < total.len() {
            let take_item = t == total.len() || (i < item.len() && u.arbitrary::<bool>()?);
            if take_item {
                pairs.push(format!("item={}", percent_encode(item[i].as_bytes(), true)));
                i += 1;
            } else {
                pairs.push(format!(
                    "total={}",
                    percent_encode(total[t].as_bytes(), false)
                ));
                t += 1;
            }
            if u.ratio(1, 4)? {
                pairs.push(format!("x{}=y", short_name(u)?));
            }
        }
        Ok(pairs.join("&"))
    };
    let fields = [
        FieldSource::Form("item".to_string()),
        FieldSource::Form("total".to_string()),
    ];
    let first = form(u, &item1, &total1)?;
    let first_again = form(u, &item1, &total1)?;
    let second = form(u, &item2, &total2)?;
    let fp1 = fields_fingerprint(&fields, FORM, first.as_bytes());
    assert!(fp1.is_some(), "{first}");
    assert_eq!(
        fp1,
        fields_fingerprint(&fields, FORM, first_again.as_bytes())
    );
    let fp2 = fields_fingerprint(&fields, FORM, second.as_bytes());
    assert!(fp2.is_some(), "{second}");
    let same = item1 == item2 && total1 == total2;
    assert_eq!(fp1 == fp2, same, "{first} / {second}");
    Ok(())
}
