//! The NRI and ttrpc messages the plugin uses, in protobuf wire format, written by hand (no NRI crate
//! exists; protobuf code generation would pull a compiler into the build for a dozen fields).
//!
//! Every field the plugin reads or writes is a [`Field`] constant carrying upstream's name, number and
//! type, and [`MESSAGES`] lists them per message: a test compares that table with upstream's
//! `api.proto` (containerd/nri `pkg/api`), so a renumbered or retyped field fails the build's tests
//! instead of a container start. Unknown fields are skipped when decoding, as protobuf requires.

use std::collections::BTreeMap;

/// One protobuf field as upstream declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// Field name in the `.proto`.
    pub name: &'static str,
    /// Field number.
    pub number: u32,
    /// Type as written in the `.proto` (maps without spaces: `map<string,string>`).
    pub ty: &'static str,
    /// `repeated`.
    pub repeated: bool,
}

const fn field(name: &'static str, number: u32, ty: &'static str) -> Field {
    Field {
        name,
        number,
        ty,
        repeated: false,
    }
}

/// A message and the fields of it the plugin uses.
#[derive(Clone, Copy, Debug)]
pub struct MessageSpec {
    /// Message name in the `.proto`.
    pub name: &'static str,
    /// The fields used.
    pub fields: &'static [Field],
}

/// `RegisterPluginRequest` (plugin → runtime).
pub mod register_plugin_request {
    use super::{Field, field};
    /// `string plugin_name = 1`.
    pub const PLUGIN_NAME: Field = field("plugin_name", 1, "string");
    /// `string plugin_idx = 2`.
    pub const PLUGIN_IDX: Field = field("plugin_idx", 2, "string");
    /// `string NRI_version = 3`.
    pub const NRI_VERSION: Field = field("NRI_version", 3, "string");
}

/// `ConfigureRequest` (runtime → plugin).
pub mod configure_request {
    use super::{Field, field};
    /// `string runtime_name = 2`.
    pub const RUNTIME_NAME: Field = field("runtime_name", 2, "string");
    /// `string runtime_version = 3`.
    pub const RUNTIME_VERSION: Field = field("runtime_version", 3, "string");
    /// `int64 request_timeout = 5` (milliseconds).
    pub const REQUEST_TIMEOUT: Field = field("request_timeout", 5, "int64");
    /// `string NRI_version = 6`.
    pub const NRI_VERSION: Field = field("NRI_version", 6, "string");
}

/// `ConfigureResponse` (plugin → runtime).
pub mod configure_response {
    use super::{Field, field};
    /// `int32 events = 2`: bit `event - 1` set per subscribed event.
    pub const EVENTS: Field = field("events", 2, "int32");
}

/// `SynchronizeRequest` / `SynchronizeResponse`.
pub mod synchronize {
    use super::{Field, field};
    /// `SynchronizeRequest`: `repeated PodSandbox pods = 1`.
    pub const REQ_PODS: Field = Field {
        repeated: true,
        ..field("pods", 1, "PodSandbox")
    };
    /// `SynchronizeRequest`: `repeated Container containers = 2`.
    pub const REQ_CONTAINERS: Field = Field {
        repeated: true,
        ..field("containers", 2, "Container")
    };
    /// `SynchronizeRequest`: `bool more = 3`.
    pub const REQ_MORE: Field = field("more", 3, "bool");
    /// `SynchronizeResponse`: `repeated ContainerUpdate update = 1`.
    pub const RESP_UPDATE: Field = Field {
        repeated: true,
        ..field("update", 1, "ContainerUpdate")
    };
    /// `SynchronizeResponse`: `bool more = 2`.
    pub const RESP_MORE: Field = field("more", 2, "bool");
    /// `ContainerUpdate`: `string container_id = 1`.
    pub const UPDATE_CONTAINER_ID: Field = field("container_id", 1, "string");
    /// `ContainerUpdate`: `LinuxContainerUpdate linux = 2`.
    pub const UPDATE_LINUX: Field = field("linux", 2, "LinuxContainerUpdate");
    /// `ContainerUpdate`: `bool ignore_failure = 3`.
    pub const UPDATE_IGNORE_FAILURE: Field = field("ignore_failure", 3, "bool");
    /// `LinuxContainerUpdate`: `LinuxResources resources = 1`.
    pub const LINUX_UPDATE_RESOURCES: Field = field("resources", 1, "LinuxResources");
}

