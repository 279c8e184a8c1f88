//! NRI's transport: two ttrpc connections multiplexed over one Unix stream (containerd/nri
//! `pkg/net/multiplex`), and the ttrpc message framing inside them. Bytes in, bytes out, but for
//! [`read_frames`], the task that reads the mux frames off the socket.
//!
//! - Mux frame: 8-byte header (connection ID, payload length; both `u32` big-endian) + payload. The
//!   payloads of one connection form a byte stream; a ttrpc message may span frames.
//! - Connection 1 carries the `Plugin` service (the plugin serves, the runtime calls); connection 2
//!   the `Runtime` service (the plugin calls `RegisterPlugin`).
//! - ttrpc message: 10-byte header (payload length `u32`, stream ID `u32`, type `u8`: 1 request,
//!   2 response; flags `u8`), then a protobuf (prost) `Request { service = 1, method = 2, payload = 3,
//!   timeout_nano = 4 }` or `Response { status = 1 { code = 1, message = 2 }, payload = 2 }`. Callers
//!   use odd stream IDs.

use std::collections::HashMap;

use prost::Message as _;
use tokio::io::AsyncReadExt as _;
use tokio::net::unix::OwnedReadHalf;
use tokio::sync::mpsc;

use super::wire::DecodeError;
use crate::error::{Error, Result};

/// Mux connection of the `Plugin` service.
pub const PLUGIN_CONN: u32 = 1;
/// Mux connection of the `Runtime` service.
pub const RUNTIME_CONN: u32 = 2;
/// Mux frame header length.
pub const MUX_HEADER_LEN: usize = 8;
/// ttrpc message header length.
pub const TTRPC_HEADER_LEN: usize = 10;
/// Largest ttrpc message payload (ttrpc's `messageLengthMax`).
pub const TTRPC_MAX_PAYLOAD: usize = 4 << 20;
/// Largest mux frame payload (`mux.go`: ttrpc header + largest message).
pub const MUX_MAX_PAYLOAD: usize = TTRPC_HEADER_LEN + TTRPC_MAX_PAYLOAD;
/// ttrpc message type of a request.
pub const TYPE_REQUEST: u8 = 1;
/// ttrpc message type of a response.
pub const TYPE_RESPONSE: u8 = 2;
/// The NRI `Plugin` service name.
pub const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";
/// The NRI `Runtime` service name.
pub const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";
/// gRPC status code `UNIMPLEMENTED`.
pub const CODE_UNIMPLEMENTED: i32 = 12;

/// One ttrpc message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The mux connection it came on.
    pub conn: u32,
    /// ttrpc stream ID.
    pub stream: u32,
    /// [`TYPE_REQUEST`] or [`TYPE_RESPONSE`] (others are ignored by callers).
    pub kind: u8,
    /// The protobuf `Request` / `Response`.
    pub payload: Vec<u8>,
}

/// The mux frame header: `(connection, payload length)`, checked against the maximum.
pub fn parse_mux_header(h: [u8; MUX_HEADER_LEN]) -> Result<(u32, usize)> {
    let conn = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
    if len > MUX_MAX_PAYLOAD {
        return Err(Error::FrameTooLong {
            what: "mux frame",
            len,
            max: MUX_MAX_PAYLOAD,
        });
    }
    Ok((conn, len))
}

/// Reassembles ttrpc messages from the byte stream of each mux connection.
#[derive(Debug, Default)]
pub struct Demux {
    pending: HashMap<u32, Vec<u8>>,
}

impl Demux {
    /// Add one frame's payload; returns the messages it completed.
    pub fn push(&mut self, conn: u32, payload: &[u8]) -> Result<Vec<Message>> {
        let buf = self.pending.entry(conn).or_default();
        buf.extend_from_slice(payload);
        let mut out = Vec::new();
        loop {
            if buf.len() < TTRPC_HEADER_LEN {
                break;
            }
            let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            if len > TTRPC_MAX_PAYLOAD {
                return Err(Error::FrameTooLong {
                    what: "ttrpc message",
                    len,
                    max: TTRPC_MAX_PAYLOAD,
                });
            }
            if buf.len() < TTRPC_HEADER_LEN + len {
                break;
            }
            let stream = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
            let kind = buf[8];
            let payload = buf[TTRPC_HEADER_LEN..TTRPC_HEADER_LEN + len].to_vec();
            buf.drain(..TTRPC_HEADER_LEN + len);
            out.push(Message {
                conn,
                stream,
                kind,
                payload,
            });
        }
        Ok(out)
    }
}

