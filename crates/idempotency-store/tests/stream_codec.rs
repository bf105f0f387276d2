//! The filter's hand-written stream codec (`idempotency_protocol::stream`) against the code
//! protoc generates from `proto/idempotency_store.proto`: what one side encodes, the other
//! decodes to the same message, for every operation and every kind of answer.

// Test code: a failed unwrap/index is a failed test, which is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use idempotency_protocol::stream::{self, Answer, Call, CallOp, FailureKind, Reply};
use idempotency_store::grpc::pb;
use idempotency_store::grpc::pb::answer::Result as PbReply;
use idempotency_store::grpc::pb::call::Op as PbOp;
use prost::Message as _;

const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

#[test]
fn calls_the_filter_encodes_are_the_calls_the_store_reads() {
    let cases = [
        (
            Call {
                id: 7,
                op: CallOp::Claim {
                    key: HEX.into(),
                    fingerprint: HEX.into(),
                    lease_ms: 60_000,
                    owner: "00ff".into(),
                },
            },
            pb::Call {
                id: 7,
                op: Some(PbOp::Claim(pb::Claim {
                    key: HEX.into(),
                    fingerprint: HEX.into(),
                    lease_ms: 60_000,
                    owner: "00ff".into(),
                })),
            },
        ),
        (
            Call {
                id: u64::MAX,
                op: CallOp::Complete {
                    key: HEX.into(),
                    owner: "ab".into(),
                    ttl_ms: 86_400_000,
                    record: (0..100_000).map(|i| (i % 253) as u8).collect(),
                    fingerprint: String::new(),
                    tombstone_ms: 15_552_000_000,
                },
            },
            pb::Call {
                id: u64::MAX,
                op: Some(PbOp::Complete(pb::Complete {
                    key: HEX.into(),
                    owner: "ab".into(),
                    ttl_ms: 86_400_000,
                    record: (0..100_000).map(|i| (i % 253) as u8).collect(),
                    fingerprint: String::new(),
                    tombstone_ms: 15_552_000_000,
                })),
            },
        ),
        (
            Call {
                id: 0,
                op: CallOp::Release {
                    key: HEX.into(),
                    owner: "cd".into(),
                },
            },
            pb::Call {
                id: 0,
                op: Some(PbOp::Release(pb::Release {
                    key: HEX.into(),
                    owner: "cd".into(),
                })),
            },
        ),
        (
            Call {
                id: 12,
                op: CallOp::Wait {
                    key: HEX.into(),
                    fingerprint: HEX.into(),
                    wait_ms: 60_000,
                },
            },
            pb::Call {
                id: 12,
                op: Some(PbOp::Wait(pb::Wait {
                    key: HEX.into(),
                    fingerprint: HEX.into(),
                    wait_ms: 60_000,
                })),
            },
        ),
        (
            Call {
                id: 13,
                op: CallOp::Renew {
                    lease_ms: 30_000,
                    // An empty lease is still an element of the list.
                    leases: vec![
                        (HEX.into(), "00ff".into()),
                        (String::new(), String::new()),
                        (HEX.to_uppercase(), "ab".repeat(32)),
                    ],
                },
            },
            pb::Call {
                id: 13,
                op: Some(PbOp::Renew(pb::Renew {
                    lease_ms: 30_000,
                    leases: vec![
                        pb::Lease {
                            key: HEX.into(),
                            owner: "00ff".into(),
                        },
                        pb::Lease::default(),
                        pb::Lease {
                            key: HEX.to_uppercase(),
                            owner: "ab".repeat(32),
                        },
                    ],
                })),
            },
        ),
        (
            Call {
                id: 14,
                op: CallOp::Renew {
                    lease_ms: 0,
                    leases: Vec::new(),
                },
            },
            pb::Call {
                id: 14,
                op: Some(PbOp::Renew(pb::Renew::default())),
            },
        ),
        (
            Call {
                id: 15,
                op: CallOp::Renew {
                    lease_ms: 1,
                    leases: (0..1024)
                        .map(|i| (format!("{i:064x}"), "cd".into()))
                        .collect(),
                },
            },
            pb::Call {
                id: 15,
                op: Some(PbOp::Renew(pb::Renew {
                    lease_ms: 1,
                    leases: (0..1024)
                        .map(|i| pb::Lease {
                            key: format!("{i:064x}"),
                            owner: "cd".into(),
                        })
                        .collect(),
                })),
            },
        ),
        (
            Call {
                id: 16,
                op: CallOp::Settle {
                    key: HEX.into(),
                    current: b"IDR1 unknown".to_vec(),
                    record: b"IDR1 took effect".to_vec(),
                    ttl_ms: 86_400_000,
                    tombstone_ms: 15_552_000_000,
                },
            },
            pb::Call {
                id: 16,
                op: Some(PbOp::Settle(pb::Settle {
                    key: HEX.into(),
                    current: b"IDR1 unknown".to_vec(),
                    record: b"IDR1 took effect".to_vec(),
                    ttl_ms: 86_400_000,
                    tombstone_ms: 15_552_000_000,
                })),
            },
        ),
        (
            Call {
                id: 17,
                op: CallOp::Settle {
                    key: HEX.into(),
                    current: b"IDR1 unknown".to_vec(),
                    record: Vec::new(),
                    ttl_ms: 0,
                    tombstone_ms: 0,
                },
            },
            pb::Call {
                id: 17,
                op: Some(PbOp::Settle(pb::Settle {
                    key: HEX.into(),
                    current: b"IDR1 unknown".to_vec(),
                    ..pb::Settle::default()
                })),
            },
        ),
    ];
    for (ours, theirs) in cases {
        let encoded = stream::encode_call(&ours);
        assert_eq!(pb::Call::decode(encoded.as_slice()).unwrap(), theirs);
        assert_eq!(
            encoded,
            theirs.encode_to_vec(),
            "byte for byte, as protoc's code writes it"
        );
        assert_eq!(stream::decode_call(&theirs.encode_to_vec()).unwrap(), ours);
    }
}