/// `CreateContainerRequest` / `CreateContainerResponse` and the messages they carry.
pub mod create_container {
    use super::{Field, field};
    /// `CreateContainerRequest`: `PodSandbox pod = 1`.
    pub const REQ_POD: Field = field("pod", 1, "PodSandbox");
    /// `CreateContainerRequest`: `Container container = 2`.
    pub const REQ_CONTAINER: Field = field("container", 2, "Container");
    /// `CreateContainerResponse`: `ContainerAdjustment adjust = 1`.
    pub const RESP_ADJUST: Field = field("adjust", 1, "ContainerAdjustment");
    /// `PodSandbox`: `string id = 1`.
    pub const POD_ID: Field = field("id", 1, "string");
    /// `PodSandbox`: `string name = 2`.
    pub const POD_NAME: Field = field("name", 2, "string");
    /// `PodSandbox`: `string uid = 3`.
    pub const POD_UID: Field = field("uid", 3, "string");
    /// `PodSandbox`: `string namespace = 4`.
    pub const POD_NAMESPACE: Field = field("namespace", 4, "string");
    /// `PodSandbox`: `map<string, string> annotations = 6`.
    pub const POD_ANNOTATIONS: Field = field("annotations", 6, "map<string,string>");
    /// `Container`: `string id = 1`.
    pub const CONTAINER_ID: Field = field("id", 1, "string");
    /// `Container`: `string pod_sandbox_id = 2`.
    pub const CONTAINER_POD_SANDBOX_ID: Field = field("pod_sandbox_id", 2, "string");
    /// `Container`: `string name = 3`.
    pub const CONTAINER_NAME: Field = field("name", 3, "string");
    /// `Container`: `ContainerState state = 4`.
    pub const CONTAINER_STATE: Field = field("state", 4, "ContainerState");
    /// `ContainerAdjustment`: `LinuxContainerAdjustment linux = 6`.
    pub const ADJUST_LINUX: Field = field("linux", 6, "LinuxContainerAdjustment");
    /// `LinuxContainerAdjustment`: `LinuxResources resources = 2`.
    pub const LINUX_RESOURCES: Field = field("resources", 2, "LinuxResources");
    /// `LinuxResources`: `map<string, string> unified = 6`.
    pub const RESOURCES_UNIFIED: Field = field("unified", 6, "map<string,string>");
}

use create_container as cc;

mod updates;
pub(super) use updates::container_update;
pub use updates::{
    failed_updates, post_start_container, started_container, update_containers,
    update_containers_request,
};

/// Every NRI message and field the plugin uses, for the test against upstream's `api.proto`.
pub const MESSAGES: &[MessageSpec] = &[
    MessageSpec {
        name: "RegisterPluginRequest",
        fields: &[
            register_plugin_request::PLUGIN_NAME,
            register_plugin_request::PLUGIN_IDX,
            register_plugin_request::NRI_VERSION,
        ],
    },
    MessageSpec {
        name: "ConfigureRequest",
        fields: &[
            configure_request::RUNTIME_NAME,
            configure_request::RUNTIME_VERSION,
            configure_request::REQUEST_TIMEOUT,
            configure_request::NRI_VERSION,
        ],
    },
    MessageSpec {
        name: "ConfigureResponse",
        fields: &[configure_response::EVENTS],
    },
    MessageSpec {
        name: "SynchronizeRequest",
        fields: &[
            synchronize::REQ_PODS,
            synchronize::REQ_CONTAINERS,
            synchronize::REQ_MORE,
        ],
    },
    MessageSpec {
        name: "SynchronizeResponse",
        fields: &[synchronize::RESP_UPDATE, synchronize::RESP_MORE],
    },
    MessageSpec {
        name: "ContainerUpdate",
        fields: &[
            synchronize::UPDATE_CONTAINER_ID,
            synchronize::UPDATE_LINUX,
            synchronize::UPDATE_IGNORE_FAILURE,
        ],
    },
    MessageSpec {
        name: "LinuxContainerUpdate",
        fields: &[synchronize::LINUX_UPDATE_RESOURCES],
    },
    MessageSpec {
        name: "UpdateContainersRequest",
        fields: &[update_containers::REQ_UPDATE],
    },
    MessageSpec {
        name: "UpdateContainersResponse",
        fields: &[update_containers::RESP_FAILED],
    },
    MessageSpec {
        name: "PostStartContainerRequest",
        fields: &[post_start_container::REQ_CONTAINER],
    },
    MessageSpec {
        name: "StateChangeEvent",
        fields: &[
            post_start_container::EVENT,
            post_start_container::EVENT_CONTAINER,
        ],
    },
    MessageSpec {
        name: "CreateContainerRequest",
        fields: &[cc::REQ_POD, cc::REQ_CONTAINER],
    },
    MessageSpec {
        name: "CreateContainerResponse",
        fields: &[cc::RESP_ADJUST],
    },
    MessageSpec {
        name: "PodSandbox",
        fields: &[
            cc::POD_ID,
            cc::POD_NAME,
            cc::POD_UID,
            cc::POD_NAMESPACE,
            cc::POD_ANNOTATIONS,
        ],
    },
    MessageSpec {
        name: "Container",
        fields: &[
            cc::CONTAINER_ID,
            cc::CONTAINER_POD_SANDBOX_ID,
            cc::CONTAINER_NAME,
            cc::CONTAINER_STATE,
        ],
    },
    MessageSpec {
        name: "ContainerAdjustment",
        fields: &[cc::ADJUST_LINUX],
    },
    MessageSpec {
        name: "LinuxContainerAdjustment",
        fields: &[cc::LINUX_RESOURCES],
    },
    MessageSpec {
        name: "LinuxResources",
        fields: &[cc::RESOURCES_UNIFIED],
    },
    MessageSpec {
        name: "Empty",
        fields: &[],
    },
];