/// One ttrpc message as mux frames, ready to write.
pub fn encode_message(conn: u32, stream: u32, kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(TTRPC_HEADER_LEN + payload.len());
    msg.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    msg.extend_from_slice(&stream.to_be_bytes());
    msg.push(kind);
    msg.push(0);
    msg.extend_from_slice(payload);
    let mut out = Vec::with_capacity(msg.len() + MUX_HEADER_LEN);
    for chunk in msg.chunks(MUX_MAX_PAYLOAD) {
        out.extend_from_slice(&conn.to_be_bytes());
        out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        out.extend_from_slice(chunk);
    }
    out
}

/// ttrpc's `Request` envelope.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Request {
    /// Service name.
    #[prost(string, tag = "1")]
    pub service: String,
    /// Method name.
    #[prost(string, tag = "2")]
    pub method: String,
    /// The method's request message.
    #[prost(bytes = "vec", tag = "3")]
    pub payload: Vec<u8>,
    /// How long the caller waits (nanoseconds).
    #[prost(int64, tag = "4")]
    pub timeout_nano: i64,
}

/// ttrpc's `Response` envelope.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Response {
    /// The status; absent means OK.
    #[prost(message, optional, tag = "1")]
    pub status: Option<Status>,
    /// The method's response message.
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
}

/// `google.rpc.Status`, as ttrpc carries it (its `details` skipped).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    /// gRPC status code (0 = OK).
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// Status message.
    #[prost(string, tag = "2")]
    pub message: String,
}

impl Response {
    /// The status code (0 = OK).
    pub fn code(&self) -> i32 {
        self.status.as_ref().map_or(0, |s| s.code)
    }

    /// The status message.
    pub fn message(&self) -> &str {
        self.status.as_ref().map_or("", |s| s.message.as_str())
    }
}

/// Decode a ttrpc `Request`.
pub fn decode_request(bytes: &[u8]) -> Result<Request, DecodeError> {
    Request::decode(bytes)
}

/// Encode a ttrpc `Request`.
pub fn encode_request(service: &str, method: &str, payload: &[u8], timeout_nanos: i64) -> Vec<u8> {
    Request {
        service: service.to_owned(),
        method: method.to_owned(),
        payload: payload.to_vec(),
        timeout_nano: timeout_nanos,
    }
    .encode_to_vec()
}

/// Encode a ttrpc `Response`: status `code` (0 = OK) with `message`, and the method's response.
pub fn encode_response(code: i32, message: &str, payload: &[u8]) -> Vec<u8> {
    Response {
        status: (code != 0).then(|| Status {
            code,
            message: message.to_owned(),
        }),
        payload: payload.to_vec(),
    }
    .encode_to_vec()
}

/// Decode a ttrpc `Response`.
pub fn decode_response(bytes: &[u8]) -> Result<Response, DecodeError> {
    Response::decode(bytes)
}

/// Reads mux frames `(logical connection, payload)` into `frames` until the connection ends (the
/// channel closes on end of file), so the session's loop can wait on a timer without cancelling a read
/// halfway through a frame.
pub async fn read_frames(
    mut reader: OwnedReadHalf,
    frames: mpsc::Sender<Result<(u32, Vec<u8>), std::io::Error>>,
) {
    loop {
        let mut header = [0u8; MUX_HEADER_LEN];
        let frame: std::io::Result<(u32, Vec<u8>)> = async {
            reader.read_exact(&mut header).await?;
            let (conn, len) = parse_mux_header(header).map_err(std::io::Error::other)?;
            let mut payload = vec![0; len];
            reader.read_exact(&mut payload).await?;
            Ok((conn, payload))
        }
        .await;
        match frame {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return,
            frame => {
                let failed = frame.is_err();
                if frames.send(frame).await.is_err() || failed {
                    return;
                }
            }
        }
    }
}

