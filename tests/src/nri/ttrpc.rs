//! NRI's transport: one Unix stream multiplexing logical connections, each carrying ttrpc.
//!
//! Multiplexing (NRI `pkg/net/multiplex`): the stream is a sequence of frames, each an 8-byte header
//! (big-endian `u32` connection id, big-endian `u32` payload length, at most [`FRAME_PAYLOAD_MAX`])
//! followed by the payload. The payloads of one connection id, in order, form that connection's byte
//! stream; a frame boundary need not match a message boundary, so [`Demux`] reassembles per id.
//! Connection [`PLUGIN_SERVICE_CONN`] (1) carries the `Plugin` service the plugin serves (the runtime is
//! the ttrpc client); [`RUNTIME_SERVICE_CONN`] (2) carries the `Runtime` service the runtime serves.
//!
//! ttrpc: each message is a 10-byte header (big-endian `u32` payload length, big-endian `u32` stream
//! id, `u8` type — [`MESSAGE_TYPE_REQUEST`] or [`MESSAGE_TYPE_RESPONSE`] — and `u8` flags) followed by a
//! protobuf [`Request`] or [`Response`]. Clients use odd stream ids from 1, stepping by 2.

use std::collections::HashMap;

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::{self, Error, Result};

/// The logical connection on which the plugin serves the `Plugin` service.
pub const PLUGIN_SERVICE_CONN: u32 = 1;
/// The logical connection on which the runtime serves the `Runtime` service.
pub const RUNTIME_SERVICE_CONN: u32 = 2;
/// Length of a multiplexer frame header.
pub const FRAME_HEADER_LEN: usize = 8;
/// Length of a ttrpc message header.
pub const MESSAGE_HEADER_LEN: usize = 10;
/// Largest ttrpc message payload (ttrpc's `messageLengthMax`).
pub const MESSAGE_LENGTH_MAX: usize = 4 << 20;
/// Largest multiplexer frame payload: one whole ttrpc message.
pub const FRAME_PAYLOAD_MAX: usize = MESSAGE_HEADER_LEN + MESSAGE_LENGTH_MAX;
/// ttrpc message type of a request.
pub const MESSAGE_TYPE_REQUEST: u8 = 1;
/// ttrpc message type of a response.
pub const MESSAGE_TYPE_RESPONSE: u8 = 2;
/// Fully qualified name of the service plugins serve.
pub const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";
/// Fully qualified name of the service runtimes serve.
pub const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";
/// gRPC status code: OK.
pub const CODE_OK: i32 = 0;
/// gRPC status code: UNKNOWN (what ttrpc answers for a plain Go error).
pub const CODE_UNKNOWN: i32 = 2;
/// gRPC status code: INVALID_ARGUMENT.
pub const CODE_INVALID_ARGUMENT: i32 = 3;
/// gRPC status code: UNIMPLEMENTED (unknown service or method).
pub const CODE_UNIMPLEMENTED: i32 = 12;

/// Splits `data` into multiplexer frames for connection `conn`.
pub fn encode_frames(conn: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + FRAME_HEADER_LEN);
    for chunk in data.chunks(FRAME_PAYLOAD_MAX) {
        out.extend_from_slice(&conn.to_be_bytes());
        out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        out.extend_from_slice(chunk);
    }
    out
}

/// A ttrpc message: header and payload.
pub fn encode_message(stream_id: u32, kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MESSAGE_HEADER_LEN + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.extend_from_slice(&[kind, 0]);
    out.extend_from_slice(payload);
    out
}

/// Reads one multiplexer frame: `Ok(None)` on a clean end of stream between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Option<(u32, Vec<u8>)>> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut filled = 0;
    while filled < FRAME_HEADER_LEN {
        let read = reader.read(&mut header[filled..]).await;
        match read.map_err(error::io("NRI socket", "read a frame header"))? {
            0 if filled == 0 => return Ok(None),
            0 => return Err(Error::Truncated),
            n => filled += n,
        }
    }
    let conn = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    let len = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
    if len as usize > FRAME_PAYLOAD_MAX {
        return Err(Error::FrameTooLarge { conn, len });
    }
    let mut payload = vec![0u8; len as usize];
    reader
        .read_exact(&mut payload)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::Truncated,
            _ => error::io("NRI socket", "read a frame")(e),
        })?;
    Ok(Some((conn, payload)))
}