/// NRI's `CREATE_CONTAINER` event number (`enum Event`).
pub const EVENT_CREATE_CONTAINER: u32 = 4;
/// NRI's `POST_START_CONTAINER` event number (`enum Event`).
pub const EVENT_POST_START_CONTAINER: u32 = 7;
/// `ContainerState`: `CONTAINER_CREATED` (created, not started yet).
pub const CONTAINER_CREATED: i64 = 1;

/// The `events` bitmask subscribing to the given events (`1 << (event - 1)` each).
pub fn event_mask(events: &[u32]) -> i32 {
    events.iter().fold(0i32, |m, e| m | (1i32 << (e - 1)))
}

/// A malformed protobuf message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed protobuf message: {0}")]
pub struct DecodeError(pub &'static str);

// ---------------------------------------------------------------------------------------------------
// Encoding

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_FIXED32: u8 = 5;

/// Builds one message.
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty message.
    pub fn new() -> Writer {
        Writer::default()
    }

    /// The encoded bytes.
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }

    fn key(&mut self, number: u32, wire: u8) {
        put_varint(&mut self.buf, (u64::from(number) << 3) | u64::from(wire));
    }

    /// A string field (omitted when empty, as proto3 does).
    pub fn string(&mut self, f: Field, v: &str) -> &mut Writer {
        self.bytes(f.number, v.as_bytes())
    }

    fn bytes(&mut self, number: u32, v: &[u8]) -> &mut Writer {
        if !v.is_empty() {
            self.key(number, WIRE_LEN);
            put_varint(&mut self.buf, v.len() as u64);
            self.buf.extend_from_slice(v);
        }
        self
    }

    /// A varint field of any integer or bool type (omitted when zero). Negative values are
    /// sign-extended to 64 bits, as protobuf encodes `int32`/`int64`.
    pub fn int(&mut self, f: Field, v: i64) -> &mut Writer {
        if v != 0 {
            self.key(f.number, WIRE_VARINT);
            put_varint(&mut self.buf, v as u64);
        }
        self
    }

    /// A bool field (omitted when false).
    pub fn bool(&mut self, f: Field, v: bool) -> &mut Writer {
        self.int(f, i64::from(v))
    }

    /// An embedded message field, written even when empty (presence matters for messages).
    pub fn message(&mut self, f: Field, build: impl FnOnce(&mut Writer)) -> &mut Writer {
        let mut inner = Writer::new();
        build(&mut inner);
        self.key(f.number, WIRE_LEN);
        put_varint(&mut self.buf, inner.buf.len() as u64);
        self.buf.extend_from_slice(&inner.buf);
        self
    }

    /// Bytes already encoded (an embedded message's body).
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Writer {
        self.buf.extend_from_slice(bytes);
        self
    }

    /// A `map<string, string>` field: one entry message (key = 1, value = 2) per pair.
    pub fn string_map<'a>(
        &mut self,
        f: Field,
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> &mut Writer {
        for (k, v) in pairs {
            self.message(f, |e| {
                e.bytes(1, k.as_bytes());
                e.bytes(2, v.as_bytes());
            });
        }
        self
    }
}

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