#[test]
fn answers_the_store_encodes_are_the_answers_the_filter_reads() {
    let empty = pb::Empty {};
    let cases = [
        (
            PbReply::Claimed(pb::Claimed {
                owner: "0a".into(),
                lease_expires_at_ms: 1_700_000_000_123,
            }),
            Reply::Claimed {
                owner: "0a".into(),
                lease_expires_at_ms: 1_700_000_000_123,
            },
        ),
        (
            PbReply::InFlight(pb::InFlight { retry_after_ms: 0 }),
            Reply::InFlight { retry_after_ms: 0 },
        ),
        (
            PbReply::Completed(pb::Recorded {
                record: vec![1; 3 << 20],
            }),
            Reply::Completed {
                record: vec![1; 3 << 20],
            },
        ),
        (PbReply::Mismatch(empty), Reply::Mismatch),
        (PbReply::Recorded(empty), Reply::Recorded),
        (PbReply::Released(empty), Reply::Released),
        (PbReply::NotOwner(empty), Reply::NotOwner),
        (
            PbReply::Renewed(pb::Renewed { lost: Vec::new() }),
            Reply::Renewed { lost: Vec::new() },
        ),
        (
            PbReply::Renewed(pb::Renewed {
                lost: vec![0, 3, 127, 128, 1023, u32::MAX],
            }),
            Reply::Renewed {
                lost: vec![0, 3, 127, 128, 1023, u32::MAX],
            },
        ),
        (
            PbReply::Failure(pb::Failure {
                kind: pb::failure::Kind::Unavailable.into(),
                detail: "backend down".into(),
            }),
            Reply::Failure {
                kind: FailureKind::Unavailable,
                detail: "backend down".into(),
            },
        ),
        (
            PbReply::Failure(pb::Failure {
                kind: pb::failure::Kind::BadRequest.into(),
                detail: String::new(),
            }),
            Reply::Failure {
                kind: FailureKind::BadRequest,
                detail: String::new(),
            },
        ),
    ];
    for (i, (theirs, ours)) in cases.into_iter().enumerate() {
        let id = (i as u64) * 1_000_003;
        let pb_answer = pb::Answer {
            id,
            result: Some(theirs),
        };
        let ours = Answer { id, reply: ours };
        assert_eq!(
            stream::decode_answer(&pb_answer.encode_to_vec()).unwrap(),
            ours
        );
        assert_eq!(
            pb::Answer::decode(stream::encode_answer(&ours).as_slice()).unwrap(),
            pb_answer
        );
        if matches!(ours.reply, Reply::Renewed { .. }) {
            assert_eq!(
                stream::encode_answer(&ours),
                pb_answer.encode_to_vec(),
                "packed, byte for byte, as protoc's code writes it"
            );
        }
    }
}

/// A reader must accept a repeated number field packed or not; prost writes it packed, an
/// older or other encoder may not.
#[test]
fn lost_leases_unpacked_read_as_packed() {
    let lost = vec![1, 300, 70_000];
    // Renewed{lost: 1, 300, 70000}, each element as its own varint field.
    let mut renewed = Vec::new();
    for n in &lost {
        renewed.push(0x08);
        prost::encoding::encode_varint(u64::from(*n), &mut renewed);
    }
    let mut unpacked = vec![0x08, 0x05, 0x52, renewed.len() as u8];
    unpacked.extend_from_slice(&renewed);
    let expected = pb::Answer {
        id: 5,
        result: Some(PbReply::Renewed(pb::Renewed { lost: lost.clone() })),
    };
    assert_eq!(pb::Answer::decode(unpacked.as_slice()).unwrap(), expected);
    assert_eq!(
        stream::decode_answer(&unpacked).unwrap(),
        Answer {
            id: 5,
            reply: Reply::Renewed { lost }
        }
    );
    assert_ne!(
        unpacked,
        expected.encode_to_vec(),
        "prost itself packs them"
    );
}