/// A ttrpc message as received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Stream id (odd for client-initiated streams).
    pub stream_id: u32,
    /// [`MESSAGE_TYPE_REQUEST`], [`MESSAGE_TYPE_RESPONSE`] or another (streaming) type.
    pub kind: u8,
    /// Header flags.
    pub flags: u8,
    /// The protobuf payload.
    pub payload: Vec<u8>,
}

/// Reassembles the byte streams of the logical connections and cuts them into ttrpc messages.
#[derive(Debug, Default)]
pub struct Demux {
    streams: HashMap<u32, Vec<u8>>,
}

impl Demux {
    /// Appends a frame's payload to connection `conn`'s stream.
    pub fn push(&mut self, conn: u32, payload: &[u8]) {
        self.streams
            .entry(conn)
            .or_default()
            .extend_from_slice(payload);
    }

    /// The next complete ttrpc message of connection `conn`, if one has arrived.
    pub fn next_message(&mut self, conn: u32) -> Result<Option<Message>> {
        let Some(buf) = self.streams.get_mut(&conn) else {
            return Ok(None);
        };
        if buf.len() < MESSAGE_HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
        if len as usize > MESSAGE_LENGTH_MAX {
            return Err(Error::MessageTooLarge { conn, len });
        }
        let total = MESSAGE_HEADER_LEN + len as usize;
        if buf.len() < total {
            return Ok(None);
        }
        let message = Message {
            stream_id: u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]),
            kind: buf[8],
            flags: buf[9],
            payload: buf[MESSAGE_HEADER_LEN..total].to_vec(),
        };
        buf.drain(..total);
        Ok(Some(message))
    }
}

/// ttrpc's `Request` envelope (ttrpc's `request.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Request {
    /// Fully qualified service name.
    #[prost(string, tag = "1")]
    pub service: String,
    /// Method name.
    #[prost(string, tag = "2")]
    pub method: String,
    /// The encoded request message.
    #[prost(bytes = "vec", tag = "3")]
    pub payload: Vec<u8>,
    /// Client deadline in nanoseconds, 0 for none.
    #[prost(int64, tag = "4")]
    pub timeout_nano: i64,
    /// Metadata key/value pairs.
    #[prost(message, repeated, tag = "5")]
    pub metadata: Vec<KeyValue>,
}

/// A metadata pair of a [`Request`].
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    /// The key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// ttrpc's `Response` envelope.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Response {
    /// The call's status (always written, as ttrpc's server does; absent means OK).
    #[prost(message, optional, tag = "1")]
    pub status: Option<Status>,
    /// The encoded response message.
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
}

/// `google.rpc.Status` as ttrpc carries it (details are dropped).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct Status {
    /// gRPC code, [`CODE_OK`] for success.
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// Error message.
    #[prost(string, tag = "2")]
    pub message: String,
}

impl Request {
    /// Encodes the envelope.
    pub fn encode(&self) -> Vec<u8> {
        prost::Message::encode_to_vec(self)
    }

    /// Decodes an envelope; unknown fields are skipped.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        <Self as prost::Message>::decode(bytes).map_err(|e| Error::Envelope {
            what: "request",
            message: e.to_string(),
        })
    }
}

impl Response {
    /// A successful response carrying `payload`.
    pub fn ok(payload: Vec<u8>) -> Self {
        Response {
            status: Some(Status::default()),
            payload,
        }
    }

    /// A failed response.
    pub fn error(code: i32, message: impl Into<String>) -> Self {
        Response {
            status: Some(Status {
                code,
                message: message.into(),
            }),
            payload: Vec::new(),
        }
    }

    /// The call's status (OK when absent).
    pub fn status(&self) -> Status {
        self.status.clone().unwrap_or_default()
    }

    /// Encodes the envelope.
    pub fn encode(&self) -> Vec<u8> {
        prost::Message::encode_to_vec(self)
    }