// ---------------------------------------------------------------------------------------------------
// Decoding

/// A field's value as found on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Value<'a> {
    /// Varint-encoded.
    Varint(u64),
    /// Length-delimited (strings, bytes, messages, map entries, packed repeated).
    Bytes(&'a [u8]),
    /// Any fixed-width value (skipped by everything here).
    Fixed,
}

impl<'a> Value<'a> {
    /// As a string (invalid UTF-8 and wrong wire types are errors).
    pub fn str(self) -> Result<&'a str, DecodeError> {
        match self {
            Value::Bytes(b) => std::str::from_utf8(b).map_err(|_| DecodeError("invalid UTF-8")),
            _ => Err(DecodeError("expected a length-delimited field")),
        }
    }

    /// As a varint integer.
    pub fn int(self) -> Result<i64, DecodeError> {
        match self {
            Value::Varint(v) => Ok(v as i64),
            _ => Err(DecodeError("expected a varint field")),
        }
    }

    /// As an embedded message's bytes.
    pub fn message(self) -> Result<&'a [u8], DecodeError> {
        match self {
            Value::Bytes(b) => Ok(b),
            _ => Err(DecodeError("expected an embedded message")),
        }
    }
}

/// Iterates over the fields of one encoded message: `(number, value)`.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Read `bytes`.
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { rest: bytes }
    }

    /// The next field, `None` at the end.
    pub fn next_field(&mut self) -> Result<Option<(u32, Value<'a>)>, DecodeError> {
        if self.rest.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let number = u32::try_from(key >> 3).map_err(|_| DecodeError("field number too large"))?;
        if number == 0 {
            return Err(DecodeError("field number 0"));
        }
        let value = match (key & 7) as u8 {
            WIRE_VARINT => Value::Varint(self.varint()?),
            WIRE_LEN => {
                let len =
                    usize::try_from(self.varint()?).map_err(|_| DecodeError("length too large"))?;
                Value::Bytes(self.take(len)?)
            }
            WIRE_FIXED64 => {
                self.take(8)?;
                Value::Fixed
            }
            WIRE_FIXED32 => {
                self.take(4)?;
                Value::Fixed
            }
            _ => {
                return Err(DecodeError(
                    "unsupported wire type (groups are not used by NRI)",
                ));
            }
        };
        Ok(Some((number, value)))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.rest.len() {
            return Err(DecodeError("field runs past the end of the message"));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let [b, rest @ ..] = self.rest else {
                return Err(DecodeError("truncated varint"));
            };
            self.rest = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError("varint longer than 10 bytes"))
    }
}

/// Decode one `map<string, string>` entry.
pub fn map_entry(bytes: &[u8]) -> Result<(&str, &str), DecodeError> {
    let (mut k, mut v) = ("", "");
    let mut r = Reader::new(bytes);
    while let Some((n, val)) = r.next_field()? {
        match n {
            1 => k = val.str()?,
            2 => v = val.str()?,
            _ => {}
        }
    }
    Ok((k, v))
}

// ---------------------------------------------------------------------------------------------------
// The messages

/// What the plugin reads from `ConfigureRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigureRequest {
    /// The runtime's name (`containerd`, `cri-o`).
    pub runtime_name: String,
    /// The runtime's version.
    pub runtime_version: String,
    /// How long the runtime waits for a plugin's answer (milliseconds; 0 = not said).
    pub request_timeout_ms: i64,
    /// The NRI release the runtime was built with (empty before NRI v0.10).
    pub nri_version: String,
}

impl ConfigureRequest {
    /// Decode.
    pub fn decode(bytes: &[u8]) -> Result<ConfigureRequest, DecodeError> {
        use configure_request as f;
        let mut out = ConfigureRequest::default();
        let mut r = Reader::new(bytes);
        while let Some((n, v)) = r.next_field()? {
            match n {
                _ if n == f::RUNTIME_NAME.number => out.runtime_name = v.str()?.to_owned(),
                _ if n == f::RUNTIME_VERSION.number => out.runtime_version = v.str()?.to_owned(),
                _ if n == f::REQUEST_TIMEOUT.number => out.request_timeout_ms = v.int()?,
                _ if n == f::NRI_VERSION.number => out.nri_version = v.str()?.to_owned(),
                _ => {}
            }
        }
        Ok(out)
    }
}

