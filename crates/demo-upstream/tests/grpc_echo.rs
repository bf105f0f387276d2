//! The instant store (`--grpc-echo`) over a real HTTP/2 connection on loopback, the way
//! Envoy talks to it: one stream, calls sent while answers come back, then the client ends
//! its side and the stream ends with grpc-status 0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use demo_upstream::grpc_echo::{serve_grpc_echo, EchoBody, EchoCounters, COORDINATE_PATH};
use http_body_util::{BodyExt, Empty};
use hyper::body::{Frame, Incoming};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idempotency_protocol::stream::{decode_answer, encode_call, Answer, Call, CallOp, Reply};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn framed_claim(id: u64) -> Bytes {
    let message = encode_call(&Call {
        id,
        op: CallOp::Claim {
            key: HEX.into(),
            fingerprint: HEX.into(),
            lease_ms: 1_000,
            owner: "00ff".into(),
        },
    });
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(&message);
    Bytes::from(out)
}

/// Reads whole answers off the response body until `n` have come.
async fn read_answers(body: &mut Incoming, pending: &mut Vec<u8>, n: usize) -> Vec<Answer> {
    let mut answers = Vec::new();
    while answers.len() < n {
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("an answer within 5 s")
            .expect("the stream still open")
            .unwrap();
        pending.extend_from_slice(&frame.into_data().unwrap());
        while pending.len() >= 5 {
            let len = u32::from_be_bytes(pending[1..5].try_into().unwrap()) as usize;
            if pending.len() < 5 + len {
                break;
            }
            assert_eq!(pending[0], 0);
            answers.push(decode_answer(&pending[5..5 + len]).unwrap());
            pending.drain(..5 + len);
        }
    }
    answers
}

#[tokio::test]
async fn answers_each_call_on_an_open_stream_and_ends_it_with_status_0() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counters = Arc::new(EchoCounters::default());
    tokio::spawn(serve_grpc_echo(listener, Arc::clone(&counters)));

    let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
    let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .unwrap();
    tokio::spawn(conn);
    let (calls, rx) = mpsc::channel::<Frame<Bytes>>(8);
    let request = Request::post(format!("http://{addr}{COORDINATE_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(EchoBody::Frames(rx))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/grpc");
    let mut body = response.into_body();
    let mut pending = Vec::new();

    // One call, its answer, then two in one DATA frame while the stream stays open.
    calls.send(Frame::data(framed_claim(1))).await.unwrap();
    let first = read_answers(&mut body, &mut pending, 1).await;
    assert_eq!(first[0].id, 1);
    assert!(matches!(&first[0].reply, Reply::Claimed { owner, .. } if owner == "00ff"));
    let mut two = framed_claim(2).to_vec();
    two.extend_from_slice(&framed_claim(3));
    calls.send(Frame::data(Bytes::from(two))).await.unwrap();
    let ids: Vec<u64> = read_answers(&mut body, &mut pending, 2)
        .await
        .iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(ids, vec![2, 3]);

    // More calls than the server's HTTP/2 receive window (1 MiB; a call is about 150 bytes)
    // go through: the server reads, and so releases flow-control capacity, as it answers.
    let many = 10_000;
    let sending = tokio::spawn(async move {
        for id in 10..10 + many {
            calls.send(Frame::data(framed_claim(id))).await.unwrap();
        }
        calls // ends the client's side when dropped below
    });
    let answers = read_answers(&mut body, &mut pending, many as usize).await;
    assert_eq!(answers.len(), many as usize);
    assert_eq!(answers.last().unwrap().id, 10 + many - 1);
    drop(sending.await.unwrap());

    let trailers = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
        .into_trailers()
        .unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(counters.calls(), 3 + many);

    // The same port answers HTTP/1.1 (the harness's readiness probe and the bench's count).
    let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
    let (mut h1, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
    tokio::spawn(conn);
    let count = h1
        .send_request(
            Request::get("/__count")
                .header("host", "x")
                .body(Empty::<Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    let text = count.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(text, format!("{{\"total\":{}}}", 3 + many).as_bytes());
}
