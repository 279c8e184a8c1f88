//! A small parser of `.proto` files (proto3, as NRI's `api.proto` uses it) into a [`Schema`].
//!
//! Supported: `syntax`/`package`/`import`/`option` statements, messages (nested ones are registered under
//! their qualified name `Outer.Inner` and, unless a top-level type has it, their simple name), enums
//! (`name = number`, negative numbers, value options), `oneof` blocks (their fields belong to the
//! message), `map<K, V>` fields (type normalised to `map<K,V>`), `repeated`/`optional` labels, field
//! options in `[...]`, `reserved`/`extensions`/`extend` (skipped), services with `rpc` methods (with or
//! without an option block), `//` and `/* */` comments.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where the upstream NRI `api.proto` is kept: the shared reference folder beside the repository.
pub fn upstream_api_proto() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/reference/nri/api.proto"
    ))
}

/// Reads and parses the upstream NRI `api.proto` ([`upstream_api_proto`]).
pub fn load_upstream() -> Result<Schema, ProtoError> {
    load(upstream_api_proto())
}

/// Reads and parses a `.proto` file.
pub fn load(path: &Path) -> Result<Schema, ProtoError> {
    let text = std::fs::read_to_string(path).map_err(|source| ProtoError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text)
}

/// What went wrong parsing a `.proto` file or encoding/decoding a message.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The `.proto` text is not understood.
    #[error("line {line}: {message}")]
    Parse {
        /// 1-based line of the offending token (0 at the end of the text).
        line: usize,
        /// What was expected or found.
        message: String,
    },
    /// A message type the schema does not define.
    #[error("unknown message type {0}")]
    UnknownMessage(String),
    /// A JSON value that does not fit the message.
    #[error("encoding {path}: {message}")]
    Encode {
        /// Dotted path of the field (`CreateContainerRequest.pod.labels`).
        path: String,
        /// What is wrong.
        message: String,
    },
    /// Bytes that are not a valid encoding of the message.
    #[error("decoding {path}: {message}")]
    Decode {
        /// Dotted path of the field.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// The definitions of a parsed `.proto` file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Schema {
    /// The `package` (empty without one).
    pub package: String,
    /// Messages by name: top-level by simple name; nested by `Outer.Inner` and by simple name.
    pub messages: BTreeMap<String, Message>,
    /// Enums, named like messages.
    pub enums: BTreeMap<String, Enum>,
    /// Services by name.
    pub services: BTreeMap<String, Service>,
}

/// A message type.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Message {
    /// Qualified name within the file (`LogRequest`, `SecurityProfile.ProfileType`...).
    pub name: String,
    /// Fields in declaration order (`oneof` members included).
    pub fields: Vec<Field>,
}

/// A message field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    /// Field name.
    pub name: String,
    /// Field number.
    pub number: u32,
    /// Type as written: a scalar (`string`, `int64`...), a message or enum name, or `map<K,V>`.
    pub ty: String,
    /// Declared `repeated`.
    pub repeated: bool,
    /// The `oneof` it belongs to.
    pub oneof: Option<String>,
}

/// An enum type.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Enum {
    /// Qualified name within the file.
    pub name: String,
    /// `(value name, number)` in declaration order.
    pub values: Vec<(String, i32)>,
}

/// A service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Service {
    /// Service name (without the package).
    pub name: String,
    /// Its `rpc` methods.
    pub methods: Vec<Method>,
}

/// An `rpc` of a service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Method {
    /// Method name.
    pub name: String,
    /// Request message type as written.
    pub input: String,
    /// Response message type as written.
    pub output: String,
}

/// Scalar type names of proto3.
pub const SCALARS: &[&str] = &[
    "double", "float", "int32", "int64", "uint32", "uint64", "sint32", "sint64", "fixed32",
    "fixed64", "sfixed32", "sfixed64", "bool", "string", "bytes",
];

impl Schema {
    /// The message called `name` (simple, qualified, package-qualified or with a leading dot).
    pub fn message(&self, name: &str) -> Option<&Message> {
        candidates(&self.package, name).find_map(|n| self.messages.get(n))
    }

    /// The enum called `name` (as for [`Schema::message`]).
    pub fn enumeration(&self, name: &str) -> Option<&Enum> {
        candidates(&self.package, name).find_map(|n| self.enums.get(n))
    }
}

/// The names to try for a type reference: as written, without a leading dot, without the package.
fn candidates<'a>(package: &'a str, name: &'a str) -> impl Iterator<Item = &'a str> {
    let bare = name.strip_prefix('.').unwrap_or(name);
    let local = bare
        .strip_prefix(package)
        .and_then(|rest| rest.strip_prefix('.'))
        .filter(|_| !package.is_empty());
    [Some(bare), local].into_iter().flatten()
}

impl Message {
    /// The field called `name`.
    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.name == name)
    }

    /// The field numbered `number`.
    pub fn field_by_number(&self, number: u32) -> Option<&Field> {
        self.fields.iter().find(|f| f.number == number)
    }
}

impl Field {
    /// `(key type, value type)` of a map field.
    pub fn map_types(&self) -> Option<(&str, &str)> {
        self.ty
            .strip_prefix("map<")?
            .strip_suffix('>')?
            .split_once(',')
    }
}

impl Enum {
    /// The number of the value called `name`.
    pub fn value(&self, name: &str) -> Option<i32> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }
}

impl Service {
    /// The method called `name`.
    pub fn method(&self, name: &str) -> Option<&Method> {
        self.methods.iter().find(|m| m.name == name)
    }
}

/// Parses the text of a `.proto` file.
pub fn parse(text: &str) -> Result<Schema, ProtoError> {
    let (mut schema, nested_aliases) = super::proto_parse::parse_file(text)?;
    // Nested types are also reachable by their simple name, unless a top-level type has it.
    for (simple, qualified, is_enum) in nested_aliases {
        if is_enum {
            if let Some(e) = schema.enums.get(&qualified).cloned() {
                schema.enums.entry(simple).or_insert(e);
            }
        } else if let Some(m) = schema.messages.get(&qualified).cloned() {
            schema.messages.entry(simple).or_insert(m);
        }
    }
    Ok(schema)
}

#[cfg(test)]
#[path = "proto_tests.rs"]
mod tests;