/// What the plugin reads from `CreateContainerRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CreateContainer {
    /// Pod sandbox ID.
    pub pod_id: String,
    /// Pod name.
    pub pod_name: String,
    /// Pod UID.
    pub pod_uid: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// The pod's annotations that are teeguard's (`misc-max.teeguard.dev/…`); others are skipped.
    pub annotations: BTreeMap<String, String>,
    /// Container ID.
    pub container_id: String,
    /// Container name.
    pub container_name: String,
}

impl CreateContainer {
    /// Decode, keeping only the annotations whose key starts with `keep_prefix`.
    pub fn decode(bytes: &[u8], keep_prefix: &str) -> Result<CreateContainer, DecodeError> {
        let mut out = CreateContainer::default();
        let mut r = Reader::new(bytes);
        while let Some((n, v)) = r.next_field()? {
            match n {
                _ if n == cc::REQ_POD.number => out.decode_pod(v.message()?, keep_prefix)?,
                _ if n == cc::REQ_CONTAINER.number => out.decode_container(v.message()?)?,
                _ => {}
            }
        }
        Ok(out)
    }

    pub(super) fn decode_pod(
        &mut self,
        bytes: &[u8],
        keep_prefix: &str,
    ) -> Result<(), DecodeError> {
        let mut r = Reader::new(bytes);
        while let Some((n, v)) = r.next_field()? {
            match n {
                _ if n == cc::POD_ID.number => self.pod_id = v.str()?.to_owned(),
                _ if n == cc::POD_NAME.number => self.pod_name = v.str()?.to_owned(),
                _ if n == cc::POD_UID.number => self.pod_uid = v.str()?.to_owned(),
                _ if n == cc::POD_NAMESPACE.number => self.pod_namespace = v.str()?.to_owned(),
                _ if n == cc::POD_ANNOTATIONS.number => {
                    let (k, val) = map_entry(v.message()?)?;
                    if k.starts_with(keep_prefix) {
                        self.annotations.insert(k.to_owned(), val.to_owned());
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn decode_container(&mut self, bytes: &[u8]) -> Result<(), DecodeError> {
        let mut r = Reader::new(bytes);
        while let Some((n, v)) = r.next_field()? {
            match n {
                _ if n == cc::CONTAINER_ID.number => self.container_id = v.str()?.to_owned(),
                _ if n == cc::CONTAINER_NAME.number => self.container_name = v.str()?.to_owned(),
                _ => {}
            }
        }
        Ok(())
    }
}

/// The NRI release whose `api.proto` this wire format follows (the one in
/// `../shared/reference/nri/`, byte for byte v0.12.2's `pkg/api/api.proto`); sent at registration, so
/// the runtime logs it instead of "unknown".
pub const NRI_VERSION: &str = "v0.12.2";

/// `RegisterPluginRequest`, with [`NRI_VERSION`].
pub fn register_plugin_request(name: &str, index: &str) -> Vec<u8> {
    let mut w = Writer::new();
    w.string(register_plugin_request::PLUGIN_NAME, name)
        .string(register_plugin_request::PLUGIN_IDX, index)
        .string(register_plugin_request::NRI_VERSION, NRI_VERSION);
    w.finish()
}

/// `ConfigureResponse` subscribing to `events` (a mask from [`event_mask`]).
pub fn configure_response(events: i32) -> Vec<u8> {
    let mut w = Writer::new();
    w.int(configure_response::EVENTS, i64::from(events));
    w.finish()
}

/// `CreateContainerResponse`: no adjustment (`None`), or `linux.resources.unified["misc.max"]`.
pub fn create_container_response(misc_max: Option<&str>) -> Vec<u8> {
    let mut w = Writer::new();
    if let Some(value) = misc_max {
        w.message(cc::RESP_ADJUST, |adjust| {
            adjust.message(cc::ADJUST_LINUX, |linux| {
                linux.message(cc::LINUX_RESOURCES, |res| unified_misc_max(res, value));
            });
        });
    }
    w.finish()
}

/// `LinuxResources.unified["misc.max"] = value`.
pub(super) fn unified_misc_max(resources: &mut Writer, value: &str) {
    resources.string_map(cc::RESOURCES_UNIFIED, [("misc.max", value)]);
}

#[cfg(test)]
mod tests;