/// Aborts its task when dropped (the session's reader ends with the session).
#[derive(Debug)]
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_one_mux_frame_with_both_headers_big_endian() {
        let bytes = encode_message(RUNTIME_CONN, 1, TYPE_REQUEST, b"abc");
        assert_eq!(
            bytes,
            [
                &[0, 0, 0, 2, 0, 0, 0, 13][..],
                &[0, 0, 0, 3, 0, 0, 0, 1, 1, 0],
                b"abc"
            ]
            .concat()
        );
    }

    #[test]
    fn messages_are_reassembled_across_frames_and_split_when_several_share_one() {
        let a = encode_message(PLUGIN_CONN, 1, TYPE_REQUEST, b"first");
        let b = encode_message(PLUGIN_CONN, 3, TYPE_REQUEST, b"second");
        let stream: Vec<u8> = [&a[MUX_HEADER_LEN..], &b[MUX_HEADER_LEN..]].concat();
        let mut d = Demux::default();
        // Byte by byte: nothing until a message is complete.
        let mut got = Vec::new();
        for byte in &stream {
            got.extend(d.push(PLUGIN_CONN, std::slice::from_ref(byte)).expect("ok"));
        }
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].stream, got[0].payload.as_slice()),
            (1, &b"first"[..])
        );
        assert_eq!(
            (got[1].stream, got[1].payload.as_slice()),
            (3, &b"second"[..])
        );
        // Two connections interleaved keep separate streams.
        let mut d = Demux::default();
        let c = encode_message(RUNTIME_CONN, 1, TYPE_RESPONSE, b"xy");
        assert!(
            d.push(PLUGIN_CONN, &a[MUX_HEADER_LEN..12])
                .expect("ok")
                .is_empty()
        );
        assert_eq!(
            d.push(RUNTIME_CONN, &c[MUX_HEADER_LEN..])
                .expect("ok")
                .len(),
            1
        );
        assert_eq!(d.push(PLUGIN_CONN, &a[12..]).expect("ok").len(), 1);
    }

    #[test]
    fn oversized_lengths_are_refused() {
        let mut h = [0u8; 8];
        h[4..].copy_from_slice(&((MUX_MAX_PAYLOAD + 1) as u32).to_be_bytes());
        let err = parse_mux_header(h).expect_err("refused");
        assert!(
            matches!(err, Error::FrameTooLong { what: "mux frame", len, .. } if len == MUX_MAX_PAYLOAD + 1),
            "{err}"
        );
        let mut d = Demux::default();
        let mut bad = vec![0u8; TTRPC_HEADER_LEN];
        bad[..4].copy_from_slice(&u32::MAX.to_be_bytes());
        let err = d.push(PLUGIN_CONN, &bad).expect_err("refused");
        assert_eq!(
            err.to_string(),
            format!(
                "NRI stream: ttrpc message of {} bytes exceeds the maximum of {TTRPC_MAX_PAYLOAD}",
                u32::MAX
            )
        );
    }

    #[test]
    fn requests_and_responses_round_trip() {
        let req = encode_request(RUNTIME_SERVICE, "RegisterPlugin", b"\x0a\x01x", 5);
        let got = decode_request(&req).expect("decode");
        assert_eq!(
            (
                got.service.as_str(),
                got.method.as_str(),
                got.payload.as_slice()
            ),
            (RUNTIME_SERVICE, "RegisterPlugin", &b"\x0a\x01x"[..])
        );
        assert_eq!(got.timeout_nano, 5);
        let ok = decode_response(&encode_response(0, "", b"pp")).expect("ok");
        assert_eq!(
            (ok.code(), ok.message(), ok.payload.as_slice()),
            (0, "", &b"pp"[..])
        );
        let err = encode_response(CODE_UNIMPLEMENTED, "no such method", &[]);
        let got = decode_response(&err).expect("err");
        assert_eq!((got.code(), got.message()), (12, "no such method"));
    }
}