    /// Decodes an envelope.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        <Self as prost::Message>::decode(bytes).map_err(|e| Error::Envelope {
            what: "response",
            message: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_and_reassemble() {
        let msg = encode_message(3, MESSAGE_TYPE_REQUEST, b"hello");
        assert_eq!(&msg[..10], &[0, 0, 0, 5, 0, 0, 0, 3, 1, 0]);
        let frames = encode_frames(2, &msg);
        assert_eq!(&frames[..8], &[0, 0, 0, 2, 0, 0, 0, 15]);
        let mut demux = Demux::default();
        // Two messages whose bytes arrive cut at arbitrary points.
        let mut both = msg.clone();
        both.extend(encode_message(5, MESSAGE_TYPE_RESPONSE, b""));
        demux.push(2, &both[..4]);
        assert_eq!(demux.next_message(2).expect("ok"), None);
        demux.push(2, &both[4..12]);
        assert_eq!(demux.next_message(2).expect("ok"), None);
        demux.push(2, &both[12..]);
        let first = demux.next_message(2).expect("ok").expect("complete");
        assert_eq!(
            (first.stream_id, first.kind, first.payload.as_slice()),
            (3, 1, &b"hello"[..])
        );
        let second = demux.next_message(2).expect("ok").expect("complete");
        assert_eq!(
            (second.stream_id, second.kind, second.payload.len()),
            (5, 2, 0)
        );
        assert_eq!(demux.next_message(2).expect("ok"), None);
        assert_eq!(demux.next_message(1).expect("ok"), None);
        demux.push(1, &[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 1, 1, 0]);
        assert!(matches!(
            demux.next_message(1),
            Err(Error::MessageTooLarge { .. })
        ));
    }

    #[test]
    fn big_payloads_take_several_frames() {
        let data = vec![7u8; FRAME_PAYLOAD_MAX + 3];
        let frames = encode_frames(1, &data);
        assert_eq!(frames.len(), data.len() + 2 * FRAME_HEADER_LEN);
        let second = FRAME_HEADER_LEN + FRAME_PAYLOAD_MAX;
        assert_eq!(&frames[second..second + 8], &[0, 0, 0, 1, 0, 0, 0, 3]);
    }

    #[tokio::test]
    async fn read_frame_checks_limits() {
        let mut ok: &[u8] = &[0, 0, 0, 1, 0, 0, 0, 2, 9, 9];
        assert_eq!(
            read_frame(&mut ok).await.expect("ok"),
            Some((1, vec![9, 9]))
        );
        assert_eq!(read_frame(&mut ok).await.expect("ok"), None);
        let mut huge: &[u8] = &[0, 0, 0, 1, 0x7f, 0, 0, 0];
        assert!(matches!(
            read_frame(&mut huge).await,
            Err(Error::FrameTooLarge { .. })
        ));
        let mut short: &[u8] = &[0, 0, 0, 1, 0, 0, 0, 9, 1];
        assert!(matches!(
            read_frame(&mut short).await,
            Err(Error::Truncated)
        ));
    }

    #[test]
    fn envelopes_round_trip() {
        let req = Request {
            service: PLUGIN_SERVICE.into(),
            method: "Configure".into(),
            payload: vec![1, 2, 3],
            timeout_nano: 2_000_000_000,
            metadata: vec![KeyValue {
                key: "k".into(),
                value: "v".into(),
            }],
        };
        assert_eq!(Request::decode(&req.encode()).expect("decodes"), req);
        let ok = Response::ok(vec![4]);
        assert_eq!(ok.encode(), [0x0a, 0x00, 0x12, 0x01, 4]);
        assert_eq!(Response::decode(&ok.encode()).expect("decodes"), ok);
        let failed = Response::error(CODE_UNIMPLEMENTED, "no");
        assert_eq!(Response::decode(&failed.encode()).expect("decodes"), failed);
        assert_eq!(
            Response::decode(&[]).expect("decodes").status(),
            Status::default()
        );
        assert!(Request::decode(&[0x0a, 0x09]).is_err());
        assert!(Request::decode(&[0x08, 0x01]).is_err());
    }
}
