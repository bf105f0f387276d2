#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;

#[test]
fn a_path_is_matched_without_its_query_or_fragment() {
    assert_eq!(path_without_query("/a/b?x=1"), "/a/b");
    assert_eq!(path_without_query("/a/b#f"), "/a/b");
    assert_eq!(path_without_query("/a/b"), "/a/b");
}

#[test]
fn json_scalars_by_pointer() {
    let body = br#"{"data":{"object":{"id":"evt_1","amount":1200,"paid":true,"tags":["a"]}},"a/b":"slash"}"#;
    let mut b = RequestBody::new("application/json; charset=utf-8", body);
    assert_eq!(b.json_scalar("/data/object/id").unwrap(), b"evt_1");
    assert_eq!(b.json_scalar("/data/object/amount").unwrap(), b"1200");
    assert_eq!(b.json_scalar("/data/object/paid").unwrap(), b"true");
    assert_eq!(b.json_scalar("/a~1b").unwrap(), b"slash");
    assert_eq!(
        b.json_scalar("/data/object/tags"),
        Err(FieldError::NotScalar)
    );
    assert_eq!(b.json_scalar("/data/object/nope"), Err(FieldError::Missing));
    assert_eq!(b.json_scalar("/data/object/tags/0").unwrap(), b"a");
}

#[test]
fn canonical_json_ignores_key_order_and_whitespace() {
    let mut a = RequestBody::new("application/json", br#"{"x":{"b":1,"a":[1, 2]}}"#);
    let mut b = RequestBody::new(
        "application/cloudevents+json",
        br#"{ "x" : { "a" : [1,2] , "b" : 1 } }"#,
    );
    assert_eq!(
        a.json_canonical("/x").unwrap(),
        b.json_canonical("/x").unwrap()
    );
    assert_eq!(a.json_canonical("/missing").unwrap(), None);
}

#[test]
fn wrong_type_and_bad_json_are_reported() {
    let mut b = RequestBody::new("text/plain", b"{}");
    assert!(matches!(
        b.json_scalar("/id"),
        Err(FieldError::WrongContentType { .. })
    ));
    let mut b = RequestBody::new("application/json", b"{not json");
    assert!(matches!(
        b.json_scalar("/id"),
        Err(FieldError::Unparseable(_))
    ));
    let mut b = RequestBody::new("application/json", b"{}");
    assert!(matches!(
        b.form_value("a"),
        Err(FieldError::WrongContentType { .. })
    ));
}

#[test]
fn form_and_query_values_are_decoded() {
    let mut b = RequestBody::new(
        "application/x-www-form-urlencoded",
        b"trade_no=2024%2F001&total_fee=1.00&subject=a+b",
    );
    assert_eq!(b.form_value("trade_no").unwrap().unwrap(), b"2024/001");
    assert_eq!(b.form_value("subject").unwrap().unwrap(), b"a b");
    assert_eq!(b.form_value("nope").unwrap(), None);
    assert_eq!(
        query_value("/pay?order_no=A%2D1&x=2", "order_no")
            .unwrap()
            .unwrap(),
        b"A-1"
    );
    assert_eq!(query_value("/pay?x=2", "order_no"), Ok(None));
    assert_eq!(query_value("/pay", "order_no"), Ok(None));
    assert_eq!(
        query_value("/pay?order_no=caf%C3%A9#frag", "order_no")
            .unwrap()
            .unwrap(),
        "café".as_bytes()
    );
}

fn json_key(body: &str, pointer: &str) -> Result<Vec<u8>, FieldError> {
    RequestBody::new("application/json", body.as_bytes()).json_scalar(pointer)
}

fn canonical(body: &str, pointer: &str) -> Vec<u8> {
    RequestBody::new("application/json", body.as_bytes())
        .json_canonical(pointer)
        .unwrap()
        .unwrap()
}

#[test]
fn json_numbers_are_keyed_by_their_literal_text() {
    // Beyond u64 serde_json's Value makes both the same f64.
    let a = json_key(r#"{"id":1234567890123456789012345678}"#, "/id").unwrap();
    let b = json_key(r#"{"id":1234567890123456789012345679}"#, "/id").unwrap();
    assert_eq!(a, b"1234567890123456789012345678");
    assert_ne!(a, b);
    for literal in [
        "100", "1e2", "1E2", "100.0", "1.50", "-0", "-12.5e+3", "0.1",
    ] {
        let body = format!(r#"{{"n": {literal} , "m":[1,2]}}"#);
        assert_eq!(json_key(&body, "/n").unwrap(), literal.as_bytes());
    }
    // Same text as before for the everyday cases, so keys stay stable.
    assert_eq!(
        json_key(r#"{"n":18446744073709551615}"#, "/n").unwrap(),
        b"18446744073709551615"
    );
    assert_eq!(json_key(r#"{"n":-42}"#, "/n").unwrap(), b"-42");
}

#[test]
fn number_texts_are_found_around_strings_escapes_and_nesting() {
    let body = r#"{"s":"1 \" 2 \\","a":[true,-3.5e-2,{"k":"-4","v":[7, 8]}],"z":null,"e":"\u0031","f":90}"#;
    assert_eq!(json_key(body, "/a/1").unwrap(), b"-3.5e-2");
    assert_eq!(json_key(body, "/a/2/k").unwrap(), b"-4");
    assert_eq!(json_key(body, "/a/2/v/1").unwrap(), b"8");
    assert_eq!(json_key(body, "/s").unwrap(), br#"1 " 2 \"#);
    assert_eq!(json_key(body, "/e").unwrap(), b"1");
    assert_eq!(json_key(body, "/f").unwrap(), b"90");
    assert_eq!(json_key(body, "/z"), Err(FieldError::NotScalar));
    assert_eq!(json_key("7", "").unwrap(), b"7");
    // RFC 6901 array indexes: no leading zeros or signs.
    assert_eq!(json_key(body, "/a/01"), Err(FieldError::Missing));
    assert_eq!(json_key(body, "/a/+1"), Err(FieldError::Missing));
    // Beyond f64's range serde_json refuses the document: an error, not a lossy key.
    assert!(matches!(
        json_key(r#"{"n":1e400}"#, "/n"),
        Err(FieldError::Unparseable(_))
    ));
}

#[test]
fn canonical_json_keeps_number_texts_and_duplicates() {
    assert_ne!(
        canonical(r#"{"a":{"n":1234567890123456789012345678}}"#, "/a"),
        canonical(r#"{"a":{"n":1234567890123456789012345679}}"#, "/a")
    );
    assert_eq!(
        canonical(r#"{"a":{"y":1.50,"x":[1e2, "s\n"]}}"#, "/a"),
        br#"{"x":[1e2,"s\n"],"y":1.50}"#
    );
    // Byte for byte what serde_json's Value printed for integers, strings and nesting.
    let body = r#"{"a":{"b":[1,-2,{"c":"é\"\u0007"}],"a":true,"n":null}}"#;
    let value: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(canonical(body, "/a"), value["a"].to_string().into_bytes());
    // Duplicates inside a fingerprinted value all count, in their order.
    let dup = canonical(r#"{"a":{"k":1,"j":0,"k":2}}"#, "/a");
    assert_eq!(dup, br#"{"j":0,"k":1,"k":2}"#);
    assert_ne!(dup, canonical(r#"{"a":{"k":2,"j":0,"k":1}}"#, "/a"));
}

#[test]
fn a_member_named_twice_on_the_pointer_is_refused() {
    let body = r#"{"order":{"id":"a","id":"b"},"x":1,"x":2}"#;
    assert_eq!(json_key(body, "/order/id"), Err(FieldError::Duplicate));
    assert_eq!(json_key(body, "/x"), Err(FieldError::Duplicate));
    let mut b = RequestBody::new("application/json", body.as_bytes());
    assert_eq!(
        b.json_canonical("/order"),
        Ok(Some(br#"{"id":"a","id":"b"}"#.to_vec()))
    );
    assert_eq!(b.json_canonical("/order/id"), Err(FieldError::Duplicate));
    // Elsewhere in the body a duplicate does not matter.
    assert_eq!(
        json_key(r#"{"id":"k","o":{"a":1,"a":2}}"#, "/id").unwrap(),
        b"k"
    );
    let twice = r#"{"o":{"id":1},"o":{"id":2}}"#;
    assert_eq!(json_key(twice, "/o/id"), Err(FieldError::Duplicate));
}

#[test]
fn json_bodies_are_refused_as_serde_json_refuses_them() {
    // Skipped values too are parsed in full: a document serde_json refuses anywhere gives
    // no key, with serde_json's own message.
    let deep = format!(r#"{{"id":1,"x":{}{}}}"#, "[".repeat(200), "]".repeat(200));
    let bad: &[&[u8]] = &[
        b"",
        b"{not json",
        br#"{"id":1,}"#,
        br#"{"id":1} x"#,
        br#"{"id":1 "x":2}"#,
        br#"{"x":[1,],"id":1}"#,
        br#"{"x":01,"id":1}"#,
        br#"{"x":1e400,"id":1}"#,
        br#"{"x":-,"id":1}"#,
        br#"{"x":"\ud800","id":1}"#,
        br#"{"x":"\udc00\ud800","id":1}"#,
        br#"{"x":"\x","id":1}"#,
        b"{\"x\":\"\xff\",\"id\":1}",
        b"{\"x\":\"\x01\",\"id\":1}",
        b"{\"\xc3\":1,\"id\":1}",
        br#"{"x":{1:2},"id":1}"#,
        br#"{"x":tru,"id":1}"#,
        deep.as_bytes(),
    ];
    for body in bad {
        let expected = serde_json::from_slice::<serde_json::Value>(body).unwrap_err();
        let expected = FieldError::Unparseable(format!("invalid JSON: {expected}"));
        let mut b = RequestBody::new("application/json", body);
        assert_eq!(b.json_scalar("/id"), Err(expected.clone()), "{body:?}");
        assert_eq!(b.json_canonical(""), Err(expected), "{body:?}");
    }
}

/// `[[...[7]...]]`, `depth` arrays deep, and the pointer to the 7.
fn nested(depth: usize) -> (String, String) {
    let body = format!("{}7{}", "[".repeat(depth), "]".repeat(depth));
    (body, "/0".repeat(depth))
}

#[test]
fn nesting_is_read_up_to_serde_jsons_limit_and_refused_beyond() {
    let accepted = |depth: usize| serde_json::from_str::<serde_json::Value>(&nested(depth).0);
    let limit = (1..300)
        .take_while(|&d| accepted(d).is_ok())
        .last()
        .unwrap();
    assert_eq!(limit, 127);
    // At the limit, along a pointer's path and inside a fingerprinted value: the visitors'
    // recursion follows the parser's, which the limit bounds (on wasm32's stack too).
    let (body, pointer) = nested(limit);
    assert_eq!(json_key(&body, &pointer).unwrap(), b"7");
    assert_eq!(canonical(&body, ""), body.as_bytes());
    assert_eq!(canonical(&body, "/0"), &body.as_bytes()[1..body.len() - 1]);
    let (body, pointer) = nested(limit + 1);
    match json_key(&body, &pointer) {
        Err(FieldError::Unparseable(why)) => {
            assert!(why.contains("recursion limit exceeded"), "{why}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn member_names_compare_and_sort_as_decoded() {
    // Sorted by the decoded name's bytes, however it is escaped in the body or printed.
    assert_eq!(
        canonical(r##"{"a\nb":5,"\\":4,"#":3,"\"":1,"!":2,"\u00e9":6}"##, ""),
        r##"{"!":2,"\"":1,"#":3,"\\":4,"a\nb":5,"é":6}"##.as_bytes()
    );
    // Two spellings of one name are one name: both count, and on a pointer's way it is
    // given twice.
    let body = r#"{"\u00e9":1,"x":0,"é":2}"#;
    assert_eq!(canonical(body, ""), r#"{"x":0,"é":1,"é":2}"#.as_bytes());
    assert_eq!(json_key(body, "/é"), Err(FieldError::Duplicate));
    assert_eq!(json_key(r#"{"a\/b":1}"#, "/a~1b").unwrap(), b"1");
}

#[test]
fn fields_read_in_one_pass_are_those_read_alone() {
    let bodies = [
        r#"{"data":{"object":{"id":"evt_1","amount":12.50,"tags":["a",{"k":null}]}},"n":[1,2e3]}"#,
        r#"{"data":{"object":{"id":"a","id":"b"}},"data2":1,"n":7,"n":8}"#,
        r#"{"data":{"object":1},"data":{"object":2}}"#,
        r#"[{"id":"x"},[true,false],"s"]"#,
        r#""just a string""#,
        r#"{"": {"": 3}, "~": 4, "/": 5}"#,
    ];
    let pointers = [
        "",
        "/data",
        "/data/object",
        "/data/object/id",
        "/data/object/tags/1/k",
        "/data/object/nope",
        "/n",
        "/n/1",
        "/0",
        "/0/id",
        "/1/01",
        "/2",
        "/",
        "//",
        "/~0",
        "/~1",
        "no-slash",
    ];
    for body in bodies {
        let alone = |read: &dyn Fn(&mut RequestBody<'_>) -> String| {
            read(&mut RequestBody::new("application/json", body.as_bytes()))
        };
        let mut together = RequestBody::new("application/json", body.as_bytes());
        together.will_read_json(pointers, pointers);
        for pointer in pointers {
            let scalar = alone(&|b| format!("{:?}", b.json_scalar(pointer)));
            let text = alone(&|b| format!("{:?}", b.json_canonical(pointer)));
            assert_eq!(
                format!("{:?}", together.json_scalar(pointer)),
                scalar,
                "{body} {pointer}"
            );
            assert_eq!(
                format!("{:?}", together.json_canonical(pointer)),
                text,
                "{body} {pointer}"
            );
            // Read again: the pass's result was handed out, a new pass gives it again.
            assert_eq!(format!("{:?}", together.json_scalar(pointer)), scalar);
        }
    }
    // The document's error, found once, is every field's.
    let mut b = RequestBody::new("application/json", b"{\"id\":1,]");
    b.will_read_json(["/id"], ["/x"]);
    let e = b.json_scalar("/id").unwrap_err();
    assert!(matches!(e, FieldError::Unparseable(_)));
    assert_eq!(b.json_canonical("/x"), Err(e.clone()));
    assert_eq!(b.json_canonical("/other"), Err(e));
}

#[test]
fn invalid_percent_encoding_and_non_utf8_values_are_refused() {
    let form = "application/x-www-form-urlencoded";
    for (body, needle) in [
        ("trade_no=%zz1", "'%zz'"),
        ("trade_no=12%4", "'%4'"),
        ("trade_no=12%", "'%'"),
        ("trade_no=%4g", "'%4g'"),
        ("trade_no=%ff", "not UTF-8"),
        ("trade_no=%fe", "not UTF-8"),
        ("trade_no=%C3", "not UTF-8"),
    ] {
        let mut b = RequestBody::new(form, body.as_bytes());
        match b.form_value("trade_no") {
            Err(FieldError::BadEncoding(why)) => assert!(why.contains(needle), "{body}: {why}"),
            other => panic!("{body}: {other:?}"),
        }
        let path = format!("/pay?{body}");
        assert!(matches!(
            query_value(&path, "trade_no"),
            Err(FieldError::BadEncoding(_))
        ));
    }
    // Other fields may be malformed: only the field read is checked.
    let mut b = RequestBody::new(form, b"sign=%zz&trade_no=T1&x=%ff");
    assert_eq!(b.form_value("trade_no").unwrap().unwrap(), b"T1");
    assert_eq!(query_value("/p?x=%zz&k=v", "k").unwrap().unwrap(), b"v");
    // A name with a bad escape keeps it literally, as the standard parser does.
    let mut b = RequestBody::new(form, b"a%zz=1");
    assert_eq!(b.form_value("a%zz").unwrap().unwrap(), b"1");
}

#[test]
fn a_key_field_given_twice_is_refused() {
    let form = "application/x-www-form-urlencoded";
    for body in [
        "trade_no=1&trade_no=2",
        "trade_no=1&trade_no=1",
        "trade_no=1&trade%5Fno=2",
        "trade_no&trade_no=x",
    ] {
        let mut b = RequestBody::new(form, body.as_bytes());
        assert_eq!(
            b.form_value("trade_no"),
            Err(FieldError::Duplicate),
            "{body}"
        );
        let path = format!("/pay?{body}");
        assert_eq!(
            query_value(&path, "trade_no"),
            Err(FieldError::Duplicate),
            "{body}"
        );
    }
    // A fingerprinted field may repeat: every value counts.
    let mut b = RequestBody::new(form, b"item=a&x=1&item=b%20c&item=");
    assert_eq!(
        b.form_values("item").unwrap(),
        vec![b"a".to_vec(), b"b c".to_vec(), Vec::new()]
    );
    assert_eq!(b.form_values("nope").unwrap(), Vec::<Vec<u8>>::new());
    let mut b = RequestBody::new(form, b"item=a&item=%zz");
    assert!(matches!(
        b.form_values("item"),
        Err(FieldError::BadEncoding(_))
    ));
    // Empty sequences are skipped, a name without '=' has an empty value.
    let mut b = RequestBody::new(form, b"&&flag&k=v&");
    assert_eq!(b.form_value("flag").unwrap().unwrap(), b"");
    assert_eq!(b.form_value("k").unwrap().unwrap(), b"v");
}
